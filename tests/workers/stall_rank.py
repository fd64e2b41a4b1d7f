"""`python -m titan_core.launch` with one rank that stalls or dies in a step, for tests/test_hangs.py.

    python tests/fork_run.py --titan 2 tests/workers/stall_rank.py MODE RANK STEP [titan train args ...]

MODE:
- `stall`: rank RANK sleeps for 10 minutes at the start of step STEP (a hung rank; it stays alive).
- `die`: rank RANK kills itself with SIGKILL at the start of step STEP (a crashed rank).

Either way the faulty rank first writes the time into `<job.dump_folder>/FAULT`.
"""

from __future__ import annotations

import os
import signal
import sys
import time

from titan_core.launch import main
from titan_core.trainer import Trainer

MODES = ("stall", "die")


def install(mode: str, rank: int, step: int) -> None:
    train_step = Trainer.train_step

    def train_step_with_fault(self: Trainer, *args, **kwargs):
        if self.rank == rank and self.state.step + 1 == step:
            (self.run_folder / "FAULT").write_text(str(time.time()))  # when, for the test's clock
            if mode == "stall":
                time.sleep(600)
            else:
                os.kill(os.getpid(), signal.SIGKILL)
        return train_step(self, *args, **kwargs)

    Trainer.train_step = train_step_with_fault


if __name__ == "__main__":
    mode, rank, step, argv = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4:]
    if mode not in MODES:
        sys.exit(f"unknown mode {mode!r}; one of {MODES}")
    install(mode, rank, step)
    from rank_exit import leave

    leave(main(argv))
