"""What the training loop checks after every backward: non-finite values and stop signals.

A month-long run meets NaNs and preemption. `RunGuard` answers, the same on every
rank, two questions:

- Is the step's loss or grad norm non-finite (NaN/inf)? Then the update is dropped and
  `training.on_nonfinite` decides: 'stop' (exit naming the step and the value; the
  newest checkpoint was written before the bad step and stays intact), 'skip_step'
  (go on with the next batch), 'rollback' (reload the newest checkpoint, go on with the
  data after the bad batch, the way large runs restart past a loss spike).
- Has any rank received SIGTERM or SIGUSR1 (what Slurm sends before it kills or
  requeues a job)? Then the loop finishes the step, saves a checkpoint and returns, so
  the process exits 0 and the next start resumes.

Without waiting for the device. `observe` runs in every step: ONE all-reduce (SUM) of
three flags (loss non-finite, grad norm non-finite, stop signal) and of the ranks'
losses and their count, enqueued on the device like any collective, gives `found_inf`,
which the step runner hands to the fused optimizer kernels so that a bad update is
dropped on the device, on every rank (`titan_core.step`); the same flags feed a few
counters kept on the device. The host
reads those counters only at a `poll`: at log steps (which read the loss anyway),
before a checkpoint is written, at the last step, and every `poll_every` steps for stop
signals. The loss is local to each rank (and only on the last pipeline stage), a signal
may reach only some ranks, and every rank must take the same branch at the same step,
hence the all-reduce; the grad norm is already global. The summed losses give the global
mean loss on every rank, from which `training.on_loss_spike`'s detector
(`titan_core.loss_spike`) adds a spiked step to `found_inf`, still on the device.

With `training.on_nonfinite` acting at the poll rather than at the bad step, the steps
between the two were trained from the state before the bad update (which was never
applied), as 'skip_step' would; with `metrics.log_freq = 1` (the default) every step is
polled.
"""

from __future__ import annotations

import logging
import math
import signal
import threading
from dataclasses import dataclass, field
from types import FrameType
from typing import TYPE_CHECKING, Any, Literal

import torch
import torch.distributed as dist

from titan_ckpt import CheckpointManager
from titan_ckpt.step_folders import list_complete_steps

if TYPE_CHECKING:
    from titan_core.loss_spike import SpikeDetector, SpikeReport

__all__ = ["GuardReport", "NonFiniteError", "NonFinitePolicy", "RunGuard", "STOP_SIGNALS"]

logger = logging.getLogger("titan")

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
"""Signals that make the run save a checkpoint and exit 0 at the end of the current step."""


class NonFiniteError(RuntimeError):
    """The run stopped on a non-finite loss or grad norm (`training.on_nonfinite`): told in one line."""


@dataclass(frozen=True)
class GuardReport:
    """What a poll read from the device: the dropped steps since the previous poll.

    Args:
        dropped: steps whose update was dropped since the previous poll.
        first_bad_step: the first of them (0 when none).
        nonfinite: what was non-finite at that step, e.g. ("loss", "grad norm").
        values: that step's loss on this rank and grad norm, for the message.
        in_a_row: the longest run of consecutive dropped steps that ended in or after the previous poll.
        spikes: the loss spikes since the previous poll (None without a spike detector); their updates
            were dropped too, but are not counted in `dropped`.
    """

    dropped: int = 0
    first_bad_step: int = 0
    nonfinite: tuple[str, ...] = ()
    values: dict[str, float] = field(default_factory=dict)
    in_a_row: int = 0
    spikes: SpikeReport | None = None

    def describe(self) -> str:
        """`step 7: the loss (nan on this rank) and the grad norm (nan) are not finite`."""
        shown = []
        for name in self.nonfinite:
            value = self.values.get(name)
            if value is None or math.isfinite(value):  # a loss that went bad on another rank
                shown.append(f"the {name} (on another rank)")
            else:
                shown.append(f"the {name} ({value})")
        verb = "is" if len(shown) == 1 else "are"
        more = f" (and {self.dropped - 1} later step(s))" if self.dropped > 1 else ""
        return f"step {self.first_bad_step}{more}: {' and '.join(shown)} {verb} not finite"


# Slots of the device-side status vector.
_DROPPED, _IN_A_ROW, _MAX_IN_A_ROW, _STOP, _FIRST_STEP, _BAD_LOSS, _BAD_NORM, _LOSS, _NORM = range(9)


class RunGuard:
    """Per-step health of a run, agreed on by every rank, kept on the device between polls.

    Use as a context manager around the training loop (it installs the signal handlers
    in the main thread and restores the old ones on exit); the step runner calls `observe`
    in every step, the loop calls `poll` where `poll_due` says.

    Args:
        device: the device the step's tensors live on.
        group: the process group that must agree (default: the whole job).
        poll_every: poll at least every this many steps (how soon a stop signal is acted on).
        spike: drops the update of a step whose loss spiked (`training.on_loss_spike`); None: no check.
    """

    def __init__(
        self,
        device: torch.device,
        group: dist.ProcessGroup | None = None,
        *,
        poll_every: int = 10,
        spike: SpikeDetector | None = None,
    ):
        self.device = device
        self.group = group
        self.poll_every = poll_every
        self.spike = spike
        self.signal_received: str | None = None  # name of the first stop signal this rank got
        self.stop_requested = False  # some rank got a stop signal (agreed at the last poll)
        self._status = torch.zeros(9, device=device)  # see the slots above; float32 holds step numbers < 2**24
        self._status[_LOSS] = float("nan")
        self._previous: dict[int, Any] = {}  # signal -> the handler it had

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
        # Only a flag: the step in flight finishes, the loop saves after it.
        if self.signal_received is None:
            self.signal_received = signal.Signals(signum).name

    @torch.no_grad()
    def observe(self, loss: torch.Tensor | None, grad_norm: torch.Tensor, step: int) -> torch.Tensor:
        """One all-reduce of (loss non-finite, grad norm non-finite, stop signal, loss, has a loss); returns
        `found_inf` (0-dim, 1.0 when the update must be dropped on every rank), without reading it on the host.

        Args:
            loss: this rank's step loss, None on pipeline ranks without the last stage.
            grad_norm: the global grad norm (the same on every rank).
            step: the step being observed (1-based), recorded for the message.
        """
        zero = torch.zeros((), device=self.device)
        value = loss.detach().float().reshape(()) if loss is not None else zero
        loss_bad = (~torch.isfinite(value)).float()
        norm_bad = (~torch.isfinite(grad_norm.detach())).float().to(self.device)
        signal_flag = torch.full((), float(self.signal_received is not None), device=self.device)
        has_loss = torch.full((), float(loss is not None), device=self.device)
        summed = torch.stack([loss_bad, norm_bad, signal_flag, torch.where(loss_bad > 0, zero, value), has_loss])
        dist.all_reduce(summed, op=dist.ReduceOp.SUM, group=self.group)
        flags = (summed[:3] > 0).float()  # any rank
        bad = flags[:2].amax()
        s = self._status
        first = bad * (s[_DROPPED] == 0)  # 1.0 at the first dropped step since the poll
        s[_DROPPED] += bad
        s[_IN_A_ROW] = (s[_IN_A_ROW] + 1) * bad
        s[_MAX_IN_A_ROW] = torch.maximum(s[_MAX_IN_A_ROW], s[_IN_A_ROW])
        s[_STOP] = torch.maximum(s[_STOP], flags[2])
        mine = torch.stack(
            [
                torch.full((), float(step), device=self.device),
                flags[0],
                flags[1],
                loss.detach().float().reshape(())
                if loss is not None
                else torch.full((), float("nan"), device=self.device),
                grad_norm.detach().float().reshape(()).to(self.device),
            ]
        )
        s[_FIRST_STEP:] = torch.where(first.bool(), mine, s[_FIRST_STEP:])
        if self.spike is None:
            return bad
        mean_loss = summed[3] / summed[4].clamp_min(1)  # the ranks holding a loss (PP: the last stage)
        return torch.maximum(bad, self.spike.observe(mean_loss, bad, step))

    def poll_due(self, step: int) -> bool:
        """Whether the loop must poll after `step` for stop signals (every `poll_every` steps)."""
        return step % self.poll_every == 0

    def poll(self) -> GuardReport:
        """Read the counters on the host (the one sync) and start counting afresh; sets `stop_requested`."""
        both = self._status if self.spike is None else torch.cat([self._status, self.spike.status])
        values = both.tolist()
        self.stop_requested = self.stop_requested or values[_STOP] > 0
        report = GuardReport(
            dropped=int(values[_DROPPED]),
            first_bad_step=int(values[_FIRST_STEP]) if values[_DROPPED] else 0,
            nonfinite=tuple(name for name, slot in (("loss", _BAD_LOSS), ("grad norm", _BAD_NORM)) if values[slot] > 0),
            values={"loss": values[_LOSS], "grad norm": values[_NORM]},
            in_a_row=int(values[_MAX_IN_A_ROW]),
            spikes=self.spike.report(values[len(self._status) :]) if self.spike is not None else None,
        )
        s = self._status
        s[_DROPPED] = 0
        s[_MAX_IN_A_ROW] = s[_IN_A_ROW]
        return report


class NonFinitePolicy:
    """`training.on_nonfinite` applied at each poll: what to do when `RunGuard` dropped updates.

    Args:
        policy: 'stop', 'skip_step' or 'rollback'.
        max_in_a_row: consecutive dropped steps tolerated by 'skip_step' / 'rollback' before stopping.
        checkpointer: the run's checkpoint manager (rolled back from; named when stopping).
        rank: this process's rank (rank 0 logs).
    """

    def __init__(self, policy: str, max_in_a_row: int, checkpointer: CheckpointManager, *, rank: int):
        self.policy, self.max_in_a_row = policy, max_in_a_row
        self.checkpointer, self.rank = checkpointer, rank
        self.in_a_row = 0  # the longest run of consecutive dropped steps at the last poll that dropped any
        self.skipped = 0  # steps dropped by 'skip_step' in this process

    def after_poll(self, report: GuardReport, step: int) -> Literal["applied", "skipped", "rolled back"]:
        """Apply the policy to the steps dropped since the previous poll; after a rollback the run state
        is the checkpoint's.

        Args:
            report: what the guard's poll read.
            step: the step just finished (1-based), the one the data goes on after.

        Raises:
            NonFiniteError: the policy is 'stop', too many dropped steps came in a row, or there is no
                checkpoint to roll back to.
        """
        if not report.dropped:
            return "applied"
        self.in_a_row = report.in_a_row
        what = report.describe()
        if self.policy == "stop":
            raise NonFiniteError(
                f"{what}: stopped without applying it (training.on_nonfinite='stop'){self._checkpoint_note()}; "
                "set training.on_nonfinite to 'skip_step' or 'rollback' to go on past it"
            )
        if self.in_a_row > self.max_in_a_row:
            raise NonFiniteError(
                f"{what}, {self.in_a_row} steps in a row (training.max_nonfinite_in_a_row={self.max_in_a_row}): "
                f"stopped{self._checkpoint_note()}; the run diverged: "
                "lower optimizer.lr or raise lr_scheduler.warmup_steps"
            )
        if self.policy == "skip_step":
            self.skipped += report.dropped
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
