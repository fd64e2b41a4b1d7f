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

import logging
import math
import signal
import threading
from types import FrameType
from typing import Literal

import torch
import torch.distributed as dist

from titan_ckpt import CheckpointManager
from titan_ckpt.step_folders import list_complete_steps

__all__ = ["NonFiniteError", "NonFinitePolicy", "RunGuard", "STOP_SIGNALS"]

logger = logging.getLogger("titan")

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
        self.values: dict[str, float] = {}  # the last bad check's loss (this rank) and grad norm
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
        if self.nonfinite:  # the values for the message; a good step copies nothing more to the host
            self.values = {"grad norm": float(grad_norm), **({"loss": float(loss)} if loss is not None else {})}
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


class NonFinitePolicy:
    """`training.on_nonfinite` applied after each step: what to do when `RunGuard` dropped its update.

    Args:
        policy: 'stop', 'skip_step' or 'rollback'.
        max_in_a_row: consecutive dropped steps tolerated by 'skip_step' / 'rollback' before stopping.
        checkpointer: the run's checkpoint manager (rolled back from; named when stopping).
        rank: this process's rank (rank 0 logs).
    """

    def __init__(self, policy: str, max_in_a_row: int, checkpointer: CheckpointManager, *, rank: int):
        self.policy, self.max_in_a_row = policy, max_in_a_row
        self.checkpointer, self.rank = checkpointer, rank
        self.in_a_row = 0  # dropped steps since the last applied one
        self.skipped = 0  # steps dropped by 'skip_step' in this process

    def after_step(self, guard: RunGuard, step: int) -> Literal["applied", "skipped", "rolled back"]:
        """Apply the policy to `step` (just counted); the run state is the checkpoint's after a rollback.

        Args:
            guard: the guard that checked the step.
            step: the step just finished (1-based).

        Raises:
            NonFiniteError: the policy is 'stop', too many dropped steps came in a row, or there is no
                checkpoint to roll back to.
        """
        if not guard.nonfinite:
            self.in_a_row = 0
            return "applied"
        self.in_a_row += 1
        what = guard.describe(step)
        if self.policy == "stop":
            raise NonFiniteError(
                f"{what}: stopped without applying it (training.on_nonfinite='stop'){self._checkpoint_note()}; "
                "set training.on_nonfinite to 'skip_step' or 'rollback' to go on past it"
            )
        if self.in_a_row > self.max_in_a_row:
            raise NonFiniteError(
                f"{what}, {self.in_a_row} steps in a row (training.max_nonfinite_in_a_row={self.max_in_a_row}): "
                f"stopped{self._checkpoint_note()}; the run diverged: lower optimizer.lr or raise lr_scheduler.warmup_steps"
            )
        if self.policy == "skip_step":
            self.skipped += 1
            if self.rank == 0:
                logger.warning("%s: update skipped (training.on_nonfinite='skip_step')", what)
            return "skipped"
        restored = self.checkpointer.restore_latest(exclude=("dataloader",))  # go on with the next data
        if restored is None:
            raise NonFiniteError(
                f"{what}: training.on_nonfinite='rollback' found no checkpoint to roll back to in "
                f"{self.checkpointer.folder}; set a checkpoint.interval the run reaches before it diverges"
            )
        if self.rank == 0:
            logger.warning(
                "%s: rolled back to step-%d; training goes on with the data after step %d", what, restored, step
            )
        return "rolled back"

    def _checkpoint_note(self) -> str:
        """`; the newest checkpoint .../step-4 is intact`, or why there is none."""
        if not self.checkpointer.enable:
            return "; no checkpoint was written (checkpoint.enable is off)"
        self.checkpointer.wait()
        steps = list_complete_steps(self.checkpointer.folder)
        return (
            f"; the newest checkpoint {self.checkpointer.folder / f'step-{steps[-1]}'} is intact"
            if steps
            else "; no checkpoint was written yet"
        )
