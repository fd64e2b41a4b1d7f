"""`titan eval`: lm-evaluation-harness tasks on a Titan checkpoint, offline.

A tiny Llama 3 is trained for two steps with `titan train` (byte tokenizer). The test writes
its own lm-eval task (YAML + JSONL, multiple choice) and runs it through the `titan eval`
command in a subprocess; the model class's log-likelihoods are checked against a plain forward
and `log_softmax` written here, its rolling log-likelihood against the sum of every token's
log-probability, its greedy generation against Titan's uncached reference loop, and a missing
extra is one line.
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

from titan_core.generation import GREEDY, generate, load_model  # noqa: E402
from titan_core.lm_eval_model import TitanLM  # noqa: E402
from titan_run import REPO, TINY, run_titan, titan_env  # noqa: E402

OFFLINE = {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
EXAMPLES = [
    {"context": "def add(a, b):\n    return", "endings": [" a + b", " zebra crossing", "!!!"], "label": 0},
    {"context": "import", "endings": [" os", " )(", " 12 12 12"], "label": 0},
    {"context": "for i in", "endings": [" range(10):", " banana", " ?"], "label": 0},
    {"context": "The cat sat on the", "endings": [" mat.", " integral", ""], "label": 0},
]


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("run")
    run_titan(folder, *TINY, "--training.steps", "2", "--checkpoint.enable", "true", "--checkpoint.interval", "2")
    return folder


@pytest.fixture(scope="module")
def titan_lm(run) -> TitanLM:
    return TitanLM(str(run), device="cpu", batch_size=3)


def _task_folder(folder: Path) -> Path:
    """A local multiple-choice task, `toy_mc`, in lm-eval's YAML format over a JSONL file."""
    folder.mkdir(parents=True, exist_ok=True)
    data = folder / "toy_mc.jsonl"
    data.write_text("".join(json.dumps(e) + "\n" for e in EXAMPLES))
    (folder / "toy_mc.yaml").write_text(
        "task: toy_mc\n"
        "dataset_path: json\n"
        f"dataset_kwargs:\n  data_files:\n    test: {data}\n"
        "test_split: test\n"
        "output_type: multiple_choice\n"
        "doc_to_text: '{{context}}'\n"
        "doc_to_choice: '{{endings}}'\n"
        "doc_to_target: '{{label}}'\n"
        "metric_list:\n  - metric: acc\n  - metric: acc_norm\n"
    )
    return folder


def _titan_eval(*args: str, python_prefix: str = "") -> subprocess.CompletedProcess:
    code = f"{python_prefix}from titan_cli.main import app; app()"
    command = [sys.executable, "-c", code, "eval", *args]
    return subprocess.run(command, capture_output=True, text=True, env={**titan_env(), **OFFLINE}, cwd=REPO, timeout=600)


def test_titan_eval_scores_a_local_task_from_a_run_folder(run, tmp_path, titan_lm):
    tasks = _task_folder(tmp_path / "tasks")
    out = tmp_path / "results.json"
    proc = _titan_eval(str(run), "--tasks", "toy_mc", "--include-path", str(tasks), "--device", "cpu",
                       "--batch-size", "4", "--output", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "toy_mc" in proc.stdout and "acc" in proc.stdout  # lm-eval's table
    scores = json.loads(out.read_text())["results"]["toy_mc"]
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
    assert scores["acc,none"] == pytest.approx(sum(chosen) / len(chosen))
    assert 0.0 <= scores["acc_norm,none"] <= 1.0


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
    got = titan_lm.loglikelihood([Instance("loglikelihood", {}, pair, 0) for pair in pairs])
    for (context, continuation), (logprob, greedy) in zip(pairs, got, strict=True):
        if context:  # lm-eval's split: the whole text encoded, the continuation is what follows the context
            whole, ctx = tok.encode(context + continuation), tok.encode(context)
            tokens, n = [tok.bos_id, *whole], len(whole) - len(ctx)
        else:  # an empty context is conditioned on BOS
            cont = tok.encode(continuation)
            tokens, n = [tok.bos_id, *cont], len(cont)
        ref, ref_greedy = _reference_logprob(model, tokens, n)
        assert logprob == pytest.approx(ref, rel=1e-5, abs=1e-4)
        assert greedy == ref_greedy
    # the rolling log-likelihood of a text is the sum over every token after BOS
    text = "def main():\n    print('hi')\n"
    (rolling,) = titan_lm.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, (text,), 0)])
    ids = tok.encode(text)
    assert rolling == pytest.approx(_reference_logprob(model, [tok.bos_id, *ids], len(ids))[0], rel=1e-5)


def test_generate_until_is_greedy_decoding_cut_at_the_stop_string(titan_lm, run):
    prompts = ["def ", "import os\n"]
    requests = [Instance("generate_until", {}, (p, {"until": ["\n\n"], "max_gen_toks": 12}), 0) for p in prompts]
    got = titan_lm.generate_until(requests)
    loaded = load_model(str(run), device="cpu")
    for prompt, text in zip(prompts, got, strict=True):
        reference = generate(loaded.model, loaded.spec.plan, [titan_lm.codec.encode(prompt)], 12, GREEDY,
                             eos_ids=titan_lm.codec.eos_ids, use_kv_cache=False)  # the uncached reference loop
        full = titan_lm.codec.decode(reference.tokens[0])
        assert text == full.split("\n\n")[0]


def test_a_missing_extra_or_unknown_task_is_one_line(run, tmp_path):
    hidden = "import sys; sys.modules['lm_eval'] = None; "  # `import lm_eval` raises ImportError
    proc = _titan_eval(str(run), "--tasks", "toy_mc", python_prefix=hidden)
    assert proc.returncode == 2
    assert proc.stderr.strip() == "titan eval: error: titan eval needs EleutherAI's lm-evaluation-harness: " \
        "pip install 'titan-core[eval]'"
    proc = _titan_eval(str(run), "--tasks", "no_such_task_xyz", "--include-path", str(_task_folder(tmp_path / "t")))
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith("titan eval: error: --tasks no_such_task_xyz: no such")
