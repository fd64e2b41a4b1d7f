"""`python -m titan_core.launch` with a crash point or a stop injected, for tests/test_resume.py.

    python tests/workers/ckpt_train.py HOOK N [titan train args ...]          # one process
    python tests/fork_run.py K tests/workers/ckpt_train.py HOOK N [...]   # K ranks (or under torchrun)

HOOK:
- `hang-after-step`: once step N is trained, logged and checkpointed (if due), rank 0
  writes `<dump_folder>/HANG` and sleeps; the test then kills the process group with
  SIGKILL (a crash between two steps).
- `hang-in-async-write`: rank 0's background writer of the step-N checkpoint writes
  its data file, then writes `HANG` and sleeps before DCP's metadata or the manifest
  exist (a crash in the middle of an async save); the training loop runs on until it
  blocks on that save.
- `stop-after-step`: after step N (its checkpoint completed), every rank exits 0 — a
  run stopped part-way without changing `training.steps`, so the LR schedule is the
  full run's.

The hooks wrap `CheckpointManager.save`, which the trainer calls after every step
before logging it: the call for step N + 1 comes after step N was logged.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import torch.distributed as dist
from rank_exit import leave
from titan_ckpt import dcp_io
from titan_ckpt.manager import CheckpointManager
from titan_core.launch import main

HOOKS = ("hang-after-step", "hang-in-async-write", "stop-after-step")


def dump_folder(argv: list[str]) -> Path:
    return Path(argv[argv.index("--job.dump_folder") + 1])


def hang(folder: Path) -> None:
    """Tell the test where we are, then wait for its SIGKILL."""
    (folder / "HANG").write_text(str(os.getpid()))
    time.sleep(600)
    os._exit(3)  # never reached when the test kills us


def install(hook: str, n: int, folder: Path) -> None:
    save = CheckpointManager.save

    def save_with_hook(self: CheckpointManager, step: int, *, last_step: bool = False, **kwargs) -> bool:
        if step == n + 1 and hook == "hang-after-step" and self.rank == 0:
            hang(folder)
        if step == n + 1 and hook == "stop-after-step":
            self.close()
            dist.barrier()
            dist.destroy_process_group()
            leave(0)
        return save(self, step, last_step=last_step, **kwargs)

    CheckpointManager.save = save_with_hook
    if hook == "hang-in-async-write":
        write_data = dcp_io.ChecksummingWriter.write_data

        def write_data_then_hang(self, plan, planner):
            future = write_data(self, plan, planner)
            if Path(self.path).name == f"step-{n}.tmp" and self.rank == 0:
                hang(folder)
            return future

        dcp_io.ChecksummingWriter.write_data = write_data_then_hang


if __name__ == "__main__":
    hook, n, argv = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
    if hook not in HOOKS:
        sys.exit(f"unknown hook {hook!r}; one of {HOOKS}")
    install(hook, n, dump_folder(argv))
    leave(main(argv))
