"""How a worker rank ends (`leave`; `write_results_and_leave` for a worker whose rank 0 reports in a JSON file),
under `torchrun` or `tests/fork_run.py` alike, and how a worker whose ranks are one function starts them
(`run_ranks`)."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from typing import Any


def leave(code: int) -> None:
    """End this rank with `code`: forked by tests/fork_run.py, by returning to it (it hands the code to the agent);
    a rank of its own leaves by `os._exit`, skipping interpreter teardown, which gloo's threads can abort."""
    sys.stdout.flush()
    sys.stderr.flush()
    if os.environ.get("TITAN_TEST_FORKED_SCRIPT"):
        raise SystemExit(code)
    os._exit(code)


def write_results_and_leave(out_path: str, results: Any) -> None:
    """Rank 0 writes `results` to `out_path` as JSON; every rank then waits for the others, ends the process group
    and leaves with 0."""
    import torch.distributed as dist

    if dist.get_rank() == 0:
        with open(out_path, "w") as f:
            json.dump(results, f)
    dist.barrier()
    dist.destroy_process_group()
    leave(0)


def run_ranks(nproc: int, entry: Callable[..., None], *args: Any) -> None:
    """`entry(*args)` as every rank: here for one process, else forked as `titan train` forks a CPU job's ranks
    (`titan_core.rank_fork`, the trainer preloaded). Call it from the worker's `__main__` block only: the fork
    server runs the worker's top level without this module on its path."""
    if nproc == 1:
        entry(*args)
        leave(0)
    from titan_core.launch import RANK_PRELOAD
    from titan_core.rank_fork import run_elastic

    run_elastic(["--standalone", f"--nproc-per-node={nproc}"], _forked_rank, (entry, *args), preload=RANK_PRELOAD)


def _forked_rank(entry: Callable[..., None], *args: Any) -> None:
    from titan_core.rank_fork import rank_finished, rank_started

    rank_started()
    entry(*args)
    rank_finished()
