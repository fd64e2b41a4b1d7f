"""`model.converters` and the `[float8]` / `[mx]` sections -> titan_parallel's float8 options.

The trainer passes the result to `build_model_parts`, which converts the meta model
before the pipeline split and parallelism (`titan_parallel.float8`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from titan_parallel.float8 import Float8Options, MXOptions, needs_emulation

from titan_core.config.errors import ConfigError
from titan_core.config.schema import JobConfig


@dataclass(frozen=True)
class Converters:
    """The model converters a run applies; None = not asked for."""

    float8: Float8Options | None = None
    mx: MXOptions | None = None


def build_converters(cfg: JobConfig, device: torch.device) -> Converters:
    """Resolve `model.converters` for `device` (`float8.emulate = 'auto'` emulates off float8 GPUs).

    Raises:
        ConfigError: both 'float8' and 'mx' asked for (a linear is converted once).
    """
    names = cfg.model.converters
    if "float8" in names and "mx" in names:
        raise ConfigError("model.converters lists both 'float8' and 'mx'; a linear is converted once: keep one")
    f, m = cfg.float8, cfg.mx
    float8 = None
    if "float8" in names:
        float8 = Float8Options(
            recipe_name=f.recipe_name,
            enable_fsdp_float8_all_gather=f.enable_fsdp_float8_all_gather,
            precompute_float8_dynamic_scale_for_fsdp=f.precompute_float8_dynamic_scale_for_fsdp,
            filter_fqns=tuple(f.filter_fqns),
            auto_filter_small_kn=f.auto_filter_small_kn,
            emulate=needs_emulation(device) if f.emulate == "auto" else f.emulate,
        )
    mx = MXOptions(recipe_name=m.recipe_name, filter_fqns=tuple(m.filter_fqns)) if "mx" in names else None
    return Converters(float8=float8, mx=mx)
