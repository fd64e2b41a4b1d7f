"""`memory_stats`: the memory figures logged each step.

CUDA: peak allocated and reserved memory since the last read (GiB and % of the
device), allocator retries and OOMs; the peaks are reset after each read, so
each log line covers its own window. Any other device: this process's host
memory, the resident set size (RSS) now and its peak over the process's life
(the OS cannot reset that peak).
"""

from __future__ import annotations

import os
import resource
import sys

import torch

__all__ = ["memory_stats", "GIB"]

GIB = float(1 << 30)


def _cuda_memory_stats(device: torch.device) -> dict[str, float]:
    """Peak allocated/reserved since the last call, retries and OOMs; resets the peaks."""
    stats = torch.cuda.memory_stats(device)
    total = torch.cuda.get_device_properties(device).total_memory
    allocated = stats.get("allocated_bytes.all.peak", 0)
    reserved = stats.get("reserved_bytes.all.peak", 0)
    torch.cuda.reset_peak_memory_stats(device)
    return {
        "memory/max_allocated_gib": allocated / GIB,
        "memory/max_allocated_pct": 100.0 * allocated / total,
        "memory/max_reserved_gib": reserved / GIB,
        "memory/max_reserved_pct": 100.0 * reserved / total,
        "memory/num_alloc_retries": float(stats.get("num_alloc_retries", 0)),
        "memory/num_ooms": float(stats.get("num_ooms", 0)),
    }


def _current_rss_bytes() -> int | None:
    """Resident set size now, from /proc/self/statm (Linux); None where that is missing."""
    try:
        with open("/proc/self/statm", encoding="ascii") as f:
            resident_pages = int(f.read().split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return resident_pages * os.sysconf("SC_PAGE_SIZE")


def _peak_rss_bytes() -> int:
    """Peak resident set size of this process (`ru_maxrss`: KiB on Linux, bytes on macOS)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


def _host_memory_stats() -> dict[str, float]:
    """This process's RSS now and at its peak, in GiB."""
    peak = _peak_rss_bytes()
    current = _current_rss_bytes()
    return {
        "memory/rss_gib": (current if current is not None else peak) / GIB,
        "memory/max_rss_gib": peak / GIB,
    }


def memory_stats(device: torch.device | str) -> dict[str, float]:
    """Memory figures for `device`, keyed by TensorBoard tag.

    Args:
        device: the training device; "cuda" devices report the caching
            allocator's peaks (and reset them), any other device reports this
            process's host RSS.

    Returns:
        CUDA: `memory/max_allocated_gib`, `memory/max_allocated_pct`,
        `memory/max_reserved_gib`, `memory/max_reserved_pct`,
        `memory/num_alloc_retries`, `memory/num_ooms`.
        Otherwise: `memory/rss_gib`, `memory/max_rss_gib`.
    """
    device = torch.device(device)
    if device.type == "cuda":
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        return _cuda_memory_stats(device)
    return _host_memory_stats()
