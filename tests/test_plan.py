"""`titan plan`: the cost model against hand-derived numbers, the search against brute force and against
torchtitan's published layouts, the command's table / JSON / errors, and an emitted config that `titan train`
runs unchanged."""

from __future__ import annotations

import dataclasses
import json
import math
import shlex
import sys
from types import SimpleNamespace

import pytest
from typer.testing import CliRunner

from titan_cli.main import app
from titan_core.config import ConfigError, load_config
from titan_core.memory.analytic import estimate_analytic
from titan_core.memory.plan import (
    SIMPLICITY_MARGIN, PlanRequest, Ranked, layout_config, prepare_plan, rank_key, search,
)
from titan_core.memory.plan_bounds import memory_lower_bound
from titan_core.memory.plan_space import candidate_layouts, refuse_by_rule
from titan_core.memory.step_cost import (
    FSDP_OVERLAP, TP_EXPOSED, ZERO_BUBBLE_RESIDUAL, Cluster, Layout, Workload, bubble_fraction, estimate_step_cost,
    group_strides, muon_exchange_seconds, ring_seconds, within_node,
)
from titan_run import REPO, read_metrics, titan_env
import warm_python

runner = CliRunner()
GiB = 2**30
SCHEDULES = ("1F1B", "Interleaved1F1B", "ZBVZeroBubble")


def _plan(*args: str):
    return runner.invoke(app, ["plan", *args])


def _searched(config: str, gpus: int, global_batch: int, seq_len: int = 8192, **kw):
    return search(prepare_plan(PlanRequest(config, gpus=gpus, gpus_per_node=8, gpu_memory="80GiB", seq_len=seq_len,
                                           global_batch=global_batch, **kw)))


# The cost model, by hand.

def test_ring_collective_moves_n_minus_1_over_n_of_the_buffer():
    # 8 ranks gather an 8 GB buffer: each receives the 7 GB it lacks; at 400 GB/s that is 17.5 ms.
    assert ring_seconds(8, 8e9, 400e9) == pytest.approx(0.0175)
    assert ring_seconds(2, 8e9, 400e9) == pytest.approx(0.010)
    assert ring_seconds(1, 8e9, 400e9) == 0.0


def test_bubble_fraction_per_schedule():
    # pp = 4, m = 8 micro-batches: a flush schedule fills and drains 3 slots out of 8 + 3.
    assert bubble_fraction("1F1B", 4, 8) == pytest.approx(3 / 11)
    assert bubble_fraction("GPipe", 4, 8) == pytest.approx(3 / 11)
    # Interleaving v = 2 stages per rank: 3 idle slots out of 2 x 8 + 3.
    assert bubble_fraction("Interleaved1F1B", 4, 8, 2) == pytest.approx(3 / 19)
    # Zero-bubble schedules leave a stated residue of 1F1B's bubble.
    assert bubble_fraction("ZBVZeroBubble", 4, 8, 2) == pytest.approx(ZERO_BUBBLE_RESIDUAL * 3 / 11)
    assert bubble_fraction("1F1B", 1, 8) == 0.0


def test_group_strides_and_which_groups_stay_in_a_node():
    # 128 ranks on the mesh (pp, dp_replicate, dp_shard, cp, tp) = (2, 2, 4, 2, 4), tp innermost.
    t = Layout(dp_replicate=2, dp_shard=4, cp=2, tp=4, pp=2)
    assert group_strides(t) == {"tp": (1, 4), "cp": (4, 2), "fsdp": (4, 8), "replicate": (32, 2), "pp": (64, 2),
                                "muon": (1, 32)}  # a block's matrix: split over dp_shard 4 x cp 2 x tp 4
    assert within_node(1, 4, 8)  # ranks 0-3
    assert within_node(4, 2, 8)  # ranks 0 and 4
    assert not within_node(4, 8, 8)  # ranks 0, 4, ..., 28: four nodes
    assert not within_node(1, 3, 8)  # ranks 6-8 straddle two nodes
    assert not within_node(1, 16, 8)
    assert within_node(64, 1, 8)  # a group of one is always local


# A model small enough to cost by hand: 1e9 parameters, 10 blocks of width 1000, 6 GFLOP per token.
WORK = Workload(n_params=10**9, n_layers=10, dim=1000, kv_dim=250, flops_per_token=6e9,
                op_recompute_flops_per_token=1e9, seq_len=1000, global_batch=64)
CLUSTER = Cluster(gpus=8, gpus_per_node=8, peak_flops=1e15, intra_node_bw=100e9, inter_node_bw=10e9, mfu=0.5)


def test_step_cost_terms_by_hand_fsdp_and_tp():
    t = Layout(dp_shard=4, tp=2, local_batch=16, microbatch=16)  # 16 sequences per data-parallel rank, no accumulation
    terms = estimate_step_cost(t, WORK, CLUSTER).terms
    # compute: 6e9 FLOP x 64,000 tokens / 8 GPUs / (1e15 x 0.5) = 0.096 s
    assert terms["compute"] == pytest.approx(0.096)
    assert terms["recompute"] == 0
    # tp: 8 collectives per block x 10 blocks, each moving 1/2 of 16 seq x 1000 tok x 1000 dim x 2 B = 32 MB
    # at 100 GB/s
    assert terms["tp"] == pytest.approx(TP_EXPOSED * 8 * 10 * 1.6e-4)
    # fsdp over 4 ranks of the 5e8 parameters a tp rank holds: 2 all-gathers of 1 GB (bf16) and a reduce-scatter
    # of 2 GB (fp32), each 3/4 of it at 100 GB/s = 7.5 + 7.5 + 15 ms; the compute hides FSDP_OVERLAP of it.
    assert terms["fsdp"] == pytest.approx((1 - FSDP_OVERLAP) * 0.030)
    # AdamW: 28 B for each of the 1.25e8 parameters of a shard at 3.35 TB/s
    assert terms["optimizer"] == pytest.approx(28 * 1.25e8 / 3.35e12)
    assert terms["bubble"] == terms["pp_p2p"] == terms["cp"] == terms["offload"] == 0


def test_muon_step_and_states_by_hand():
    """Under Muon the optimizer term adds the Newton-Schulz matmuls, spread over the GPUs but the HSDP replicas,
    and the two all-to-alls that bring each matrix to its owner and back; each parameter Muon steps holds one
    fp32 momentum where AdamW holds two moments."""
    import dataclasses

    from titan_core.memory.plan_bounds import model_states_per_rank
    from titan_core.memory.plan_model import newton_schulz_flops

    assert newton_schulz_flops((4096, 1024), 5) == 5 * (4 * 1024**2 * 4096 + 2 * 1024**3)  # m = 1024 <= n = 4096
    assert newton_schulz_flops((8, 64, 128), 5) == 8 * newton_schulz_flops((128, 64), 5)  # 8 experts, transposed
    muon = dataclasses.replace(WORK, muon_params=8 * 10**8, muon_ns_flops=4e15)  # 8e8 of the 1e9 parameters
    # the exchange, in bf16 over the dp_shard x tp ranks splitting each matrix (NVLink, 100 GB/s), twice:
    # FSDP 4 x TP 2: each rank sends 7/8 of its 8e8 / 8 elements = 7/8 x 2e8 B -> 1.75 ms, x 2
    # HSDP 2 x 2, TP 2: each replica's 4 ranks, 3/4 of 8e8 / 4 elements = 3/4 x 4e8 B -> 3 ms, x 2
    for t, sharing, exchange in ((Layout(dp_shard=4, tp=2, local_batch=16, microbatch=16), 8, 3.5e-3),
                                 (Layout(dp_replicate=2, dp_shard=2, tp=2, local_batch=16, microbatch=16), 4, 6e-3)):
        terms = estimate_step_cost(t, muon, CLUSTER).terms
        shard = 1e9 / (t.dp_shard * t.tp)  # HSDP: each replica shards all of it over its dp_shard x tp
        elementwise = (0.2 * 28 + 0.8 * 36) * shard / 3.35e12
        assert terms["optimizer"] == pytest.approx(elementwise + 4e15 / sharing / (1e15 * 0.5) + exchange), t
        # states: 16 B per AdamW parameter and 12 per Muon one, over dp_shard x tp
        adamw, states = model_states_per_rank(t, WORK), model_states_per_rank(t, muon)
        assert adamw == pytest.approx(16e9 / (t.dp_shard * t.tp))
        assert states == pytest.approx((16 * 2e8 + 12 * 8e8) / (t.dp_shard * t.tp))
    # a MoE model: Muon steps its 4e8 routed experts' parameters too, which TP splits by hidden dim as the rest
    from titan_core.memory.expert_cost import MoEWork

    moe = dataclasses.replace(muon, moe=MoEWork(expert_params=4 * 10**8, num_experts=8, top_k=2, layers=10))
    t = Layout(dp_shard=4, tp=2, local_batch=16, microbatch=16)
    assert model_states_per_rank(t, moe) == pytest.approx((16 * 2e8 + 12 * 8e8) / 8)
    # its exchange: the 4e8 block matrices over 8 ranks (7/8 x 1e8 B -> 0.875 ms), twice. FSDP alone splits the
    # stacked experts by expert, TP by hidden dim: each rank's 4e8 / 8 expert elements go half to its TP peer
    # (1/2 x 1e8 B -> 0.5 ms). EP 2: the 2 ranks holding the same experts split them by rows too, groups of
    # 2 x 2 (3/4 x 1e8 B -> 0.75 ms); EP 4: each rank its own experts, only TP's halves move.
    # The experts' pieces travel over the TP group alone, or over the "experts" group under EP 2.
    for layout, experts, groups in ((t, 0.5e-3, {"muon", "tp"}), (dataclasses.replace(t, ep=2), 0.75e-3,
                                     {"muon", "experts"}), (dataclasses.replace(t, ep=4), 0.5e-3, {"muon", "tp"})):
        used = set()
        seconds = muon_exchange_seconds(layout, moe, lambda group, term: used.add(group) or 100e9)
        assert seconds == pytest.approx(2 * (0.875e-3 + experts)) and used == groups, layout
    assert muon_exchange_seconds(t, WORK, lambda group, term: 100e9) == 0  # AdamW
    # 8 one-GPU nodes: the block matrices' group leaves the node
    near = estimate_step_cost(t, muon, CLUSTER).terms["optimizer"]  # t: FSDP 4 x TP 2, as above
    far = estimate_step_cost(t, muon, dataclasses.replace(CLUSTER, gpus_per_node=1)).terms["optimizer"]
    assert far - near == pytest.approx(3.5e-3 * 9)  # the same exchange at 10 GB/s rather than 100


def test_muon_plan_counts_its_matrices_and_bounds_below_its_estimate():
    """`titan plan` under Muon: the workload's Muon parameters are the blocks' matrices (Llama 3 8B: all but the
    embedding, the output projection and the norms), and the memory lower bound stays below the estimate of each
    layout, and below AdamW's bound where the model states count."""
    import dataclasses

    from titan_core.memory.activations import ActivationLayout
    from titan_core.memory.eager_saved import measure_eager
    from titan_models import get_model_args, get_model_spec

    overrides = ("--optimizer.name", "Muon", "--compile.enable", "false")
    plan = prepare_plan(PlanRequest("llama3_8b", overrides, gpus=8, seq_len=1024, global_batch=8))
    spec, args = get_model_spec("llama3"), get_model_args("llama3", plan.base.model.flavor)
    w = plan.workload
    assert w.muon_params == w.n_params - 2 * args.vocab_size * args.dim - (2 * args.n_layers + 1) * args.dim
    assert w.muon_ns_flops > 0
    adamw = dataclasses.replace(w, muon_params=0)
    one, two = (spec.count_params(dataclasses.replace(args, n_layers=n)) for n in (1, 2))
    layouts = [t for t in candidate_layouts(8, 8, 1024, 8, SCHEDULES) if refuse_by_rule(t, args, plan.base, 1024) is None]
    for t in layouts[:: len(layouts) // 12]:
        act = measure_eager(spec, args, ActivationLayout(compute_bytes=2, tp=t.tp, cp=t.cp, seq_len=1024)).act
        peak = estimate_analytic(layout_config(plan, t), 8, device_type="cuda").peak
        bound = memory_lower_bound(t, w, act, two - one)
        assert bound <= peak, t
        assert bound <= memory_lower_bound(t, adamw, act, two - one), t
        if not t.offload:
            assert bound < memory_lower_bound(t, adamw, act, two - one), t


def test_step_cost_terms_by_hand_pipeline_and_full_ac():
    # pp 2 x dp_shard 4: 16 sequences per pipeline in 8 micro-batches of 2.
    t = Layout(dp_shard=4, pp=2, schedule="1F1B", local_batch=16, microbatch=2, ac="full")
    terms = estimate_step_cost(t, WORK, CLUSTER).terms
    assert terms["recompute"] == pytest.approx(0.096 / 3)  # full AC runs the forward (1/3 of the FLOPs) again
    # each of the 8 micro-batches sends (2 x 1000 x 1000 x 2 B = 4 MB) forward and its gradient back: 16 sends
    # at 100 GB/s (pp = 2 x 4 ranks fit one node), half of it exposed
    assert terms["pp_p2p"] == pytest.approx(0.5 * 16 * 4e6 / 100e9)
    # 1F1B idles 1 of 8 + 1 slots: the bubble is 1/8 of the busy time
    busy = terms["compute"] + terms["recompute"] + terms["pp_p2p"]
    assert terms["bubble"] == pytest.approx(busy / 8)


def test_tp_across_nodes_costs_more_than_tp_within_a_node():
    work = prepare_plan(PlanRequest("llama3_70b", gpus=64, seq_len=8192, global_batch=512)).workload
    eight = Cluster(gpus=64, gpus_per_node=8, peak_flops=989e12)
    four = Cluster(gpus=64, gpus_per_node=4, peak_flops=989e12)
    tp8 = Layout(dp_shard=8, tp=8, local_batch=1, microbatch=1, accum=64, ac="full")
    within, across = estimate_step_cost(tp8, work, eight), estimate_step_cost(tp8, work, four)
    assert (within.notes["tp"], across.notes["tp"]) == ("NVLink", "network")
    assert across.seconds > 1.5 * within.seconds
    # tp 16 spans two 8-GPU nodes: slower than tp 8 in one, with the same batch and checkpointing
    tp16 = Layout(dp_shard=4, tp=16, local_batch=2, microbatch=2, accum=64, ac="full")
    assert estimate_step_cost(tp16, work, eight).seconds > within.seconds


def test_search_ranks_tp_across_nodes_below_tp_within_a_node():
    # On 4-GPU nodes, with every layout admitted (a stand-in estimator), tp = 8 crosses nodes and ranks below tp = 4.
    # (Eager: a compiled job's search would first measure its blocks' memory budgets at each TP degree, ~20 s.)
    plan = prepare_plan(PlanRequest("llama3_70b", ("--compile.enable", "false"), gpus=16, gpus_per_node=4,
                                    seq_len=8192, global_batch=32, top=100_000))  # fmt: skip
    search(plan, estimate=lambda cfg, world_size: SimpleNamespace(peak=0, ranks=[]))
    ranks = {tp: next(i for i, r in enumerate(plan.fits) if r.layout.tp == tp) for tp in (4, 8)}
    assert ranks[4] < ranks[8]
    assert all(r.cost.notes["tp"] == "network" for r in plan.fits if r.layout.tp == 8)


# The search.

def test_memory_lower_bound_never_exceeds_the_estimate():
    import dataclasses

    from titan_core.memory.activations import ActivationLayout
    from titan_core.memory.eager_saved import measure_eager
    from titan_models import get_model_args, get_model_spec

    # The 70B's shipped config compiles, so its estimates trace compiled blocks (~3 s each on a 2-core EPYC): a
    # dozen layouts check the compiled bound; the 405B, uncompiled here, checks the eager bound on 25.
    for config, gpus, global_batch, compiled, samples in (("llama3_70b", 64, 512, "true", 12),
                                                          ("llama3_405b", 512, 256, "false", 25)):
        request = PlanRequest(config, overrides=("--compile.enable", compiled), gpus=gpus, seq_len=8192,
                              global_batch=global_batch)
        plan = prepare_plan(request)
        assert plan.base.compile.enable is (compiled == "true")
        spec, args = get_model_spec("llama3"), get_model_args("llama3", plan.base.model.flavor)
        one, two = (spec.count_params(dataclasses.replace(args, n_layers=n)) for n in (1, 2))
        layouts = [t for t in candidate_layouts(gpus, 8, 8192, global_batch, SCHEDULES)
                   if refuse_by_rule(t, args, plan.base, 8192) is None]
        for t in layouts[:: len(layouts) // samples]:
            act = measure_eager(spec, args, ActivationLayout(compute_bytes=2, tp=t.tp, cp=t.cp, seq_len=8192)).act
            peak = estimate_analytic(layout_config(plan, t), gpus, device_type="cuda").peak
            bound = memory_lower_bound(t, plan.workload, act, two - one, compiled=plan.base.compile.enable)
            assert bound <= peak, t


def test_the_plan_reads_the_model_a_run_builds_its_shape_and_a_longer_rope_table():
    """The plan measures the model `titan train` would build: `model.shape` applied, and a RoPE table as long as a
    sequence beyond the flavor's `max_seq_len` (the debug model's 2048; 8192 crashed the blocks' measurement)."""
    request = PlanRequest("llama3_debugmodel", overrides=("--model.shape", "n_layers=3"), gpus=2, gpus_per_node=2,
                          gpu_memory="16GiB", seq_len=8192, global_batch=4, top=3)  # fmt: skip
    plan = search(prepare_plan(request))
    assert plan.workload.n_layers == 3 and plan.workload.seq_len == 8192
    assert plan.fits, plan.counts
    t = plan.fits[0].layout
    assert plan.fits[0].peak == estimate_analytic(layout_config(plan, t), 2, device_type="cuda").peak


def test_search_finds_what_brute_force_finds():
    # 110M on 4 GPUs of 4 GiB: many layouts do not fit, so the lower bound and the skipping rules matter.
    request = PlanRequest("llama3_110m", gpus=4, gpus_per_node=4, gpu_memory="4GiB", seq_len=1024, global_batch=32,
                          top=4)
    plan = search(prepare_plan(request))
    fitting = []
    for t in candidate_layouts(4, 4, 1024, 32, SCHEDULES):
        try:
            peak = estimate_analytic(layout_config(plan, t), 4, device_type="cuda").peak
        except ConfigError:
            continue
        if peak <= plan.usable:
            fitting.append((estimate_step_cost(t, plan.workload, plan.cluster).seconds, t))
    best: dict[tuple, float] = {}  # the fastest fitting layout of each table row
    for seconds, t in fitting:
        row = (t.dp_replicate, t.dp_shard, t.cp, t.tp, t.pp, t.schedule, t.ac, t.offload)
        ranked_seconds = seconds * (1 + SIMPLICITY_MARGIN * ((t.tp > 1) + (t.cp > 1) + (t.pp > 1)))
        best[row] = min(best.get(row, math.inf), ranked_seconds)
    expected = sorted(best.values())[:4]
    assert 0 < plan.counts["estimated"] < len(fitting)  # it did not estimate everything
    assert [rank_key(r)[0] for r in plan.fits] == pytest.approx(expected)


# torchtitan's published layouts (benchmarks/llama3_h100_202412_torchtitan.md and its llama3_*.toml), all at
# seq_len 8192 on H100s, here with 80 GiB each (torchtitan's hosts had 96 GB HBM2e parts):
PUBLISHED = {
    # llama3_8b.toml, like Titan's shipped llama3_8b: FSDP over 8 GPUs, local batch 1, selective op AC.
    "8B FSDP 8": ("llama3_8b", 8, 8, Layout(dp_shard=8, local_batch=1, microbatch=1, ac="op")),
    # Table 4: FSDP 32 x TP 8 on 256 GPUs, local batch 16, global batch 512, full AC.
    "70B FSDP 32 x TP 8": ("llama3_70b", 256, 512, Layout(dp_shard=32, tp=8, local_batch=16, microbatch=16, ac="full")),
    # Table 5: FSDP 8 x TP 8 x PP 8 on 512 GPUs, local batch 32, global batch 256, full AC, Interleaved 1F1B with
    # torchtitan's default micro-batch of 1 (32 micro-batches).
    "405B FSDP 8 x TP 8 x PP 8": ("llama3_405b", 512, 256, Layout(
        dp_shard=8, tp=8, pp=8, schedule="Interleaved1F1B", stages_per_rank=2, local_batch=32, microbatch=1,
        ac="full")),
}


@pytest.mark.parametrize("name", PUBLISHED)
def test_published_layout_is_feasible_and_the_plan_is_no_slower(name):
    config, gpus, global_batch, published = PUBLISHED[name]
    plan = _searched(config, gpus, global_batch, top=2)
    best = plan.fits[0]
    t = best.layout
    assert t.dp_replicate * t.dp_shard * t.cp * t.tp * t.pp == gpus
    assert best.estimated and best.peak <= plan.usable
    assert estimate_analytic(layout_config(plan, t), gpus, device_type="cuda").peak == best.peak
    # The published layout is a candidate, passes the rules, and its estimate fits: it is in the feasible set.
    assert published in set(candidate_layouts(gpus, 8, 8192, global_batch, SCHEDULES))
    from titan_models import get_model_args

    assert refuse_by_rule(published, get_model_args("llama3", plan.base.model.flavor), plan.base, 8192) is None
    assert estimate_analytic(layout_config(plan, published), gpus, device_type="cuda").peak <= plan.usable
    # The search returns the best-ranked layout that fits, so the published one ranks no better.
    cost = estimate_step_cost(published, plan.workload, plan.cluster)
    assert rank_key(Ranked(published, cost, 0.0))[0] >= rank_key(best)[0]


# The command.

@pytest.mark.parametrize("config, gpus, global_batch, seq_len", [
    ("llama3_debugmodel", 1, 8, 256), ("llama3_10m", 2, 16, 512), ("llama3_110m", 4, 32, 1024),
    ("llama3_8b", 8, 8, 8192), ("llama3_70b", 64, 512, 8192), ("llama3_405b", 512, 256, 8192),
])
def test_shipped_configs_print_their_table(config, gpus, global_batch, seq_len):
    result = _plan("--config", config, "--gpus", str(gpus), "--gpus-per-node", str(min(gpus, 8)),
                   "--gpu-memory", "80GiB", "--seq-len", str(seq_len), "--global-batch-size", str(global_batch),
                   "--top", "3")
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("#  dp_rep"))
    rows = [line.split() for line in lines[header + 1:] if line[:1].isdigit()]
    assert 1 <= len(rows) <= 3
    for row in rows:  # degrees multiply to the GPU count; the peak is within 80 GiB less the CUDA context
        assert math.prod(int(x) for x in row[1:6]) == gpus
        unit = next(i for i, cell in enumerate(row) if cell in ("GiB", "MiB"))
        assert float(row[unit - 1]) * (GiB if row[unit] == "GiB" else 2**20) <= (80 - 2.5) * GiB
    assert any(line.startswith("searched ") and " layouts: " in line for line in lines)


def test_json_rows_are_ranked_and_their_overrides_reproduce_the_peak():
    result = _plan("--config", "llama3_70b", "--gpus", "64", "--gpu-memory", "80GiB", "--seq-len", "8192",
                   "--global-batch-size", "512", "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    rows = data["layouts"]
    assert len(rows) == 5 and data["hint"] is None
    from titan_core.memory.plan import SIMPLICITY_MARGIN  # ranked by step time plus a margin per parallel dim

    keys = [r["step_seconds"] * (1 + SIMPLICITY_MARGIN * sum(r[d] > 1 for d in ("tp", "cp", "pp", "ep")))
            for r in rows]
    assert keys == sorted(keys)
    assert all(r["peak_bytes"] <= data["usable"] for r in rows)
    assert all(sum(r["terms_seconds"].values()) == pytest.approx(r["step_seconds"]) for r in rows)
    cfg = load_config("llama3_70b", ["--training.seq_len", "8192", *rows[0]["overrides"]])
    assert estimate_analytic(cfg, 64, device_type="cuda").peak == rows[0]["peak_bytes"]
    n = data["counts"]
    assert n["layouts"] == n["rule"] + n["lower_bound"] + n["estimated"] + n["skipped"] + n["not_estimated"]


@pytest.mark.parametrize("args, names", [
    (["--gpus", "12"], "--gpus 12"),  # not whole 8-GPU nodes
    (["--gpus", "8", "--gpu", "X999"], "--gpu 'X999'"),
    (["--gpus", "8", "--gpu-memory", "eighty"], "--gpu-memory 'eighty'"),
    (["--gpus", "8", "--gpu-memory", "2GiB"], "--gpu-memory 2 GiB leaves nothing for tensors"),  # < CUDA's context
    (["--gpus", "8", "--training.seq_lenn", "8192"], "training.seq_lenn"),
    (["--gpus", "8", "--seq-len", "0"], "--seq-len"),
    ([], "--gpus"),
])
def test_impossible_request_is_one_line_naming_the_flag(args, names, tmp_path):
    out = tmp_path / "plan.toml"
    result = _plan("--config", "llama3_8b", "--global-batch-size", "8", "--emit-config", str(out), *args)
    assert result.exit_code == 2, result.output
    assert result.stdout == ""
    [line] = result.stderr.splitlines()
    assert line.startswith("titan: error: ") and names in line, line
    assert not out.exists()


def test_without_a_global_batch_the_plan_takes_the_configs_own_on_those_gpus():
    """llama3_70b leaves training.global_batch_size = -1 with local batch 8 and TP 8: on 16 GPUs it trains with
    8 x 2 data-parallel ranks = 16 sequences, the batch the plan then ranks layouts at (and says why)."""
    args = ("--config", "llama3_70b", "--gpus", "16", "--gpu-memory", "80GiB", "--seq-len", "8192", "--top", "1",
            "--compile.enable", "false")  # fmt: skip
    result = _plan(*args, "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["global_batch"] == 16
    assert data["global_batch_from"].startswith("the config's local batch 8 x its data-parallel degree 2 on 16 GPUs")
    given = json.loads(_plan(*args, "--json", "--global-batch-size", "16").stdout)
    assert given["global_batch_from"] is None and given["layouts"] == data["layouts"]
    [first] = [line for line in _plan(*args).stdout.splitlines() if " global batch " in line]
    assert "global batch 16 = 131,072 tokens per step (the config's local batch 8" in first, first
    # degrees that do not fill the GPUs give no such batch: one line asking for the flag
    result = _plan("--config", "llama3_70b", "--gpus", "4", "--gpus-per-node", "4", "--gpu-memory", "80GiB")
    assert result.exit_code == 2 and result.stdout == ""
    [line] = result.stderr.splitlines()
    assert line.startswith("titan: error: --global-batch-size is needed") and "tp 8" in line and "--gpus 4" in line


def test_no_layout_fits_is_one_line_and_exit_1():
    result = _plan("--config", "llama3_405b", "--gpus", "8", "--gpu-memory", "80GiB", "--global-batch-size", "8")
    assert result.exit_code == 1, result.output
    [line] = result.stderr.splitlines()
    assert "no layout fits 8 GPUs" in line and "the closest" in line and "more GPUs" in line
    assert result.stdout == ""


def test_no_fit_for_want_of_host_memory_says_how_much_offload_needs():
    """Llama 3 8B on 2 GPUs of 40 GiB fits only with CPU offload, whose fp32 states (16 bytes x 8.03 B parameters =
    119.66 GiB per node) exceed --host-memory 64GiB: the one line says so, and what offload would need."""
    args = ("--config", "llama3_8b", "--gpus", "2", "--gpus-per-node", "2", "--gpu-memory", "40GiB", "--seq-len", "2048",
            "--global-batch-size", "2", "--compile.enable", "false")  # fmt: skip
    result = _plan(*args, "--host-memory", "64GiB")
    assert result.exit_code == 1, result.output
    [line] = result.stderr.splitlines()
    assert line.endswith("with CPU offload a layout fits in GPU memory but needs at least 119.66 GiB of host memory "
                         "per node (--host-memory 64.00 GiB)"), line  # fmt: skip
    assert _plan(*args).exit_code == 0  # the default 2 TiB of host memory: it fits, offloaded


def test_emit_config_refuses_to_overwrite_without_force(tmp_path):
    out = tmp_path / "plan.toml"
    out.write_text("keep me\n")
    args = ["--config", "llama3_8b", "--gpus", "8", "--gpu-memory", "80GiB", "--global-batch-size", "8",
            "--emit-config", str(out)]
    result = _plan(*args)
    assert result.exit_code == 2 and "--emit-config" in result.stderr and "--force" in result.stderr
    assert out.read_text() == "keep me\n"
    assert _plan(*args, "--force").exit_code == 0
    p = load_config(str(out)).parallelism
    degrees = (p.data_parallel_replicate_degree, p.data_parallel_shard_degree, p.context_parallel_degree,
               p.tensor_parallel_degree, p.pipeline_parallel_degree)
    assert math.prod(degrees) == 8
    assert not list(tmp_path.glob(".plan.toml.*"))  # no temporary file left behind


def test_emitted_config_loads_back_and_titan_train_runs_it_unchanged(tmp_path):
    # The planner targets GPUs; the job it plans here trains on CPU (training.device passes through), 2 processes.
    out, run = tmp_path / "plan.toml", tmp_path / "run"
    result = _plan("--config", "llama3_debugmodel", "--gpus", "2", "--gpus-per-node", "2", "--gpu-memory", "4GiB",
                   "--seq-len", "64", "--global-batch-size", "8", "--emit-config", str(out),
                   "--training.device", "cpu", "--training.steps", "2",
                   "--training.mixed_precision_param", "float32", "--metrics.enable_tensorboard", "false",
                   "--metrics.log_freq", "1", "--job.dump_folder", str(run))
    assert result.exit_code == 0, result.output
    command = result.stdout.splitlines()[-1].strip()
    assert command.startswith("titan train --config ")
    # The file is the winner: its degrees are the table's first row.
    first = next(line.split() for line in result.stdout.splitlines() if line.startswith("1 "))
    p = load_config(str(out)).parallelism
    degrees = [p.data_parallel_replicate_degree, p.data_parallel_shard_degree, p.context_parallel_degree,
               p.tensor_parallel_degree, p.pipeline_parallel_degree]
    assert degrees == [int(x) for x in first[1:6]] and math.prod(degrees) == 2
    proc = warm_python.run([sys.executable, "-m", "titan_cli", *shlex.split(command)[1:]], env=titan_env(debug_detail=False),
                           timeout=300, cwd=REPO)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = read_metrics(run)
    assert [r["step"] for r in records] == [1, 2]
    # lr_scheduler.warmup_steps stays unset in the emitted file: the default warmup fits the 2-step run,
    # whose steps train at lr * s / (W + 1) with W = 2, and the log says so once.
    assert proc.stderr.count("lr_scheduler.warmup_steps unset: warming up over all 2 step(s)") == 1, proc.stderr[-3000:]
    assert [r["optim/lr"] for r in records] == pytest.approx([8e-4 / 3, 8e-4 * 2 / 3], rel=1e-12)


def test_memory_budgets_are_searched_at_the_tp_degrees_their_recompute_was_measured_at():
    """Budgets join the AC modes at cp = 1 and at the TP degrees given (those whose recompute the planner
    measured), each such layout with each budget of its degree; their overrides load as
    `activation_checkpoint.mode = 'memory_budget'` at that budget, and the memory bound's order of AC modes places
    a budget between none and full AC, by its size, not against selective "op"."""
    from titan_core.memory.plan_bounds import keeps_at_least
    from titan_core.memory.plan_space import layout_overrides

    layouts = list(candidate_layouts(8, 8, 8192, 16, SCHEDULES, budgets={1: (0.75, 0.5), 4: (0.5,)}))
    budgeted = [t for t in layouts if t.ac == "budget"]
    assert budgeted and all(t.cp == 1 and t.tp in (1, 4) for t in budgeted)
    for tp, budgets in ((1, {0.75, 0.5}), (4, {0.5})):
        plain = {t for t in layouts if t.ac == "none" and t.tp == tp and t.cp == 1}
        assert plain and {(dataclasses.replace(t, ac="none", memory_budget=None), t.memory_budget)
                          for t in budgeted if t.tp == tp} == {(t, b) for t in plain for b in budgets}  # fmt: skip
    cfg = load_config(None, layout_overrides(budgeted[0], 16))
    assert (cfg.activation_checkpoint.mode, cfg.activation_checkpoint.memory_budget) == (
        "memory_budget", budgeted[0].memory_budget)
    ac = {name: Layout(ac=name) for name in ("none", "op", "full")}
    high, low = Layout(ac="budget", memory_budget=0.75), Layout(ac="budget", memory_budget=0.5)
    assert keeps_at_least(ac["none"], high) and keeps_at_least(high, low) and keeps_at_least(low, ac["full"])
    assert not keeps_at_least(low, high) and not keeps_at_least(high, ac["none"])
    assert not keeps_at_least(high, ac["op"]) and not keeps_at_least(ac["op"], low)


def test_a_compiled_plan_measures_the_budgets_recompute_at_each_tp_degree_and_ranks_them_there():
    """On 2 GPUs the compiled debug model's budgets are measured at tp 1 and 2 (the partitioner cuts TP's children
    one by one: tests/test_memory_compiled_parallel.py), and TP 2 layouts at a budget are estimated and ranked, each no
    faster than the same split without AC and costed by what it recomputes at TP 2; a terminal is told of each
    slow part as it starts."""
    from titan_core.memory.step_cost import recompute_flops_per_token

    said: list[str] = []
    request = PlanRequest(config=None, overrides=("--compile.enable", "true", "--training.seq_len", "256"), gpus=2,
                          gpus_per_node=2, gpu_memory="8GiB", global_batch=2, top=200, progress=said.append)  # fmt: skip
    plan = search(prepare_plan(request))
    assert [line.split(":")[0].split(" on ")[0] for line in said] == [  # what a terminal sees while it waits
        "measuring the compiled block", "measuring what the memory budgets recompute under TP 2",
        "searching the layouts of 2 GPUs (each estimate measures its blocks once)"], said  # fmt: skip
    measured = {(tp, b) for tp, b, _ in plan.workload.budget_recompute}
    assert measured == {(tp, b) for tp in (1, 2) for b in (0.75, 0.5, 0.25)}, plan.workload.budget_recompute
    rows = {(r.layout.tp, r.layout.pp, r.layout.local_batch, r.layout.ac_name): r for r in plan.fits}
    at_tp2 = [key for key in rows if key[0] == 2 and key[3].startswith("budget")]
    assert {key[3] for key in at_tp2} == {"budget 0.75", "budget 0.5", "budget 0.25"}, sorted(rows)
    for key in at_tp2:
        budgeted, plain = rows[key], rows[(*key[:3], "none")]
        assert budgeted.cost.seconds >= plain.cost.seconds and budgeted.peak <= plain.peak
        recompute = dict(((tp, b), f) for tp, b, f in plan.workload.budget_recompute)[2, budgeted.layout.memory_budget]
        assert recompute_flops_per_token(budgeted.layout, plan.workload) == recompute


def test_a_compiled_job_plans_a_larger_micro_batch_than_the_eager_estimate_allows():
    """The 1B on one GPU of 72 GiB (62.5 usable), 32 sequences per step: compiled blocks and loss keep less for
    backward, so the compiled job fits 16 sequences per micro-step where the eager one fits 8 (on one H100 the
    compiled plan's 16 peaked at 56.65 GiB against 61.31 estimated, and 32 ran out of memory: docs/memory.md)."""
    job = ("--model.flavor", "1B", "--training.seq_len", "2048", "--training.mixed_precision_param", "bfloat16")

    def best(compile_enable: str):
        request = PlanRequest(
            config=None,
            overrides=(*job, "--compile.enable", compile_enable),
            gpus=1,
            gpus_per_node=1,
            gpu_memory="72GiB",
            global_batch=32,
            top=3,
        )
        plan = search(prepare_plan(request))
        assert plan.fits, plan.counts
        return plan.fits

    (eager, *_), (compiled, *budgets) = best("false"), best("true")
    assert (eager.layout.local_batch, eager.layout.ac) == (8, "none")
    assert (compiled.layout.local_batch, compiled.layout.ac) == (16, "none")
    assert compiled.cost.seconds < eager.cost.seconds  # fewer micro-steps: fewer one-rank FSDP casts and copies
    # The compiled job's next rows are its blocks' memory budgets at the same split: they keep less for backward
    # than no AC, and cost what their backward graphs recompute (0.75 no matmul on the 1B's block, 0.5 some).
    assert [(r.layout.local_batch, r.layout.ac_name) for r in budgets] == [(16, "budget 0.75"), (16, "budget 0.5")]
    assert compiled.peak > budgets[0].peak > budgets[1].peak
    assert compiled.cost.seconds <= budgets[0].cost.seconds < budgets[1].cost.seconds
