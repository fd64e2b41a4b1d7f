"""Python's garbage collector during training (`training.gc_freq`, torchtitan's key).

Python collects when allocations pass its thresholds: at a step no one chose, on each rank apart, and a rank that
pauses for a full collection holds every other rank at the next collective. As torchtitan does, a run with
`gc_freq = N` turns the automatic collector off for the training loop and collects the young generations
(`gc.collect(1)`) every N steps, on every rank at the same step; the collector is back on after the loop. `auto`
(the default) does so every 50 steps on CUDA, where ranks wait on each other's pauses, and leaves Python's own on
CPU (its runs are short, and their memory measurements are made with it). Kept here rather than in torch: torch has
no such switch (torchtitan's `GarbageCollection` is its own too).
"""

from __future__ import annotations

import gc
import logging

logger = logging.getLogger("titan")

AUTO_GC_FREQ_CUDA = 50
"""`training.gc_freq = 'auto'` on CUDA: torchtitan's default."""


def resolve_gc_freq(setting: int | str, device_type: str) -> tuple[int, str]:
    """`training.gc_freq` for a run on `device_type`: the steps between collections (0: Python's own collector) and
    why, for the start-up line.

    Args:
        setting: the config's value: 'auto', 0, or a step count.
        device_type: the training device's type.
    """
    if setting != "auto":
        return int(setting), "asked for"
    if device_type == "cuda":
        return AUTO_GC_FREQ_CUDA, "auto: on CUDA"
    return 0, f"auto: Python's own on {device_type}"


class PeriodicGC:
    """Python's automatic collector off while open, a young-generation collection every `freq` steps (`step`); a
    no-op for `freq` 0. `close()` (idempotent) turns the collector back on where it was on.

    Args:
        freq: steps between collections; 0 leaves Python's collector alone.
    """

    def __init__(self, freq: int):
        self.freq = freq
        self._was_enabled = gc.isenabled()
        if freq > 0:
            gc.collect(1)  # start from clean young generations
            gc.disable()

    def step(self, step: int) -> None:
        """Collect the young generations when `step` is a multiple of `freq`.

        Args:
            step: the step just finished.
        """
        if self.freq > 0 and step % self.freq == 0:
            gc.collect(1)

    def close(self) -> None:
        """Turn Python's automatic collector back on where it was on before."""
        if self.freq > 0 and self._was_enabled:
            gc.enable()
        self.freq = 0
