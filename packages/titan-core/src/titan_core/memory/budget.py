"""The memory budget of a rank: `--gpu-memory 80GiB`, or a GPU's name.

A GPU's usable memory is less than its datasheet size: the CUDA context, NCCL's
buffers and cuBLAS workspaces live outside PyTorch's allocator, and the caching
allocator fragments. `usable_bytes` takes `CONTEXT_BYTES` and `FRAGMENTATION`
off the device size; `docs/memory.md` explains both figures.
"""

from __future__ import annotations

import re

from titan_core.config.errors import ConfigError

GPU_MEMORY_GIB: dict[str, float] = {
    # Datasheet HBM/GDDR sizes (GB as the datasheets write them, which NVIDIA means as GiB-sized stacks).
    "A100-40GB": 40,
    "A100": 80,
    "A100-80GB": 80,
    "H100": 80,
    "H100-PCIe": 80,
    "H100-NVL": 94,
    "H200": 141,
    "GH200": 96,
    "B200": 180,
    "GB200": 186,
    "L40S": 48,
    "L40": 48,
    "L4": 24,
    "A10G": 24,
    "A10": 24,
    "MI300X": 192,
}
"""Device memory per GPU by name, for `--gpu-memory H100` (sizes in GiB)."""

CONTEXT_BYTES = int(2.5 * 1024**3)
"""Memory outside PyTorch's allocator on a CUDA device: context (~0.5 GiB), NCCL buffers and cuBLAS workspaces."""

FRAGMENTATION = 0.10
"""Fraction of the rest kept free for the caching allocator's rounding and fragmentation (expandable segments lower
it) and for what the estimate misses: torchtitan's reserved peaks for Llama 3.1 8B on H100 (FSDP 8 and 128) are 11%
and 6% above the analytic estimate (docs/memory.md, Accuracy)."""

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(B|KB|MB|GB|TB|KiB|MiB|GiB|TiB)?\s*$", re.IGNORECASE)
_UNITS = {
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}


def parse_gpu_memory(value: str) -> tuple[int, str]:
    """The device memory `value` names, in bytes, and how it was read.

    Args:
        value: a size ("80GiB", "80GB", "81920MiB"; a bare number is GiB) or a GPU name from
            `GPU_MEMORY_GIB` ("H100", "h200"), case-insensitive.

    Raises:
        ValueError: neither a size nor a known GPU; the message lists the names.
    """
    for name, gib in GPU_MEMORY_GIB.items():
        if value.strip().lower() == name.lower():
            return int(gib * 2**30), f"{name}, {gib:g} GiB"
    match = _SIZE.match(value)
    if match is None:
        names = ", ".join(GPU_MEMORY_GIB)
        raise ConfigError(f"--gpu-memory {value!r} is neither a size (e.g. 80GiB, 80GB) nor a known GPU ({names})")
    number, unit = float(match.group(1)), (match.group(2) or "GiB").lower()
    size = int(number * _UNITS[unit])
    if size <= 0:
        raise ConfigError(f"--gpu-memory {value!r} must be more than 0")
    return size, value.strip()


def usable_bytes(device_bytes: int, device_type: str = "cuda") -> int:
    """What a rank's tensors may use of `device_bytes`: less the CUDA context and fragmentation on a GPU.

    Raises:
        ConfigError: naming --gpu-memory, a CUDA device no larger than `CONTEXT_BYTES` (nothing left for tensors:
            every layout would read as over memory, and more GPUs as the fix).
    """
    if device_type != "cuda":
        return int(device_bytes * (1 - FRAGMENTATION))
    if device_bytes <= CONTEXT_BYTES:
        raise ConfigError(
            f"--gpu-memory {device_bytes / 2**30:.3g} GiB leaves nothing for tensors: a CUDA device keeps about "
            f"{CONTEXT_BYTES / 2**30:g} GiB outside PyTorch's allocator (its context, NCCL buffers and cuBLAS "
            "workspaces); give the device's whole memory, e.g. --gpu-memory 80GiB or --gpu-memory H100"
        )
    return int((device_bytes - CONTEXT_BYTES) * (1 - FRAGMENTATION))
