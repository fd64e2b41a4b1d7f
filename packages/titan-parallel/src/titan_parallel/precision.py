"""Mixed precision: which compute dtype suits a device, and how it is applied.

Two questions, answered by asking torch rather than parsing /proc:

- `native_bf16(device)`: does the device run bf16 matmuls at full speed? A CUDA
  device from Ampere on does; a CPU does with AVX512-BF16 or AMX, unless oneDNN
  (torch's CPU bf16 matmuls) is held below them by `ONEDNN_MAX_CPU_ISA` (or its
  old name `DNNL_MAX_CPU_ISA`). On an AVX2-only CPU torch has no fast bf16 kernel:
  a bf16 matmul measured 0.9 GFLOP/s there against 143 GFLOP/s in fp32, so "auto"
  picks fp32 on such a machine; an AVX512-BF16 CPU with oneDNN held to AVX2
  measured 2.5 GFLOP/s against 151.
- `mixed_precision_context(...)`: how the compute dtype is applied. Under
  `dp_mode="fsdp"` FSDP2's `MixedPrecisionPolicy` casts (weights gathered in bf16,
  so activations and the residual stream are bf16 too) on every world size, one
  rank included (`titan_parallel.uses_fsdp`): bf16 means the same on 1 and N
  ranks, and the context is a no-op. Under DDP `torch.autocast` casts instead, on
  1 and N ranks alike: bf16 matmuls around fp32 weights, embeddings, norms and
  residual stream, a different recipe from FSDP's.
"""

from __future__ import annotations

import contextlib
import os
import warnings

import torch

__all__ = ["native_bf16", "resolve_param_dtype", "mixed_precision_context"]


_ONEDNN_ISAS_WITHOUT_BF16 = {"SSE41", "AVX", "AVX2", "AVX2_VNNI", "AVX2_VNNI_2", "AVX512_CORE", "AVX512_CORE_VNNI"}
"""oneDNN's CPU ISA names (`ONEDNN_MAX_CPU_ISA`) below AVX512_CORE_BF16, the first with bf16 dot products."""


def _onednn_held_below_bf16() -> str | None:
    """`NAME=VALUE` of the environment variable that holds oneDNN below bf16 instructions, or None."""
    for name in ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA"):  # oneDNN reads the first one set
        value = os.environ.get(name)
        if value:
            return f"{name}={value}" if value.strip().upper() in _ONEDNN_ISAS_WITHOUT_BF16 else None
    return None


def native_bf16(device: torch.device) -> tuple[bool, str]:
    """Whether `device` computes in bf16 at full speed, and why (a short phrase for the log).

    Args:
        device: the training device.
    """
    if device.type == "cuda":
        if torch.cuda.is_bf16_supported(including_emulation=False):
            return True, f"{torch.cuda.get_device_name(device)} has native bf16"
        return False, f"{torch.cuda.get_device_name(device)} has no native bf16 (needs compute capability 8.0+)"
    if device.type == "cpu":
        features = [
            name
            for name, has in (
                ("AMX", _cpu_has("_is_amx_tile_supported")),
                ("AVX512-BF16", _cpu_has("_is_avx512_bf16_supported")),
            )
            if has
        ]
        held = _onednn_held_below_bf16()
        if features and held:
            return False, f"this CPU has {' and '.join(features)}, but {held} keeps torch's bf16 matmuls from it"
        if features:
            return True, f"this CPU has {' and '.join(features)}"
        capability = torch.backends.cpu.get_cpu_capability()
        return False, f"this CPU has neither AVX512-BF16 nor AMX (torch's CPU capability: {capability})"
    return False, f"no bf16 check for device type {device.type!r}"


def resolve_param_dtype(name: str, device: torch.device) -> tuple[torch.dtype, str]:
    """The compute dtype for `name` ("auto", "bfloat16" or "float32") on `device`, and the reason.

    "auto" is bf16 where `native_bf16` says so, else fp32. An explicit "bfloat16" on a
    device without native bf16 is kept, with a warning that it will be many times slower.

    Args:
        name: the requested dtype, "auto", "bfloat16" or "float32".
        device: the training device.
    """
    fast, why = native_bf16(device)
    if name == "auto":
        if fast:
            return torch.bfloat16, f"auto: bfloat16, since {why}"
        return torch.float32, f"auto: float32, since {why}; bf16 would run many times slower here"
    dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32}[name]
    if dtype is torch.bfloat16 and not fast:
        warnings.warn(
            f"bfloat16 compute requested but {why}: training will be many times slower than in float32 "
            "(ask for 'auto' or 'float32' instead)",
            stacklevel=2,
        )
        return dtype, f"bfloat16 as requested, without native support ({why})"
    return dtype, f"{name} as requested"


def mixed_precision_context(
    device_type: str, param_dtype: torch.dtype, *, fsdp: bool
) -> contextlib.AbstractContextManager:
    """`torch.autocast` to `param_dtype` when FSDP does not apply mixed precision itself (DDP), else a no-op.

    Args:
        device_type: "cuda" or "cpu".
        param_dtype: the compute dtype; fp32 needs no context.
        fsdp: whether the model is wrapped by FSDP (whose policy casts parameters), as `uses_fsdp` says.
    """
    if fsdp or param_dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(device_type, dtype=param_dtype)


def _cpu_has(probe: str) -> bool:
    """A `torch.cpu._is_*_supported` probe; False where this torch lacks it."""
    fn = getattr(torch.cpu, probe, None)
    return bool(fn()) if fn is not None else False
