"""Batch-size ramp-up: a global batch that grows linearly over the first steps (GPT-3's, DeepSeek-V3's).

    training.batch_size_rampup_start = 64     # sequences at step 1
    training.batch_size_rampup_steps = 2000   # the full training.global_batch_size from step 2001 on

Step s (1-based) of the ramp trains on the linear interpolation from the start to the full
batch, rounded down to whole rounds of micro-batches (`local_batch_size` sequences on every
data-parallel rank):

    batch(s) = start + (full - start) * (s - 1) / rampup_steps,  rounded down to a multiple of
               local_batch_size x dp;  the full batch once s > rampup_steps

so the micro-batch each rank runs keeps its shape (no recompile, the same memory) and only
the number of accumulated micro-batches grows: Megatron-LM's `--rampup-batch-size` does the
same in samples, with an explicit increment. The step's loss stays the mean over its
tokens (`titan_core.step_loss.StepLoss` divides by the step's own micro-batches). The learning-rate
schedule still counts steps. A resumed run continues the ramp where the step counter is,
and the data where the loader left it.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class BatchRamp:
    """Sequences per step over all ranks, and micro-batches per rank, at each step.

    Args:
        per_round: sequences in one micro-batch round over all ranks (`local_batch_size x dp`).
        full: the global batch after the ramp (`training.global_batch_size`), a multiple of `per_round`.
        start: the global batch at step 1, a multiple of `per_round`, at most `full`.
        steps: steps the ramp lasts (0: no ramp, `full` from step 1).
    """

    per_round: int
    full: int
    start: int
    steps: int = 0

    @classmethod
    def constant(cls, per_round: int, full: int) -> BatchRamp:
        """No ramp: `full` sequences from step 1."""
        return cls(per_round, full, full, 0)

    def global_batch(self, step: int) -> int:
        """Sequences over all ranks at `step` (1-based)."""
        if step > self.steps:
            return self.full
        grown = self.start + (self.full - self.start) * (step - 1) // self.steps  # exact in integers, rounded down
        return grown - grown % self.per_round

    def accum_steps(self, step: int) -> int:
        """Micro-batches each rank accumulates at `step` (1-based)."""
        return self.global_batch(step) // self.per_round

    def samples_through(self, step: int) -> int:
        """Sequences over all ranks in steps 1..`step`."""
        ramp = min(step, self.steps)
        return sum(self.global_batch(s) for s in range(1, ramp + 1)) + max(step - ramp, 0) * self.full

    def describe(self, seq_len: int) -> str:
        """'global batch 8 x seq_len 256, 1 micro-batch per step', or with a ramp
        'global batch 4 -> 12 over 2 steps x seq_len 32, 1 -> 3 micro-batches per step'."""
        first, last = self.accum_steps(1), self.full // self.per_round
        if self.steps == 0 or first == last:
            plural = "es" if last > 1 else ""
            return f"global batch {self.full} x seq_len {seq_len}, {last} micro-batch{plural} per step"
        return (
            f"global batch {self.global_batch(1)} -> {self.full} over {self.steps} steps x seq_len {seq_len}, "
            f"{first} -> {last} micro-batches per step"
        )
