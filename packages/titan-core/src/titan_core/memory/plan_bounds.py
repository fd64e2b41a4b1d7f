"""What a layout needs at least: the memory filters that spare `titan plan` most estimates.

`memory_lower_bound` counts, short, the terms of two moments of the analytic estimate
(`titan_core.memory.analytic`), so that no estimate goes below it: a layout over the
budget by its bound is dropped without building its config. `needs_at_least` orders two
layouts of the same degrees by the memory the estimate's formulas give them, so that one
is skipped once a smaller one did not fit. `tests/test_plan.py` checks both against the
estimate.
"""

from __future__ import annotations

from typing import Any

from titan_core.memory.step_cost import Layout, Workload

STATE_BYTES_PER_PARAM = 16
"""Device bytes per parameter at the optimizer step without offload: fp32 parameter, gradient and AdamW's two
moments. Sharded over dp_shard x cp x tp x pp, a lower bound of every layout's peak."""

RESIDENT_BYTES_PER_PARAM = 12
"""Device bytes per parameter through forward and backward without offload: fp32 parameter and two moments."""

AC_KEEPS = {"none": 2, "op": 1, "full": 0}
"""Activation checkpointing modes by how much they keep for backward: none keeps the most."""


def memory_lower_bound(
    layout: Layout,
    work: Workload,
    act: Any,
    block_params: int,
    compute_bytes: int = 2,
    end_weights: tuple[int, int] = (1, 1),
) -> int:
    """Bytes per rank that no estimate of `layout` goes below: step 3's filter.

    The larger of two moments of `titan_core.memory.analytic`, each counted short:

    - the optimizer step: the model states (`STATE_BYTES_PER_PARAM` per parameter over
      dp_shard x cp x tp x pp; 0 under offload);
    - the last block backward of pipeline ranks 0 and 1 (`_pipeline_ranks`): their blocks' states
      (`RESIDENT_BYTES_PER_PARAM`, and the gradients under accumulation), the activations they
      keep (`act`, the family's `ActivationBytes` at this tp and cp) for the micro-batches in
      flight, one block's backward and recomputation, and FSDP's gathered blocks (three, or all
      of the rank's where the weights stay gathered under PP).

    Args:
        layout: the layout.
        work: the model and batch.
        act: `ModelSpec.activation_bytes` at this layout's tp and cp.
        block_params: parameters of one block.
        compute_bytes: bytes of the compute dtype (FSDP gathers the weights in it).
        end_weights: blocks' worth the first and the last pipeline stage's other modules count for
            (`parallelism.pipeline_parallel_{first,last}_stage_less_layers`).
    """
    t = layout
    shards = t.dp_shard * t.cp * t.tp
    states = 0.0 if t.offload else STATE_BYTES_PER_PARAM * work.n_params / (shards * t.pp)
    tokens = t.microbatch * work.seq_len // t.cp  # (micro)batch tokens on this rank
    kept = {"none": act.block, "op": act.block_op, "full": act.block_input}[t.ac]
    recompute = {"none": 0, "op": act.block - act.block_op, "full": act.block}[t.ac]
    per_param = 0 if t.offload else RESIDENT_BYTES_PER_PARAM + (4 if t.accum > 1 else 0)  # + gradients if accumulating
    fsdp = t.dp_replicate * t.dp_shard * t.cp > 1 or t.offload
    reshard = {"always": True, "never": False, "default": t.pp == 1}[work.fsdp_reshard]
    bound = states
    for blocks, in_flight in _pipeline_ranks(t, work.n_layers, end_weights):
        if blocks == 0:
            continue
        backward = tokens * (act.block_backward + recompute)  # one block's backward and recomputation
        gathered = (3 if reshard else blocks) * compute_bytes * block_params / t.tp if fsdp else 0
        rank = per_param * blocks * block_params / shards + in_flight * tokens * blocks * kept + backward + gathered
        bound = max(bound, rank)
    return int(bound)


def host_lower_bound(layout: Layout, work: Workload, gpus_per_node: int) -> int:
    """Host bytes per node that CPU offload needs at least: each GPU's fp32 parameters, gradients and AdamW moments
    (`STATE_BYTES_PER_PARAM` per parameter over dp_shard x cp x tp x pp), for the node's GPUs."""
    t = layout
    return int(STATE_BYTES_PER_PARAM * work.n_params / (t.dp_shard * t.cp * t.tp * t.pp) * gpus_per_node)


def _pipeline_ranks(layout: Layout, n_layers: int, end_weights: tuple[int, int]) -> list[tuple[int, float]]:
    """(blocks held, micro-batches in flight) at least, of pipeline ranks 0 and 1 (the whole model without PP).

    Stages get `units // stages` units or one more, units = blocks + the first and the last
    stage's `end_weights`, which those stages hold fewer blocks by; rank 0 holds the first
    stage (and under V schedules the last), rank 1 the last when pp = 2.
    In flight: `titan_core.memory.analytic.inflight_microbatches`, as the estimate counts them.
    """
    from titan_core.memory.analytic import inflight_microbatches
    from titan_parallel.pipeline_layout import schedule_kind

    t = layout
    if t.pp == 1:
        return [(n_layers, 1.0)]
    v, m = t.stages_per_rank, t.microbatches
    first, last = end_weights
    per_stage = (n_layers + first + last) // (t.pp * v)
    v_shaped = schedule_kind(t.schedule).placement == "v"  # rank 0 holds the first and the last stage
    ranks = []
    for r in (0, 1):
        ends = first + (last if v_shaped else 0) if r == 0 else (last if t.pp == 2 and not v_shaped else 0)
        blocks = max(0, v * per_stage - ends)
        ranks.append((blocks, inflight_microbatches(t.schedule, t.pp, r, v, m)))
    return ranks


def degrees_and_schedule(layout: Layout) -> tuple:
    """What `needs_at_least` compares only within: dp_replicate, dp_shard, cp, tp, pp and the schedule."""
    t = layout
    return (t.dp_replicate, t.dp_shard, t.cp, t.tp, t.pp, t.schedule)


def needs_at_least(layout: Layout, other: Layout) -> bool:
    """Whether `layout` needs at least `other`'s memory by the estimator's formulas.

    Same degrees and schedule, and no less in each of: micro-batch size, micro-batches in
    flight, activations kept (`AC_KEEPS`), device-resident states (no offload), and gradients
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
        and AC_KEEPS[a.ac] >= AC_KEEPS[b.ac]
        and a.offload <= b.offload
        and (a.accum > 1 or b.accum == 1)
    )
