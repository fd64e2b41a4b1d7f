"""What a layout needs at least: the memory filters that spare `titan plan` most estimates.

`memory_lower_bound` counts, short, the terms of two moments of the analytic estimate
(`titan_core.memory.analytic`), so that no estimate goes below it: a layout over the
budget by its bound is dropped without building its config. `needs_at_least` orders two
layouts of the same degrees by the memory the estimate's formulas give them, so that one
is skipped once a smaller one did not fit. `tests/test_plan.py` and `tests/test_plan_ep.py`
(Mixture-of-Experts layouts, with and without expert parallel) check both against the estimate.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

from titan_core.memory.analytic import inflight_microbatches
from titan_core.memory.step_cost import Layout, Workload

STATE_BYTES_PER_PARAM = 16
"""Device bytes per parameter at the optimizer step without offload: fp32 parameter, gradient and AdamW's two
moments. Sharded over dp_shard x cp x tp x pp, a lower bound of every layout's peak."""

RESIDENT_BYTES_PER_PARAM = 12
"""Device bytes per parameter through forward and backward without offload: fp32 parameter and two moments."""

MUON_SAVES_PER_PARAM = 4
"""What a parameter Muon steps holds less than one AdamW steps: one fp32 momentum, not two moments."""

AC_KEEPS = {"none": 2, "op": 1, "full": 0}
"""Activation checkpointing modes by how much they keep for backward: none keeps the most."""


def keeps_at_least(layout: Layout, other: Layout) -> bool:
    """Whether `layout`'s checkpointing keeps at least what `other`'s does for backward: `AC_KEEPS`' order, and a
    compiled block's memory budget keeps no more than none, no less than full AC, and more the larger it is (it is
    not ordered against selective "op")."""
    a, b = layout, other
    if a.ac != "budget" and b.ac != "budget":
        return AC_KEEPS[a.ac] >= AC_KEEPS[b.ac]
    if a.ac == "budget" and b.ac == "budget":
        assert a.memory_budget is not None and b.memory_budget is not None
        return a.memory_budget >= b.memory_budget
    return a.ac == "none" or b.ac == "full"


@dataclass(frozen=True)
class BlockSizes:
    """Parameters of each block, split by what divides them: what the bound counts a rank's blocks as.

    Args:
        blocks: (parameters outside the routed experts, routed experts' parameters) of each block, in order
            (DeepSeek-V3's first blocks are dense, the rest MoE).
    """

    blocks: tuple[tuple[int, int], ...]


@dataclass(frozen=True)
class RankBlocks:
    """What one pipeline rank's blocks hold, at least, at given tp and ep.

    Args:
        pp_rank: the rank's place in the pipeline (0 without PP).
        count: blocks on the rank.
        held: their parameters per TP rank before FSDP shards them: tensor parallel splits them all at most
            (the experts' hidden dim too, `TPStyle.MOE_INPUT`), and expert parallel keeps the states FSDP's
            share (E / ep experts over dp_shard x cp / ep ranks).
        gathered: their parameters FSDP gathers on the rank: each block's TP share, of `E / ep` experts.
        biggest: the largest block's share of `gathered`.
    """

    pp_rank: int
    count: int
    held: float
    gathered: float
    biggest: float


@functools.cache
def pipeline_rank_blocks(
    sizes: BlockSizes, pp: int, schedule: str, end_weights: tuple[int, int], tp: int, ep: int, etp: int
) -> tuple[RankBlocks, ...]:
    """The pipeline ranks' blocks, as titan-parallel cuts the stages (`stage_module_names`) and places them
    (`stage_indices`), less the ranks that an earlier rank outweighs in every field: a later rank has no more
    micro-batches in flight (`inflight_microbatches`), so its bound is no larger.

    Args:
        sizes: the model's blocks.
        pp: pipeline degree (1: one rank holds every block).
        schedule: the pipeline schedule.
        end_weights: blocks' worth of the first and the last stage's other modules.
        tp: tensor parallel degree.
        ep: expert parallel degree.
        etp: how many ways TP splits each routed expert: `tp`, or 1 when the TP ranks join expert parallel.
    """
    from titan_parallel.pipeline_layout import count_stages, stage_indices, stage_module_names
    from titan_parallel.plan import ModelPlan

    n_layers = len(sizes.blocks)
    if pp == 1:
        placed = [list(range(n_layers))]
    else:
        less = {"first_stage_less_layers": end_weights[0], "last_stage_less_layers": end_weights[1]}
        n_stages = count_stages(n_layers, pp, schedule, **less)
        names = stage_module_names(ModelPlan(blocks="b"), n_layers, n_stages, **less)  # "b.<index>"
        placed = [[int(n[2:]) for i in stage_indices(r, pp, n_stages, schedule) for n in names[i]] for r in range(pp)]
    ranks: list[RankBlocks] = []
    for r, indices in enumerate(placed):
        shares = [
            (sum(sizes.blocks[i]) / tp, sizes.blocks[i][0] / tp + sizes.blocks[i][1] / (ep * etp)) for i in indices
        ]
        gathered = [g for _, g in shares]
        rank = RankBlocks(r, len(indices), sum(h for h, _ in shares), sum(gathered), max(gathered, default=0.0))
        if not any(_outweighs(other, rank) for other in ranks):
            ranks.append(rank)
    return tuple(ranks)


def _outweighs(a: RankBlocks, b: RankBlocks) -> bool:
    """Whether rank `a`'s blocks hold no less than rank `b`'s in every field."""
    return a.count >= b.count and a.held >= b.held and a.gathered >= b.gathered and a.biggest >= b.biggest


def memory_lower_bound(
    layout: Layout,
    work: Workload,
    act: Any | None,
    block_params: int | BlockSizes,
    compute_bytes: int = 2,
    end_weights: tuple[int, int] = (1, 1),
    compiled: bool = False,
) -> int:
    """Bytes per rank that no estimate of `layout` goes below: step 3's filter.

    The larger of two moments of `titan_core.memory.analytic`, each counted short:

    - the optimizer step: the model states (`STATE_BYTES_PER_PARAM` per parameter, 4 less under Muon, over
      dp_shard x cp x tp x pp, the routed experts' too; 0 under offload);
    - the last block backward of each pipeline rank (`pipeline_rank_blocks`): its blocks' states
      (`RESIDENT_BYTES_PER_PARAM`, and the gradients under accumulation or pipeline micro-batches),
      the activations they keep (`act`, the measured `ActivationBytes` at this tp and cp: its
      smallest block's) for the micro-batches in flight, one block's backward and recomputation,
      FSDP's gathered blocks (three of the biggest, or all of the rank's where the weights stay
      gathered under PP; `E / ep` experts each) and under PP the stage's unsharded gradients, which
      FSDP reduces once per run.

    Args:
        layout: the layout.
        work: the model and batch.
        act: the eager `ActivationBytes` at this layout's tp and cp (`eager_saved.measure_eager`); None leaves
            activations out.
        block_params: the blocks' sizes (`BlockSizes`), or the parameters of the smallest block of a dense model
            (every block counted as that).
        compute_bytes: bytes of the compute dtype (FSDP gathers the weights in it).
        end_weights: blocks' worth the first and the last pipeline stage's other modules count for
            (`parallelism.pipeline_parallel_{first,last}_stage_less_layers`).
        compiled: the blocks compile: the estimate reads what the compiled graphs keep, less than the eager figures
            but never less than each block's input (what full AC keeps; a memory budget of 0 keeps as much), which
            the bound then counts whatever the AC mode or budget, with no backward or recompute.
    """
    t = layout
    if isinstance(block_params, int):
        block_params = BlockSizes(((block_params, 0),) * work.n_layers)
    states = 0.0 if t.offload else model_states_per_rank(t, work)
    tokens = t.microbatch * work.seq_len // t.cp  # (micro)batch tokens on this rank
    kept = recompute = 0
    if act is not None and compiled:
        kept = act.block_input
    elif act is not None:
        kept = {"none": act.block, "op": act.block_op, "full": act.block_input}[t.ac]
        recompute = {"none": 0, "op": act.block - act.block_op, "full": act.block}[t.ac]
    accumulates = t.accum > 1 or t.microbatches > 1  # the gradients of earlier (micro-)batches live through backward
    # GPipe without accumulation: its peak, every micro-batch kept, comes before any gradient exists (or a later
    # backward's, with gradients and one micro-batch fewer, is larger): the gradients are not counted
    gpipe_first = t.pp > 1 and t.schedule == "GPipe" and t.accum == 1
    accumulates = accumulates and not gpipe_first
    per_param = 0 if t.offload else RESIDENT_BYTES_PER_PARAM + (4 if accumulates else 0)
    if per_param and work.muon_params:  # the blocks' parameters are Muon's but their norms: count all as Muon's
        per_param -= MUON_SAVES_PER_PARAM
    fsdp = t.dp_replicate * t.dp_shard * t.cp > 1 or t.offload
    reshard = {"always": True, "never": False, "default": t.pp == 1}[work.fsdp_reshard]
    bound = states
    for r in pipeline_rank_blocks(block_params, t.pp, t.schedule, end_weights, t.tp, t.ep, t.etp):
        if r.count == 0:
            continue
        in_flight = inflight_microbatches(t.schedule, t.pp, r.pp_rank, t.stages_per_rank, t.microbatches)
        backward = 0 if act is None or compiled else tokens * (act.block_backward + recompute)  # and its recompute
        gathered = 0.0
        if fsdp:
            gathered = compute_bytes * (3 * r.biggest if reshard else r.gathered)
            if t.pp > 1 and not gpipe_first:  # FSDP reduces once per pipeline run: its unsharded gradients wait
                gathered += max(compute_bytes, work.reduce_bytes) * r.gathered
        held = per_param * r.held / (t.dp_shard * t.cp)
        rank = held + in_flight * tokens * r.count * kept + backward + gathered
        bound = max(bound, rank)
    return int(bound)


def model_states_per_rank(layout: Layout, work: Workload) -> float:
    """Bytes of fp32 parameters, gradients and optimizer states a rank holds at least: `STATE_BYTES_PER_PARAM` per
    parameter (`MUON_SAVES_PER_PARAM` less for one Muon steps) over dp_shard x cp x tp x pp: the routed experts
    too (TP splits their hidden dim, `TPStyle.MOE_INPUT`; expert parallel keeps FSDP's share). The router, which
    TP replicates, is counted split: short, as a bound may be."""
    t = layout
    return (STATE_BYTES_PER_PARAM * work.n_params - MUON_SAVES_PER_PARAM * work.muon_params) / (
        t.dp_shard * t.cp * t.tp * t.pp
    )


def host_lower_bound(layout: Layout, work: Workload, gpus_per_node: int) -> int:
    """Host bytes per node that CPU offload needs at least: each GPU's fp32 parameters, gradients and AdamW moments
    (`model_states_per_rank`), for the node's GPUs."""
    return int(model_states_per_rank(layout, work) * gpus_per_node)


def degrees_and_schedule(layout: Layout) -> tuple:
    """What `needs_at_least` compares only within: dp_replicate, dp_shard, cp, tp, pp, ep (and whether it spans tp)
    and the schedule."""
    t = layout
    return (t.dp_replicate, t.dp_shard, t.cp, t.tp, t.pp, t.ep, t.ep_spans_tp, t.schedule)


def needs_at_least(layout: Layout, other: Layout) -> bool:
    """Whether `layout` needs at least `other`'s memory by the estimator's formulas.

    Same degrees and schedule, and no less in each of: micro-batch size, micro-batches in
    flight, activations kept (`keeps_at_least`), device-resident states (no offload), and gradients
    kept across accumulation. In flight: a pipeline rank holds at most `(v + 1) pp` of its v
    stages' micro-batches, so counts at or above `3 pp` hold the same.
    """
    a, b = layout, other
    if degrees_and_schedule(a) != degrees_and_schedule(b):
        return False
    cap = 3 * a.pp
    return (
        a.microbatch >= b.microbatch
        and min(a.microbatches, cap) >= min(b.microbatches, cap)
        and keeps_at_least(a, b)
        and a.offload <= b.offload
        and (a.accum > 1 or b.accum == 1)
    )
