"""What `titan plan` searches: every layout of a job on N GPUs, the overrides that set one, and the torch-free rules.

A layout (`titan_core.memory.step_cost.Layout`) is the parallel degrees, the pipeline
schedule and micro-batch, the batch split, activation checkpointing and CPU offload.
`candidate_layouts` lists those whose degrees multiply to the GPU count and whose batch
split gives the global batch exactly (compiled blocks' memory budgets, `PLAN_BUDGETS`, where their
recompute was measured), and for a Mixture-of-Experts model each expert
parallel degree the rules allow (`expert_degrees`; under TP also those the TP ranks join,
`joined_expert_degrees`); `refuse_by_rule` runs on each the
rules of titan-parallel that need no model (the same rules `titan_core.job` runs), and
`refuse_expert_parallel` the expert-parallel ones.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

from titan_core.config import JobConfig
from titan_core.memory.step_cost import Layout

PLAN_SCHEDULES = ("1F1B", "Interleaved1F1B", "ZBVZeroBubble")
"""Pipeline schedules searched, one per bubble family of the cost model: flush, interleaved, zero-bubble
(GPipe keeps every micro-batch's activations; InterleavedZeroBubble and DualPipeV cost as ZBVZeroBubble)."""

MICROBATCH_SIZES = (1, 2, 4)
"""Pipeline micro-batch sizes searched (sequences)."""

AC_MODES = ("none", "op", "full")
"""Activation checkpointing searched: none, selective "op", full."""

PLAN_BUDGETS = (0.75, 0.5, 0.25)
"""Compiled blocks' activation memory budgets searched (`activation_checkpoint.mode = 'memory_budget'`) beside
`AC_MODES`, where the job compiles its blocks and the estimate measures them (no MX), at cp = 1 and each TP degree
whose recompute was measured (`plan_model.budget_recompute`: a dense block whole at tp = 1, TP's compiled children,
which the partitioner cuts one by one around the eager norms, at each degree, a Mixture-of-Experts block's compiled
pieces around its eager experts). On Llama
3.2 1B's block (bf16, 2048 tokens) 0.75 keeps 68% of the unbudgeted block's bytes and recomputes no matmul, 0.5
62% for +6% of the backward's FLOPs, 0.25 19% for +29% (selective "op": 39% for +15%); 0 is full AC, 1 none."""

MIN_TOKENS_PER_CP_RANK = 2048
"""Context parallel is searched while each rank keeps at least this many tokens of a sequence."""

AC_TOKENS = {
    "none": ["--activation_checkpoint.mode", "none"],
    "op": ["--activation_checkpoint.mode", "selective", "--activation_checkpoint.selective_ac_option", "op"],
    "full": ["--activation_checkpoint.mode", "full"],
}
"""Config overrides of each searched checkpointing mode."""


def divisors(n: int) -> list[int]:
    """The divisors of `n`, ascending."""
    return [d for d in range(1, n + 1) if n % d == 0]


def expert_degrees(dp_shard: int, cp: int, num_experts: int) -> list[int]:
    """The expert-parallel degrees a layout may take: 1, and each `cp x d` (d a divisor of `dp_shard`) that
    divides `num_experts` (`ParallelDims`' and `check_ep`'s rules: EP is carved from the FSDP x CP ranks).

    Args:
        dp_shard: FSDP shards.
        cp: context parallel degree.
        num_experts: routed experts per MoE layer; 0 (a dense model) gives [1].
    """
    if num_experts < 1:
        return [1]
    return [1] + [cp * d for d in divisors(dp_shard) if cp * d > 1 and num_experts % (cp * d) == 0]


def joined_expert_degrees(dp_shard: int, cp: int, tp: int, num_experts: int) -> list[int]:
    """The expert-parallel degrees with the TP ranks joining expert parallel (`expert_tensor_parallel_degree = 1`):
    each `cp x tp x d` (d a divisor of `dp_shard`) that divides `num_experts`; none without TP.

    Args:
        dp_shard: FSDP shards.
        cp: context parallel degree.
        tp: tensor parallel degree.
        num_experts: routed experts per MoE layer; 0 (a dense model) gives [].
    """
    if num_experts < 1 or tp == 1:
        return []
    return [cp * tp * d for d in divisors(dp_shard) if num_experts % (cp * tp * d) == 0]


def candidate_layouts(
    gpus: int,
    gpus_per_node: int,
    seq_len: int,
    global_batch: int,
    schedules: tuple[str, ...],
    num_experts: int = 0,
    budgets: Mapping[int, tuple[float, ...]] | None = None,
) -> Iterator[Layout]:
    """Every layout whose degrees multiply to `gpus` and whose batch split is exactly `global_batch`.

    HSDP (dp_replicate > 1) is searched only with shard groups of whole nodes; CP while each
    rank keeps `MIN_TOKENS_PER_CP_RANK` tokens; CPU offload only where FSDP shards; pipeline
    micro-batches in whole multiples of the pipeline degree; expert parallel, for a
    Mixture-of-Experts model, at each of `expert_degrees`.

    Args:
        gpus: GPUs in the job.
        gpus_per_node: GPUs per node.
        seq_len: tokens per sequence.
        global_batch: sequences per optimizer step.
        schedules: pipeline schedules to search.
        num_experts: routed experts per MoE layer; 0 for a dense model (or to search without expert parallel).
        budgets: compiled blocks' memory budgets to search beside `AC_MODES` at cp = 1, by TP degree (`PLAN_BUDGETS`
            at each degree the planner measured their recompute at; None searches none).
    """
    for tp in divisors(gpus):
        for cp in (c for c in divisors(gpus // tp) if c == 1 or seq_len // c >= MIN_TOKENS_PER_CP_RANK):
            for pp in divisors(gpus // (tp * cp)):
                dp = gpus // (tp * cp * pp)
                if global_batch % dp:
                    continue
                for rep in divisors(dp):
                    shard = dp // rep
                    if rep > 1 and (shard * cp * tp) % gpus_per_node:
                        continue
                    experts = [(ep, False) for ep in expert_degrees(shard, cp, num_experts)]
                    experts += [(ep, True) for ep in joined_expert_degrees(shard, cp, tp, num_experts)]
                    for ep, spans in experts:
                        degrees = {"dp_replicate": rep, "dp_shard": shard, "cp": cp, "tp": tp, "pp": pp, "ep": ep}
                        acs: list[tuple[str, float | None]] = [(ac, None) for ac in AC_MODES]
                        acs += [("budget", b) for b in (budgets or {}).get(tp, ())] if cp == 1 else []
                        layouts = _batch_layouts({**degrees, "ep_spans_tp": spans}, global_batch // dp, schedules, acs)
                        yield from layouts


def _batch_layouts(
    degrees: dict[str, Any], seqs_per_rank: int, schedules: tuple[str, ...], acs: list[tuple[str, float | None]]
) -> Iterator[Layout]:
    """The batch splits, pipelines, checkpointing modes and offload choices of one set of degrees."""
    pp = degrees["pp"]
    pipelines = (
        [("1F1B", 1, None)]
        if pp == 1
        else [(s, 1 if s in ("GPipe", "1F1B") else 2, mbs) for s in schedules for mbs in MICROBATCH_SIZES]
    )
    offloads = (False, True) if degrees["dp_shard"] * degrees["cp"] > 1 else (False,)
    for local in divisors(seqs_per_rank):
        for schedule, per_rank, mbs in pipelines:
            if mbs is not None and (local % mbs or (local // mbs) % pp):
                continue
            for ac, budget in acs:
                for offload in offloads:
                    yield Layout(
                        **degrees,
                        schedule=schedule,
                        stages_per_rank=per_rank,
                        local_batch=local,
                        microbatch=mbs or local,
                        accum=seqs_per_rank // local,
                        ac=ac,
                        offload=offload,
                        memory_budget=budget,
                    )


def layout_overrides(layout: Layout, global_batch: int) -> list[str]:
    """The `--section.key value` tokens that set `layout` on top of a config."""
    t = layout
    return [
        "--parallelism.dp_mode",
        "fsdp",
        "--parallelism.data_parallel_replicate_degree",
        str(t.dp_replicate),
        "--parallelism.data_parallel_shard_degree",
        str(t.dp_shard),
        "--parallelism.context_parallel_degree",
        str(t.cp),
        "--parallelism.tensor_parallel_degree",
        str(t.tp),
        "--parallelism.pipeline_parallel_degree",
        str(t.pp),
        "--parallelism.expert_parallel_degree",
        str(t.ep),
        "--parallelism.expert_tensor_parallel_degree",
        "1" if t.ep_spans_tp else "-1",
        "--parallelism.pipeline_parallel_schedule",
        t.schedule,
        "--parallelism.pipeline_parallel_schedule_csv",
        "none",
        "--parallelism.pipeline_parallel_microbatch_size",
        str(t.microbatch if t.pp > 1 else 1),
        "--parallelism.pipeline_parallel_layers_per_stage",
        "none",
        "--parallelism.module_fqns_per_model_part",
        "none",
        "--training.local_batch_size",
        str(t.local_batch),
        "--training.global_batch_size",
        str(global_batch),
        "--training.enable_cpu_offload",
        "true" if t.offload else "false",
        *ac_tokens(t),
    ]


def ac_tokens(layout: Layout) -> list[str]:
    """The `--activation_checkpoint.*` tokens of `layout`'s checkpointing (`AC_TOKENS`, or a memory budget's)."""
    if layout.ac == "budget":
        mode = ["--activation_checkpoint.mode", "memory_budget"]
        return [*mode, "--activation_checkpoint.memory_budget", f"{layout.memory_budget:g}"]
    return AC_TOKENS[layout.ac]


def refuse_by_rule(layout: Layout, args: Any, cfg: JobConfig, seq_len: int) -> str | None:
    """The message of the first torch-free layout rule `layout` breaks, or None.

    Args:
        layout: the layout (its tp, cp, pp, schedule, local batch and micro-batch are read).
        args: the model's args (`n_heads`, `kv_heads`, `ffn_hidden_dim`, `vocab_size`, `n_layers`).
        cfg: the job config, for the model's plan and the pipeline's first / last stage weights.
        seq_len: tokens per sequence.
    """
    from titan_core.job.naming import config_error
    from titan_core.job.rules import CONTEXT_PARALLEL_KEYS, PIPELINE_RULE_KEYS
    from titan_models import get_model_spec
    from titan_parallel import ParallelConfigError
    from titan_parallel.layout import check_cp, check_cp_method
    from titan_parallel.pipeline_layout import count_microbatches, count_stages, stage_module_names

    t, p = layout, cfg.parallelism
    for name in ("n_heads", "kv_heads", "ffn_hidden_dim", "vocab_size"):
        size = getattr(args, name, None)
        if isinstance(size, int) and size % t.tp:
            return f"parallelism.tensor_parallel_degree={t.tp} does not divide {name}={size}"
    try:
        check_cp(seq_len, t.cp, t.tp)
        check_cp_method(p.context_parallel_method, args.n_heads, t.cp, t.tp)
        if t.pp > 1:
            less = {
                "first_stage_less_layers": p.pipeline_parallel_first_stage_less_layers,
                "last_stage_less_layers": p.pipeline_parallel_last_stage_less_layers,
            }
            n_stages = count_stages(args.n_layers, t.pp, t.schedule, **less)
            stage_module_names(get_model_spec(cfg.model.name).plan, args.n_layers, n_stages, **less)
            count_microbatches(t.local_batch, t.microbatch, n_stages, t.schedule)
    except ParallelConfigError as e:
        return str(config_error(e, {**CONTEXT_PARALLEL_KEYS, **PIPELINE_RULE_KEYS}))
    return None


def refuse_expert_parallel(layout: Layout, cfg: JobConfig) -> str | None:
    """The message of the expert-parallel rule `layout` breaks, or None: `ParallelDims`' (ep is cp times a
    divisor of dp_shard) and `check_ep`'s (ep divides each MoE layer's experts; the model has some) on the
    meta model, as `titan_core.job` runs them.

    Args:
        layout: the layout (its degrees are read).
        cfg: the job config, for the model.
    """
    from titan_core.job.meta_model import build_meta_model
    from titan_core.job.naming import config_error
    from titan_core.job.options import DIMS_KEYS
    from titan_core.memory.plan_model import model_of
    from titan_parallel import ParallelConfigError, ParallelDims
    from titan_parallel.expert_parallel import check_ep

    t = layout
    if t.ep == 1:
        return None
    spec, args = model_of(cfg)
    try:
        world = t.dp_replicate * t.dp_shard * t.cp * t.tp * t.pp
        etp = 1 if t.ep_spans_tp else -1
        ParallelDims(t.dp_replicate, t.dp_shard, t.cp, t.tp, t.pp, world_size=world, ep=t.ep, etp=etp)
        check_ep(build_meta_model(spec, args), spec.plan, t.ep)
    except ParallelConfigError as e:
        return str(config_error(e, DIMS_KEYS))
    return None
