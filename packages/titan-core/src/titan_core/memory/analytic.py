"""The analytic tier of `titan estimate-memory`: per-rank peak memory by arithmetic on measured parts, for any size.

Quick for any model size and world size: parameters are counted on the meta
model (exact, after TP and FSDP sharding with FSDP2's padding); the bytes each kind
of block, the head and the loss keep for backward are measured once per layout on fake
tensors at the rank's shapes (`titan_core.memory.eager_saved`; under compile, the blocks
from the compiled graph, `compiled_saved`) and scaled by tokens, and so are the transients of a
backward (a block's, the loss's); and the peak is the largest of the moments a training step passes through
(`_moments`): the loss's backward, the output projection's backward, the last
block's backward, and the optimizer step. `docs/memory.md` writes every term out.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from titan_core.config.errors import ConfigError
from titan_core.config.schema import JobConfig
from titan_core.job import Job
from titan_core.memory.blocks import block_activations, block_backward_peak, saved_per_block
from titan_core.memory.report import MemoryEstimate, RankMemory
from titan_core.memory.run_paths import (
    float8_loss_applies,
    fused_loss_applies,
    plain_loss_compiled,
    precast_float8_weights,
)
from titan_core.memory.target_job import check_target_job
from titan_core.muon_groups import takes_muon
from titan_core.optim import resolve_implementation

if TYPE_CHECKING:
    from titan_core.memory.activations import ActivationBytes
    from titan_core.memory.eager_saved import FusedLossBytes
    from titan_parallel import ParallelDims

DTYPE_BYTES = {"bfloat16": 2, "float32": 4, "float16": 2}
"""Bytes per element of the dtypes a config names (`training.mixed_precision_param` / `_reduce`)."""
_SHARDED_STYLES = {"colwise", "rowwise", "embedding", "output"}


@dataclass
class _StageParams:
    """Element counts of the parameters one rank holds for one set of modules."""

    sharded: int = 0  # local shard (after TP and FSDP), what the optimizer steps
    muon: int = 0  # of `sharded`, what Muon steps under optimizer.name = "Muon" (titan_core.muon_groups.RULE)
    unsharded_blocks: list[int] = field(default_factory=list)  # per block, after TP only: what FSDP all-gathers
    unsharded_root: dict[str, int] = field(default_factory=dict)  # per root unit (embedding, output, rest), after TP
    matmul: int = 0  # after TP: the weights autocast copies to the compute dtype
    buffers: int = 0  # bytes


def estimate_analytic(cfg: JobConfig, world_size: int, *, device_type: str | None = None) -> MemoryEstimate:
    """Per-rank peak memory of `cfg` on `world_size` ranks, by arithmetic on measured parts.

    Args:
        cfg: the job config.
        world_size: number of ranks.
        device_type: the target device ("cuda" / "cpu"); None = 'cpu' when `training.device`
            says so, else 'cuda'.

    Raises:
        ConfigError: the layout breaks a rule of `titan_core.job`, or it has TP / CP and this process already
            has a process group (the blocks are measured over a fake one).
    """
    job, notes = check_target_job(cfg, world_size, device_type)
    return _estimate(job, notes)


def compute_dtype_bytes(cfg: JobConfig, device_type: str) -> int:
    """Bytes of the compute dtype `training.mixed_precision_param` resolves to on `device_type`."""
    name = cfg.training.mixed_precision_param
    if name != "auto":
        return DTYPE_BYTES[name]
    if device_type == "cuda":
        return 2
    import torch

    from titan_parallel.precision import native_bf16

    return 2 if native_bf16(torch.device("cpu"))[0] else 4


def _estimate(job: Job, notes: list[str]) -> MemoryEstimate:
    from titan_core.memory.activations import ActivationLayout
    from titan_parallel import uses_fsdp

    cfg, world_size = job.cfg, job.world_size
    dims, _ = _sized(job)
    assert world_size is not None, "an estimate's job is resolved for a world size"
    t, p = cfg.training, cfg.parallelism
    b = compute_dtype_bytes(cfg, job.device_type)
    fsdp = uses_fsdp(dims, job.parallel)  # the same rule `parallelize` wraps by (bf16 on one rank included)
    shards = dims.dp_shard * dims.cp if fsdp else 1
    reduce_b = DTYPE_BYTES[t.mixed_precision_reduce] if fsdp else 4
    layout = ActivationLayout(
        compute_bytes=b,
        tp=dims.tp,
        cp=dims.cp,
        cp_rotate_method=p.context_parallel_rotate_method,
        cp_method=p.context_parallel_method,
        seq_len=t.seq_len,
        device_type=job.device_type,
        loss_parallel=not p.disable_loss_parallel,
        block_causal=cfg.model.attn_mask_type == "block_causal",
        ep_spans_tp=dims.ep_spans_tp,
    )
    from titan_core.memory.eager_saved import measure_eager
    from titan_core.memory.fake_run import NoFakeGroup

    microbatch = p.pipeline_parallel_microbatch_size if dims.pp > 1 else t.local_batch_size
    tokens = microbatch * t.seq_len // dims.cp  # rank-local tokens of one (micro)batch
    try:
        eager = measure_eager(job.spec, job.model_args, layout, job.meta_model())
    except NoFakeGroup:
        raise ConfigError(
            "the analytic estimate of a tensor / context parallel layout measures its blocks over a fake process "
            "group, and this process already has one: estimate before init_process_group, or in a process of its own"
        ) from None
    act, fused_saved = eager.for_tokens(tokens), eager.fused_loss  # per-call bytes over the micro-batch
    if cfg.compile.enable:  # the blocks' saved bytes read from the compiled graph (eager runs: measured eager)
        from titan_core.memory.compiled_estimate import compiled_block_bytes, compiled_loss_bytes

        act, compile_note = compiled_block_bytes(job, act, layout, microbatch)
        notes.append(compile_note)
        act, loss_note = compiled_loss_bytes(job, act)
        notes += [loss_note] if loss_note else []
    stages = _stage_names(job)
    buffers = _buffer_bytes(job)  # counted once: every stage holds the root's buffers
    ranks = [
        _rank_memory(job, pp_rank, stages, act, fused_saved, b, reduce_b, fsdp, shards, tokens, buffers)
        for pp_rank in range(dims.pp)
    ]
    float8 = job.converters.float8
    if float8 is not None and not cfg.compile.enable:  # compiled: the compile note says how the blocks were counted
        notes.append("float8: the eager blocks' activations are counted as in the compute dtype (an upper bound)")
    if float8 is not None and float8.enable_fsdp_float8_all_gather and shards > 1:
        notes.append("float8: FSDP's float8 all-gathers are counted in the compute dtype (an upper bound)")
    if cfg.optimizer.name == "Muon":
        notes.append(
            "Muon: one fp32 momentum per element of the blocks' matrices (AdamW's two moments for the rest); "
            "its step adds each local matrix's update and, where matrices are split over ranks, the bf16 "
            "buffers that gather each whole on its owner (docs/optimizers.md)"
        )
    return MemoryEstimate("analytic", world_size, describe_layout(job, b), ranks, notes=notes)


def _sized(job: Job) -> tuple[ParallelDims, int]:
    """`job.dims` and `job.accum_steps`: `resolve` leaves them None only without a world size, and an
    estimate's job always has one (`check_target_job`)."""
    assert job.dims is not None and job.accum_steps is not None, "an estimate's job is resolved for a world size"
    return job.dims, job.accum_steps


def describe_layout(job: Job, compute_bytes: int) -> str:
    """The layout as both tiers print it: the degrees above 1, then the run's shape, e.g.
    'dp_shard=8 (bf16 compute; AC selective (op); local batch 1 x seq 8192)'."""
    cfg = job.cfg
    dims, accum_steps = _sized(job)
    t, p, ac = cfg.training, cfg.parallelism, cfg.activation_checkpoint
    degrees = ", ".join(f"{k}={v}" for k, v in _degrees(dims).items()) or "no parallelism"
    extras = [
        f"{'bf16' if compute_bytes == 2 else 'fp32'} compute",
        f"AC {ac.mode}"
        + {"selective": f" ({ac.selective_ac_option})", "memory_budget": f" ({ac.memory_budget:g})"}.get(ac.mode, ""),
    ]
    if dims.cp > 1:
        method = p.context_parallel_method
        extras.append(f"CP {method}" + (f" ({p.context_parallel_rotate_method})" if method == "ring" else ""))
    if dims.pp > 1:
        extras.append(f"{p.pipeline_parallel_schedule}, microbatch {p.pipeline_parallel_microbatch_size}")
    extras.append(f"local batch {t.local_batch_size} x seq {t.seq_len}")
    if accum_steps > 1:
        extras.append(f"{accum_steps} accumulation steps")
    return f"{degrees} ({'; '.join(extras)})"


def _degrees(dims: ParallelDims) -> dict[str, int]:
    """The degrees above 1; `ep` last, as it is carved from the dp_shard x cp ranks rather than multiplying them."""
    names = ("dp_replicate", "dp_shard", "cp", "tp", "pp", "ep")
    return {n: getattr(dims, n) for n in names if getattr(dims, n) > 1}


def _stage_names(job: Job) -> list[list[str]]:
    """Module names of each stage; one stage holding everything without pipeline parallel."""
    if job.names_per_stage:
        return job.names_per_stage
    return [[name for name, _ in job.meta_model().named_children()]]


def _tp_styles(job: Job) -> tuple[dict[str, str], dict[str, str]]:
    plan = job.spec.plan
    return {m: s.value for m, s in plan.tp}, {m: s.value for m, s in plan.block_tp}


def _moe_tp_dim(pname: str, moe: str | None, block_styles: dict[str, str], routed: bool) -> int | None:
    """The dim tensor parallel splits of the block parameter `pname` inside a `TPStyle.MOE_INPUT` module, or None
    (`routed=False`: the routed experts stay whole, as when the TP ranks join expert parallel)."""
    from titan_parallel.tensor_parallel_layout import MOE_TP_SPLITS

    if moe is None or block_styles.get(moe) != "moe_input" or not pname.startswith(moe + "."):
        return None
    inner = pname[len(moe) + 1 :]
    return MOE_TP_SPLITS.get(inner) if routed or not inner.startswith("experts.") else None


def _count_params(job: Job, module_names: list[str], shards: int) -> _StageParams:
    """Parameters of the modules `module_names` (top-level names or `blocks.i`) on one rank."""
    model = job.meta_model()
    plan = job.spec.plan
    dims, _ = _sized(job)
    tp, ep = dims.tp, dims.ep
    root_styles, block_styles = _tp_styles(job)
    out = _StageParams()
    seen: set[int] = set()
    for name in module_names:
        module = model.get_submodule(name)
        in_block = name.startswith(plan.blocks + ".")
        block_total = 0
        for pname, param in module.named_parameters():
            if id(param) in seen:
                continue
            seen.add(id(param))
            owner = pname.rsplit(".", 1)[0] if "." in pname else ""
            style = block_styles.get(owner) if in_block else root_styles.get(name if not owner else f"{name}.{owner}")
            shape = list(param.shape)
            if tp > 1 and style in _SHARDED_STYLES:
                dim = 0 if style in ("colwise", "embedding", "output") else len(shape) - 1
                shape[dim] = math.ceil(shape[dim] / tp)
            moe_split = (
                _moe_tp_dim(pname, plan.moe, block_styles, not dims.ep_spans_tp) if in_block and tp > 1 else None
            )
            if moe_split is not None:  # an expert's (or shared expert's) hidden dim (`TPStyle.MOE_INPUT`)
                shape[moe_split] = math.ceil(shape[moe_split] / tp)
            expert_shards = shards
            if in_block and ep > 1 and plan.moe is not None and owner.startswith(f"{plan.moe}.experts"):
                # Expert parallel keeps E / ep experts per rank (gathered by FSDP whole); FSDP shards
                # them on dim 1 over the ranks holding the same experts (dp_shard x cp / ep of them, x tp when
                # the TP ranks are part of the ep group).
                shape[0] //= ep
                expert_shards = shards * (tp if dims.ep_spans_tp else 1) // ep
                rows_dim = 1
            else:
                rows_dim = 0
            local = math.prod(shape)
            rows = shape[rows_dim] if shape else 1
            sharded = math.ceil(rows / expert_shards) * (local // max(rows, 1)) if expert_shards > 1 else local
            out.sharded += sharded
            if job.cfg.optimizer.name == "Muon" and takes_muon(f"{name}.{pname}", param.dim(), plan):
                out.muon += sharded
            if param.dim() == 2 and style != "embedding" and not name.endswith("embeddings"):
                out.matmul += local
            if in_block:
                block_total += local
            else:
                out.unsharded_root[name] = out.unsharded_root.get(name, 0) + local
        if in_block:
            out.unsharded_blocks.append(block_total)
    return out


def _buffer_bytes(job: Job) -> int:
    """Buffers every stage holds (the root's, e.g. the RoPE table), in bytes."""
    return sum(buf.numel() * buf.element_size() for buf in job.meta_model().buffers())


def inflight_microbatches(schedule: str, pp: int, pp_rank: int, stages_per_rank: int, microbatches: int) -> float:
    """Micro-batches whose activations a pipeline rank holds at its peak, in units of its whole set of stages.

    1F1B warms up `pp - 1 - rank` forwards, then keeps one more: `pp - rank`. GPipe runs every
    forward first: all micro-batches. Schedules with v stages per rank (interleaved, zero-bubble
    V) warm up `(v - 1) pp + 2 (pp - 1 - rank)` stage-forwards plus one, each holding 1/v of the
    rank's activations. Never more than all micro-batches.

    Args:
        schedule: the pipeline schedule's name.
        pp: pipeline degree (1: no pipeline, one micro-batch).
        pp_rank: the rank's place in the pipeline.
        stages_per_rank: v.
        microbatches: micro-batches per pipeline run.
    """
    if pp == 1:
        return 1.0
    if schedule == "GPipe":
        return float(microbatches)
    if stages_per_rank == 1:
        return float(min(microbatches, pp - pp_rank))
    v = stages_per_rank
    chunks = (v - 1) * pp + 2 * (pp - 1 - pp_rank) + 1
    return min(chunks, microbatches * v) / v


def _rank_memory(
    job: Job,
    pp_rank: int,
    stages: list[list[str]],
    act: ActivationBytes,
    fused_saved: FusedLossBytes,
    b: int,
    reduce_b: int,
    fsdp: bool,
    shards: int,
    tokens: int,
    stage_buffers: int,
) -> RankMemory:
    from titan_parallel.pipeline_layout import stage_indices

    cfg = job.cfg
    dims, accum_steps = _sized(job)
    t, p, ac = cfg.training, cfg.parallelism, cfg.activation_checkpoint
    plan = job.spec.plan
    if dims.pp > 1:
        indices = stage_indices(pp_rank, dims.pp, len(stages), p.pipeline_parallel_schedule)
    else:
        indices = (0,)
    names = [name for i in indices for name in stages[i]]
    expanded = _expand_blocks(job, names)
    params = _count_params(job, expanded, shards)
    blocks = params.unsharded_blocks
    block_acts = block_activations(act, [n for n in expanded if n.startswith(plan.blocks + ".")])
    has_head = any(n in plan.pp_last for n in names) or dims.pp == 1
    buffers = stage_buffers * len(indices)

    # Model states: fp32 master parameters, fp32 gradients, two fp32 Adam moments (Muon: one momentum). Master
    # weights (`titan_parallel.master_weights`): the compute copies beside the masters, gradients in the compute dtype.
    master = job.parallel.master_weights
    param_bytes = (4 + (b if master else 0)) * params.sharded + precast_float8_weights(job)  # + float8 copies
    if job.cfg.ema.enable:  # the moving average of the weights: one more fp32 copy of the shards (titan_core.ema)
        param_bytes += 4 * params.sharded
    ft = job.cfg.fault_tolerance
    semi_sync = ft.enable and ft.semi_sync_method != "none"
    if semi_sync:  # DiLoCo's anchors (+ outer momentum) beside the weights
        param_bytes += 4 * params.sharded * (1 if ft.semi_sync_method == "local_sgd" or not ft.outer_momentum else 2)
        if ft.fragment_sync_delay:  # a fragment's all-reduce runs behind the next steps: its flat buffer stays
            param_bytes += (2 if ft.sync_dtype == "bfloat16" else 4) * params.sharded // ft.num_fragments
    grad_bytes = (b if master else 4) * params.sharded
    opt_bytes = 8 * (params.sharded - params.muon) + 4 * params.muon
    if p.dp_mode == "ddp" and dims.dp_replicate > 1:
        grad_bytes *= 2  # DDP's gradient buckets hold a second copy

    # Activations kept for backward, per micro-batch on this rank's stages.
    per_block = saved_per_block(block_acts, ac.mode, ac.selective_ac_option)
    n_micro = t.local_batch_size // p.pipeline_parallel_microbatch_size if dims.pp > 1 else 1
    inflight = inflight_microbatches(p.pipeline_parallel_schedule, dims.pp, pp_rank, len(indices), n_micro)
    saved_blocks = tokens * sum(per_block)
    fused = fused_loss_applies(job)
    # The fused loss keeps the gradients it took in forward (hidden states, output weight), no logits: measured.
    fused_fixed = fused_saved.fixed
    # Multi-token prediction: each depth's rows go through the head and the loss (once per depth), their saved
    # bytes kept together until backward.
    head_tokens = tokens * (1 + getattr(job.model_args, "n_mtp_layers", 0))
    saved_loss = head_tokens * fused_saved.per_token + fused_fixed if fused else head_tokens * act.logits_saved
    saved_head = head_tokens * act.head + saved_loss if has_head else 0
    gpipe = dims.pp > 1 and p.pipeline_parallel_schedule == "GPipe"
    # GPipe's last stage runs every micro-batch's loss before the first backward; the 1F1B family's, one at a time.
    activations = inflight * saved_blocks + saved_head * (n_micro if gpipe else 1)

    # FSDP's gathered (unsharded) parameters and gradient buffers, in the compute dtype.
    biggest_block = max(blocks, default=0)
    root = params.unsharded_root
    output_weight = sum(v for k, v in root.items() if k in plan.pp_last and k != "norm")
    one_shard_rank = dims.dp_shard * dims.cp == 1  # FSDP keeps a one-rank group's gathered copy (fsdp.py)
    reshard = {"always": True, "never": False, "default": dims.pp == 1 and not one_shard_rank}[
        p.fsdp_reshard_after_forward
    ]
    if fsdp:
        gathered_fwd = 2 * b * biggest_block if reshard else b * sum(blocks) + b * sum(root.values())
        # backward: this block and the prefetched next gathered, its gradient in b bytes and the
        # reduce-scatter input in the reduce dtype
        block_comm_bwd = (b * biggest_block if reshard else 0) + gathered_fwd + (b + reduce_b) * biggest_block
        output_comm_bwd = (b if reshard else 0) * output_weight + (b + reduce_b) * output_weight + b * biggest_block
    else:
        gathered_fwd = block_comm_bwd = output_comm_bwd = 0
    cast_copies = b * params.matmul if (not fsdp and not master and b != 4) else 0  # autocast's compute-dtype weights

    offload = t.enable_cpu_offload  # parameters, gradients and optimizer state live in host memory
    # Gradients of earlier micro-batches (accumulation steps, or pipeline micro-batches) live through a backward.
    grads_during_bwd = grad_bytes if (accum_steps > 1 or n_micro > 1) and not offload else 0
    reduce_once = accum_steps > 1 and not job.cfg.parallelism.fsdp_reduce_every_microbatch
    if fsdp and (dims.pp > 1 or reduce_once):
        # Under pipeline parallel (torch.distributed.pipelining turns the sync off) or with
        # `parallelism.fsdp_reduce_every_microbatch = false`, FSDP reduces once, after the last micro-batch: until
        # then it keeps the stage's unsharded gradients, in the reduce dtype.
        grads_during_bwd += max(b, reduce_b) * (sum(blocks) + sum(root.values()))
    if gpipe and accum_steps == 1:
        # GPipe runs every micro-batch's forward before the first backward: while all are kept no gradient exists
        # yet (zero_grad leaves None); from the second backward on they do, and one micro-batch fewer is kept.
        if grads_during_bwd > saved_blocks + saved_head:
            activations -= saved_blocks + saved_head
        else:
            grads_during_bwd = 0
    # A block's backward: its recompute under AC, the gradients of its activations, net of what the blocks after it
    # freed; where no earlier micro-batch made them, plus the parameters' gradients those blocks left behind. Not
    # under FSDP: there the CPU rows hold within 9% without them and go over 10% with them (single-bf16,
    # fsdp2-ac-full; docs/memory.md): what FSDP's backward frees meanwhile is not followed yet.
    per_param = grad_bytes / params.sharded if params.sharded else 4.0  # bytes of a gradient per local parameter
    grads_grow = grads_during_bwd == 0 and not offload and not fsdp
    block_grads = [round(per_param * n / shards) if grads_grow else 0 for n in blocks]
    head_params = sum(v for k, v in params.unsharded_root.items() if k in plan.pp_last)
    head_grads = round(per_param * head_params / shards) if grads_grow and has_head else 0
    block_bwd = block_backward_peak(
        block_acts or [act], per_block or [0], ac.mode, ac.selective_ac_option, tokens, block_grads or None, head_grads
    )
    implementation, _ = resolve_implementation(cfg.optimizer.implementation, job.device_type)
    opt_temp = {"foreach": 4 * (params.sharded - params.muon), "fused": 0}.get(implementation, 0)
    if implementation == "for-loop":
        opt_temp = 4 * max(blocks + list(root.values()), default=0) // max(shards, 1)
    if master:  # the Triton kernel reads the bf16 gradients; elsewhere torch's fused step takes fp32 casts of them
        opt_temp = 0 if job.device_type == "cuda" else 4 * params.sharded
    # Muon's step (titan_core.muon): each local matrix's fp32 Nesterov update (4 B) and its Newton-Schulz result
    # (r: 2 B in bf16, 4 B in fp32); split over ranks, also the exchange's buffers (titan_parallel.matrix_owners,
    # r B each), three alive at once. Measured (CPU allocator, debugmodel) per Muon element, bf16 / fp32:
    # 6.2 / 8.4 B on one process, 12.3 / 20.6 B on FSDP 2.
    if params.muon:
        from titan_core.muon import resolve_ns_dtype

        ns_dtype, _ = resolve_ns_dtype(cfg.optimizer.muon_ns_dtype, job.device_type)
        r = ns_dtype.itemsize
        exchanged = shards > 1 or dims.tp > 1
        opt_temp += (4 + r + (3 * r if exchanged else 0)) * params.muon
    if fused:  # one chunk of logits at a time; backward only scales the kept gradients (one copy of each)
        from titan_parallel.linear_cross_entropy import default_chunk_rows

        chunk = min(tokens, default_chunk_rows(job.model_args.vocab_size))  # the loss runs once per depth
        logits_now = chunk * (act.logits + act.logits_saved) if has_head else 0  # a chunk's loss, saved and freed
        grad_logits = saved_loss if has_head else 0
        if has_head and float8_loss_applies(job):  # float8 W, h and a chunk's logit gradient, each in two layouts
            local_vocab = job.model_args.vocab_size // (dims.tp if not p.disable_loss_parallel else 1)
            logits_now += 2 * (local_vocab * job.model_args.dim + tokens * job.model_args.dim + chunk * local_vocab)
    elif plain_loss_compiled(job):  # Inductor's backward writes the logits' gradient in the compute dtype, fused
        logits_now = grad_logits = tokens * b * job.model_args.vocab_size if has_head else 0
    else:  # one depth's rows at a time: the loss runs once per depth
        logits_now = tokens * act.logits if has_head else 0
        grad_logits = tokens * act.logits_grad if has_head else 0

    moments = {
        # The loss's backward: every activation saved, the log-softmax and its gradients.
        "loss backward": (activations + logits_now + (gathered_fwd if not reshard else 0), grads_during_bwd),
        # The output projection's backward: its weight gathered, its gradient and reduce-scatter buffers.
        "output backward": (activations + grad_logits + output_comm_bwd, grads_during_bwd),
        # The last block's backward: recompute (under AC), the gradients of its activations, FSDP buffers.
        "block backward": (
            activations - (saved_head if has_head else 0) + block_bwd + block_comm_bwd,
            grads_during_bwd,
        ),
        # The optimizer step: every gradient, the optimizer's temporaries.
        "optimizer step": (0, 0) if offload else (opt_temp, grad_bytes),  # offloaded: the step runs on the host
    }
    sync_buffer = 0
    if semi_sync:
        # DiLoCo's sync after the step: the inner gradients freed, the pseudo-gradients in one flat buffer in the
        # wire's dtype (`titan_core.diloco`); the anchors and outer momentum are counted with the parameters.
        wire = 2 if ft.sync_dtype == "bfloat16" else 4  # bfloat16 on the wire: read back as fp32 for the outer step
        sync_buffer = wire * params.sharded // ft.num_fragments  # one fragment per sync (about)
        upcast = 4 * params.sharded // ft.num_fragments if wire < 4 else 0
        if ft.fragment_sync_delay:  # held through the next steps: counted with the model states above
            sync_buffer = 0
        moments["diloco sync"] = (sync_buffer + upcast, 0)
    elif ft.enable:
        # torchft replica groups average the local gradient shards across groups through one flat copy per dtype
        # (`titan_core.fault_tolerance`): every gradient and its flat copy, between backward and the step.
        moments["replica all-reduce"] = (grad_bytes, grad_bytes)
    name, (transient, grads) = max(moments.items(), key=lambda kv: kv[1][0] + kv[1][1])
    comm = {
        "loss backward": gathered_fwd if not reshard else 0,
        "output backward": output_comm_bwd,
        "block backward": block_comm_bwd,
        "optimizer step": 0,
        "replica all-reduce": grad_bytes if ft.enable else 0,
        "diloco sync": sync_buffer,  # the flat buffer is what the all-reduce sends
    }[name]
    after_backward = name in ("optimizer step", "replica all-reduce", "diloco sync")  # every activation freed
    act_at_peak = 0 if after_backward else (activations - (saved_head if name == "block backward" else 0))
    temporary = transient - comm - act_at_peak + cast_copies
    detail = {
        "peak_moment_" + name.replace(" ", "_"): 0,
        "saved_activations_per_microbatch": int(saved_blocks + saved_head),
        "microbatches_in_flight_x1000": int(inflight * 1000),
        "block_backward_transient": int(block_bwd),
        "logits_transient": int(logits_now),
        "fsdp_gathered_forward": int(gathered_fwd),
        "autocast_weight_copies": int(cast_copies),
        "optimizer_temporaries": int(opt_temp),
        "muon_elements": int(params.muon),
        "buffers": int(buffers),
    }
    return RankMemory(
        stage=pp_rank,
        parameters=0 if offload else param_bytes + buffers,
        gradients=int(grads),
        optimizer=0 if offload else opt_bytes,
        activations=int(act_at_peak),
        communication=int(comm),
        temporary=int(temporary),
        cpu_offloaded=(param_bytes + grad_bytes + opt_bytes) if offload else 0,
        detail=detail,
    )


def _expand_blocks(job: Job, names: list[str]) -> list[str]:
    """Stage module names with the block container (`layers`) spelled out block by block."""
    blocks = job.spec.plan.blocks
    out: list[str] = []
    for name in names:
        if name == blocks:
            out.extend(f"{blocks}.{child}" for child, _ in job.meta_model().get_submodule(blocks).named_children())
        else:
            out.append(name)
    return out
