"""`ThroughputMeter`: tokens/s, TFLOP/s and MFU per device over a logging window.

Tokens/s is per device: the tokens this rank processed, divided by the window's
wall time and by the number of devices that process those same tokens (the
tensor, context and pipeline parallel degrees multiplied). TFLOP/s per device is
`flops_per_token` (forward + backward, e.g. 6N + attention) times tokens/s; MFU
is that over the device's peak, in percent.
"""

from __future__ import annotations

import time
from collections.abc import Callable

__all__ = ["ThroughputMeter", "compute_throughput"]


def compute_throughput(
    *,
    tokens: int,
    seconds: float,
    flops_per_token: float,
    peak_flops: float | None,
    non_data_parallel_size: int = 1,
) -> dict[str, float | None]:
    """Per-device throughput of `tokens` processed in `seconds`.

    Args:
        tokens: tokens this rank processed in the window.
        seconds: the window's wall time.
        flops_per_token: training FLOPs per token (forward + backward).
        peak_flops: the device's peak FLOP/s, or None when unknown.
        non_data_parallel_size: devices that share each token (tp x cp x pp).

    Returns:
        `throughput/tokens_per_s`, `throughput/tflops` and `throughput/mfu_pct`
        (None when `peak_flops` is None).
    """
    if seconds <= 0:
        raise ValueError(f"throughput window must have positive duration, got {seconds} s")
    tokens_per_s = tokens / (seconds * non_data_parallel_size)
    flops = flops_per_token * tokens_per_s
    return {
        "throughput/tokens_per_s": tokens_per_s,
        "throughput/tflops": flops / 1e12,
        "throughput/mfu_pct": None if not peak_flops else 100.0 * flops / peak_flops,
    }


class ThroughputMeter:
    """Counts tokens between `read()`s and turns them into per-device throughput.

    Usage: `meter.add_tokens(n)` after every step; `meter.read()` at each
    logging step returns the figures for the tokens since the previous read
    (or since construction / `reset()`) and starts a new window.

    Args:
        flops_per_token: training FLOPs per token (forward + backward).
        peak_flops: the device's peak FLOP/s (see `device_peak_flops`), or None.
        non_data_parallel_size: devices that share each token (tp x cp x pp).
        clock: seconds as a float; `time.perf_counter` unless a test swaps it.
        raise_peak: called with the achieved FLOP/s when a window beats `peak_flops` (MFU > 100%),
            returns the corrected peak; for a peak that was measured, not read from a datasheet
            (see `titan_core.metrics.peak_flops.raise_cpu_peak`). None leaves the peak as given.
    """

    def __init__(
        self,
        *,
        flops_per_token: float,
        peak_flops: float | None,
        non_data_parallel_size: int = 1,
        clock: Callable[[], float] = time.perf_counter,
        raise_peak: Callable[[float], float] | None = None,
    ) -> None:
        self.flops_per_token = flops_per_token
        self.raise_peak = raise_peak
        self.peak_flops = peak_flops
        self.non_data_parallel_size = non_data_parallel_size
        self._clock = clock
        self.reset()

    def reset(self) -> None:
        """Start a new, empty window now (e.g. after a checkpoint save or evaluation)."""
        self._tokens = 0
        self._window_start = self._clock()

    def add_tokens(self, tokens: int) -> None:
        """Count `tokens` this rank processed in the step just taken."""
        self._tokens += tokens

    def read(self) -> dict[str, float | None]:
        """Throughput over the window so far; then start a new window.

        Returns:
            The dict of `compute_throughput`; all None if no time has passed.
        """
        now = self._clock()
        seconds = now - self._window_start
        if seconds <= 0:
            figures: dict[str, float | None] = dict.fromkeys(
                ("throughput/tokens_per_s", "throughput/tflops", "throughput/mfu_pct")
            )
        else:
            figures = compute_throughput(
                tokens=self._tokens,
                seconds=seconds,
                flops_per_token=self.flops_per_token,
                peak_flops=self.peak_flops,
                non_data_parallel_size=self.non_data_parallel_size,
            )
            mfu, tflops = figures["throughput/mfu_pct"], figures["throughput/tflops"]
            if mfu is not None and tflops is not None and mfu > 100 and self.raise_peak is not None:
                self.peak_flops = self.raise_peak(tflops * 1e12)
                figures["throughput/mfu_pct"] = 100 * tflops * 1e12 / self.peak_flops
        self._tokens = 0
        self._window_start = now
        return figures
