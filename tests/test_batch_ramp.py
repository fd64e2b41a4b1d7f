"""Batch-size ramp-up (`training.batch_size_rampup_start` / `_steps`): each step's batch by hand, the job check's
lines, and `titan train` on 2 FSDP ranks, stopped and resumed inside the ramp, against one uninterrupted process."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import warm_python
from titan_core.batch_ramp import BatchRamp
from titan_core.config import ConfigError, load_config
from titan_core.job import resolve
from titan_run import FORK_RUN, REPO, TINY, losses, read_metrics, run_titan_all, titan_env

WORKER = REPO / "tests" / "workers" / "ckpt_train.py"
STEPS = 4
# 4 sequences at step 1, 12 from step 3 on: 4, 8, 12, 12 (rounds of local_batch_size x dp = 4 sequences)
RAMP = ["--training.batch_size_rampup_start", "4", "--training.batch_size_rampup_steps", "2",
        "--training.global_batch_size", "12"]  # fmt: skip
RUN = [*TINY, "--training.steps", str(STEPS), "--checkpoint.enable", "--checkpoint.interval", "2",
       "--checkpoint.keep_latest_k", "0"]  # fmt: skip


def test_each_steps_batch_by_hand():
    # start 4, full 16 over 5 steps, rounds of 4: 4 + 12 (s - 1) / 5 = 4, 6.4, 8.8, 11.2, 13.6 -> 4, 4, 8, 8, 12
    ramp = BatchRamp(per_round=4, full=16, start=4, steps=5)
    assert [ramp.global_batch(s) for s in range(1, 9)] == [4, 4, 8, 8, 12, 16, 16, 16]
    assert [ramp.accum_steps(s) for s in range(1, 7)] == [1, 1, 2, 2, 3, 4]
    assert ramp.samples_through(7) == 4 + 4 + 8 + 8 + 12 + 16 + 16 and ramp.samples_through(0) == 0
    assert ramp.describe(32) == "global batch 4 -> 16 over 5 steps x seq_len 32, 1 -> 4 micro-batches per step"
    plain = BatchRamp.constant(per_round=8, full=8)
    assert plain.global_batch(1) == plain.global_batch(10**6) == 8 and plain.samples_through(3) == 24
    assert plain.describe(256) == "global batch 8 x seq_len 256, 1 micro-batch per step"


@pytest.mark.parametrize("args, world, expected", [
    (["--training.batch_size_rampup_start", "4"], 1,
     "training.batch_size_rampup_start needs training.batch_size_rampup_steps too"),
    (["--training.batch_size_rampup_steps", "10"], None,
     "training.batch_size_rampup_steps needs training.batch_size_rampup_start too"),
    (["--training.batch_size_rampup_start", "6", "--training.batch_size_rampup_steps", "10", "--training.local_batch_size",
      "2", "--training.global_batch_size", "16"], 2,
     "training.batch_size_rampup_start=6 must be a multiple of training.local_batch_size x data-parallel degree = "
     "2 x 2 = 4, below training.global_batch_size=16"),
    (["--training.batch_size_rampup_start", "8", "--training.batch_size_rampup_steps", "10"], 1,
     "training.batch_size_rampup_start=8 must be a multiple of training.local_batch_size x data-parallel degree = "
     "8 x 1 = 8, below training.global_batch_size=8"),
])  # fmt: skip
def test_a_broken_ramp_is_one_line_naming_the_keys(args, world, expected):
    with pytest.raises(ConfigError) as caught:
        resolve(load_config(None, args), world)
    assert "\n" not in str(caught.value) and expected in str(caught.value), str(caught.value)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    """One process with the ramp (4 steps), one without it at the ramp's first batch (1 step), and 2 FSDP ranks
    with the ramp, stopped after step 2 (inside the ramp) and resumed on 2 ranks."""
    root = tmp_path_factory.mktemp("ramp")
    folders = {name: root / name for name in ("one", "first_batch", "two", "short")}
    cmd = [sys.executable, str(FORK_RUN), "2", str(WORKER), "stop-after-step", "2", *RUN, *RAMP,
           "--training.local_batch_size", "2", "--job.dump_folder", str(folders["two"])]  # fmt: skip
    proc = warm_python.run(cmd, env=titan_env(), cwd=REPO, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    run_titan_all({
        folders["one"]: [*RUN, *RAMP, "--training.local_batch_size", "4"],
        folders["first_batch"]: [*TINY, "--training.steps", "2", "--training.local_batch_size", "4"],
        folders["short"]: [*TINY, *RAMP, "--training.steps", "2", "--training.local_batch_size", "4"],
    })  # fmt: skip
    run_titan_all({folders["two"]: [*RUN, *RAMP, "--training.local_batch_size", "2"]}, nproc=2)
    return folders


def test_the_ramp_on_two_ranks_resumed_matches_one_process(runs):
    one, two = read_metrics(runs["one"]), {r["step"]: r for r in read_metrics(runs["two"])}
    assert [r["data/global_batch"] for r in one] == [4, 8, 12, 12]
    assert sorted(two) == [1, 2, 3, 4] and [two[s]["data/global_batch"] for s in (1, 2, 3, 4)] == [4, 8, 12, 12]
    assert max(abs(r["loss/global_avg"] - two[r["step"]]["loss/global_avg"]) for r in one) < 2e-5
    # Step 1 trains on the ramp's first 4 sequences alone: the loss of a run whose every batch is those 4.
    assert one[0]["loss/global_avg"] == losses(runs["first_batch"])[0]
    # The data and token counters of the checkpoints are the ramp's sums, on both layouts.
    for folder in (runs["one"], runs["two"]):
        for step, samples in ((2, 4 + 8), (4, 4 + 8 + 12 + 12)):
            saved = folder / "checkpoint" / f"step-{step}"
            assert json.loads((saved / "dataloader.json").read_text())["samples_consumed"] == samples
            assert json.loads((saved / "train_state.json").read_text())["tokens_seen"] == samples * 32


def test_a_ramp_as_long_as_the_run_is_said_at_start(runs):
    assert [r["data/global_batch"] for r in read_metrics(runs["short"])] == [4, 8]
    said = ("training.batch_size_rampup_steps=2 is not shorter than training.steps=2: the batch grows to the run's "
            "end (8 sequences at its last step, not training.global_batch_size=12)")
    assert said in (runs["short"] / "train.log").read_text()


def test_the_banner_names_the_ramp():
    from titan_core.run_banner import run_banner

    job = resolve(load_config(None, [*RAMP, "--training.local_batch_size", "2", "--training.seq_len", "32"]), 2)
    assert "global batch 4 -> 12 over 2 steps x seq_len 32, 1 -> 3 micro-batches per step" in run_banner(job)


def test_a_resume_on_another_global_batch_is_said():
    from titan_core.train_state import TrainState

    saved = TrainState(step=3, tokens_seen=3 * 16 * 32)  # 3 steps of 16 sequences of 32 tokens
    assert saved.batch_change(16, 32) is None
    assert saved.batch_change(8, 32) == (
        "resumed at step 3, whose steps took 16 sequences each on average; this run's take 8 "
        "(training.global_batch_size, or local_batch_size x the data-parallel degree where it is -1): set "
        "training.global_batch_size = 16 to keep the batch"
    )
    assert TrainState(step=2, tokens_seen=(4 + 7) * 32).batch_change(8, 32) is None  # no whole average: not said
    assert TrainState().batch_change(8, 32) is None
