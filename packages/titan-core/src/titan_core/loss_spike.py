"""Loss spikes: found on the device in every step, acted on at the guard's poll (`training.on_loss_spike`).

A step's loss spikes when the global mean loss (all ranks) exceeds `loss_spike_factor`
times its running average, once `loss_spike_warmup_steps` steps built that average. The
average is an exponential moving average (decay 0.99, bias-corrected as Adam's moments
are) of the accepted steps only, so a spike does not raise the bar for the next one.

`SpikeDetector.observe` runs inside `RunGuard.observe`, on the device, from the sum of
the ranks' losses that the guard's one all-reduce already carries: every rank computes
the same verdict from the same reduced values, and nothing is read on the host. A spike
joins `found_inf`, so the fused optimizer drops the update on every rank, as for a NaN.
The host learns of it at the next poll, where `LossSpikePolicy` logs the step, the loss,
the average and the sources of the step's batch, and then:

- 'skip': nothing more (the batch's update was dropped; the next step takes the next batch);
- 'rollback': reload the newest checkpoint (model, optimizer, LR, step, RNG) and keep the
  data position, so the batches between the checkpoint and the spike are skipped.

`max_loss_spikes_in_a_row` spikes in a row stop the run (exit code 3): the loss moved for
good (a diverged run, or a data change the average has not seen), and skipping forever
would train on nothing. The average lives on the device of one process: a resumed run
builds it again over `loss_spike_warmup_steps` steps.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, Protocol

import torch

from titan_ckpt import CheckpointManager
from titan_core.run_guard import NonFiniteError

if TYPE_CHECKING:
    from titan_core.batch_ramp import BatchRamp

__all__ = ["InjectedSpike", "LossSpikeError", "LossSpikePolicy", "SpikeDetector", "SpikeReport"]

logger = logging.getLogger("titan")

DECAY = 0.99  # the running average's decay per accepted step
INJECTED_FACTOR = 10.0  # debug.inject_loss_spike_step multiplies the loss by this

# Slots of the detector's device vector.
_EMA, _ACCEPTED, _SPIKES, _IN_A_ROW, _MAX_IN_A_ROW, _STEP, _LOSS, _AVERAGE = range(8)
N_SLOTS = 8


class LossSpikeError(NonFiniteError):
    """Too many loss spikes in a row (`training.max_loss_spikes_in_a_row`): told in one line, exit code 3."""


@dataclass(frozen=True)
class SpikeReport:
    """The spikes a poll read since the previous one.

    Args:
        spikes: spiked steps since the previous poll.
        step: the first of them.
        loss: its global mean loss.
        average: the running average it was compared with.
        in_a_row: the longest run of consecutive spikes that ended in or after the previous poll.
    """

    spikes: int = 0
    step: int = 0
    loss: float = 0.0
    average: float = 0.0
    in_a_row: int = 0


class SpikeDetector:
    """The running average and the spike verdict, on the device.

    Args:
        factor: `training.loss_spike_factor`.
        warmup_steps: `training.loss_spike_warmup_steps`.
        device: where the step's tensors live.
    """

    def __init__(self, factor: float, warmup_steps: int, device: torch.device):
        self.factor, self.warmup_steps = factor, warmup_steps
        self.status = torch.zeros(N_SLOTS, device=device)  # see the slots above (float32: steps < 2**24)

    @torch.no_grad()
    def observe(self, mean_loss: torch.Tensor, nonfinite: torch.Tensor, step: int) -> torch.Tensor:
        """1.0 when this step's loss spiked, else 0.0 (0-dim, on the device, not read on the host).

        Args:
            mean_loss: the step's global mean loss (the same on every rank).
            nonfinite: 1.0 when the loss or grad norm was not finite on some rank.
            step: the step being observed (1-based), recorded for the message.
        """
        s = self.status
        average = s[_EMA] / (1 - torch.pow(torch.full_like(s[_EMA], DECAY), s[_ACCEPTED])).clamp_min(1e-12)
        finite = nonfinite == 0
        spike = ((s[_ACCEPTED] >= self.warmup_steps) & finite & (mean_loss > self.factor * average)).float()
        accepted = finite & (spike == 0)
        s[_EMA] = torch.where(accepted, DECAY * s[_EMA] + (1 - DECAY) * mean_loss, s[_EMA])
        s[_ACCEPTED] += accepted.float()
        first = spike * (s[_SPIKES] == 0)
        s[_SPIKES] += spike
        s[_IN_A_ROW] = (s[_IN_A_ROW] + 1) * spike
        s[_MAX_IN_A_ROW] = torch.maximum(s[_MAX_IN_A_ROW], s[_IN_A_ROW])
        record = torch.stack([torch.full_like(mean_loss, float(step)), mean_loss, average])
        s[_STEP:] = torch.where(first.bool(), record, s[_STEP:])
        return spike

    def report(self, values: list[float]) -> SpikeReport:
        """The report from the host copy of `status` (read with the guard's), and counting afresh.

        Args:
            values: `status.tolist()`, read at the poll.
        """
        spikes = int(values[_SPIKES])
        report = SpikeReport(
            spikes=spikes,
            step=int(values[_STEP]) if spikes else 0,
            loss=values[_LOSS],
            average=values[_AVERAGE],
            in_a_row=int(values[_MAX_IN_A_ROW]),
        )
        self.status[_SPIKES] = 0
        self.status[_MAX_IN_A_ROW] = self.status[_IN_A_ROW]
        return report


class BatchLedger(Protocol):
    """What the policy asks the loader: its position and which sources a sample range came from."""

    samples_consumed: int

    def describe_samples(self, first: int, count: int) -> str: ...


class LossSpikePolicy:
    """`training.on_loss_spike` applied at each poll that found spikes.

    Args:
        policy: 'none', 'skip' or 'rollback'.
        factor: `training.loss_spike_factor`.
        warmup_steps: `training.loss_spike_warmup_steps`.
        max_in_a_row: `training.max_loss_spikes_in_a_row`.
        checkpointer: the run's checkpoint manager (rolled back from).
        loader: the training loader (names the spiked step's samples).
        batches: each step's samples, all ranks (the run's `BatchRamp`).
        rank: this process's rank (rank 0 logs).
    """

    def __init__(
        self,
        policy: str,
        factor: float,
        warmup_steps: int,
        max_in_a_row: int,
        checkpointer: CheckpointManager,
        loader: BatchLedger,
        *,
        batches: BatchRamp,
        rank: int,
    ):
        self.policy, self.factor, self.warmup_steps, self.max_in_a_row = policy, factor, warmup_steps, max_in_a_row
        self.checkpointer, self.loader, self.batches, self.rank = checkpointer, loader, batches, rank
        self.spikes = 0  # spiked steps in this process

    def detector(self, device: torch.device) -> SpikeDetector | None:
        """The device-side detector for `RunGuard`, or None when the policy is 'none'."""
        return None if self.policy == "none" else SpikeDetector(self.factor, self.warmup_steps, device)

    def after_poll(self, report: SpikeReport | None, step: int) -> Literal["applied", "skipped", "rolled back"]:
        """Log the spikes since the previous poll and apply the policy.

        Args:
            report: the guard's spike report (None without a detector).
            step: the step just finished (1-based); the loader stands after its batch.

        Raises:
            LossSpikeError: `max_loss_spikes_in_a_row` spikes came in a row, or there is no checkpoint
                to roll back to.
        """
        if report is None or not report.spikes:
            return "applied"
        self.spikes += report.spikes
        what = self.describe(report, step)
        if report.in_a_row > self.max_in_a_row:
            raise LossSpikeError(
                f"{what}; {report.in_a_row} spikes in a row (training.max_loss_spikes_in_a_row={self.max_in_a_row}): "
                "stopped, the loss moved for good; lower optimizer.lr, raise training.loss_spike_factor, "
                "or set training.on_loss_spike = 'none'"
            )
        if self.policy == "skip":
            if self.rank == 0:
                logger.warning("%s: update skipped (training.on_loss_spike='skip')", what)
            return "skipped"
        restored = self.checkpointer.restore_latest(exclude=("dataloader",))  # go on with the next data
        if restored is None:
            raise LossSpikeError(
                f"{what}: training.on_loss_spike='rollback' found no checkpoint to roll back to in "
                f"{self.checkpointer.folder}; set a checkpoint.interval the run reaches before a spike"
            )
        if self.rank == 0:
            logger.warning(
                "%s: rolled back to step-%d; training goes on with the data after step %d "
                "(the batches of steps %d-%d are skipped)",
                what,
                restored,
                step,
                restored + 1,
                step,
            )
        return "rolled back"

    def describe(self, report: SpikeReport, step: int) -> str:
        """`step 6: loss 33.1 is 5.2x its running average 6.37 (training.loss_spike_factor=2.0); batch: ...`."""
        spanned = self.batches.samples_through(step) - self.batches.samples_through(report.step - 1)
        first = self.loader.samples_consumed - spanned  # the spiked step's first sample
        more = f" (and {report.spikes - 1} later step(s))" if report.spikes > 1 else ""
        ratio = report.loss / report.average if report.average > 0 else float("inf")
        return (
            f"step {report.step}{more}: loss {report.loss:.4g} is {ratio:.1f}x its running average "
            f"{report.average:.4g} (training.loss_spike_factor={self.factor}); batch: "
            f"{self.loader.describe_samples(first, self.batches.global_batch(report.step))}"
        )

    def metrics(self) -> dict[str, int]:
        """`loss/spikes` once a spike was seen (for the metrics of a log step)."""
        return {"loss/spikes": self.spikes} if self.spikes else {}


class InjectedSpike:
    """`debug.inject_loss_spike_step`: the step's loss times 10 on this rank, once (a rolled-back run
    redoes the step on the next batch, unspiked). Validation (no grad) is left alone.

    Args:
        fn: the loss function `(logits, labels) -> mean loss` to wrap.
        step: the step to spike (1-based).
        current_step: returns the step being trained.
        calls_per_step: returns the loss calls in the step being trained on this rank (`StepLoss.divisor`:
            micro-batches), read at its first call.
    """

    def __init__(self, fn: Callable, step: int, current_step: Callable[[], int], calls_per_step: Callable[[], int]):
        self.fn, self.step, self.current_step, self.calls_per_step = fn, step, current_step, calls_per_step
        self.remaining: int | None = None  # spiked calls left, once the step began

    def __call__(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        loss = self.fn(logits, labels)
        if torch.is_grad_enabled() and self.current_step() == self.step:
            if self.remaining is None:
                self.remaining = self.calls_per_step()
            if self.remaining:
                self.remaining -= 1
                return loss * INJECTED_FACTOR
        return loss
