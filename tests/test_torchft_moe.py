"""Mixture-of-Experts models and pipeline stages across torchft replica groups (docs/fault_tolerance.md, "MoE
models", "Pipeline parallel").

Per step, the replica groups are one job's replicate dimension: their expert biases must move on the load of the
whole global batch. Two groups of two pipeline stages each (DeepSeek-V3's debug model, aux-loss-free balancing with
a step large enough to change the routing) are held against one job of two stages x two FSDP ranks on the same
data: the same token counts per expert, the same biases, the same weights. With DiLoCo each group's biases follow
its own tokens between syncs and each sync averages them; the fragments are the whole model's, so a stage may hold
none of one (the in-process test checks the buffers' mean against a stand-in all-reduce).
"""

from __future__ import annotations

import json

import pytest
import torch
from test_diloco import OUTER_LR, OUTER_MOMENTUM, FakeGroups, inner_step, split, tiny_blocks, train_groups
from test_loss_spike import dcp_tensors
from test_torchft import run_groups, running_lighthouse
from titan_run import read_metrics, run_titan

from titan_core.diloco import model_fragments, synced_buffers

pytest.importorskip("torchft")

MOE = [
    "--model.name", "deepseek_v3", "--model.flavor", "debugmodel", "--moe.load_balance_coeff", "0.05",
    "--training.seq_len", "32", "--training.steps", "3", "--training.mixed_precision_param", "float32",
    "--lr_scheduler.warmup_steps", "2", "--metrics.log_freq", "1", "--metrics.enable_tensorboard", "false",
    "--metrics.peak_tflops", "1", "--debug.seed", "7", "--training.local_batch_size", "2",
    "--checkpoint.enable", "--checkpoint.keep_latest_k", "0", "--parallelism.pipeline_parallel_degree", "2",
]  # fmt: skip
BIASES = [f"layers.{i}.moe.expert_bias" for i in (1, 2, 3)]  # the debug model's first layer is dense
STAGES = ["--nproc-per-node", "2"]  # each group: 2 pipeline stages of 2 blocks


def test_moe_stages_in_replica_groups_balance_on_the_global_batch_and_diloco_averages_the_biases(tmp_path):
    reference = tmp_path / "pp2-fsdp2"
    run_titan(reference, *MOE, "--checkpoint.interval", "3", nproc=4, debug_detail=False)
    with running_lighthouse(tmp_path, min_replicas=2) as address:
        per_step = run_groups(tmp_path, ("g0", "g1"), address, *MOE, *STAGES, "--checkpoint.interval", "3")
        diloco = train_groups(tmp_path, ("d0", "d1"), address, *MOE, *STAGES, "--fault_tolerance.sync_steps", "2",
                              "--fault_tolerance.num_fragments", "2", "--training.steps", "2",
                              "--checkpoint.interval", "1")

    assert "collectives across the groups over gloo" in (tmp_path / "g0.log").read_text()  # process_group 'auto'
    # Per step: each step's tokens per expert are the global batch's (the two groups' sum), as the 4-rank job's.
    expected = read_metrics(reference)
    for folder in per_step:
        got = read_metrics(folder)
        assert [r["moe/tokens_per_expert"] for r in got] == [r["moe/tokens_per_expert"] for r in expected]
        assert all(r["ft/replica_groups"] == 2 for r in got)
    group_losses = [[r["loss/global_avg"] for r in read_metrics(folder)] for folder in per_step]
    for step, ref in enumerate(expected):  # each group logs its own half of the batch
        assert (group_losses[0][step] + group_losses[1][step]) / 2 == pytest.approx(ref["loss/global_avg"], rel=1e-5)
    ref_state = split(dcp_tensors(reference / "checkpoint/step-3"), "model.")
    states = [split(dcp_tensors(folder / "checkpoint/step-3"), "model.") for folder in per_step]
    assert any(ref_state[name].abs().max() > 0.05 for name in BIASES)  # more than one step of 0.05
    for state in states:
        assert state.keys() == ref_state.keys()
        for name in BIASES:  # sign steps of integer counts: equal, not close
            assert torch.equal(state[name], ref_state[name]), name
        worst = max((state[k] - ref_state[k]).abs().max().item() for k in ref_state)
        assert worst < 1e-5, worst

    # DiLoCo in 2 fragments of the whole model: the first (the embedding, blocks 0-1: all of stage 0) syncs after
    # step 1, the second (blocks 2-3, the norm, the output: stage 1's) after step 2. The biases apart until their
    # fragment's sync (each group's own load), equal after it, where they are their anchors (no outer momentum).
    step1, step2 = ([dcp_tensors(folder / f"checkpoint/step-{step}") for folder in diloco] for step in (1, 2))
    names = list(split(step1[0], "model."))
    first = set(model_fragments(names, "layers", 2)[0])  # (here every block is in `names`: the whole model's cut)
    assert "tok_embeddings.weight" in first and "layers.1.moe.expert_bias" in first and "output.weight" not in first
    for name in names:  # (Adam's first update is +-lr: a vector's signs may agree by chance)
        for step, synced_now in ((step1, first), (step2, set(names) - first)):
            same = torch.equal(step[0][name], step[1][name])
            assert same if name in synced_now else (not same or step[0][name].dim() == 1), name
    assert not torch.equal(step1[0]["layers.2.moe.expert_bias"], step1[1]["layers.2.moe.expert_bias"])
    for name, step in zip(BIASES, (step1, step2, step2), strict=True):  # after their syncs
        assert torch.equal(step[0][f"diloco.anchor.{name}"], step[0][name])
        assert f"diloco.momentum.{name}" not in step[0]
    records = [json.loads(line) for line in (diloco[0] / "metrics.jsonl").read_text().splitlines()]
    assert [r["ft/replica_groups"] for r in records] == [2, 2] and records[1]["ft/dropped_syncs"] == 0
    # rank 0 logs: at step 2 its stage holds none of the fragment, so its norm is stage 1's, summed over the stages
    assert all(r["ft/outer_grad_norm"] > 0 for r in records)


class Routed(torch.nn.Module):
    """A block with a moving persistent buffer (as an MoE layer's `expert_bias`), a non-persistent one and an integer
    one."""

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(4, 4)
        self.register_buffer("bias", torch.zeros(3), persistent=True)
        self.register_buffer("counts", torch.zeros(3), persistent=False)
        self.register_buffer("steps", torch.zeros((), dtype=torch.long), persistent=True)  # not floating: kept


def test_diloco_syncs_a_models_persistent_buffers_to_their_mean_without_momentum():
    """The buffers' anchors take local SGD's step (their mean with the peer, which the stand-in all-reduce keeps at
    the anchors), in their block's fragment, while the parameters take the Nesterov outer step exactly as without
    buffers; the outer gradient's norm is the parameters'."""
    from titan_core.diloco import DiLoCo

    def model_with_buffers():
        model = tiny_blocks()
        model.layers = torch.nn.ModuleList([Routed(), Routed()])
        torch.manual_seed(1)
        model.layers.apply(lambda m: m.reset_parameters() if isinstance(m, torch.nn.Linear) else None)
        return model

    model, plain_params = model_with_buffers(), model_with_buffers()
    assert [name for name, _ in synced_buffers([model])] == ["layers.0.bias", "layers.1.bias"]
    names = [n for n, _ in model.named_parameters()] + ["layers.0.bias", "layers.1.bias"]
    fragments = model_fragments(names, "layers", 2)
    assert "layers.0.bias" in fragments[0] and "layers.1.bias" in fragments[1]
    outer = DiLoCo([model], FakeGroups(), sync_steps=2, outer_lr=OUTER_LR, outer_momentum=OUTER_MOMENTUM,
                   fragments=fragments)
    # the parameters alone: a model whose buffers DiLoCo does not see (made non-persistent)
    for block in plain_params.layers:
        block._non_persistent_buffers_set.add("bias")
    plain = DiLoCo([plain_params], FakeGroups(), sync_steps=2, outer_lr=OUTER_LR, outer_momentum=OUTER_MOMENTUM,
                   fragments=model_fragments([n for n, _ in plain_params.named_parameters()], "layers", 2))
    start = {f"layers.{i}.bias": torch.zeros(3) for i in (0, 1)}
    for step in (1, 2):
        for m in (model, plain_params):
            inner_step(m, step)
        with torch.no_grad():
            for i, block in enumerate(model.layers):
                block.bias.add_(torch.tensor([1.0, -2.0, 0.5]) * (step + i))
                block.counts.fill_(step)
        local = {f"layers.{i}.bias": block.bias.clone() for i, block in enumerate(model.layers)}
        outer.advance(step)
        plain.advance(step)
        synced = f"layers.{step - 1}.bias"  # fragment 0 after step 1, fragment 1 after step 2
        mean = (start[synced] + local[synced]) / 2  # with the peer that stayed at the anchor
        torch.testing.assert_close(outer.anchors[synced], mean, rtol=0, atol=1e-7)
        assert torch.equal(dict(model.named_buffers())[synced], outer.anchors[synced])
        for name, p in model.named_parameters():
            assert torch.equal(p, dict(plain_params.named_parameters())[name]), name
        assert outer.metrics()["ft/outer_grad_norm"] == pytest.approx(plain.metrics()["ft/outer_grad_norm"], rel=1e-7)
    assert all(block.counts.eq(2).all() and block.steps.item() == 0 for block in model.layers)  # not synced
    state = outer.state_dict()
    assert "anchor.layers.1.bias" in state and "momentum.layers.1.bias" not in state
    assert "momentum.layers.1.proj.weight" in state
