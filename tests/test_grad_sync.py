"""Gradient accumulation synchronises data parallel once per step (titan_parallel.set_gradient_sync): counted
collectives and gradients against one process, over 4 real processes (tests/workers/grad_sync_worker.py, gloo);
and `titan train` with accumulation on DDP, FSDP (both settings of parallelism.fsdp_reduce_every_microbatch) and
HSDP against one process."""

from __future__ import annotations

import pytest

from titan_run import REPO, TINY, losses, run_json_worker, run_titan_all

WORKER = REPO / "tests" / "workers" / "grad_sync_worker.py"
TOL = 1e-5


@pytest.fixture(scope="module")
def cases(tmp_path_factory) -> dict:
    return run_json_worker(WORKER, 4, tmp_path_factory.mktemp("grad_sync") / "result.json")


def check(ranks: list[dict]) -> list[dict]:
    errors = [r["error"] for r in ranks if "error" in r]
    assert not errors, errors[0]
    for r in ranks:
        assert r["grad_diff"] < TOL, r
    return [r["counts"] for r in ranks]


def test_ddp_all_reduces_only_in_the_last_micro_batch(cases):
    check(cases["ddp"])  # DDP's reducer calls the process group itself: its gradients tell
    assert all(r["ranks_differ_after_first"] for r in cases["ddp"])


def test_fsdp_reduce_scatters_every_micro_batch_by_default_and_once_when_asked(cases):
    for counts in check(cases["fsdp"]):
        assert counts[0]["reduce_scatter"] == counts[1]["reduce_scatter"] > 0  # one per FSDP unit, both times
    for counts in check(cases["fsdp_once"]):
        assert counts[0]["reduce_scatter"] == 0 and counts[1]["reduce_scatter"] > 0


def test_hsdp_all_reduces_over_the_replicas_once_and_reduce_scatters_every_micro_batch(cases):
    for counts in check(cases["hsdp"]):
        assert counts[0]["all_reduce"] == 0 and counts[1]["all_reduce"] > 0
        assert counts[0]["reduce_scatter"] == counts[1]["reduce_scatter"] > 0


ACCUMULATE = [*TINY, "--training.steps", "3", "--training.global_batch_size", "8", "--training.local_batch_size", "2"]
ROWS = {  # row -> (nproc, arguments): 4 micro-batches per step on one process, 2 on two
    "reference": (1, []),
    "ddp": (2, ["--parallelism.data_parallel_replicate_degree", "2", "--parallelism.data_parallel_shard_degree", "1",
                "--parallelism.dp_mode", "ddp"]),
    "fsdp": (2, []),
    "fsdp_once": (2, ["--parallelism.fsdp_reduce_every_microbatch", "false"]),
    "hsdp": (2, ["--parallelism.data_parallel_replicate_degree", "2", "--parallelism.data_parallel_shard_degree", "1"]),
}  # fmt: skip


def test_titan_train_accumulates_as_one_process_on_every_data_parallel_layout(tmp_path):
    for nproc in (1, 2):
        rows = {tmp_path / r: [*ACCUMULATE, *a] for r, (n, a) in ROWS.items() if n == nproc and r != "ddp"}
        run_titan_all(rows, nproc=nproc)
    # DDP's first forward crashes on gloo under TORCH_DISTRIBUTED_DEBUG=DETAIL (torch 2.15; docs/debugging.md)
    run_titan_all({tmp_path / "ddp": [*ACCUMULATE, *ROWS["ddp"][1]]}, nproc=2, debug_detail=False)
    reference = losses(tmp_path / "reference")
    for row in ("ddp", "fsdp", "fsdp_once", "hsdp"):
        assert losses(tmp_path / row) == pytest.approx(reference, rel=0, abs=TOL), row
