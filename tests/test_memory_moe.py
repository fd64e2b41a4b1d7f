"""`titan estimate-memory` for Qwen3, Qwen3-MoE and DeepSeek-V3: each family's activation formulas
against what autograd really saves (`saved_tensors_hooks`, CPU fp32), the analytic tier's per-block
kinds (DeepSeek-V3's dense and MoE blocks), and expert parallel in the command's output."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from typer.testing import CliRunner

from titan_cli.main import app
from titan_core.config import load_config
from titan_core.memory.analytic import estimate_analytic
from titan_core.trainer import cross_entropy_loss
from titan_models import ActivationLayout, get_model_args, get_model_spec
from titan_run import autograd_saved_bytes

BS, SEQ = 2, 64
LAYOUT = ActivationLayout(compute_bytes=4, tp=1, cp=1, seq_len=SEQ, device_type="cpu")

# (model.name, flavor, a block of each kind: DeepSeek-V3 debugmodel's block 0 is dense, block 1 MoE)
FAMILIES = [
    ("qwen3", "debugmodel", 0),
    ("qwen3_moe", "debugmodel_moe", 0),
    ("deepseek_v3", "debugmodel", 0),
    ("deepseek_v3", "debugmodel", 1),
]


def _model(name: str, flavor: str) -> torch.nn.Module:
    torch.manual_seed(0)
    model = get_model_spec(name).build(get_model_args(name, flavor))
    model.init_weights()
    return model


def _saved_bytes_per_token(model: torch.nn.Module, run) -> float:
    """Bytes of the storages autograd saves while `run()` runs, parameters and buffers aside, per token."""
    return autograd_saved_bytes(model, run) / (BS * SEQ)


@pytest.mark.parametrize("name, flavor, layer", FAMILIES)
def test_a_block_keeps_what_the_formula_says(name, flavor, layer):
    """One block's forward (its input counted: only this block keeps it) against `ActivationBytes.block`."""
    model = _model(name, flavor)
    act = get_model_spec(name).activation_bytes(model.args, LAYOUT)
    expected = act.per_block[layer].block if act.per_block else act.block
    x = torch.randn(BS, SEQ, model.args.dim, requires_grad=True)
    measured = _saved_bytes_per_token(model, lambda: model.layers[str(layer)](x, model.rope_cache))
    assert measured == pytest.approx(expected, rel=0.05)


@pytest.mark.parametrize("name, flavor", [("qwen3", "debugmodel"), ("deepseek_v3", "debugmodel")])
def test_the_head_and_loss_keep_what_the_formula_says(name, flavor):
    """The final norm, the output projection and the loss against `head + logits_saved`."""
    model = _model(name, flavor)
    act = get_model_spec(name).activation_bytes(model.args, LAYOUT)
    h = torch.randn(BS, SEQ, model.args.dim, requires_grad=True)
    labels = torch.randint(0, model.args.vocab_size, (BS, SEQ))
    measured = _saved_bytes_per_token(model, lambda: cross_entropy_loss(model.output(model.norm(h)), labels))
    labels_bytes = 8  # the int64 labels nll_loss keeps are the batch's, not an activation
    assert measured - labels_bytes == pytest.approx(act.head + act.logits_saved, rel=0.05)


def test_the_estimate_counts_each_block_by_its_kind():
    """DeepSeek-V3 debugmodel (1 dense block of 4): the saved activations are the dense block's once and the
    MoE block's three times, on one stage; split over two pipeline stages, each stage counts its own."""
    base = [
        "--model.name",
        "deepseek_v3",
        "--model.flavor",
        "debugmodel",
        "--training.device",
        "cpu",
        "--training.mixed_precision_param",
        "float32",
        "--training.seq_len",
        "256",
        "--training.local_batch_size",
        "2",
        "--training.fused_loss",
        "false",
    ]  # the plain loss: its saved log-softmax is `act.logits_saved`
    cfg = load_config(None, base)
    args = get_model_args("deepseek_v3", "debugmodel")
    from titan_core.memory.eager_saved import measure_eager  # the figures the analytic tier uses

    eager = measure_eager(
        get_model_spec("deepseek_v3"), args, ActivationLayout(compute_bytes=4, seq_len=256, device_type="cpu")
    )
    act = eager.for_tokens(2 * 256)  # what a block keeps once per call, spread over the micro-batch's tokens
    dense, moe = act.per_block[0], act.per_block[1]
    assert dense.block != moe.block and act.block == min(dense.block, moe.block)
    tokens = 2 * 256
    (rank,) = estimate_analytic(cfg, 1).ranks
    assert rank.detail["saved_activations_per_microbatch"] == tokens * (
        dense.block + 3 * moe.block + act.head + act.logits_saved
    )
    pp = load_config(
        None,
        [
            *base,
            "--parallelism.pipeline_parallel_degree",
            "2",
            "--parallelism.pipeline_parallel_schedule",
            "1F1B",
            "--parallelism.pipeline_parallel_microbatch_size",
            "1",
        ],
    )
    first, last = estimate_analytic(pp, 2).ranks
    microbatch = 256
    act = eager.for_tokens(microbatch)
    dense, moe = act.per_block[0], act.per_block[1]
    assert first.detail["saved_activations_per_microbatch"] == microbatch * (dense.block + moe.block)
    assert last.detail["saved_activations_per_microbatch"] == microbatch * (2 * moe.block + act.head + act.logits_saved)


EP_JOB = ["--model.name", "deepseek_v3", "--model.flavor", "debugmodel", "--nproc-per-node", "2"]


def test_expert_parallel_estimate_prints_a_table_and_gathers_fewer_experts():
    """EP 2 on 2 ranks: the table prints; each rank gathers half the experts of a block (FSDP's gathered
    figure is smaller), while the sharded model states are the same (EP x FSDP still splits them 2 ways)."""
    command = [
        sys.executable,
        "-m",
        "titan_cli",
        "estimate-memory",
        *EP_JOB,
        "--parallelism.expert_parallel_degree",
        "2",
    ]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert "analytic estimate, 2 ranks" in proc.stdout
    for component in ("parameters", "gradients", "optimizer", "activations", "communication", "temporary", "total"):
        assert any(line.startswith(component) for line in lines), component

    def rank(ep: int) -> dict:
        result = CliRunner().invoke(
            app, ["estimate-memory", *EP_JOB, "--parallelism.expert_parallel_degree", str(ep), "--json"]
        )
        assert result.exit_code == 0, result.output
        (only,) = json.loads(result.output)["ranks"]
        return only

    without, with_ep = rank(1), rank(2)
    assert with_ep["detail"]["fsdp_gathered_forward"] < without["detail"]["fsdp_gathered_forward"]
    assert with_ep["parameters"] == without["parameters"] and with_ep["optimizer"] == without["optimizer"]
