"""`model.converters` and the `[float8]` / `[mx]` sections -> titan_parallel's float8 options.

The trainer passes the result to `build_model_parts`, which converts the meta model
before the pipeline split and parallelism (`titan_parallel.float8`). Whether the
options can run is checked once, by `titan_core.job` (rule "converters"), which
keeps what `build_converters` returned on the resolved job. `FLOAT8_KEYS` /
`MX_KEYS` name the key behind each field, for the errors that name the field.
"""

from __future__ import annotations

from dataclasses import dataclass

from titan_core.config.schema import JobConfig
from titan_parallel.float8 import Float8Options, MXOptions, needs_emulation


@dataclass(frozen=True)
class Converters:
    """The model converters a run applies; None = not asked for."""

    float8: Float8Options | None = None
    mx: MXOptions | None = None


FLOAT8_KEYS: dict[str, str] = {
    "recipe_name": "float8.recipe_name",
    "enable_fsdp_float8_all_gather": "float8.enable_fsdp_float8_all_gather",
    "precompute_float8_dynamic_scale_for_fsdp": "float8.precompute_float8_dynamic_scale_for_fsdp",
    "filter_fqns": "float8.filter_fqns",
    "auto_filter_small_kn": "float8.auto_filter_small_kn",
    "emulate": "float8.emulate",
}
"""`Float8Options` field -> config key."""

MX_KEYS: dict[str, str] = {"recipe_name": "mx.recipe_name", "filter_fqns": "mx.filter_fqns"}
"""`MXOptions` field -> config key."""


def float8_options(cfg: JobConfig, device_type: str) -> Float8Options:
    """The `[float8]` section for a run on `device_type` (`emulate = 'auto'` emulates off float8 GPUs)."""
    import torch

    f = cfg.float8
    return Float8Options(
        recipe_name=f.recipe_name,
        enable_fsdp_float8_all_gather=f.enable_fsdp_float8_all_gather,
        precompute_float8_dynamic_scale_for_fsdp=f.precompute_float8_dynamic_scale_for_fsdp,
        filter_fqns=tuple(f.filter_fqns),
        auto_filter_small_kn=f.auto_filter_small_kn,
        emulate=needs_emulation(torch.device(device_type)) if f.emulate == "auto" else f.emulate,
    )


def mx_options(cfg: JobConfig) -> MXOptions:
    """The `[mx]` section."""
    return MXOptions(recipe_name=cfg.mx.recipe_name, filter_fqns=tuple(cfg.mx.filter_fqns))


def build_converters(cfg: JobConfig, device_type: str) -> Converters:
    """The converters `model.converters` asks for, on `device_type`."""
    names = cfg.model.converters
    return Converters(
        float8=float8_options(cfg, device_type) if "float8" in names else None,
        mx=mx_options(cfg) if "mx" in names else None,
    )
