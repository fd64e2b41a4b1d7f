"""`titan estimate-memory` for Qwen3, Qwen3-MoE and DeepSeek-V3: the analytic tier's per-block kinds
(DeepSeek-V3's dense and MoE blocks) and expert parallel in the command's output. What each kind of block
keeps, measured, is held to what autograd really saves in tests/test_memory_eager.py."""

from __future__ import annotations

import json
import sys
import warm_python

import torch
from typer.testing import CliRunner

from titan_cli.main import app
from titan_core.config import load_config
from titan_core.memory.analytic import estimate_analytic
from titan_core.memory.activations import ActivationLayout
from titan_models import get_model_args, get_model_spec

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
    proc = warm_python.run(command, timeout=120)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert "analytic estimate, 2 ranks: dp_shard=2, ep=2 (" in proc.stdout  # the layout names the EP degree
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
