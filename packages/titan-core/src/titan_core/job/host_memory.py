"""Refuse a CPU run that cannot fit in this machine's memory before it allocates anything.

On a GPU a run too large for the device fails with torch's out-of-memory error. On the CPU it
takes host memory until the kernel's OOM killer ends it (`titan train` then reports a rank killed
by SIGKILL), often after minutes of swapping. The bound here is what no layout of the job goes
below: the model states at the optimizer step, per parameter at least 4 bytes of fp32 weight, 2 of
gradient (bf16 copies' under master weights, else fp32: 4) and the optimizer's state (AdamW and
Adam: two fp32 moments, 8; Muon: one fp32 momentum for its matrices, 4), over the largest split
any parallelism makes of them (dp_shard x cp x tp x pp). Activations and buffers come on top, so a
job under the bound may still not fit (`titan estimate-memory` estimates the whole); one over it
cannot, and is refused in one line.
"""

from __future__ import annotations

from pathlib import Path

from titan_core.config.errors import ConfigError

__all__ = ["bytes_per_param_at_least", "check_host_memory", "host_memory_available"]

GIB = 2**30


def bytes_per_param_at_least(optimizer: str) -> int:
    """Bytes each parameter's states take at the optimizer step, at least (module docstring).

    Args:
        optimizer: `optimizer.name`.
    """
    return 4 + 2 + (4 if optimizer == "Muon" else 8)


def host_memory_available(meminfo: Path = Path("/proc/meminfo")) -> int | None:
    """Bytes the kernel can still give processes: MemAvailable + SwapFree; None where /proc/meminfo is not there.

    Args:
        meminfo: the file to read (Linux's).
    """
    try:
        fields = dict(line.split(":", 1) for line in meminfo.read_text().splitlines() if ":" in line)
        kib = int(fields["MemAvailable"].split()[0]) + int(fields.get("SwapFree", "0 kB").split()[0])
    except (OSError, KeyError, ValueError):
        return None
    return kib * 1024


def check_host_memory(n_params: int, optimizer: str, model_shards: int, processes: int, available: int | None) -> None:
    """Raise `ConfigError` when this node's processes need more than `available` bytes by the bound.

    Args:
        n_params: the model's parameters.
        optimizer: `optimizer.name`.
        model_shards: dp_shard x cp x tp x pp: the most any parallelism splits a parameter's states.
        processes: the job's processes on this node.
        available: `host_memory_available()`; None skips the check.
    """
    per_param = bytes_per_param_at_least(optimizer)
    need = n_params * per_param * processes / model_shards
    if available is None or need <= available:
        return
    states = "one fp32 momentum" if optimizer == "Muon" else "two fp32 moments"
    raise ConfigError(
        f"the model needs at least {need / GIB:.1f} GiB of host memory on this node ({n_params / 1e9:.2f}B "
        f"parameters x {per_param} bytes: fp32 weights, gradients and {optimizer}'s {states}, x {processes} "
        f"process(es) / {model_shards} model shard(s)), and this machine has {available / GIB:.1f} GiB available "
        "(MemAvailable + SwapFree): choose a smaller model.flavor, or shard it over more machines "
        "(titan train --nnodes; parallelism.data_parallel_shard_degree)",
        keys=("model.flavor", "parallelism.data_parallel_shard_degree"),
    )
