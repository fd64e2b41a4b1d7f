"""`titan eval`: lm-evaluation-harness tasks on a Titan checkpoint, offline.

A tiny Llama 3 is trained for two steps with `titan train` (byte tokenizer). The test writes
its own lm-eval tasks (YAML + JSONL): `toy_mc`, multiple choice, and `toy_gen`, generate_until,
whose targets are `titan generate`'s greedy continuations for two of its three prompts. It runs
both through the `titan eval` command in a subprocess, offline. The model class's
log-likelihoods are checked against a plain forward and `log_softmax` written here, its rolling
log-likelihood against the sum of every token's log-probability, its greedy generation against
`titan generate --temperature 0`; a missing extra, a bad checkpoint path and an unknown task are
one line each.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("lm_eval")

from lm_eval.api.instance import Instance  # noqa: E402
from typer.testing import CliRunner  # noqa: E402

from titan_cli.main import app  # noqa: E402
from titan_core.lm_eval_model import TitanLM  # noqa: E402
from titan_run import REPO, TINY, run_titan, titan_env  # noqa: E402
import warm_python

OFFLINE = {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
EXAMPLES = [
    {"context": "def add(a, b):\n    return", "endings": [" a + b", " zebra crossing", "!!!"], "label": 0},
    {"context": "import", "endings": [" os", " )(", " 12 12 12"], "label": 0},
    {"context": "for i in", "endings": [" range(10):", " banana", " ?"], "label": 0},
    {"context": "The cat sat on the", "endings": [" mat.", " integral", ""], "label": 0},
]
GEN_PROMPTS = ["def add(a, b):", "import os", "for i in range(3):"]
STOP, MAX_GEN = "\n\n", 12


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("run")
    run_titan(folder, *TINY, "--training.steps", "2", "--checkpoint.enable", "true", "--checkpoint.interval", "2")
    return folder


@pytest.fixture(scope="module")
def titan_lm(run) -> TitanLM:
    return TitanLM(str(run), device="cpu", batch_size=3)


def _titan_generate(run: Path, prompt: str, max_new: int = MAX_GEN) -> str:
    """`titan generate --temperature 0`'s continuation of `prompt` (it prints the prompt, the text, a blank line)."""
    result = CliRunner().invoke(
        app, ["generate", str(run), "--prompt", prompt, "-n", str(max_new), "--temperature", "0", "--device", "cpu"]
    )
    assert result.exit_code == 0, result.output
    assert result.stdout.startswith(prompt) and result.stdout.endswith("\n\n")
    return result.stdout[len(prompt) : -2]


@pytest.fixture(scope="module")
def greedy(run) -> list[str]:
    """`titan generate`'s greedy continuation of each of GEN_PROMPTS, cut at STOP."""
    return [_titan_generate(run, prompt).split(STOP)[0] for prompt in GEN_PROMPTS]


def _task_folder(folder: Path, gen_targets: list[str]) -> Path:
    """Two local tasks in lm-eval's YAML format over JSONL files: `toy_mc` (multiple choice) and `toy_gen`
    (greedy generation up to MAX_GEN tokens, cut at STOP, scored by exact match against `gen_targets`)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "toy_mc.jsonl").write_text("".join(json.dumps(e) + "\n" for e in EXAMPLES))
    (folder / "toy_mc.yaml").write_text(
        "task: toy_mc\n"
        "dataset_path: json\n"
        f"dataset_kwargs:\n  data_files:\n    test: {folder / 'toy_mc.jsonl'}\n"
        "test_split: test\n"
        "output_type: multiple_choice\n"
        "doc_to_text: '{{context}}'\n"
        "doc_to_choice: '{{endings}}'\n"
        "doc_to_target: '{{label}}'\n"
        "metric_list:\n  - metric: acc\n  - metric: acc_norm\n"
    )
    docs = [{"prompt": p, "target": t} for p, t in zip(GEN_PROMPTS, gen_targets, strict=True)]
    (folder / "toy_gen.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
    (folder / "toy_gen.yaml").write_text(
        "task: toy_gen\n"
        "dataset_path: json\n"
        f"dataset_kwargs:\n  data_files:\n    test: {folder / 'toy_gen.jsonl'}\n"
        "test_split: test\n"
        "output_type: generate_until\n"
        "doc_to_text: prompt\n"  # a field name: the text as it is, no template
        "doc_to_target: target\n"
        f"generation_kwargs:\n  until: [{json.dumps(STOP)}]\n  max_gen_toks: {MAX_GEN}\n  do_sample: false\n"
        "metric_list:\n  - metric: exact_match\n"
    )
    return folder


def _titan_eval(*args: str, python_prefix: str = "", env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    code = f"{python_prefix}from titan_cli.main import app; app()"
    command = [sys.executable, "-c", code, "eval", *args]
    env = {**titan_env(), **OFFLINE, **(env or {})}
    return warm_python.run(command, env=env, cwd=REPO, timeout=600)


def test_titan_eval_scores_local_tasks_from_a_run_folder(run, tmp_path, titan_lm, greedy):
    targets = [greedy[0], greedy[1], greedy[2] + "#"]  # the last one cannot match: exact match 2/3
    tasks = _task_folder(tmp_path / "tasks", targets)
    out = tmp_path / "results.json"
    proc = _titan_eval(str(run), "--tasks", "toy_mc,toy_gen", "--include-path", str(tasks), "--device", "cpu",
                       "--batch-size", "4", "--output", str(out), env={"HF_DATASETS_CACHE": str(tmp_path / "hf")})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "toy_mc" in proc.stdout and "acc" in proc.stdout and "exact_match" in proc.stdout  # lm-eval's table
    results = json.loads(out.read_text())["results"]
    # The same accuracy as choosing, for each example, the ending with the highest log-likelihood from the model
    # class (whose log-likelihoods the next test checks against a plain forward).
    lls = titan_lm.loglikelihood(
        [Instance("loglikelihood", {}, (e["context"], " " + ending), 0)  # lm-eval's target delimiter: " "
         for e in EXAMPLES for ending in e["endings"]]
    )
    chosen, k = [], 0
    for e in EXAMPLES:
        row = [ll for ll, _ in lls[k : k + len(e["endings"])]]
        chosen.append(max(range(len(row)), key=row.__getitem__) == e["label"])
        k += len(e["endings"])
    assert results["toy_mc"]["acc,none"] == pytest.approx(sum(chosen) / len(chosen))
    assert 0.0 <= results["toy_mc"]["acc_norm,none"] <= 1.0
    # titan eval's generations are titan generate's greedy text, cut at the stop string
    assert results["toy_gen"]["exact_match,none"] == pytest.approx(2 / 3)


def _reference_logprob(model: torch.nn.Module, tokens: list[int], n_scored: int) -> tuple[float, bool]:
    """Plain forward of the whole sequence, log_softmax, the last `n_scored` targets."""
    with torch.no_grad():
        logits = model(torch.tensor([tokens[:-1]]))[0].float()  # (len - 1, vocab)
    logprobs = torch.log_softmax(logits, dim=-1)[-n_scored:]
    targets = torch.tensor(tokens[-n_scored:])
    picked = logprobs.gather(-1, targets[:, None])[:, 0]
    return float(picked.sum()), bool((logprobs.argmax(-1) == targets).all())


def test_loglikelihoods_equal_a_plain_forward_and_log_softmax(titan_lm):
    model, tok = titan_lm.loaded.model, titan_lm.codec.tokenizer
    pairs = [(e["context"], ending) for e in EXAMPLES for ending in e["endings"] if ending] + [("", "hello")]
    long_context = "x = 1\n" * 350 + "y ="  # 2,103 bytes: past max_seq_len (2,048), cut from the left
    pairs.append((long_context, " 2"))  # (no context here ends in whitespace: lm-eval moves that to the continuation)
    got = titan_lm.loglikelihood([Instance("loglikelihood", {}, pair, 0) for pair in pairs])
    for (context, continuation), (logprob, greedy) in zip(pairs, got, strict=True):
        if context:  # lm-eval's split: the whole text encoded, the continuation is what follows the context
            whole, ctx = tok.encode(context + continuation), tok.encode(context)
            tokens, n = [tok.bos_id, *whole], len(whole) - len(ctx)
        else:  # an empty context is conditioned on BOS
            cont = tok.encode(continuation)
            tokens, n = [tok.bos_id, *cont], len(cont)
        tokens = tokens[-(titan_lm.max_length + 1) :]  # the model's window: max_seq_len inputs
        ref, ref_greedy = _reference_logprob(model, tokens, n)
        assert logprob == pytest.approx(ref, rel=1e-5, abs=1e-4)
        assert greedy == ref_greedy
    # the rolling log-likelihood of a text is the sum over every token after BOS
    text = "def main():\n    print('hi')\n"
    (rolling,) = titan_lm.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, (text,), 0)])
    ids = tok.encode(text)
    assert rolling == pytest.approx(_reference_logprob(model, [tok.bos_id, *ids], len(ids))[0], rel=1e-5)


def test_generate_until_is_titan_generates_greedy_text_cut_at_the_stop_string(titan_lm, greedy, run):
    # batch_size 3: the three prompts decode as one left-padded batch, the short request in a batch of its own
    requests = [
        Instance("generate_until", {}, (p, {"until": [STOP], "max_gen_toks": MAX_GEN}), 0) for p in GEN_PROMPTS
    ]
    short = Instance("generate_until", {}, (GEN_PROMPTS[0], {"until": "n", "max_gen_toks": 5}), 0)
    got = titan_lm.generate_until([requests[0], short, *requests[1:]])
    assert [got[0], *got[2:]] == greedy
    assert got[1] == _titan_generate(run, GEN_PROMPTS[0], max_new=5).split("n")[0]  # `until` as one string


def test_a_missing_extra_a_bad_checkpoint_or_an_unknown_task_is_one_line(run, tmp_path, monkeypatch):
    hidden = "import sys; sys.modules['lm_eval'] = None; "  # `import lm_eval` raises ImportError
    proc = _titan_eval(str(run), "--tasks", "toy_mc", python_prefix=hidden)
    assert proc.returncode == 2
    assert proc.stderr.strip() == "titan eval: error: titan eval needs EleutherAI's lm-evaluation-harness: " \
        "pip install 'titan-core[eval]'"
    for key, value in OFFLINE.items():
        monkeypatch.setenv(key, value)
    tasks = str(_task_folder(tmp_path / "t", ["a", "b", "c"]))
    missing = tmp_path / "no_such_run"
    result = CliRunner().invoke(app, ["eval", str(missing), "--tasks", "toy_mc", "--include-path", tasks])
    assert result.exit_code == 2
    assert result.stderr.strip() == f"titan eval: error: {missing} does not exist; pass an existing checkpoint " \
        "file or folder"
    result = CliRunner().invoke(app, ["eval", str(run), "--tasks", "toy_mc,no_such_task_xyz", "--include-path", tasks])
    assert result.exit_code == 2  # typer.Exit(2); an exception other than a user error exits 1
    assert result.stderr.strip() == "titan eval: error: --tasks no_such_task_xyz: no such lm-eval task in " \
        f"--include-path {tasks} or in lm-eval's own; check the names (`lm_eval ls tasks`)"
    for option, says in ((["--batch-size", "0"], "--batch-size 0: give 1 or more sequences"),
                         (["--limit", "-1"], "--limit -1: give a count of examples, or a fraction of each task"),
                         (["--limit", "0"], "--limit 0: give a count of examples"),
                         (["--num-fewshot", "-1"], "--num-fewshot -1: give 0 or more examples")):  # fmt: skip
        result = CliRunner().invoke(app, ["eval", str(run), "--tasks", "toy_mc", "--include-path", tasks, *option])
        assert result.exit_code == 2 and result.stderr.strip().startswith(f"titan eval: error: {says}"), result.stderr
