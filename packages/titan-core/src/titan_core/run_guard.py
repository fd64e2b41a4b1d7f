"""What the training loop checks after every backward: non-finite values and stop signals.

A month-long run meets NaNs and preemption. `RunGuard` answers, once per step and the
same on every rank, two questions before the optimizer steps:

- Is the step's loss or grad norm non-finite (NaN/inf)? Then the update is dropped and
  `training.on_nonfinite` decides: 'stop' (exit naming the step and the value; the
  newest checkpoint was written before the bad step and stays intact), 'skip_step'
  (go on with the next batch), 'rollback' (reload the newest checkpoint, go on with the
  data after the bad batch, the way large runs restart past a loss spike).
- Has any rank received SIGTERM or SIGUSR1 (what Slurm sends before it kills or
  requeues a job)? Then the loop finishes the step, saves a checkpoint and returns, so
  the process exits 0 and the next start resumes.

Both answers come from ONE all-reduce (MAX) of three flags: the loss is local to each
rank (and only on the last pipeline stage), a signal may reach only some ranks, and
every rank must take the same branch or the next collective hangs. The grad norm is
already global. The all-reduce is on the default group: under NCCL it is one small
device collective plus one host sync per step.
"""

from __future__ import annotations

import math
import signal
import threading
from types import FrameType

import torch
import torch.distributed as dist

__all__ = ["NonFiniteError", "RunGuard", "STOP_SIGNALS"]

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
"""Signals that make the run save a checkpoint and exit 0 at the end of the current step."""


class NonFiniteError(RuntimeError):
    """The run stopped on a non-finite loss or grad norm (`training.on_nonfinite`): told in one line."""


class RunGuard:
    """Per-step health of a run, agreed on by every rank.

    Use as a context manager around the training loop (it installs the signal handlers
    in the main thread and restores the old ones on exit), and pass `check` to
    `Trainer.train_step` as its verdict on whether to apply the update.

    Args:
        device: the device the step's tensors live on.
        group: the process group that must agree (default: the whole job).
    """

    def __init__(self, device: torch.device, group: dist.ProcessGroup | None = None):
        self.device = device
        self.group = group
        self.signal_received: str | None = None  # name of the first stop signal this rank got
        self.stop_requested = False  # some rank got a stop signal (agreed at the last check)
        self.nonfinite: list[str] = []  # what was non-finite at the last check, e.g. ["loss", "grad norm"]
        self.values: dict[str, float] = {}  # the last check's loss (this rank) and grad norm
        self._previous: dict[int, object] = {}

    def __enter__(self) -> RunGuard:
        if threading.current_thread() is threading.main_thread():
            for sig in STOP_SIGNALS:
                self._previous[sig] = signal.signal(sig, self._on_signal)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        # Only a flag: the step in flight finishes, the loop saves at its end.
        if self.signal_received is None:
            self.signal_received = signal.Signals(signum).name

    def check(self, loss: torch.Tensor | None, grad_norm: torch.Tensor) -> bool:
        """One all-reduce of (loss non-finite, grad norm non-finite, stop signal); True when the
        update may be applied (both values finite on every rank).

        Args:
            loss: this rank's step loss, None on pipeline ranks without the last stage.
            grad_norm: the global grad norm (the same on every rank).
        """
        flags = torch.zeros(3, device=self.device)
        if loss is not None:
            flags[0] = (~torch.isfinite(loss.detach())).float()
        flags[1] = (~torch.isfinite(grad_norm.detach())).float()
        flags[2] = float(self.signal_received is not None)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.group)
        bad_loss, bad_norm, stop = (bool(f) for f in flags.tolist())
        self.stop_requested = self.stop_requested or stop
        self.nonfinite = [name for name, bad in (("loss", bad_loss), ("grad norm", bad_norm)) if bad]
        self.values = {"grad norm": float(grad_norm)}
        if loss is not None:
            self.values["loss"] = float(loss)
        return not self.nonfinite

    def describe(self, step: int) -> str:
        """`step 7: the loss (nan on this rank) and the grad norm (nan) are not finite`."""
        shown = []
        for name in self.nonfinite:
            value = self.values.get(name)
            if value is None or math.isfinite(value):  # a loss that went bad on another rank
                shown.append(f"the {name} (on another rank)")
            else:
                shown.append(f"the {name} ({value})")
        verb = "is" if len(shown) == 1 else "are"
        return f"step {step}: {' and '.join(shown)} {verb} not finite"
