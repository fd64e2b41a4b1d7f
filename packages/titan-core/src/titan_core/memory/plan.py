"""`titan plan`: search the layouts of a job on N GPUs, keep those that fit, rank them by step time.

The search, in order:

1. `plan_space.candidate_layouts` lists every layout whose degrees multiply to the GPU
   count and whose batch split gives the global batch exactly: dp_replicate x dp_shard x
   cp x tp x pp, for a Mixture-of-Experts model each expert-parallel degree the rules allow,
   pipeline schedule and micro-batch, local batch and accumulation, activation
   checkpointing (none / selective op / full; for compiled blocks also memory budgets,
   `plan_space.PLAN_BUDGETS`), CPU offload.
2. `plan_space.refuse_by_rule` runs the torch-free rules of titan-parallel on each (tp
   against the model's widths, cp against the sequence, pipeline stages and
   micro-batches), and `refuse_expert_parallel` the expert-parallel ones on the meta model:
   rules `titan_core.job_check` runs, without building the model.
3. `plan_bounds.memory_lower_bound` drops those whose model states, or whose pipeline
   ranks' blocks (states, FSDP's gathered weights, kept activations), exceed the device budget, and
   `plan_bounds.host_lower_bound` those whose CPU-offloaded states exceed the host's
   memory: no estimate of them can fit.
4. The rest are scored by the cost model (`titan_core.memory.step_cost`) and estimated in
   order of `rank_key` (step time, plus `SIMPLICITY_MARGIN` per model-parallel dimension),
   fastest first: a `JobConfig` from the user's config and overrides
   plus the layout's override tokens, through `estimate_analytic` (every rule of
   `job_check.RULES`, then the memory; offloaded bytes count against the host's). A layout
   is not estimated when a faster batch split of the same row already fits, or when it
   needs at least the device memory of one that did not fit (`needs_at_least`). The search
   stops at the `top`-th row that fits: the rows are then the `top` fastest layouts that fit.

`titan_core.memory.plan_report` prints the outcome and writes the winner as a config.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from titan_core.config import ConfigError, JobConfig, load_config
from titan_core.config.load import validate_config
from titan_core.config.overrides import parse_overrides
from titan_core.memory.budget import GPU_MEMORY_GIB, parse_gpu_memory, usable_bytes
from titan_core.memory.plan_bounds import degrees_and_schedule, host_lower_bound, memory_lower_bound, needs_at_least
from titan_core.memory.plan_model import block_sizes, budget_recompute, model_of, workload
from titan_core.memory.plan_space import (
    PLAN_SCHEDULES,
    candidate_layouts,
    divisors,
    layout_overrides,
    refuse_by_rule,
    refuse_expert_parallel,
)
from titan_core.memory.step_cost import (
    Cluster,
    Layout,
    StepCost,
    Workload,
    estimate_step_cost,
    tokens_per_second_per_gpu,
)

if TYPE_CHECKING:
    from titan_core.memory.report import MemoryEstimate

    Estimator = Callable[[JobConfig, int], MemoryEstimate]

HOST_MEMORY = "2TiB"
"""Host memory per node that CPU offload may fill, by default: a DGX / HGX H100 server has 2 TB."""


@dataclass(frozen=True)
class PlanRequest:
    """What `titan plan` was asked.

    Args:
        config: TOML file or shipped config name; None = the defaults.
        overrides: `--section.key value` tokens, applied before the search.
        gpus: GPUs in the job.
        gpus_per_node: GPUs per node (one NVLink domain).
        gpu: GPU name, for its peak FLOP/s (and its memory when `gpu_memory` is None).
        gpu_memory: device memory, e.g. "80GiB", or a GPU name; None = `gpu`'s.
        seq_len: tokens per sequence; None = the config's.
        global_batch: sequences per optimizer step; None = the config's.
        top: how many layouts to rank.
        host_memory: host memory per node, e.g. "2TiB": what CPU offload may fill; None = `HOST_MEMORY`.
        expert_parallel: search expert-parallel degrees for a Mixture-of-Experts model (False: ep = 1 only).
        workers: processes measuring, on fake tensors, what the blocks keep at the (tp, cp, etp) the search meets
            (`eager_saved.measure_eager_many`); 1 = all in this process; None (what `titan plan` passes unless
            told) = the CPUs this process may run on where there are at least `SPREAD_FROM_CPUS` (on fewer, the
            processes' own imports of torch cost about what they save). The processes are spawned: they import
            the calling script, whose start must then be under `if __name__ == "__main__":`.
        progress: receives a line as each slow part starts (the compiled blocks' measurements, the search);
            None says nothing (`titan plan` passes one when its stderr is a terminal).
    """

    config: str | None
    overrides: tuple[str, ...] = ()
    gpus: int = 8
    gpus_per_node: int = 8
    gpu: str = "H100"
    gpu_memory: str | None = None
    seq_len: int | None = None
    global_batch: int | None = None
    top: int = 5
    host_memory: str | None = None
    expert_parallel: bool = True
    workers: int | None = 1
    progress: Callable[[str], None] | None = None


@dataclass
class Ranked:
    """One scored layout.

    Args:
        layout: the layout.
        cost: its step time by term.
        tokens_per_gpu: tokens/s per GPU.
        peak: per-rank peak bytes (the largest pipeline stage's), or its lower bound when `estimated` is False.
        estimated: whether `peak` came from the memory estimate.
    """

    layout: Layout
    cost: StepCost
    tokens_per_gpu: float
    peak: int = 0
    estimated: bool = False


@dataclass
class Plan:
    """The search's outcome.

    Args:
        request: what was asked.
        base: the user's config with the request's seq_len / global batch applied.
        cluster: the GPUs.
        workload: the model and batch.
        usable: usable bytes per GPU.
        device_memory: the device's bytes.
        host_memory: host bytes per node, for CPU offload.
        fits: the fastest layouts that fit, fastest first (at most `request.top`).
        closest: the layout nearest to fitting, when none fits.
        counts: layouts by outcome: layouts, rule, lower_bound, estimated, fit, memory, skipped, not_estimated.
        rule_errors: messages of the rules that refused layouts, with how many each refused.
        host_needed: the least host memory per node that a CPU-offload layout within GPU memory needed beyond
            `host_memory` (by its lower bound or its estimate); None where none was refused for host memory.
        global_batch_from: where the global batch came from when neither `--global-batch-size` nor the config gave
            it (`config_global_batch`); None where one did.
    """

    request: PlanRequest
    base: JobConfig
    cluster: Cluster
    workload: Workload
    usable: int
    device_memory: int
    host_memory: int
    fits: list[Ranked] = field(default_factory=list)
    closest: Ranked | None = None
    counts: Counter = field(default_factory=Counter)
    rule_errors: Counter = field(default_factory=Counter)
    host_needed: int | None = None
    global_batch_from: str | None = None


def prepare_plan(request: PlanRequest) -> Plan:
    """Check the request and build what the search needs.

    Raises:
        ConfigError: a bad request; one line naming the flag or config key at fault.
    """
    r = request
    for flag, value in (
        ("--gpus", r.gpus),
        ("--gpus-per-node", r.gpus_per_node),
        ("--top", r.top),
        ("--seq-len", r.seq_len),
        ("--global-batch-size", r.global_batch),
    ):
        if value is not None and value < 1:
            raise ConfigError(f"{flag} {value} must be >= 1")
    if r.gpus > r.gpus_per_node and r.gpus % r.gpus_per_node:
        raise ConfigError(f"--gpus {r.gpus} is not a multiple of --gpus-per-node {r.gpus_per_node}: give whole nodes")
    tokens = list(r.overrides)
    if r.seq_len is not None:
        tokens += ["--training.seq_len", str(r.seq_len)]
    if r.global_batch is not None:
        tokens += ["--training.global_batch_size", str(r.global_batch)]
    base = load_config(r.config, tokens)
    batch_from = None
    if base.training.global_batch_size == -1:  # the batch the config trains with on these GPUs
        base.training.global_batch_size, batch_from = config_global_batch(base, r.gpus)
    cluster = _cluster(r, base)
    if r.gpu_memory is None and not any(r.gpu.lower() == name.lower() for name in GPU_MEMORY_GIB):
        raise ConfigError(f"--gpu {r.gpu!r} has no memory size in the table; give --gpu-memory (e.g. 80GiB)")
    device_memory, _ = parse_gpu_memory(r.gpu_memory or r.gpu)  # ValueError names --gpu-memory
    host_memory = _host_bytes(r.host_memory)
    if r.progress and base.compile.enable:
        r.progress("measuring the compiled block on fake tensors: what it keeps, and recomputes at each memory budget")
    usable = usable_bytes(device_memory)
    return Plan(r, base, cluster, workload(base), usable, device_memory, host_memory, global_batch_from=batch_from)


def config_global_batch(cfg: JobConfig, gpus: int) -> tuple[int, str]:
    """The global batch of a config that leaves `training.global_batch_size = -1`, as it trains on `gpus` GPUs: its
    local batch x its data-parallel degree there; and where that figure comes from, for the plan's first line.

    Raises:
        ConfigError: the config's degrees give no data-parallel degree on `gpus` GPUs.
    """
    p, local = cfg.parallelism, cfg.training.local_batch_size
    others = p.tensor_parallel_degree * p.context_parallel_degree * p.pipeline_parallel_degree
    replicas, shards = p.data_parallel_replicate_degree, p.data_parallel_shard_degree
    fixed = others * replicas * (shards if shards != -1 else 1)
    if gpus % fixed or (shards != -1 and fixed != gpus):
        raise ConfigError(
            f"--global-batch-size is needed: the config leaves training.global_batch_size = -1 (local batch x the "
            f"data-parallel degree), and its degrees (tp {p.tensor_parallel_degree} x cp {p.context_parallel_degree} "
            f"x pp {p.pipeline_parallel_degree} x dp_replicate {replicas} x dp_shard {shards}) do not fill --gpus "
            f"{gpus}"
        )
    dp = replicas * (shards if shards != -1 else gpus // fixed)
    return local * dp, (
        f"the config's local batch {local} x its data-parallel degree {dp} on {gpus} GPUs; --global-batch-size sets "
        "another"
    )


def _host_bytes(value: str | None) -> int:
    """`--host-memory` in bytes: a size such as "2TiB" or "1024GiB"."""
    try:
        size, read_as = parse_gpu_memory(value or HOST_MEMORY)
    except ValueError:
        read_as = None
    if read_as != (value or HOST_MEMORY).strip():  # not a size, or a GPU's name
        raise ConfigError(f"--host-memory {value!r} is not a size; give the host memory per node, e.g. 2TiB")
    return size


def _cluster(request: PlanRequest, cfg: JobConfig) -> Cluster:
    """The GPUs: peak FLOP/s from `metrics.peak_tflops`, else the peak table's row for `--gpu`."""
    import torch

    from titan_core.metrics.peak_flops import gpu_peak_flops

    dtype = torch.float32 if cfg.training.mixed_precision_param == "float32" else torch.bfloat16
    peak = cfg.metrics.peak_tflops * 1e12 if cfg.metrics.peak_tflops else gpu_peak_flops(request.gpu, dtype)
    if peak is None:
        known = ", ".join(n for n in GPU_MEMORY_GIB if gpu_peak_flops(n, torch.bfloat16))
        raise ConfigError(
            f"--gpu {request.gpu!r} is not in the peak FLOP/s table; name one of {known}, "
            "or give --metrics.peak_tflops and --gpu-memory"
        )
    return Cluster(request.gpus, min(request.gpus_per_node, request.gpus), peak)


def layout_config(plan: Plan, layout: Layout) -> JobConfig:
    """The job config of `layout`: the user's config and overrides (`plan.base`), then the layout's tokens.

    The same as `load_config(config, [*user_tokens, *layout_tokens])`, without reading the file again.
    """
    values = plan.base.model_dump()
    layout_values, origins = parse_overrides(layout_overrides(layout, plan.workload.global_batch))
    for section, table in layout_values.items():
        values[section].update(table)
    return validate_config(values, origins)


def default_estimator() -> Estimator:
    """`estimate_analytic`, for a CUDA target."""
    from titan_core.memory.analytic import estimate_analytic

    return lambda cfg, world_size: estimate_analytic(cfg, world_size, device_type="cuda")


def search(plan: Plan, estimate: Estimator | None = None, schedules: tuple[str, ...] | None = None) -> Plan:
    """Fill `plan.fits` with the fastest layouts that fit (see the module docstring); returns `plan`.

    Args:
        plan: from `prepare_plan`.
        estimate: `(cfg, world_size) -> MemoryEstimate`; default `estimate_analytic` for CUDA.
        schedules: pipeline schedules to search; default those of `PLAN_SCHEDULES` this torch has.
    """
    from titan_core.memory.activations import ActivationLayout
    from titan_core.memory.analytic import compute_dtype_bytes

    estimate = estimate or default_estimator()
    if schedules is None:
        from titan_parallel.pipeline_layout import available_schedules

        schedules = tuple(s for s in PLAN_SCHEDULES if s in available_schedules())
    cfg, w, c = plan.base, plan.workload, plan.cluster
    spec, args = model_of(cfg)
    sizes = block_sizes(cfg)
    compute_bytes = compute_dtype_bytes(cfg, "cuda")
    p = cfg.parallelism
    ends = (p.pipeline_parallel_first_stage_less_layers, p.pipeline_parallel_last_stage_less_layers)

    @functools.cache
    def refuse(tp: int, cp: int, pp: int, schedule: str, local: int, microbatch: int) -> str | None:
        probe = Layout(tp=tp, cp=cp, pp=pp, schedule=schedule, local_batch=local, microbatch=microbatch)
        return refuse_by_rule(probe, args, cfg, w.seq_len)

    @functools.cache
    def refuse_ep(dp_replicate: int, dp_shard: int, cp: int, tp: int, pp: int, ep: int, spans: bool) -> str | None:
        probe = Layout(dp_replicate=dp_replicate, dp_shard=dp_shard, cp=cp, tp=tp, pp=pp, ep=ep, ep_spans_tp=spans)
        return refuse_expert_parallel(probe, cfg)

    def activation_layout(tp: int, cp: int, ep_spans_tp: bool) -> ActivationLayout:
        return ActivationLayout(
            compute_bytes=compute_bytes,
            tp=tp,
            cp=cp,
            cp_rotate_method=w.cp_rotate_method,
            cp_method=w.cp_method,
            seq_len=w.seq_len,
            device_type="cuda",
            loss_parallel=not cfg.parallelism.disable_loss_parallel,
            ep_spans_tp=ep_spans_tp,
        )

    @functools.cache
    def activations(tp: int, cp: int, ep_spans_tp: bool) -> Any:  # measured on fake tensors once each (`eager_saved`)
        from titan_core.memory.eager_saved import measure_eager

        return measure_eager(spec, args, activation_layout(tp, cp, ep_spans_tp)).act

    def refused(t: Layout) -> str | None:
        refusal = refuse(t.tp, t.cp, t.pp, t.schedule, t.local_batch, t.microbatch)
        return refusal or refuse_ep(t.dp_replicate, t.dp_shard, t.cp, t.tp, t.pp, t.ep, t.ep_spans_tp)

    experts = w.moe.num_experts if plan.request.expert_parallel else 0
    if w.budget_recompute:  # measured at tp = 1: also at each TP degree a layout may take in a node (with cp = 1)
        # (TP across nodes runs its collectives over the network: those layouts are searched without budgets, which
        # would cost a trace per budget and kind of block each, ~2.8 s for DeepSeek-V3 671B's MoE
        # block on a 2-core AMD EPYC with AVX-512)
        tps = tuple(tp for tp in divisors(c.gpus)
                    if 1 < tp <= c.gpus_per_node and refuse(tp, 1, 1, "1F1B", 1, 1) is None)  # fmt: skip
        if plan.request.progress and tps:
            plan.request.progress(f"measuring what the memory budgets recompute under TP {', '.join(map(str, tps))}")
        more = budget_recompute(cfg, tps) if tps else ()
        w = plan.workload = dataclasses.replace(w, budget_recompute=w.budget_recompute + more)
    budgets: dict[int, tuple[float, ...]] = {}
    for tp, budget, _ in w.budget_recompute:
        budgets[tp] = (*budgets.get(tp, ()), budget)
    workers = plan.request.workers or (cpus if (cpus := _cpus()) >= SPREAD_FROM_CPUS else 1)
    if workers > 1:  # the layouts' eager measurements (a compiled run's bound reads them too) spread over processes
        from titan_core.memory.eager_saved import measure_eager_many

        keys = {
            (t.tp, t.cp, t.ep_spans_tp)
            for t in candidate_layouts(c.gpus, c.gpus_per_node, w.seq_len, w.global_batch, schedules, experts, budgets)
            if refused(t) is None
        }
        measure_eager_many(spec, args, [activation_layout(*key) for key in sorted(keys)], workers)

    if plan.request.progress:
        plan.request.progress(f"searching the layouts of {c.gpus} GPUs (each estimate measures its blocks once)")
    scored: list[Ranked] = []
    closest_bound = None
    for t in candidate_layouts(c.gpus, c.gpus_per_node, w.seq_len, w.global_batch, schedules, experts, budgets):
        plan.counts["layouts"] += 1
        refusal = refused(t)
        if refusal is not None:
            plan.counts["rule"] += 1
            plan.rule_errors[refusal] += 1
            continue
        act = activations(t.tp, t.cp, t.ep_spans_tp)  # compiled: its blocks' inputs only
        bound = memory_lower_bound(t, w, act, sizes, compute_bytes, ends, compiled=cfg.compile.enable)
        host = host_lower_bound(t, w, c.gpus_per_node) if t.offload else 0
        over_host = host > plan.host_memory
        if over_host and bound <= plan.usable:
            _needs_host(plan, host)
        if bound > plan.usable or over_host:
            plan.counts["lower_bound"] += 1
            if not over_host and (closest_bound is None or bound < closest_bound.peak):
                closest_bound = _score(plan, t, bound)
            continue
        scored.append(_score(plan, t, bound))
    plan.closest = closest_bound
    scored.sort(key=rank_key)
    _estimate_fastest(plan, scored, estimate)
    return plan


SPREAD_FROM_CPUS = 4
"""`PlanRequest.workers` unset: the CPUs from which the search spreads its measurements over processes."""


def _cpus() -> int:
    """The CPUs this process may run on (its affinity, where the OS tells it)."""
    affinity = getattr(os, "sched_getaffinity", None)
    return len(affinity(0)) if affinity is not None else os.cpu_count() or 1


SIMPLICITY_MARGIN = 0.02
"""Step time a layout is charged per model-parallel dimension it uses (tp, cp, pp, ep > 1), for ranking only: the
cost model does not see the per-micro-batch and per-collective overheads of each, and cannot tell layouts
within a few percent apart; among those, the simpler layout ranks first (e.g. FSDP alone over pp=4 x cp=2
for an 8B model on 8 GPUs of 96 GiB, 2.20 s against 2.19 s)."""


def rank_key(ranked: Ranked) -> tuple[float, int]:
    """What layouts are ranked by: step time plus `SIMPLICITY_MARGIN` per model-parallel dimension, then memory."""
    t = ranked.layout
    dims = (t.tp > 1) + (t.cp > 1) + (t.pp > 1) + (t.ep > 1)
    return ranked.cost.seconds * (1 + SIMPLICITY_MARGIN * dims), ranked.peak


def _score(plan: Plan, layout: Layout, bound: int) -> Ranked:
    """`layout` scored by the cost model, with its memory lower bound as the peak until it is estimated."""
    cost = estimate_step_cost(layout, plan.workload, plan.cluster)
    return Ranked(layout, cost, tokens_per_second_per_gpu(cost, plan.workload, plan.cluster), peak=bound)


def _estimate_fastest(plan: Plan, scored: list[Ranked], estimate: Estimator) -> None:
    """Estimate `scored` (fastest first) until `plan.request.top` rows fit; count what was skipped."""
    over: dict[tuple, list[Layout]] = {}  # estimated layouts over the budget, by degrees and schedule
    shown: set[tuple] = set()
    for i, ranked in enumerate(scored):
        if len(plan.fits) == plan.request.top:
            plan.counts["not_estimated"] = len(scored) - i
            return
        t = ranked.layout
        group = degrees_and_schedule(t)
        # one table row: a faster batch split of it is all the table shows
        row = (*group, t.ac, t.memory_budget, t.offload)
        if row in shown or any(needs_at_least(t, big) for big in over.get(group, ())):
            plan.counts["skipped"] += 1  # a faster split of the same row fits, or a smaller layout did not
            continue
        if _estimate_one(plan, ranked, estimate):
            shown.add(row)
        elif ranked.estimated and ranked.peak > plan.usable:
            over.setdefault(group, []).append(t)


def _estimate_one(plan: Plan, ranked: Ranked, estimate: Estimator) -> bool:
    """Estimate `ranked`'s memory; count it under fit, memory or rule in `plan`; True when it fits."""
    try:
        result = estimate(layout_config(plan, ranked.layout), plan.cluster.gpus)
    except ConfigError as e:  # a rule the torch-free checks of step 2 do not run
        plan.counts["rule"] += 1
        plan.rule_errors[str(e)] += 1
        return False
    plan.counts["estimated"] += 1
    ranked.peak, ranked.estimated = result.peak, True
    host = max((r.cpu_offloaded for r in result.ranks), default=0) * plan.cluster.gpus_per_node
    if ranked.peak <= plan.usable and host <= plan.host_memory:
        plan.counts["fit"] += 1
        plan.fits.append(ranked)
        return True
    if ranked.peak <= plan.usable:
        _needs_host(plan, host)
    plan.counts["memory"] += 1
    c = plan.closest
    if ranked.peak > plan.usable and (c is None or not c.estimated or ranked.peak < c.peak):
        plan.closest = ranked  # the nearest to fitting: an estimate before a lower bound, then the smallest
    return False


def _needs_host(plan: Plan, host: int) -> None:
    """Note that a layout within GPU memory needed `host` bytes of host memory per node, over `plan.host_memory`."""
    plan.host_needed = host if plan.host_needed is None else min(plan.host_needed, host)
