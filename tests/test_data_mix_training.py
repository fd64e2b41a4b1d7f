"""A real run on a 70/30 mixture of two pre-tokenized corpora, in shuffled order, resumed on another
world size: the losses of every step and the per-source token counts equal the uninterrupted
one-process run's (fp32, same seed; ranks differ from one process only by float summation order).
"""

from __future__ import annotations

import itertools
import json
import shutil
from pathlib import Path

from titan_run import TINY, ListSource, read_metrics, run_titan

from titan_core.data import ByteTokenizer, StdlibSource, write_token_shards
from titan_core.data.corpus import collect_builtin_docs

STEPS = 6
GLOBAL_BATCH = 4


def two_corpora(folder: Path) -> str:
    """Two token-shard folders (12 stdlib files: "code"; 60 builtin docstrings: "docs"); the 70/30 mix as JSON."""
    write_token_shards(ListSource(list(itertools.islice(StdlibSource(), 12))), ByteTokenizer(), folder / "code")
    write_token_shards(ListSource(collect_builtin_docs()[:60]), ByteTokenizer(), folder / "docs")
    return json.dumps([{"path": str(folder / "code"), "weight": 0.7}, {"path": str(folder / "docs"), "weight": 0.3}])


def by_step(run: Path) -> dict[int, dict]:
    return {r["step"]: r for r in read_metrics(run)}


def test_a_70_30_shuffled_mix_resumes_from_2_ranks_on_1_with_the_same_batches(tmp_path):
    mix = two_corpora(tmp_path / "data")
    run = [
        *TINY,
        "--training.steps",
        str(STEPS),
        "--training.dataset_mix",
        mix,
        "--checkpoint.enable",
        "--checkpoint.interval",
        "3",
        "--checkpoint.keep_latest_k",
        "0",
    ]
    reference, two, resumed = tmp_path / "reference", tmp_path / "two", tmp_path / "resumed"
    run_titan(reference, *run, "--training.local_batch_size", str(GLOBAL_BATCH))
    run_titan(two, *run, "--training.local_batch_size", str(GLOBAL_BATCH // 2), nproc=2)
    shutil.copytree(two / "checkpoint" / "step-3", resumed / "checkpoint" / "step-3")  # 2 ranks' state at step 3
    proc = run_titan(resumed, *run, "--training.local_batch_size", str(GLOBAL_BATCH))
    assert "mix of code 70% + docs 30% (token shards shuffled)" in proc.stdout + proc.stderr
    ref, two_ranks, after = by_step(reference), by_step(two), by_step(resumed)
    assert sorted(after) == [4, 5, 6]
    for step in range(1, STEPS + 1):
        for other in (two_ranks, after):
            if step in other:
                assert abs(other[step]["loss/global_avg"] - ref[step]["loss/global_avg"]) < 1e-5, (step, other[step])
                data = {k: v for k, v in other[step].items() if k.startswith("data/")}
                assert data == {k: v for k, v in ref[step].items() if k.startswith("data/")}
    # 70/30 exactly every 10 samples: after 5 steps of 4, code gave 14 samples and docs 6 (32 tokens each).
    assert (ref[5]["data/code/tokens"], ref[5]["data/docs/tokens"]) == (14 * 32, 6 * 32)
    saved = json.loads((resumed / "checkpoint" / "step-6" / "dataloader.json").read_text())
    assert saved == json.loads((reference / "checkpoint" / "step-6" / "dataloader.json").read_text())
    assert saved["samples_consumed"] == STEPS * GLOBAL_BATCH and saved["shuffle_seed"] == 0


def test_an_annealing_phase_decided_at_a_checkpoint_trains_as_one_planned_from_the_start(tmp_path):
    # A batch ramp (4, 4, then 8 sequences) puts step 4's first sample at 16; from step 4 the mix reads docs only.
    # Planned: one process with the phase from the start. Decided late: 2 ranks without it to step 3, then the
    # phase added on resuming its step-3 checkpoint on 1 process: steps 4-6 the same losses and per-source tokens.
    mix = two_corpora(tmp_path / "data")
    run = [*TINY, "--training.steps", str(STEPS), "--training.dataset_mix", mix,
           "--training.global_batch_size", "8", "--training.batch_size_rampup_start", "4",
           "--training.batch_size_rampup_steps", "2", "--checkpoint.enable", "--checkpoint.interval", "3"]  # fmt: skip
    phase = ["--training.dataset_mix_phases", '[{"step": 4, "weights": {"docs": 1}}]']
    planned, early, late = tmp_path / "planned", tmp_path / "early", tmp_path / "late"
    proc = run_titan(planned, *run, *phase, "--training.local_batch_size", "4")
    assert "mix of code 70% + docs 30%, from step 4 docs 100% (token shards shuffled)" in proc.stdout + proc.stderr
    run_titan(early, *run, "--training.local_batch_size", "2", nproc=2)  # its step-3 checkpoint is taken
    shutil.copytree(early / "checkpoint" / "step-3", late / "checkpoint" / "step-3")
    run_titan(late, *run, *phase, "--training.local_batch_size", "4")
    ref, before, after = by_step(planned), by_step(early), by_step(late)
    assert sorted(after) == [4, 5, 6]
    for step, other in [*((s, before) for s in (1, 2, 3)), *((s, after) for s in (4, 5, 6))]:
        assert abs(other[step]["loss/global_avg"] - ref[step]["loss/global_avg"]) < 1e-5, (step, other[step])
        assert {k: v for k, v in other[step].items() if k.startswith("data/")} == {
            k: v for k, v in ref[step].items() if k.startswith("data/")
        }
    tokens = [(ref[s]["data/code/tokens"], ref[s]["data/docs/tokens"]) for s in range(1, STEPS + 1)]
    assert sum(tokens[2]) == 16 * 32 and tokens[2][0] > tokens[2][1] > 0  # 16 samples, about 70/30
    for s in (3, 4, 5):  # 8 samples a step, all docs
        assert tokens[s] == (tokens[s - 1][0], tokens[s - 1][1] + 8 * 32)
    saved = json.loads((late / "checkpoint" / "step-6" / "dataloader.json").read_text())
    assert saved["phases"] == [[16, [0, 1]]] and saved["samples_consumed"] == 40
