"""What the analytic tier takes from the compiled measurements: a compiled job's block and loss figures in place of the
eager ones, with a note saying what was measured, or why not.

The measurements are `titan_core.memory.compiled_saved`'s (a whole block traced on fake tensors at tp = cp = 1,
the compiled plain loss) and `titan_core.memory.compiled_parallel`'s (a block split and compiled as under tensor /
context parallel, and a Mixture-of-Experts block compiled around its eager experts); this module decides which
applies to a job, with what (its AC kinds, its memory budget, its float8 linears as the target runs them), and turns
their figures into `ActivationBytes`.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

import torch

from titan_core.memory.compiled_saved import measure_block, measure_loss

if TYPE_CHECKING:
    from titan_core.config import JobConfig
    from titan_core.job import Job
    from titan_core.memory.activations import ActivationBytes, ActivationLayout
    from titan_core.memory.compiled_parallel import Split
    from titan_parallel.float8 import Float8Options


def traced_float8(cfg: JobConfig, device_type: str) -> Float8Options | None:
    """The [float8] options a run on `device_type` converts its linears with, as its blocks are traced: None without
    float8; `emulate = 'auto'` resolves against the target, not this host (a CUDA target's float8 GPU runs
    `_scaled_mm`: that graph is traced here too).

    Args:
        cfg: the job config.
        device_type: the target's device type.
    """
    if "float8" not in cfg.model.converters:
        return None
    from titan_core.converters import float8_options

    options = float8_options(cfg, device_type)
    if device_type == "cuda" and cfg.float8.emulate == "auto":
        options = dataclasses.replace(options, emulate=False)
    return options


def compiled_block_bytes(
    job: Job, act: ActivationBytes, layout: ActivationLayout, sequences: int = 1
) -> tuple[ActivationBytes, str]:
    """`act` with a block's saved bytes (`block`, and `block_op` or `block_input` as the AC mode needs)
    measured from the compiled block, and a note for the estimate saying so; `act` unchanged, and a note
    saying why, where the compiled block is not measured (see the module docstring).

    The block is measured on one sequence of `training.seq_len` tokens: what it saves grows with the
    batch, but for the few tensors per position (RoPE's rotation, `seq_len x head_dim / 2` complex
    numbers, a few hundred bytes per position), which a batch of B sequences counts B times, an
    overcount under 1% of a block. One figure per token then serves every micro-batch size, as the
    planner tries them. Under tensor / context parallel a block also keeps per-call tensors that are not small
    (float8 weight copies under TP, ring attention's mask): there it is measured at `sequences` too
    (`parallel_block_bytes`).

    Args:
        job: the resolved job (compile on).
        act: the eager figures measured for the job's layout.
        layout: that layout (`eager_saved.measure_eager`'s), read under tensor parallel.
        sequences: sequences per micro-batch on a rank, over which per-call bytes are spread.
    """
    from titan_parallel import uses_fsdp

    cfg = job.cfg
    dims = job.dims
    assert dims is not None, "an estimate's job is resolved for a world size"
    dtype = job.parallel.param_dtype
    eager = "the eager blocks' figures (an upper bound)"
    if cfg.activation_checkpoint.mode == "memory_budget":
        eager += ", every activation kept: the memory budget's recompute is not counted"
    why_not = None
    if not job.parallel.compile:
        why_not = "compile.components leaves the blocks eager"
    elif job.parallel.compile_backend == "eager":
        why_not = "compile.backend = 'eager' runs Dynamo alone, whose blocks save what eager ones do"
    elif job.converters.mx is not None:
        why_not = "MX linears are not measured compiled"
    elif dtype != torch.float32 and not uses_fsdp(dims, job.parallel) and not job.parallel.master_weights:
        why_not = "autocast's compiled blocks (DDP with a 16-bit compute dtype) are not measured"
    if why_not is not None:
        return act, f"compile: {why_not}; {eager}"
    if dims.tp > 1 or dims.cp > 1 or job.spec.plan.moe is not None or act.per_block:
        return parallel_block_bytes(job, act, layout, sequences)
    ac = cfg.activation_checkpoint
    kinds = ["none"]
    if ac.mode == "selective" and ac.selective_ac_option == "op":
        kinds.append("op")
    elif ac.mode == "memory_budget":
        kinds.append("budget")
    elif ac.mode != "none":
        kinds.append("full")
    meta = job.meta_model()
    block = next(iter(meta.get_submodule(job.spec.plan.blocks).children()))
    rope = getattr(meta, "rope_cache", None)
    if not isinstance(rope, torch.Tensor):
        return act, f"compile: the model has no `rope_cache` to call a block with; {eager}"
    float8 = traced_float8(cfg, job.device_type)
    try:
        traced = {
            kind: measure_block(
                block,
                family=cfg.model.name,
                blocks_path=job.spec.plan.blocks,
                rope_shape=tuple(rope.shape),
                rope_dtype=rope.dtype,
                dim=job.model_args.dim,
                batch=1,
                seq_len=cfg.training.seq_len,
                dtype=dtype,
                ac="none" if kind == "budget" else kind,
                memory_budget=ac.memory_budget if kind == "budget" else None,
                float8=float8,
            )
            for kind in kinds
        }
    except Exception as e:  # torch raises many kinds; the eager figures still bound the estimate
        first_line = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        return act, f"compile: tracing the compiled block failed ({first_line}); {eager}"
    saved = {kind: t.per_token for kind, t in traced.items()}
    fields = {"none": "block", "op": "block_op", "full": "block_input", "budget": "block"}
    measured = dataclasses.replace(
        act,
        block=saved["none"],
        block_op=saved.get("op", act.block_op),
        block_input=saved.get("full", act.block_input),
        block_budget=saved.get("budget"),
    )
    names = {"budget": f"memory budget {ac.memory_budget:g}"}
    figures = ", ".join(
        f"{names.get(k, f'AC {k}')}: {v:,} (eager {getattr(act, fields[k]):,})" for k, v in saved.items()
    )
    if "budget" in traced:  # what the budget costs: the matmuls and attention its backward recomputes
        base, budget = traced["none"].backward_flops, traced["budget"].backward_flops
        more = (budget - base) / max(base, 1.0)
        figures += f", its backward {more:.0%} more matmul and attention FLOPs (the recompute)"
    linears = ""
    if float8 is not None:
        linears = f", float8 {float8.recipe_name} linears" + (" emulated" if float8.emulate else " as on the GPU")
    return measured, (
        "compile: block activations measured from the compiled graph (AOTAutograd's partitioner on fake CPU "
        f"tensors{linears}), bytes per token per block: {figures}; the loss and the rest as eager"
    )


def compiled_loss_bytes(job: Job, act: ActivationBytes) -> tuple[ActivationBytes, str | None]:
    """`act` with `logits_saved` measured from the compiled plain loss where the run compiles it (and does not
    fuse it into the output projection), with a note saying so; `act` and None otherwise.

    Args:
        job: the resolved job.
        act: the eager figures measured for the job's layout.
    """
    from titan_core.memory.run_paths import plain_loss_compiled

    if not plain_loss_compiled(job):
        return act, None
    saved = measure_loss(job.model_args.vocab_size, job.parallel.param_dtype)
    note = (
        f"compile: the plain loss keeps {saved:,} bytes per token for backward, measured from its compiled graph "
        f"(eager: {act.logits_saved:,}); its backward holds one gradient of the logits in the compute dtype"
    )
    return dataclasses.replace(act, logits_saved=saved), note


def parallel_block_bytes(
    job: Job, act: ActivationBytes, layout: ActivationLayout, sequences: int = 1
) -> tuple[ActivationBytes, str]:
    """`compiled_block_bytes` under tensor and / or context parallel, and for Mixture-of-Experts models, with no AC
    or at the job's memory budget: the block split and compiled on CPU (`compiled_parallel.measure_parallel_block`),
    under TP less what its eager sequence-parallel norms keep on CPU beyond what they keep on the target device
    (`eager_norms_device_gap`: CUDA's fused RMSNorm keeps less than CPU's decomposition). It is measured on CPU
    because Dynamo cannot trace fake CUDA tensors without a GPU; the compiled graphs are device-blind (Inductor
    decomposes a norm inside them, Qwen3's QK norms, alike on both; CPU's flash attention keeps what CUDA's does, and
    `wide_attention` stands in for CUDA's kernel where head widths differ), and so are ring attention, which runs
    eager between them (its own autograd function, on both devices), and the routed experts, which the trainer
    leaves eager (at even load, as the eager figures; bf16 ones for a CUDA target as Hopper's grouped matmul:
    `compiled_parallel.cuda_kernels`). Where the model's blocks differ (DeepSeek-V3's dense and MoE blocks:
    `act.per_block`), each kind is measured. Selective `op` and full AC keep the eager figures (their checkpoints
    keep the block's input and the policy's outputs whether or not the block compiles).
    With `sequences` > 1, where a block keeps tensors once per call (float8 linears under TP, ring attention), it is
    traced at one and at two sequences, and what it keeps for the micro-batch is taken on the line through both.

    Args:
        job: the resolved job (compile on; TP or CP > 1, or a Mixture-of-Experts model).
        act: the eager figures measured for the job's layout on its device.
        layout: that layout.
        sequences: sequences per micro-batch on a rank.
    """
    from titan_core.memory.compiled_parallel import (
        ParallelBlockTrace,
        Split,
        eager_norms_device_gap,
        moe_args,
        partition_only_backend,
        trace_block,
    )
    from titan_core.memory.compiled_saved import block_signature

    cfg, dims = job.cfg, job.dims
    assert dims is not None
    ac, p = cfg.activation_checkpoint, cfg.parallelism
    split = Split(dims.tp, dims.cp, p.context_parallel_method, p.context_parallel_rotate_method, layout.ep_spans_tp)
    seq, rank_seq = cfg.training.seq_len, cfg.training.seq_len // dims.cp  # the eager figures are per rank token
    budgets = {"none": None, **({"budget": ac.memory_budget} if ac.mode == "memory_budget" else {})}
    float8 = traced_float8(cfg, job.device_type)
    options = {"dim": job.model_args.dim, "dtype": job.parallel.param_dtype, "seq_len": seq, "float8": float8,
               "backend": partition_only_backend(), "target": layout.device_type}  # fmt: skip
    # The micro-batch's bytes: per call once, the rest per sequence, on the line through one and two sequences where a
    # block keeps tensors per call (module docstring); elsewhere only a few bytes per position (the debug block, bf16,
    # per call: TP 2 none, Ulysses 2,056 of 282,888 at seq 64), counted per sequence as at tp = 1.
    per_call = (float8 is not None and split.tp > 1) or (split.cp > 1 and split.cp_method == "ring")
    try:
        meta = job.meta_model()
        # a multi-token-prediction depth (its input `input_width` wide, its output two tensors) keeps its eager figures
        blocks = list(meta.get_submodule(job.spec.plan.blocks).children())
        signatures = [None if hasattr(b, "input_width") else block_signature(b) for b in blocks]
        kinds: dict[Any, int] = {sig: signatures.index(sig) for sig in signatures if sig is not None}
        kinds = kinds if act.per_block else {signatures[0]: 0}
        traced: dict[int, dict[str, ParallelBlockTrace]] = {}
        whole: dict[int, dict[str, float]] = {}
        for index in kinds.values():
            traced[index], whole[index] = {}, {}
            for kind, b in budgets.items():
                one = traced[index][kind] = trace_block(job.spec, meta, split, memory_budget=b, index=index, **options)
                two = 2 * one.saved
                if sequences > 1 and per_call:
                    two = trace_block(job.spec, meta, split, memory_budget=b, index=index, batch=2, **options).saved
                whole[index][kind] = one.saved + (sequences - 1) * (two - one.saved)
        gap = 0
        if split.tp > 1:  # the sequence-parallel norms run eager, on the rank's cp x tp part of a sequence
            gap = eager_norms_device_gap(job.spec, meta, tp=split.tp, seq_len=rank_seq, dim=options["dim"],
                                         dtype=options["dtype"], device=layout.device_type)  # fmt: skip
    except Exception as e:  # torch raises many kinds; the eager figures still bound the estimate
        first_line = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        return act, f"compile: tracing the {_describe(split)}block failed ({first_line}); the eager blocks' figures"
    saved = {
        index: {kind: round(bytes_ / (sequences * rank_seq) - gap / rank_seq) for kind, bytes_ in by_kind.items()}
        for index, by_kind in whole.items()
    }
    measured = _with_blocks(act, [saved[kinds[s]] if s is not None else None for s in signatures] if act.per_block
                            else [saved[0]])  # fmt: skip
    figures = []
    for index in kinds.values():
        eager = act.per_block[index] if act.per_block else act
        name = f"{'MoE' if moe_args(job.spec, blocks[index]) else 'dense'} block, " if act.per_block else ""
        line = f"{name}AC none: {saved[index]['none']:,} (eager {eager.block:,})"
        if "budget" in saved[index]:
            base, budget = (traced[index][kind].backward_flops or 0.0 for kind in ("none", "budget"))
            line += (
                f", memory budget {ac.memory_budget:g}: {saved[index]['budget']:,}, its backward "
                f"{(budget - base) / max(base, 1.0):.0%} more matmul and attention FLOPs (the recompute)"
            )
        figures.append(line)
    kept = "" if ac.mode in ("none", "memory_budget") else f"; AC {ac.mode} as eager"
    how = []
    if split.tp > 1:
        how.append(f"each child but the sequence-parallel norms, the norms as on {layout.device_type}")
    if split.cp > 1 and split.cp_method == "ring":
        how.append("around the eager ring attention")
    if job.spec.plan.moe is not None:
        how.append("the routed experts eager at even load")
    if None in signatures:
        how.append("the multi-token-prediction depths as eager")
    if float8 is not None:
        how.append(f"float8 {float8.recipe_name} linears " + ("emulated" if float8.emulate else "as on the GPU"))
    return measured, (
        f"compile: {_describe(split)}block activations measured compiled as the trainer compiles them "
        f"({'; '.join([*how, 'fake CPU tensors'])}), bytes per {'rank ' if split.cp > 1 else ''}token per block"
        f"{f' at {sequences} sequences per micro-batch' if sequences > 1 else ''}: "
        f"{'; '.join(figures)}{kept}; the loss and the rest as eager"
    )


def _with_blocks(act: ActivationBytes, saved: list[dict[str, int] | None]) -> ActivationBytes:
    """`act` with each block's compiled figures (`block`, and `block_budget` where measured): one dict for all
    blocks, or one per block where they differ (`per_block`: the top-level figures then the smallest; None keeps
    that block's eager figures)."""
    if not act.per_block:
        assert saved[0] is not None
        return dataclasses.replace(act, block=saved[0]["none"], block_budget=saved[0].get("budget"))
    blocks = tuple(
        a if s is None else dataclasses.replace(a, block=s["none"], block_budget=s.get("budget"))
        for a, s in zip(act.per_block, saved, strict=True)
    )
    budgets = [b.block_budget for b in blocks if b.block_budget is not None]
    return dataclasses.replace(
        act, block=min(b.block for b in blocks), block_budget=min(budgets) if budgets else None, per_block=blocks
    )


def _describe(split: Split) -> str:
    """'TP 8 ', 'CP 2 (ring) ', 'TP 2 x CP 2 (ulysses) ' (to put before "block"); '' for neither."""
    parts = [f"TP {split.tp}"] if split.tp > 1 else []
    parts += [f"CP {split.cp} ({split.cp_method})"] if split.cp > 1 else []
    return " x ".join(parts) + " " if parts else ""
