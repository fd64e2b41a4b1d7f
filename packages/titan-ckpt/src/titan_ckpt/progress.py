"""A minimal byte-count progress bar on stderr, shown only for large transfers.

Written here rather than taken from tqdm: titan-ckpt depends only on torch, numpy,
safetensors and huggingface-hub.
"""

from __future__ import annotations

import sys
import time

SHOW_FROM_BYTES = 1 << 30
"""Transfers smaller than this (1 GiB) print nothing."""


class ProgressBar:
    """`label [#####.....] 52%  3.4/6.5 GB` on stderr, redrawn in place on a terminal,
    every 10% otherwise.

    Args:
        label: what is moving ("reading model-00001-of-00004.safetensors").
        total_bytes: size of the whole transfer.
        enabled: force on or off; None shows it when `total_bytes >= SHOW_FROM_BYTES`.
    """

    def __init__(self, label: str, total_bytes: int, enabled: bool | None = None):
        self.label = label
        self.total = max(total_bytes, 1)
        self.done = 0
        self.enabled = total_bytes >= SHOW_FROM_BYTES if enabled is None else enabled
        self._tty = sys.stderr.isatty()
        self._last_decile = -1
        self._last_draw = 0.0

    def update(self, n_bytes: int) -> None:
        """Advance by `n_bytes` and redraw when due."""
        self.done += n_bytes
        if not self.enabled:
            return
        decile = 10 * self.done // self.total
        now = time.monotonic()
        if self._tty and (now - self._last_draw > 0.1 or self.done >= self.total):
            sys.stderr.write("\r" + self._line())
            self._last_draw = now
        elif not self._tty and decile != self._last_decile:
            sys.stderr.write(self._line() + "\n")
        self._last_decile = decile
        sys.stderr.flush()

    def close(self) -> None:
        """End the bar's line."""
        if self.enabled and self._tty:
            sys.stderr.write("\n")
            sys.stderr.flush()

    def _line(self) -> str:
        frac = min(self.done / self.total, 1.0)
        bar = "#" * int(30 * frac) + "." * (30 - int(30 * frac))
        return f"{self.label} [{bar}] {100 * frac:3.0f}%  {self.done / 1e9:.1f}/{self.total / 1e9:.1f} GB"
