"""`titan params`: the table agrees with the optimizer the trainer builds, parameter by parameter; float8's choice
on the Llama 3 8B shape by torchao's size table, by hand; `--match` as `optimizer.weight_decay_exclude` matches."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from titan_core.config import load_config
from titan_core.job import resolve
from titan_core.optim import build_optimizer
from titan_core.param_table import parameter_rows
from titan_run import REPO
import warm_python


def titan_params(*args: str) -> subprocess.CompletedProcess:
    """`titan params ARGS`, forked from the worker's warm interpreter (tests/warm_python.py)."""
    return warm_python.run([sys.executable, "-m", "titan_cli", "params", *args], cwd=REPO, timeout=300)


@pytest.mark.parametrize("args", [
    ["--model.name", "deepseek_v3", "--optimizer.name", "Muon", "--optimizer.adamw_weight_decay", "0.05",
     "--optimizer.weight_decay_exclude", "*norm*,tok_embeddings.*"],
    ["--optimizer.name", "Adam", "--optimizer.weight_decay_exclude", "*norm*"],
    ["--mup.enable", "true", "--mup.base_dim", "64", "--optimizer.weight_decay_exclude", "*norm*"],
])  # fmt: skip
def test_each_row_is_what_the_trainers_optimizer_does_with_the_parameter(args):
    job = resolve(load_config(None, args), 1)
    model = job.spec.build(job.model_args)  # on CPU, uninitialised: only names and shapes matter
    optimizer = build_optimizer(model.named_parameters(), job.optimizer, device_type="cpu", plan=job.spec.plan)
    by_param = {id(p): group for group in optimizer.param_groups for p in group["params"]}
    rows = parameter_rows(job)
    assert [r.name for r in rows] == [n for n, _ in model.named_parameters()]
    kinds = set()
    for row, (name, p) in zip(rows, model.named_parameters(), strict=True):
        group = by_param[id(p)]
        kind = ("Muon" if group["use_muon"] else "AdamW") if "use_muon" in group else job.cfg.optimizer.name
        assert (row.optimizer, row.weight_decay, row.lr, row.shape, row.numel) == (
            kind, group["weight_decay"], group["lr"], tuple(p.shape), p.numel()), name  # fmt: skip
        kinds.add((row.optimizer, row.weight_decay, row.lr))
    name = job.cfg.optimizer.name
    # every kind of row occurs: Muon's matrices at 0.1, AdamW's others at 0.05, the excluded at 0 (or Adam's two);
    # under muP (4x the base width) the blocks' matrices at a quarter of the learning rate
    assert kinds == {
        "Muon": {("Muon", 0.1, 8e-4), ("AdamW", 0.05, 8e-4), ("AdamW", 0.0, 8e-4)},
        "Adam": {("Adam", 0.1, 8e-4), ("Adam", 0.0, 8e-4)},
        "AdamW": {("AdamW", 0.1, 8e-4), ("AdamW", 0.1, 2e-4), ("AdamW", 0.0, 8e-4)},
    }[name]


def test_float8_choice_on_the_8b_shape_by_hand():
    """torchao's tensorwise table skips a GEMM with K <= 4096 and N <= 1024: the 8B's wk / wv (4096 -> 1024) stay in
    bf16, wq / wo (4096 -> 4096) and the feed-forward convert; the output projection is in filter_fqns."""
    job = resolve(load_config(None, ["--model.flavor", "8B", "--model.converters", "float8"]), None)
    rows = {r.name: r.float8 for r in parameter_rows(job, ["layers.0.*", "output.*", "norm.*"])}
    assert rows == {
        "layers.0.attention_norm.weight": "-",
        "layers.0.attention.wq.weight": "yes",
        "layers.0.attention.wk.weight": "no: K=4096, N=1024: too small to gain (tensorwise)",
        "layers.0.attention.wv.weight": "no: K=4096, N=1024: too small to gain (tensorwise)",
        "layers.0.attention.wo.weight": "yes",
        "layers.0.ffn_norm.weight": "-",
        "layers.0.feed_forward.w1.weight": "yes",
        "layers.0.feed_forward.w2.weight": "yes",
        "layers.0.feed_forward.w3.weight": "yes",
        "norm.weight": "-",
        "output.weight": "no: filter_fqns 'output'",
    }
    assert parameter_rows(resolve(load_config(None, []), None))[0].float8 is None  # no float8 column without it


def test_the_command_matches_as_weight_decay_exclude_and_says_when_nothing_does():
    proc = titan_params("--match", "*norm*", "--json")
    assert proc.returncode == 0, proc.stderr
    names = [json.loads(line)["name"] for line in proc.stdout.splitlines()]
    args = resolve(load_config(None, []), None).model_args
    from titan_models import get_model_spec

    model = get_model_spec("llama3").build(args)  # the default model, built independently of the command
    assert names == [n for n, _ in model.named_parameters() if "norm" in n] and len(names) == 2 * args.n_layers + 1
    table = titan_params("--match", "layers.0.attention.w?.weight")
    kv = args.n_kv_heads * args.dim // args.n_heads  # grouped-query attention: wk, wv project to the kv heads
    expected = 2 * args.dim * args.dim + 2 * args.dim * kv  # wq, wo; wk, wv
    assert table.returncode == 0 and f"4 tensors, {expected:,} elements" in table.stdout, table.stdout
    none = titan_params("--match", "layer.*")  # a typo: no parameter is called layer.*
    assert none.returncode == 1 and "(no parameter)" in none.stdout
    # A shipped GPU config, its tokenizer folder absent here: listed for a CUDA host with the flavor's vocab, said so.
    shipped = titan_params("--config", "llama3_8b", "--match", "tok_embeddings.*", "--json")
    assert shipped.returncode == 0 and json.loads(shipped.stdout)["shape"] == [128256, 4096], shipped.stderr
    assert "the flavor's vocab (128256) is assumed" in shipped.stderr
    bad = titan_params("--model.flavor", "nope")
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "model.flavor" in bad.stderr


def test_a_405b_table_costs_no_memory():
    # 405B parameters would need ~1.6 TB in fp32, on a machine of 24 GiB: the table builds the model on the meta
    # device. Its embedding is Llama 3.1 405B's published shape, vocab 128256 x dim 16384.
    job = resolve(load_config(None, ["--model.flavor", "405B"]), None)
    rows = parameter_rows(job)
    assert rows[0].name == "tok_embeddings.weight" and rows[0].shape == (128256, 16384)
    assert sum(r.numel for r in rows) > 400e9
