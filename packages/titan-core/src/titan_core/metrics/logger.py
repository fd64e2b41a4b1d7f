"""`MetricsLogger`: the console line, TensorBoard scalars and the progress bar.

Metrics arrive as a dict keyed by TensorBoard tag; `None` values are skipped.
The console line shows the keys below when present (any other key goes to
TensorBoard only):

    loss/global_avg, loss/global_max   loss 5.4321 (max 5.50)
    optim/grad_norm                    grad_norm 1.23
    optim/lr                           lr 8.0e-04
    throughput/tokens_per_s            tokens/s 2,345
    throughput/tflops                  tflops 0.12
    throughput/mfu_pct                 mfu 4.1%
    memory/max_reserved_gib            mem 1.23GiB   (CUDA; see memory.py)
    memory/rss_gib                     mem 1.23GiB   (host, when no CUDA figure)

Only rank 0 writes. Text goes through the `logging` logger "titan"; if nothing
has configured a handler for it, the logger adds one that prints to stdout
while it is open. When stdout is a terminal a progress bar (steps done/total,
rate, ETA) sits on the last line, rewritten in place with `\\r` and cleared
before each log line; when stdout is not a terminal there is no bar and no
`\\r` or colour codes.

Written here rather than taken from rich/tqdm to keep titan-core's
dependencies to torch, pydantic and tensorboard.
"""

from __future__ import annotations

import logging
import sys
import time
from pathlib import Path
from typing import TextIO

__all__ = ["MetricsLogger", "format_metrics_line"]

logger = logging.getLogger("titan")

_RESET = "\033[0m"
_COLORS = {
    "step": "\033[36m",  # cyan
    "loss": "\033[32m",  # green
    "grad_norm": "\033[33m",  # yellow
    "lr": "\033[34m",  # blue
    "tokens/s": "\033[35m",  # magenta
    "tflops": "\033[36m",  # cyan
    "mfu": "\033[35m",  # magenta
    "mem": "\033[33m",  # yellow
}
_CLEAR_LINE = "\r\033[2K"
_BAR_WIDTH = 24
_BAR_MIN_INTERVAL_S = 0.1  # redraw the bar at most this often


def _paint(text: str, label: str, color: bool) -> str:
    """`text` wrapped in the ANSI colour of `label` when `color` is on."""
    return f"{_COLORS[label]}{text}{_RESET}" if color else text


def format_metrics_line(step: int, total_steps: int, metrics: dict[str, float | None], color: bool = False) -> str:
    """The console line for one step, e.g. `step  12/60  loss 5.4321 (max 5.50)  ...`.

    Args:
        step: the step just finished (1-based).
        total_steps: steps the run will take.
        metrics: values keyed by TensorBoard tag; None values are skipped.
        color: add ANSI colours.

    Returns:
        The line, fields separated by two spaces.
    """

    def value(key: str) -> float | None:
        return metrics.get(key)

    width = len(str(total_steps))
    fields = [_paint(f"step  {step:>{width}}/{total_steps}", "step", color)]
    if (loss := value("loss/global_avg")) is not None:
        text = f"loss {loss:.4f}"
        if (loss_max := value("loss/global_max")) is not None:
            text += f" (max {loss_max:.2f})"
        fields.append(_paint(text, "loss", color))
    if (grad_norm := value("optim/grad_norm")) is not None:
        fields.append(_paint(f"grad_norm {grad_norm:.3g}", "grad_norm", color))
    if (lr := value("optim/lr")) is not None:
        fields.append(_paint(f"lr {lr:.1e}", "lr", color))
    if (tokens_per_s := value("throughput/tokens_per_s")) is not None:
        fields.append(_paint(f"tokens/s {tokens_per_s:,.0f}", "tokens/s", color))
    if (tflops := value("throughput/tflops")) is not None:
        fields.append(_paint(f"tflops {tflops:.2f}", "tflops", color))
    if (mfu := value("throughput/mfu_pct")) is not None:
        fields.append(_paint(f"mfu {mfu:.1f}%", "mfu", color))
    mem = value("memory/max_reserved_gib")
    if mem is None:
        mem = value("memory/rss_gib")
    if mem is not None:
        fields.append(_paint(f"mem {mem:.2f}GiB", "mem", color))
    return "  ".join(fields)


def _format_duration(seconds: float) -> str:
    """`H:MM:SS` for a duration in seconds."""
    seconds = int(round(seconds))
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


class _ProgressBar:
    """One terminal line, rewritten in place: `[####....] 12/60 steps  1.23 steps/s  ETA 0:00:39`."""

    def __init__(self, stream: TextIO, total_steps: int) -> None:
        self.stream = stream
        self.total_steps = total_steps
        self.text = ""  # what is on the line now; "" = nothing drawn
        self._first: tuple[int, float] | None = None  # (step, time) of the first update
        self._last_draw = 0.0

    def update(self, step: int) -> None:
        """Redraw for `step` steps done (throttled, except for the last step)."""
        now = time.perf_counter()
        if self._first is None:
            self._first = (step, now)
        if step < self.total_steps and now - self._last_draw < _BAR_MIN_INTERVAL_S:
            return
        first_step, first_time = self._first
        elapsed = now - first_time
        rate = (step - first_step) / elapsed if elapsed > 0 and step > first_step else None
        done = min(step, self.total_steps)
        filled = _BAR_WIDTH * done // max(self.total_steps, 1)
        text = f"[{'#' * filled}{'.' * (_BAR_WIDTH - filled)}] {done}/{self.total_steps} steps"
        if rate is not None:
            text += f"  {rate:.2f} steps/s  ETA {_format_duration((self.total_steps - done) / rate)}"
        self.text = text
        self._last_draw = now
        self.redraw()

    def clear(self) -> None:
        """Blank the line (before other text is printed)."""
        if self.text:
            self.stream.write(_CLEAR_LINE)
            self.stream.flush()

    def redraw(self) -> None:
        """Write the current bar on the (blank) line."""
        if self.text:
            self.stream.write(f"{_CLEAR_LINE}{self.text}")
            self.stream.flush()


class _BarAwareHandler(logging.StreamHandler):
    """A stdout handler that clears the progress bar before a record and redraws it after."""

    def __init__(self, stream: TextIO, bar: _ProgressBar | None) -> None:
        super().__init__(stream)
        self.bar = bar
        self.setFormatter(logging.Formatter("%(message)s"))

    def emit(self, record: logging.LogRecord) -> None:
        if self.bar is not None:
            self.bar.clear()
        super().emit(record)
        if self.bar is not None:
            self.bar.redraw()


class MetricsLogger:
    """Writes each logged step to the console and TensorBoard, on rank 0 only.

    Args:
        log_dir: TensorBoard folder (e.g. `job.dump_folder / metrics.save_tb_folder`);
            may be None when TensorBoard is off.
        enable_tensorboard: write TensorBoard event files (`metrics.enable_tensorboard`).
        rank: this process's rank; only rank 0 prints and writes.
        total_steps: steps the run will take (`training.steps`), for the line and bar.
        color: colour the console line (`not metrics.disable_color_printing`);
            ignored when stdout is not a terminal.
    """

    def __init__(
        self,
        log_dir: str | Path | None,
        enable_tensorboard: bool,
        rank: int,
        total_steps: int,
        color: bool,
    ) -> None:
        self.rank = rank
        self.total_steps = total_steps
        self._stream = sys.stdout
        is_tty = self._stream.isatty()
        self.color = color and is_tty
        self._writer = None
        self._bar: _ProgressBar | None = None
        self._handler: _BarAwareHandler | None = None
        self._saved_level: int | None = None
        if rank != 0:
            return
        if enable_tensorboard:
            if log_dir is None:
                raise ValueError(
                    "metrics.enable_tensorboard is true but no TensorBoard folder was given; "
                    "set job.dump_folder or set metrics.enable_tensorboard = false"
                )
            from torch.utils.tensorboard import SummaryWriter

            self._writer = SummaryWriter(log_dir=str(log_dir))
        if is_tty:
            self._bar = _ProgressBar(self._stream, total_steps)
        if not logger.hasHandlers():
            self._handler = _BarAwareHandler(self._stream, self._bar)
            logger.addHandler(self._handler)
            if logger.getEffectiveLevel() > logging.INFO:
                self._saved_level = logger.level
                logger.setLevel(logging.INFO)

    def update_progress(self, step: int) -> None:
        """Advance the progress bar to `step` steps done (call every step; cheap)."""
        if self._bar is not None:
            self._bar.update(step)

    def log(self, step: int, metrics: dict[str, float | None]) -> None:
        """Print the console line and write the TensorBoard scalars for `step`.

        Args:
            step: the step just finished (1-based).
            metrics: values keyed by TensorBoard tag (see the module docstring);
                None values are skipped.
        """
        if self.rank != 0:
            return
        values = {key: float(v) for key, v in metrics.items() if v is not None}
        if self._writer is not None:
            for tag, v in values.items():
                self._writer.add_scalar(tag, v, step)
        line = format_metrics_line(step, self.total_steps, values, color=self.color)
        if self._bar is not None and self._handler is None:
            self._bar.clear()  # someone else's handler: clear around the record ourselves
            logger.info(line)
            self._bar.redraw()
        else:
            logger.info(line)
        self.update_progress(step)

    def close(self) -> None:
        """Flush and close TensorBoard, end the bar's line and remove the added handler."""
        if self._writer is not None:
            self._writer.flush()
            self._writer.close()
            self._writer = None
        if self._bar is not None:
            if self._bar.text:
                self._stream.write("\n")
                self._stream.flush()
            self._bar = None
        if self._handler is not None:
            logger.removeHandler(self._handler)
            self._handler.flush()
            self._handler = None
            if self._saved_level is not None:
                logger.setLevel(self._saved_level)
                self._saved_level = None

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
