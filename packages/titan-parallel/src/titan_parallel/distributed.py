"""Choosing the device, starting and ending the process group, the same way for 1 process or N.

A lone process (no `RANK` in the environment) still gets a world of size 1 on
an in-memory store, so every collective runs on the same code path.
"""

from __future__ import annotations

import datetime
import os
from pathlib import Path

import torch
import torch.distributed as dist

from titan_parallel.flight_recorder import enable_flight_recorder, recorder_dump_file
from titan_parallel.layout import ParallelConfigError

DEVICES = ("auto", "cuda", "cpu")


def resolve_device(device: str = "auto") -> torch.device:
    """The device this process computes on: `cuda:LOCAL_RANK`, or the CPU.

    Args:
        device: "auto" (this rank's GPU when CUDA is available, else the CPU),
            "cuda" (refused when no GPU is visible) or "cpu".
    """
    if device not in DEVICES:
        raise ParallelConfigError(
            f"device={device!r} is unknown; choose 'auto', 'cuda' or 'cpu'", arguments=("device",)
        )
    if device == "cuda" and not torch.cuda.is_available():
        raise ParallelConfigError(
            "device='cuda' but no CUDA GPU is visible; use 'auto' or 'cpu'", arguments=("device",)
        )
    if device == "cpu" or not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))


def init_distributed(
    device: torch.device, timeout_s: float = 300.0, *, trace_buf_size: int = 0, trace_folder: Path | None = None
) -> tuple[int, int]:
    """Initialise the default process group for `device`; returns (rank, world_size).

    Backends: NCCL for CUDA tensors with gloo beside it for CPU tensors, gloo on CPU.
    Under torchrun the env:// rendezvous is used; alone, a size-1 world on a HashStore.

    Args:
        device: the device this process computes on (see `resolve_device`).
        timeout_s: timeout of the rendezvous and of every collective, in seconds
            (`titan_parallel.comm_watch.set_collective_timeout` changes it later).
        trace_buf_size: collectives the flight recorder keeps; 0 = off.
        trace_folder: where the flight recorder dumps (`rank_<N>`) on a timeout; None = the recorder is
            left as the environment sets it. Variables the user set win (`flight_recorder_env`).
    """
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    if trace_folder is not None and enable_flight_recorder(trace_buf_size, trace_folder) and device.type == "cuda":
        if (dump_file := recorder_dump_file(0)) is not None:
            dump_file.parent.mkdir(parents=True, exist_ok=True)  # NCCL's dump does not create it
    backend = "cuda:nccl,cpu:gloo" if device.type == "cuda" else "gloo"
    timeout = datetime.timedelta(seconds=timeout_s)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if "RANK" in os.environ:
        device_id = device if device.type == "cuda" else None
        dist.init_process_group(backend=backend, timeout=timeout, device_id=device_id)
    else:
        dist.init_process_group(backend=backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    return dist.get_rank(), dist.get_world_size()


def shutdown_distributed() -> None:
    """Destroy the process group, if any."""
    if dist.is_initialized():
        dist.destroy_process_group()
