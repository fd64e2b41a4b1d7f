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
