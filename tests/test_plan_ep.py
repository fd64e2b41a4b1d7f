"""`titan plan` with expert parallel: the all-to-all cost by hand, the EP degrees the rules allow, the lower
bound against the estimate on EP layouts, the search against brute force on a small MoE, DeepSeek-V3 671B on
256 x 80 GB (an EP layout fits; without EP only where TP splits the experts), dense plans unchanged, and the ep
column of the table; the TP ranks joining expert parallel (etp = 1) by hand and in the search."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
from typer.testing import CliRunner

from titan_cli.main import app
from titan_core.config import ConfigError, load_config
from titan_core.memory.analytic import estimate_analytic
from titan_core.memory.budget import usable_bytes
from titan_core.memory.expert_cost import (
    ALL_TO_ALLS_PER_LAYER,
    MoEWork,
    all_to_all_seconds,
    ep_group_strides,
    members_per_node,
)
from titan_core.memory.plan import SIMPLICITY_MARGIN, PlanRequest, layout_config, prepare_plan, rank_key, search
from titan_core.memory.plan_bounds import memory_lower_bound
from titan_core.memory.plan_model import block_sizes
from titan_core.memory.plan_report import render_plan
from titan_core.memory.plan_space import (
    candidate_layouts,
    expert_degrees,
    joined_expert_degrees,
    layout_overrides,
    refuse_by_rule,
    refuse_expert_parallel,
)
from titan_core.memory.step_cost import Cluster, Layout, Workload, estimate_step_cost
from titan_core.memory.activations import ActivationLayout
from titan_core.memory.eager_saved import measure_eager
from titan_models import get_model_args, get_model_spec
from titan_parallel import ParallelDims

GiB = 2**30
SCHEDULES = ("1F1B", "Interleaved1F1B", "ZBVZeroBubble")
DSV3 = ("--model.name", "deepseek_v3", "--model.flavor", "671B")
DEBUG_MOE = ("--model.name", "deepseek_v3", "--model.flavor", "debugmodel")  # 8 experts, top 2, 4 blocks


def _671b(expert_parallel: bool, top: int = 3):
    # DeepSeek-V3's pretraining sequence (4096) and 4M tokens per step; the default config (eager, bf16).
    return search(prepare_plan(PlanRequest(None, DSV3, gpus=256, gpus_per_node=8, gpu_memory="80GiB", seq_len=4096,
                                           global_batch=1024, top=top, expert_parallel=expert_parallel)))


@pytest.fixture(scope="module")
def plan_671b():
    return _671b(expert_parallel=True, top=8)


# The cost model, by hand.

# 10 MoE blocks of width 1000, top 4 of 64 experts; one 1000-token sequence per data-parallel rank on 64 GPUs.
MOE_WORK = Workload(n_params=10**10, n_layers=10, dim=1000, kv_dim=250, flops_per_token=6e9,
                    op_recompute_flops_per_token=1e9, seq_len=1000, global_batch=64,
                    moe=MoEWork(expert_params=9 * 10**9, num_experts=64, top_k=4, layers=10))
CLUSTER = Cluster(gpus=64, gpus_per_node=8, peak_flops=1e15, intra_node_bw=100e9, inter_node_bw=10e9, mfu=0.5)


def test_all_to_all_by_hand():
    # 8 ranks in one node, 8 MB each: 7/8 of it leaves the rank, over NVLink.
    assert all_to_all_seconds(8, 8, 8e6, 100e9, 10e9) == pytest.approx(7 / 8 * 8e6 / 100e9)
    # 16 ranks over two nodes: 7/16 over NVLink and, at the same time, 8/16 over the NIC; the NIC is slower.
    assert all_to_all_seconds(16, 8, 8e6, 100e9, 10e9) == pytest.approx(8 / 16 * 8e6 / 10e9)
    assert all_to_all_seconds(1, 1, 8e6, 100e9, 10e9) == 0.0
    # Ranks of a group on one node: all of a group inside a node; 8 / stride of a group spanning whole nodes.
    assert members_per_node(1, 8, 8) == 8 and members_per_node(1, 32, 8) == 8 and members_per_node(2, 8, 8) == 4
    assert members_per_node(16, 4, 8) == 1


def test_ep_term_by_hand_and_it_grows_when_the_group_spans_nodes():
    def ep_seconds(ep: int, tp: int = 1, ac: str = "none") -> tuple[float, str]:
        t = Layout(dp_shard=64 // tp, tp=tp, ep=ep, local_batch=64 * tp // 64, microbatch=64 * tp // 64, ac=ac)
        cost = estimate_step_cost(t, MOE_WORK, CLUSTER)
        return cost.terms["ep"], cost.notes.get("ep", "")

    # Each rank routes 1000 tokens x 4 slots of 1000 bf16 values: 8 MB per all-to-all; dispatch and combine,
    # forward and backward (4), in each of 10 MoE layers.
    one_node = 4 * 10 * 7 / 8 * 8e6 / 100e9
    assert ep_seconds(8) == (pytest.approx(one_node), "NVLink")
    assert ep_seconds(16) == (pytest.approx(4 * 10 * 8 / 16 * 8e6 / 10e9), "network")
    spanning = [ep_seconds(ep)[0] for ep in (8, 16, 32, 64)]
    assert spanning == sorted(spanning) and spanning[1] > 5 * spanning[0]
    # AC's recomputed forward exchanges again (selective "op" keeps no all-to-all output).
    assert ep_seconds(8, ac="full")[0] == pytest.approx(ALL_TO_ALLS_PER_LAYER["full"] / 4 * one_node)
    assert ep_seconds(8, ac="op")[0] == pytest.approx(6 / 4 * one_node)
    # tp = 2 puts an ep group's 8 ranks 2 apart: over two nodes; the MoE input is the TP group's whole sequence
    # shard (2 sequences per data-parallel rank now), replicated on both TP ranks.
    seconds, link = ep_seconds(8, tp=2)
    assert link == "network"
    assert seconds == pytest.approx(4 * 10 * max(3 / 8 * 16e6 / 100e9, 4 / 8 * 16e6 / 10e9))
    assert ep_seconds(1)[0] == 0.0


def test_tp_splits_the_experts_and_ep_shrinks_fsdps_expert_traffic():
    # tp = 2 splits each expert's hidden dim (TPStyle.MOE_INPUT): the MoE's FLOPs divide like the rest, no term of
    # their own, and each rank gathers half the experts' weights.
    tp2 = estimate_step_cost(Layout(dp_shard=32, tp=2, local_batch=2, microbatch=2), MOE_WORK, CLUSTER)
    assert "moe_tp" not in tp2.terms
    assert tp2.terms["compute"] == pytest.approx(estimate_step_cost(Layout(dp_shard=64), MOE_WORK, CLUSTER).terms["compute"])
    # FSDP gathers E / ep experts per rank: the raw traffic (beyond the compute, which it exceeds here) shrinks.
    fsdp = [estimate_step_cost(Layout(dp_shard=64, ep=ep), MOE_WORK, CLUSTER).terms["fsdp"] for ep in (1, 8, 64)]
    assert fsdp[0] > fsdp[1] > fsdp[2]


def test_tp_ranks_joining_ep_by_hand():
    # At the same expert memory per rank on 64 GPUs at tp 2: EP 8 splitting each expert over TP, against EP 16 over
    # the TP ranks too (etp = 1): E / 16 experts per rank either way, FSDP-sharded over the same 4 ranks.
    def cost(ep: int, spans: bool, work: Workload = MOE_WORK):
        t = Layout(dp_shard=32, tp=2, ep=ep, ep_spans_tp=spans, local_batch=2, microbatch=2)
        return t, estimate_step_cost(t, work, CLUSTER)

    (split, s), (joined, j) = cost(8, False), cost(16, True)
    assert (split.expert_split, split.expert_holders) == (16, 4) and (joined.expert_split, joined.expert_holders) == (16, 4)
    assert ep_group_strides(split) == {"ep": (2, 8), "experts": (16, 4)}
    assert ep_group_strides(joined) == {"ep": (1, 16), "experts": (16, 4)}  # 16 consecutive ranks: two nodes
    # The all-to-all: split, each TP rank sends every slot of the TP group's 2 sequences (2000 tokens x 4 slots x
    # 1000 bf16 values = 16 MB) over 8 ranks 2 apart (4 per node); joined, its own 1000 tokens' (8 MB) over 16.
    assert s.terms["ep"] == pytest.approx(4 * 10 * max(3 / 8 * 16e6 / 100e9, 4 / 8 * 16e6 / 10e9))
    assert j.terms["ep"] == pytest.approx(4 * 10 * max(7 / 16 * 8e6 / 100e9, 8 / 16 * 8e6 / 10e9))
    # FSDP gathers as many expert weights per rank; without shared experts a joined MoE layer takes no TP collective
    # (half its block's), with them it keeps them all.
    assert j.terms["fsdp"] == pytest.approx(s.terms["fsdp"]) and j.terms["compute"] == s.terms["compute"]
    assert j.terms["tp"] == pytest.approx(s.terms["tp"] / 2)
    shared = dataclasses.replace(MOE_WORK, moe=dataclasses.replace(MOE_WORK.moe, shared=True))
    assert cost(16, True, shared)[1].terms["tp"] == pytest.approx(s.terms["tp"])
    # What it writes for `titan train`, and how it reads.
    assert joined.describe() == "dp_shard=32 tp=2 ep=16 etp=1"
    overrides = layout_overrides(joined, 64)
    assert overrides[overrides.index("--parallelism.expert_tensor_parallel_degree") + 1] == "1"


# The degrees and the rules.

def test_ep_degrees_are_those_the_job_rules_accept():
    assert expert_degrees(8, 1, 0) == [1]  # a dense model
    assert expert_degrees(8, 2, 256) == [1, 2, 4, 8, 16]  # cp x a divisor of dp_shard
    assert expert_degrees(16, 1, 8) == [1, 2, 4, 8]  # ... that divides the experts
    # With the TP ranks joining: cp x tp x a divisor of dp_shard that divides the experts; none without TP.
    assert joined_expert_degrees(8, 2, 2, 256) == [4, 8, 16, 32] and joined_expert_degrees(8, 1, 4, 8) == [4, 8]
    assert joined_expert_degrees(8, 1, 1, 256) == [] and joined_expert_degrees(8, 1, 2, 0) == []
    cfg = load_config(None, list(DEBUG_MOE))
    for t in candidate_layouts(8, 8, 8192, 8, SCHEDULES, num_experts=8):
        inner = t.cp * (t.tp if t.ep_spans_tp else 1)
        assert t.ep == 1 or (t.ep % inner == 0 and t.dp_shard % (t.ep // inner) == 0 and 8 % t.ep == 0)
        etp = 1 if t.ep_spans_tp else -1
        ParallelDims(t.dp_replicate, t.dp_shard, t.cp, t.tp, t.pp, world_size=8, ep=t.ep, etp=etp)  # the job's rule
        assert refuse_expert_parallel(t, cfg) is None
    layouts = list(candidate_layouts(8, 8, 8192, 8, SCHEDULES, num_experts=8))
    assert {t.ep for t in layouts} == {1, 2, 4, 8}
    assert {(t.tp, t.ep) for t in layouts if t.ep_spans_tp} >= {(2, 2), (2, 8), (4, 4), (8, 8)}
    # What the rules refuse is one line naming the key: 3 does not divide 8 experts; ep 2 is not a multiple of cp 4.
    for bad in (Layout(dp_shard=6, ep=3), Layout(dp_shard=2, cp=4, ep=2)):
        message = refuse_expert_parallel(bad, cfg)
        assert message is not None and "\n" not in message and "parallelism.expert_parallel_degree" in message
    message = refuse_expert_parallel(Layout(dp_shard=2, cp=2, tp=2, ep=2, ep_spans_tp=True), cfg)  # not cp x tp x d
    assert message is not None and "parallelism.expert_tensor_parallel_degree" in message


def test_lower_bound_never_exceeds_the_estimate_on_671b_layouts():
    plan = prepare_plan(PlanRequest(None, DSV3, gpus=256, seq_len=4096, global_batch=1024))
    spec, args = get_model_spec("deepseek_v3"), get_model_args("deepseek_v3", "671B")
    sizes = block_sizes(plan.base)
    layouts = list(candidate_layouts(256, 8, 4096, 1024, SCHEDULES, num_experts=256))[::4999]  # ~41 layouts, as [::2999] gave before the joined ones
    checked = []
    for t in layouts:
        if refuse_by_rule(t, args, plan.base, 4096) or refuse_expert_parallel(t, plan.base):
            continue
        act = measure_eager(spec, args, ActivationLayout(  # as the search asks
            compute_bytes=2, tp=t.tp, cp=t.cp, cp_rotate_method=plan.workload.cp_rotate_method, seq_len=4096,
            device_type="cuda", loss_parallel=not plan.base.parallelism.disable_loss_parallel,
            ep_spans_tp=t.ep_spans_tp)).act
        peak = estimate_analytic(layout_config(plan, t), 256, device_type="cuda").peak
        assert memory_lower_bound(t, plan.workload, act, sizes) <= peak, t
        checked.append(t)
    assert len(checked) >= 25
    assert {t.ep > 1 for t in checked} == {True, False} and {t.pp > 1 for t in checked} == {True, False}
    assert {t.ep_spans_tp for t in checked} == {True, False}


def test_search_finds_what_brute_force_finds_on_a_moe_model():
    # DeepSeek-V3 debugmodel on 4 GPUs (2 per node) of 2.6 GiB: most layouts do not fit, some with EP do.
    request = PlanRequest(None, DEBUG_MOE, gpus=4, gpus_per_node=2, gpu_memory="2.6GiB", seq_len=2048,
                          global_batch=16, top=4)
    plan = search(prepare_plan(request))
    best: dict[tuple, float] = {}  # the fastest fitting layout of each table row
    estimated = 0
    for t in candidate_layouts(4, 2, 2048, 16, SCHEDULES, num_experts=8):
        try:
            peak = estimate_analytic(layout_config(plan, t), 4, device_type="cuda").peak
        except ConfigError:
            continue
        estimated += 1
        if peak <= plan.usable:
            row = (t.dp_replicate, t.dp_shard, t.cp, t.tp, t.pp, t.ep, t.ep_spans_tp, t.schedule, t.ac, t.offload)
            dims = (t.tp > 1) + (t.cp > 1) + (t.pp > 1) + (t.ep > 1)
            seconds = estimate_step_cost(t, plan.workload, plan.cluster).seconds * (1 + SIMPLICITY_MARGIN * dims)
            best[row] = min(best.get(row, math.inf), seconds)
    assert any(row[5] > 1 for row in best)  # EP layouts fit
    assert 0 < plan.counts["estimated"] < estimated  # it did not estimate everything
    assert [rank_key(r)[0] for r in plan.fits] == pytest.approx(sorted(best.values())[:4])


# DeepSeek-V3 671B on 256 x 80 GB.

def test_671b_finds_an_expert_parallel_layout_that_fits(plan_671b):
    assert plan_671b.fits, render_plan(plan_671b)
    # Tensor parallel splits the experts too, so TP x PP layouts rank first (2026-11-29: dp_shard 2, tp 4, pp 32,
    # 17.7 s); the first with EP (dp_shard 8, cp 2, pp 16, ep 8) within 5% of it.
    best = next(r.layout for r in plan_671b.fits if r.layout.ep > 1)
    assert best.dp_replicate * best.dp_shard * best.cp * best.tp * best.pp == 256
    assert 256 % best.ep == 0 and best.ep % best.cp == 0 and best.dp_shard % (best.ep // best.cp) == 0
    # The layout's config passes every rule of the job check and its estimate fits 80 GiB less the CUDA context
    # and the allocator's margin, counted here from the bytes.
    cfg = layout_config(plan_671b, best)
    assert cfg.parallelism.expert_parallel_degree == best.ep
    assert estimate_analytic(cfg, 256, device_type="cuda").peak <= usable_bytes(80 * GiB)


def test_671b_without_expert_parallel_fits_only_where_tp_splits_the_experts(plan_671b):
    # Without EP each MoE block FSDP gathers holds all 256 experts: 11.3e9 parameters, 22.5 GB in bf16, at tp 1;
    # tensor parallel splits their hidden dim, so the best layout fits at tp 4 and its tp 1 twin does not.
    best = plan_671b.fits[0].layout
    assert best.ep == 1 and best.tp > 1
    twin = dataclasses.replace(best, dp_shard=best.dp_shard * best.tp, tp=1, local_batch=best.local_batch // best.tp)
    for t, fits in ((best, True), (twin, False)):
        peak = estimate_analytic(layout_config(plan_671b, t), 256, device_type="cuda").peak
        assert (peak <= plan_671b.usable) is fits, (t, peak / GiB)


def test_dense_plan_is_unchanged():
    # Llama 3 8B on 8 GPUs of 80 GiB, eager: the planner before expert parallel chose FSDP over the 8 GPUs, local
    # batch 1, no AC (computed on the code before this change); no EP degree exists for a dense model.
    request = PlanRequest("llama3_8b", ("--compile.enable", "false"), gpus=8, gpu_memory="80GiB", seq_len=8192,
                          global_batch=8, top=3)
    plan = search(prepare_plan(request))
    t = plan.fits[0].layout
    assert (t.dp_replicate, t.dp_shard, t.cp, t.tp, t.pp, t.ep) == (1, 8, 1, 1, 1, 1)
    assert (t.local_batch, t.accum, t.ac, t.offload) == (1, 1, "none", False)
    without = search(prepare_plan(dataclasses.replace(request, expert_parallel=False)))
    assert [(r.layout, r.peak, r.cost.seconds) for r in without.fits] == [
        (r.layout, r.peak, r.cost.seconds) for r in plan.fits
    ]
    assert "ep" not in render_plan(plan).splitlines()[2].split()  # the dense table keeps its columns


# The command.

def test_table_and_json_show_ep():
    args = ["plan", *DEBUG_MOE, "--gpus", "4", "--gpus-per-node", "2", "--gpu-memory", "2.6GiB", "--seq-len", "2048",
            "--global-batch-size", "16", "--top", "4"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    header = next(line.split() for line in lines if line.startswith("#  dp_rep"))
    assert header[:8] == ["#", "dp_rep", "dp_shard", "cp", "tp", "pp", "ep", "etp"]
    rows = [line.split() for line in lines if line[:1].isdigit()]
    assert rows and all(math.prod(int(x) for x in row[1:6]) == 4 for row in rows)
    data = json.loads(CliRunner().invoke(app, [*args, "--json"]).stdout)
    assert [r["ep"] for r in data["layouts"]] == [int(row[6]) for row in rows]
    assert [r["etp"] for r in data["layouts"]] == [int(row[7]) for row in rows]
    off = json.loads(CliRunner().invoke(app, [*args, "--json", "--no-expert-parallel"]).stdout)
    assert off["layouts"] and all(r["ep"] == 1 for r in off["layouts"])


def test_a_search_spread_over_processes_measures_what_one_process_measures(monkeypatch):
    """`workers=2`: the layouts' measurements run in spawned processes (the searching process measures none
    itself), each equal to the same layout measured here, and the plan is the same."""
    from titan_core.memory import eager_saved

    request = PlanRequest(None, DEBUG_MOE, gpus=4, gpus_per_node=2, gpu_memory="2.6GiB", seq_len=512,
                          global_batch=16, top=4, workers=2)
    before = set(eager_saved._CACHE)
    measure_here = eager_saved._measure
    monkeypatch.setattr(eager_saved, "_measure", lambda *_: pytest.fail("measured in the searching process"))
    spread = search(prepare_plan(request))
    measured = {key: eager_saved._CACHE.pop(key) for key in set(eager_saved._CACHE) - before}
    assert len(measured) >= 4 and {layout.ep_spans_tp for _, _, layout in measured} == {True, False}
    monkeypatch.setattr(eager_saved, "_measure", measure_here)
    spec, args = get_model_spec("deepseek_v3"), get_model_args("deepseek_v3", "debugmodel")
    for (_, _, layout), result in measured.items():
        assert eager_saved.measure_eager(spec, args, layout) == result, layout
    here = search(prepare_plan(dataclasses.replace(request, workers=1)))
    assert spread.fits and [(r.layout, r.peak) for r in here.fits] == [(r.layout, r.peak) for r in spread.fits]


def test_a_compiled_moe_plan_searches_memory_budgets_measured_on_each_kind_of_block():
    """The compiled debug DeepSeek-V3 (1 dense and 3 MoE blocks) on one GPU: what each memory budget recomputes is
    measured on the blocks compiled around their eager experts, the dense and the MoE kind apart, each counted as
    many times as the model has it, and grows as the budget falls; the search then estimates and ranks layouts at each
    budget, each no faster than the same layout without AC and keeping no more."""
    import torch

    from titan_core.job.meta_model import build_meta_model
    from titan_core.memory.compiled_parallel import Split, parallel_block_backward_flops
    from titan_core.memory.plan_model import budget_recompute

    job = (*DEBUG_MOE, "--compile.enable", "true", "--training.seq_len", "256")
    rows = {b: f for _, b, f in budget_recompute(load_config(None, list(job)))}
    spec, args = get_model_spec("deepseek_v3"), get_model_args("deepseek_v3", "debugmodel")
    meta = build_meta_model(spec, args)

    def extra(index: int, budget: float) -> float:  # what a budget adds to one block's backward, one sequence (bf16)
        flops = {b: parallel_block_backward_flops(spec, meta, split=Split(), dim=args.dim, seq_len=256,
                                                  dtype=torch.bfloat16, memory_budget=b, index=index, target="cuda")
                 for b in (None, budget)}  # fmt: skip
        return max(0.0, flops[budget] - flops[None])

    assert args.n_dense_layers == 1 and args.n_layers == 4
    for budget, per_token in rows.items():
        assert per_token == pytest.approx((extra(0, budget) + 3 * extra(1, budget)) / 256), budget
    assert rows[0.25] >= rows[0.5] >= rows[0.75] and rows[0.25] > 0, rows
    plan = search(prepare_plan(PlanRequest(None, job, gpus=1, gpus_per_node=1, gpu_memory="8GiB", global_batch=2,
                                           top=100)))  # fmt: skip
    fits = {(r.layout.local_batch, r.layout.ac_name): r for r in plan.fits}
    budgeted = [key for key in fits if key[1].startswith("budget")]
    assert {key[1] for key in budgeted} == {"budget 0.75", "budget 0.5", "budget 0.25"}, sorted(fits)
    for key in budgeted:
        assert fits[key].cost.seconds >= fits[(key[0], "none")].cost.seconds
        assert fits[key].peak <= fits[(key[0], "none")].peak
