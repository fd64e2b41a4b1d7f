"""The run's progress, which checkpoints save, and the seed every rank starts from."""

from __future__ import annotations

import dataclasses
import os

import torch
import torch.distributed as dist


@dataclasses.dataclass
class TrainState:
    """Progress of the run, saved in checkpoints."""

    step: int = 0
    tokens_seen: int = 0

    def state_dict(self) -> dict[str, int]:
        return dataclasses.asdict(self)

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.step, self.tokens_seen = int(state["step"]), int(state["tokens_seen"])

    def batch_change(self, global_batch: int, seq_len: int) -> str | None:
        """A note where the checkpointed steps took another batch than `global_batch` sequences (a resume on another
        data-parallel degree with `training.global_batch_size = -1`); None where they took the same, or none.

        Args:
            global_batch: the resumed run's sequences per step (it has no batch ramp).
            seq_len: tokens per sequence.
        """
        if not self.step or self.tokens_seen % (self.step * seq_len):
            return None  # nothing saved, or no whole number of sequences per step (steps of several batch sizes)
        before = self.tokens_seen // (self.step * seq_len)
        if before == global_batch:
            return None
        return (
            f"resumed at step {self.step}, whose steps took {before} sequences each on average; this run's take "
            f"{global_batch} (training.global_batch_size, or local_batch_size x the data-parallel degree where it is "
            f"-1): set training.global_batch_size = {before} to keep the batch"
        )


def set_determinism(seed: int | None, deterministic: bool, warn_only: bool = False) -> int:
    """Seed every RNG with the same seed on every rank (rank 0's when `seed` is None); returns it. With
    `deterministic`, torch's deterministic algorithms; an op without one raises, or with `warn_only` warns."""
    if seed is None:
        chosen = torch.tensor([int.from_bytes(os.urandom(4), "little") >> 1], dtype=torch.int64)
        dist.broadcast(chosen, src=0)
        seed = int(chosen.item())
    torch.manual_seed(seed)
    if deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True, warn_only=warn_only)
        torch.backends.cudnn.benchmark = False
    return seed
