"""Downstream multiple-choice evaluation (`titan_core.downstream_eval`): scores and accuracies.

In process: the evaluator's per-sequence log-likelihoods and accuracies on a hand-built task equal an
independent computation (the model's logits, `log_softmax`, written here), with the fused and the plain
loss, a context cut from the left included. Under torchrun: real runs with FSDP on 2 ranks, pipeline
parallel (pp=2, validation on too) and TP 2 with the plain loss on vocab-sharded logits report
`eval/<task>/...` every 2 steps in metrics.jsonl, equal to one process's (fp32, same seed); the TP run
is marked slow.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from titan_run import TINY, read_metrics, run_titan

from titan_core.config import ConfigError, load_config
from titan_core.downstream_eval import MultipleChoiceTask, load_task, load_tasks, score_task
from titan_core.trainer import Trainer

SEQ_LEN = 32  # TINY's
LONG = "Once upon a time, in a land far away, there lived a cat who"  # 60 bytes: cut to fit 33 tokens
EXAMPLES = [
    {"context": "The sun rises in the", "endings": [" east.", " sock drawer.", " west"], "label": 0},
    {"context": "def add(a, b):\n    return", "endings": [" a + b", " banana", " a - b", " None"], "label": 0},
    {"context": "import numpy as", "endings": [" np", " pd"], "label": 1},
    {"context": LONG, "endings": [" loved fish.", " was a very small teapot."], "label": 1},
    {"context": "Water boils at 100 degrees", "endings": [" Celsius.", " Fahrenheit", " Kelvin in space."], "label": 2},
    {"context": "for i in", "endings": [" range(10):", " the house"], "label": 0},
]


def write_task(folder: Path, name: str = "toy") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}.jsonl"
    path.write_text("".join(json.dumps(example) + "\n" for example in EXAMPLES))
    return path


def reference_logprobs(model: torch.nn.Module, tokenizer) -> list[float]:
    """Each (example, ending)'s log-likelihood from the model's logits: an independent computation."""
    out = []
    for example in EXAMPLES:
        for ending in example["endings"]:
            context = [tokenizer.bos_id, *tokenizer.encode(example["context"])]
            ending_ids = tokenizer.encode(ending)
            tokens = (context + ending_ids)[-(SEQ_LEN + 1) :]
            logits = model(torch.tensor([tokens[:-1]]))  # (1, T, vocab)
            logp = torch.log_softmax(logits.float(), dim=-1)[0]
            picked = logp[torch.arange(len(tokens) - 1), torch.tensor(tokens[1:])]  # (T,)
            out.append(picked[len(tokens) - 1 - len(ending_ids) :].sum().item())
    return out


def test_score_task_counts_acc_and_per_character_acc_norm():
    task = MultipleChoiceTask("t", ["a", "b"], [[" x", " longer ending"], [" y", " z"]], [1, 0])
    # Example 1: raw argmax is ending 0 (-2 > -6), per character ending 1 (-6/14 > -2/2). Example 2: right both ways.
    values = score_task(task, [-2.0, -6.0, -1.0, -3.0])
    assert values == {"eval/t/acc": 0.5, "eval/t/acc_norm": 1.0, "eval/t/gold_logprob": -3.5}


def test_load_task_names_and_rejects(tmp_path):
    path = write_task(tmp_path)
    assert load_task(str(path)).name == "toy"
    named = load_task(f"hella={path}", max_examples=3)
    assert named.name == "hella" and len(named.labels) == 3 and named.labels == [0, 0, 1]
    good = {"context": "a", "endings": [" b", " c"], "label": 0}
    for change, why in (({"label": 2}, "the label 2 is not the index of an ending"),
                        ({"label": True}, "the label True is not the index"),
                        ({"endings": ["", " c"]}, "an empty ending has log-likelihood 0"),
                        ({"endings": [" b"]}, "a choice needs a list of two endings or more"),
                        ({"context": 3}, "the context is not a string")):  # fmt: skip
        bad = tmp_path / "bad.jsonl"
        bad.write_text(json.dumps(good) + "\n" + json.dumps({**good, **change}) + "\n")
        with pytest.raises(ConfigError) as caught:
            load_task(str(bad))
        assert str(caught.value).startswith(f"eval.tasks: {bad}:2 is not ") and f"({why}" in str(caught.value)
    with pytest.raises(FileNotFoundError, match="eval.tasks"):
        load_task(str(tmp_path / "missing.jsonl"))
    with pytest.raises(ConfigError, match="eval.tasks: the name 'toy' labels two tasks, whose eval/toy/... figures"):
        load_tasks([str(path), f"toy={tmp_path / 'other.jsonl'}"])
    assert [t.name for t in load_tasks([str(path), f"toy2={path}"])] == ["toy", "toy2"]


@pytest.mark.parametrize("fused", ["true", "false"])
def test_scores_equal_an_independent_log_softmax(tmp_path, fused):
    task = write_task(tmp_path / "tasks")
    args = [*TINY, "--job.dump_folder", str(tmp_path / "run"), "--training.local_batch_size", "4",
            "--training.fused_loss", fused, "--eval.enable", "--eval.tasks", str(task)]
    trainer = Trainer(load_config(None, args))
    try:
        evaluator = trainer.build_downstream_eval()
        long = [1 + len((e["context"] + end).encode()) > SEQ_LEN + 1 for e in EXAMPLES for end in e["endings"]]
        assert evaluator is not None and evaluator.truncated == sum(long) >= 2  # cut from the left
        results = evaluator.evaluate()
        with torch.no_grad():
            expected = reference_logprobs(trainer.model.parts[0], trainer.tokenizer)
            got = []
            for first in range(0, len(evaluator.rows), 4):
                got += (-trainer.runner.eval_sequence_losses(*evaluator.batch_tensors(first))).tolist()
    finally:
        dist.destroy_process_group()
    assert got[: len(expected)] == pytest.approx(expected, abs=1e-4)
    assert got[len(expected) :] == [0.0] * (len(got) - len(expected))  # the padding rows
    tasks = load_task(str(task))
    assert results == pytest.approx(score_task(tasks, expected), abs=1e-5)


def eval_records(run: Path) -> dict[int, dict]:
    return {r["step"]: r for r in read_metrics(run) if "eval/toy/acc" in r}


RUN = [*TINY, "--training.steps", "4", "--eval.enable", "--eval.freq", "2"]
VALIDATION = ["--validation.enable", "--validation.freq", "4", "--validation.steps", "1"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> tuple[Path, Path]:
    """(the task file, one process's run folder)."""
    folder = tmp_path_factory.mktemp("downstream")
    task = write_task(folder / "tasks")
    proc = run_titan(folder / "reference", *RUN, "--eval.tasks", str(task), *VALIDATION,
                     "--training.local_batch_size", "4")
    assert "eval: toy acc" in proc.stdout + proc.stderr and "lose the start of their context" in proc.stderr
    return task, folder / "reference"


def assert_same_figures(run: Path, reference: Path) -> None:
    ref, other = eval_records(reference), eval_records(run)
    assert sorted(ref) == sorted(other) == [2, 4]
    for step in (2, 4):
        for key in ("acc", "acc_norm"):
            assert other[step][f"eval/toy/{key}"] == ref[step][f"eval/toy/{key}"], (run.name, step, key)
        gold = other[step]["eval/toy/gold_logprob"]
        assert gold == pytest.approx(ref[step]["eval/toy/gold_logprob"], abs=1e-4), (run.name, step)


def test_fsdp_and_pipeline_report_one_process_figures(reference, tmp_path):
    task, ref = reference
    fsdp, pp = tmp_path / "fsdp2", tmp_path / "pp2"
    run_titan(fsdp, *RUN, "--eval.tasks", str(task), "--training.local_batch_size", "2", nproc=2)
    run_titan(pp, *RUN, "--eval.tasks", str(task), *VALIDATION, "--training.local_batch_size", "4",
              "--parallelism.pipeline_parallel_degree", "2", nproc=2)
    assert_same_figures(fsdp, ref)
    assert_same_figures(pp, ref)
    # Validation under pipeline parallel (the schedule's forward-only pass) gives one process's loss.
    ref_val = [r["validation/loss"] for r in read_metrics(ref) if "validation/loss" in r]
    pp_val = [r["validation/loss"] for r in read_metrics(pp) if "validation/loss" in r]
    assert len(ref_val) == 1 and pp_val == pytest.approx(ref_val, abs=1e-5)


@pytest.mark.slow
def test_tensor_parallel_plain_loss_on_vocab_shards_reports_one_process_figures(reference, tmp_path):
    task, ref = reference
    run_titan(tmp_path / "tp2", *RUN, "--eval.tasks", str(task), "--training.local_batch_size", "4",
              "--parallelism.tensor_parallel_degree", "2", "--training.fused_loss", "false", nproc=2)
    assert_same_figures(tmp_path / "tp2", ref)


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["--eval.enable"], ["eval.enable", "eval.tasks is empty"]),
        (["--eval.enable", "--eval.tasks", "t.jsonl", "--parallelism.pipeline_parallel_degree", "2",
          "--parallelism.pipeline_parallel_schedule", "ZBVZeroBubble"], ["eval.enable", "'ZBVZeroBubble'"]),
    ],
)
def test_the_job_check_refuses_eval_without_tasks_or_under_a_v_schedule(args, words):
    from titan_core.job import resolve

    with pytest.raises(ConfigError) as error:
        resolve(load_config(None, args), 2)
    assert all(word in str(error.value) for word in words), str(error.value)


def test_the_example_config_loads_and_its_task_reads():
    cfg = load_config(str(Path(__file__).resolve().parents[1] / "examples" / "downstream_eval.toml"))
    assert cfg.eval.enable and cfg.eval.freq == 20
    for spec in cfg.eval.tasks:
        task = load_task(str(Path(__file__).resolve().parents[1] / spec), cfg.eval.max_examples)
        assert task.name == "toy_commonsense" and len(task.labels) == 8
