"""`python -m titan_core.launch` with a NaN loss injected on one rank, for tests/test_faults.py.

    python tests/fork_run.py --titan 2 tests/workers/nonfinite_worker.py STEP RANK [titan train args ...]

The loss of step STEP on rank RANK is multiplied by NaN, once (a rolled-back run
redoes STEP on the next batch, which stays finite). Every rank records a checksum
of its model and optimizer state after each step's `train_step`; when the run
drops an update or rolls back, rank 0 prints what the state then equals, as

    STATE-CHECK {"kind": "skipped", "step": 4, "same_as_previous": true}
    STATE-CHECK {"kind": "rollback", "from": 5, "to": 4, "same_as_restored": true}

so the test can tell the update was really not applied, and the rollback really
restored the checkpointed state (not merely relabelled the step).
"""

from __future__ import annotations

import json
import sys

import torch
from torch.distributed.tensor import DTensor

from titan_core import trainer as trainer_module
from titan_core.launch import main


def state_checksum(trainer) -> float:
    """Sum of |x| over this rank's model parameters and optimizer tensors, in float64."""
    total = 0.0
    for part in trainer.model.parts:
        for p in part.parameters():
            local = p.to_local() if isinstance(p, DTensor) else p
            total += local.detach().double().abs().sum().item()
    for optimizer in trainer.optimizers:
        for state in optimizer.state.values():
            for value in state.values():
                if torch.is_tensor(value):
                    local = value.to_local() if isinstance(value, DTensor) else value
                    total += local.detach().double().abs().sum().item()
    return total


def install(bad_step: int, bad_rank: int) -> None:
    Trainer, Policy = trainer_module.Trainer, trainer_module.NonFinitePolicy
    init, train_step, after_poll = Trainer.__init__, Trainer.train_step, Policy.after_poll
    injected = {"done": False}
    checksums: dict[int, float] = {}
    trainers = []

    def init_with_poison(self, cfg, **kwargs):
        init(self, cfg, **kwargs)
        trainers.append(self)
        loss_fn = self.loss.fn  # the step's loss before its normalisation (`titan_core.step_loss.StepLoss`)

        def poisoned(logits, labels):
            loss = loss_fn(logits, labels)
            if self.state.step + 1 == bad_step and self.rank == bad_rank and not injected["done"]:
                return loss * float("nan")
            return loss

        self.loss.fn = poisoned

    def train_step_recording(self, batches, guard=None):
        result = train_step(self, batches, guard)
        if self.state.step + 1 == bad_step:
            injected["done"] = True
        checksums[self.state.step + 1] = state_checksum(self)
        return result

    def after_poll_checked(self, report, step):
        outcome = after_poll(self, report, step)
        trainer = trainers[-1]
        if outcome == "rolled back":
            restored = trainer.state.step
            record = {"kind": "rollback", "from": step, "to": restored,
                      "same_as_restored": state_checksum(trainer) == checksums[restored]}
        elif outcome == "skipped":
            record = {"kind": "skipped", "step": step, "same_as_previous": checksums[step] == checksums[step - 1]}
        if outcome != "applied" and trainer.rank == 0:
            print("STATE-CHECK " + json.dumps(record), flush=True)
        return outcome

    Trainer.__init__ = init_with_poison
    Trainer.train_step = train_step_recording
    Policy.after_poll = after_poll_checked


if __name__ == "__main__":
    install(int(sys.argv[1]), int(sys.argv[2]))
    from rank_exit import leave

    leave(main(sys.argv[3:]))
