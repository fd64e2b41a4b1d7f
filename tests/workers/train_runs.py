"""Several `titan train` runs (the real `Trainer`, as `titan train` builds it) one after another in one launch,
for `titan_run.run_titan_shared` (the parity matrix, and other tests whose runs share a launch).

    python tests/workers/train_runs.py N JOBS.json

JOBS.json is a list of `{"folder": run folder, "args": [titan train args ...]}`. For N > 1 the ranks run under
torchrun's elastic agent, forked from one process that imported the trainer, as `titan train` starts a CPU job
(`titan_core.rank_fork`); for N = 1 this process is the one rank. Each run trains into its folder (metrics.jsonl;
rank 0's log in train.log) on the launch's one process group; once every rank is through it, rank 0 writes `DONE`
there.
Between runs dynamo's caches are reset, so that a compiled run compiles its blocks afresh, as in a launch of its own
(the recompile limit is per code object and the blocks' forward is shared by every run). A run that raises ends
the launch (the other ranks would wait in a collective): the runs without `DONE` are then run again, each in a
launch of its own, by the caller, which reports the error of the one that fails.
One launch pays the imports' start-up (~13 s of CPU on a 2-core AVX2-only AMD EPYC) once for all its runs and ranks.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import traceback
from pathlib import Path

from titan_core.launch import collector_paused, setup_logging

DONE = "DONE"


def run_jobs(jobs_file: str) -> None:
    """One rank: every run of `jobs_file`, in order."""
    with collector_paused(freeze=True):  # as `titan train`'s ranks import (imported already when forked)
        import torch
        import torch.distributed as dist

        from titan_core.config import load_config
        from titan_core.trainer import Trainer
        from titan_parallel.distributed import init_distributed, shutdown_distributed

    setup_logging()
    init_distributed(torch.device("cpu"))
    for job in json.loads(Path(jobs_file).read_text()):
        folder = Path(job["folder"])
        torch._dynamo.reset()
        log = None
        if dist.get_rank() == 0:  # the run's own log (rank 0's, as `titan train` prints it), beside its metrics
            folder.mkdir(parents=True, exist_ok=True)
            log = logging.FileHandler(folder / "train.log")
            log.setFormatter(logging.Formatter("%(asctime)s %(message)s", "%H:%M:%S"))
            logging.getLogger().addHandler(log)
        try:
            Trainer(load_config(None, [*job["args"], "--job.dump_folder", str(folder)])).train()
        except BaseException:
            traceback.print_exc()
            logging.shutdown()
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(1)  # the agent then stops the other ranks
        dist.barrier()
        if log is not None:
            logging.getLogger().removeHandler(log)
            log.close()
            (folder / DONE).write_text("")
    dist.barrier()
    shutdown_distributed()


if __name__ == "__main__":
    from rank_exit import run_ranks

    run_ranks(int(sys.argv[1]), run_jobs, sys.argv[2])
