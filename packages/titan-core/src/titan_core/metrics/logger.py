"""`MetricsLogger`: the console line, `metrics.jsonl`, TensorBoard, W&B and the progress bar.

Metrics arrive as a dict keyed by TensorBoard tag; `None` values are skipped.
The console line shows the keys below when present (any other key goes to
TensorBoard only):

    loss/global_avg, loss/global_max   loss 5.4321 (max 5.50)
    loss/z_loss                        z_loss 0.0012   (its part of the loss, with training.z_loss_weight)
    loss/mtp                           mtp 5.6789      (the prediction depths' mean cross-entropy, with mtp.layers)
    optim/grad_norm                    grad_norm 1.23
    optim/lr                           lr 8.0e-04
    throughput/tokens_per_s            tokens/s 2,345
    throughput/tflops                  tflops 0.12
    throughput/mfu_pct                 mfu 4.1%
    memory/max_reserved_gib            mem 1.23GiB   (CUDA; see memory.py)
    memory/rss_gib                     mem 1.23GiB   (host, when no CUDA figure)
    validation/loss                    validation loss 3.2500 (ppl 25.79)
    validation/<set>/loss              validation loss 3.2500 (ppl 25.79; code 3.0000, web 3.5000)   (validation.sets)
    validation_ema/loss                ema validation loss 3.1000 (ppl 22.20)   (ema.validation: the averaged weights')

A record with none of these keys (a downstream evaluation's, whose evaluator prints
its own line) prints no console line.
Only rank 0 writes. Text goes through the `logging` logger "titan"; if nothing
has configured a handler for it, the logger adds one that prints to stdout
while it is open. When stdout is a terminal a tqdm progress bar (steps
done/total, rate, ETA) sits on the last line, and console log lines are printed
above it (`tqdm.contrib.logging.logging_redirect_tqdm`); when stdout is not a
terminal there is no bar and no colour codes. Every logged step is also one JSON
line in `metrics.jsonl`, the record scripts and tests read.

One trajectory per run folder: a run that starts at step N (N = 0 for a fresh
start, the checkpoint's step for a resume) logs steps N+1 on, so the records an
earlier process left past step N (steps it ran after its last checkpoint, or a
whole earlier run in the same folder) are moved from `metrics.jsonl` to
`metrics.superseded.jsonl`, with a line that says so, and TensorBoard hides the
earlier event files' steps from N+1 on (`SummaryWriter(purge_step=N + 1)`).

The resolved config is recorded once at the start: as TOML text (tag `config`)
in TensorBoard, and as the run's config in Weights & Biases (`wandb_sink.py`,
optional), which receives the same values as TensorBoard each step.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import re
import sys
from collections.abc import Mapping
from pathlib import Path

from tqdm import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

from titan_core.metrics.wandb_sink import WandbOptions, WandbSink

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
_BAR_FORMAT = "{bar:24} {n_fmt}/{total_fmt} steps  {rate_fmt}  ETA {remaining}"  # rate: "1.23 steps/s"


def _paint(text: str, label: str, color: bool) -> str:
    """`text` wrapped in the ANSI colour of `label` when `color` is on."""
    return f"{_COLORS[label]}{text}{_RESET}" if color else text


def format_metrics_line(step: int, total_steps: int, metrics: Mapping[str, float | None], color: bool = False) -> str:
    """The console line for one step, e.g. `step  12/60  loss 5.4321 (max 5.50)  ...`.

    Args:
        step: the step just finished (1-based).
        total_steps: steps the run will take.
        metrics: values keyed by TensorBoard tag; None values are skipped.
        color: add ANSI colours.

    Returns:
        The line, fields separated by two spaces.
    """
    width = len(str(total_steps))
    return "  ".join([_paint(f"step  {step:>{width}}/{total_steps}", "step", color), *_fields(metrics, color)])


def _fields(metrics: Mapping[str, float | None], color: bool) -> list[str]:
    """The console fields of the keys in the module docstring that `metrics` holds, in its order."""

    def value(key: str) -> float | None:
        return metrics.get(key)

    fields = []
    if (loss := value("loss/global_avg")) is not None:
        text = f"loss {loss:.4f}"
        if (loss_max := value("loss/global_max")) is not None:
            text += f" (max {loss_max:.2f})"
        fields.append(_paint(text, "loss", color))
    if (z_loss := value("loss/z_loss")) is not None:
        fields.append(_paint(f"z_loss {z_loss:.4f}", "loss", color))
    if (mtp := value("loss/mtp")) is not None:
        fields.append(_paint(f"mtp {mtp:.4f}", "loss", color))
    if (grad_norm := value("optim/grad_norm")) is not None:
        fields.append(_paint(f"grad_norm {grad_norm:#.3g}", "grad_norm", color))  # "19.0", not "19"
    if (lr := value("optim/lr")) is not None:
        fields.append(_paint(f"lr {lr:.1e}", "lr", color))
    if (tokens_per_s := value("throughput/tokens_per_s")) is not None:
        fields.append(_paint(f"tokens/s {tokens_per_s:,.0f}", "tokens/s", color))
    if (tflops := value("throughput/tflops")) is not None:
        fields.append(_paint(f"tflops {tflops:.2f}", "tflops", color))
    if (max_load := value("moe/max_load")) is not None:
        fields.append(_paint(f"moe max_load {max_load:.2f}", "grad_norm", color))
    if (mfu := value("throughput/mfu_pct")) is not None:
        fields.append(_paint(f"mfu {mfu:.1f}%", "mfu", color))
    mem = value("memory/max_reserved_gib")
    if mem is None:
        mem = value("memory/rss_gib")
    if mem is not None:
        fields.append(_paint(f"mem {mem:.2f}GiB", "mem", color))
    for prefix, label in (("validation", "validation loss"), ("validation_ema", "ema validation loss")):
        if (val_loss := value(f"{prefix}/loss")) is not None:
            ppl = math.inf if val_loss > 700 else math.exp(val_loss)  # exp() overflows past ~709; NaN stays NaN
            sets = [
                f"{key[len(prefix) + 1 : -len('/loss')]} {v:.4f}"
                for key, v in metrics.items()
                if key.startswith(f"{prefix}/") and key.endswith("/loss") and key != f"{prefix}/loss" and v is not None
            ]
            each = f"; {', '.join(sets)}" if sets else ""  # validation.sets: each set's, {prefix}/loss their mean
            fields.append(_paint(f"{label} {val_loss:.4f} (ppl {ppl:.2f}{each})", "loss", color))
    return fields


_STEP_PREFIX = re.compile(r'\{"step": (-?\d+)[,}]')
"""The start of every record `MetricsLogger.log` writes, read without parsing the rest."""


def _record_step(line: str) -> int | None:
    """The step of a `metrics.jsonl` line, or None for a line torn by a kill (no newline; or not a record)."""
    if not line.endswith("\n"):
        return None
    if (match := _STEP_PREFIX.match(line)) is not None and line.endswith("}\n"):
        return int(match.group(1))
    try:
        record = json.loads(line)
    except json.JSONDecodeError:
        return None
    return record.get("step") if isinstance(record, dict) and isinstance(record.get("step"), int) else None


def set_aside_records_after(path: Path, step: int) -> str | None:
    """Move the records of `path` (a `metrics.jsonl`) whose step is after `step`, and any torn line a killed process
    left, to `metrics.superseded.jsonl` beside it; returns the line saying so, or None when there were none.
    The file is read line by line, twice at most (a long run's file need not fit in memory), and replaced whole
    (staged, renamed), so a kill leaves either file.

    Args:
        path: the run's `metrics.jsonl` (need not exist).
        step: the step the new run starts from.
    """
    if not path.is_file():
        return None
    with open(path, encoding="utf-8") as f:
        if all((s := _record_step(line)) is not None and s <= step for line in f):
            return None
    aside, staged = path.with_name("metrics.superseded.jsonl"), path.with_name(path.name + ".tmp")
    moved, low, high = 0, None, None  # the set-aside records and their lowest and highest steps
    with open(path, encoding="utf-8") as f, open(staged, "w", encoding="utf-8") as keep:
        with open(aside, "a", encoding="utf-8") as out:
            for line in f:
                record_step = _record_step(line)
                if record_step is not None and record_step <= step:
                    keep.write(line)
                    continue
                out.write(line if line.endswith("\n") else line + "\n")
                moved += 1
                if record_step is not None:
                    low = record_step if low is None else min(low, record_step)
                    high = record_step if high is None else max(high, record_step)
    os.replace(staged, path)
    span = "a torn line" if low is None else f"step {low}" if low == high else f"steps {low}-{high}"
    return (
        f"metrics: {path} held {moved} record{'s' * (moved != 1)} past step {step} ({span}) from an earlier "
        f"process in this folder, which this run logs anew from step {step + 1}: moved to {aside.name}"
    )


def _is_console(handler: logging.Handler) -> bool:
    return isinstance(handler, logging.StreamHandler) and handler.stream in (sys.stdout, sys.stderr)


class MetricsLogger:
    """Writes each logged step to the console, `metrics.jsonl`, TensorBoard and W&B, on rank 0 only.

    Args:
        log_dir: TensorBoard folder; None when TensorBoard is off.
        enable_tensorboard: write TensorBoard event files.
        rank: this process's rank; only rank 0 prints and writes.
        total_steps: steps the run will take, for the line and bar.
        color: colour the console line; ignored when stdout is not a terminal.
        jsonl_path: append one JSON record per logged step to this file; None writes none.
        config_toml: the resolved config as TOML, written once to TensorBoard as text; None writes none.
        wandb: log to a Weights & Biases run made with these options; None = no W&B.
        start_step: the step the run starts from (0, or the resumed checkpoint's); records and TensorBoard events
            of later steps that an earlier process wrote are set aside (module docstring).
    """

    def __init__(
        self,
        log_dir: str | Path | None,
        enable_tensorboard: bool,
        rank: int,
        total_steps: int,
        color: bool,
        jsonl_path: str | Path | None = None,
        config_toml: str | None = None,
        wandb: WandbOptions | None = None,
        start_step: int = 0,
    ) -> None:
        self.rank = rank
        self.total_steps = total_steps
        self._stream = sys.stdout
        is_tty = self._stream.isatty()
        self.color = color and is_tty
        self._writer = None
        self._jsonl = None
        self._wandb: WandbSink | None = None
        self._bar: tqdm | None = None
        self._handler: logging.Handler | None = None
        self._saved_level: int | None = None
        self._redirect = contextlib.ExitStack()
        if rank != 0:
            return
        if enable_tensorboard:
            if log_dir is None:
                raise ValueError(
                    "enable_tensorboard is true but log_dir is None; give a TensorBoard folder or turn it off"
                )
            from torch.utils.tensorboard import SummaryWriter

            self._writer = SummaryWriter(log_dir=str(log_dir), purge_step=start_step + 1)
            if config_toml is not None:
                self._writer.add_text("config", f"```toml\n{config_toml}```", global_step=0)
        if wandb is not None:
            self._wandb = WandbSink(wandb)
        superseded = None
        if jsonl_path is not None:
            superseded = set_aside_records_after(Path(jsonl_path), start_step)
            self._jsonl = open(jsonl_path, "a", encoding="utf-8")
        if not logger.hasHandlers():
            self._handler = logging.StreamHandler(self._stream)
            self._handler.setFormatter(logging.Formatter("%(message)s"))
            logger.addHandler(self._handler)
            if logger.getEffectiveLevel() > logging.INFO:
                self._saved_level = logger.level
                logger.setLevel(logging.INFO)
        if is_tty:
            # Console handlers (ours, or the root's from logging.basicConfig) print above the bar.
            consoles = [lg for lg in (logging.root, logger) if any(_is_console(h) for h in lg.handlers)]
            self._redirect.enter_context(logging_redirect_tqdm(loggers=consoles))
            self._bar = tqdm(total=total_steps, file=self._stream, bar_format=_BAR_FORMAT, unit=" steps")
        if superseded:
            logger.info("%s", superseded)

    def update_progress(self, step: int) -> None:
        """Advance the progress bar to `step` steps done (call every step; cheap)."""
        if self._bar is not None and step > self._bar.n:
            self._bar.update(min(step, self.total_steps) - self._bar.n)

    def log(self, step: int, metrics: dict[str, object]) -> None:
        """Print the console line and write the JSON record and TensorBoard scalars for `step`.

        Args:
            step: the step just finished (1-based).
            metrics: values keyed by TensorBoard tag (see the module docstring);
                None values are skipped on the console and in TensorBoard, null in the JSON record.
        """
        if self.rank != 0:
            return
        if self._jsonl is not None:
            self._jsonl.write(json.dumps({"step": step, **metrics}) + "\n")
            self._jsonl.flush()
        # Scalars go everywhere; structured values (e.g. `moe/tokens_per_expert`) to the JSON record only.
        values = {key: float(v) for key, v in metrics.items() if isinstance(v, (int, float))}
        if self._writer is not None:
            for tag, v in values.items():
                self._writer.add_scalar(tag, v, step)
        if self._wandb is not None:
            self._wandb.log(step, values)
        if _fields(values, color=False):  # not a bare step line (an evaluation's record: its evaluator says it)
            logger.info(format_metrics_line(step, self.total_steps, values, color=self.color))
        self.update_progress(step)

    def close(self) -> None:
        """Flush and close the files, end the bar and remove what was added to logging."""
        if self._writer is not None:
            self._writer.flush()
            self._writer.close()
            self._writer = None
        if self._wandb is not None:
            self._wandb.close()
            self._wandb = None
        if self._jsonl is not None:
            self._jsonl.close()
            self._jsonl = None
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        self._redirect.close()
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
