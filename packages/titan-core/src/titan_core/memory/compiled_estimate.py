"""What the analytic tier takes from the compiled measurements: a compiled job's block and loss figures in place of the
eager ones, with a note saying what was measured, or why not.

The measurements are `titan_core.memory.compiled_saved`'s (a whole block traced on fake tensors at tp = cp = 1,
the compiled plain loss) and `titan_core.memory.compiled_parallel`'s (a block split and compiled as under tensor /
context parallel); this module decides which applies to a job, with what (its AC kinds, its memory budget, its
float8 linears as the target runs them), and turns their figures into `ActivationBytes`.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import torch

from titan_core.memory.compiled_saved import measure_block, measure_loss

if TYPE_CHECKING:
    from titan_core.config import JobConfig
    from titan_core.job import Job
    from titan_core.memory.activations import ActivationBytes, ActivationLayout
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
    (`compiled_parallel.parallel_block_bytes`).

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
    elif job.converters.mx is not None:
        why_not = "MX linears are not measured compiled"
    elif job.spec.plan.moe is not None or act.per_block:
        why_not = "Mixture-of-Experts blocks are not measured compiled"
    elif dtype != torch.float32 and not uses_fsdp(dims, job.parallel) and not job.parallel.master_weights:
        why_not = "autocast's compiled blocks (DDP with a 16-bit compute dtype) are not measured"
    if why_not is not None:
        return act, f"compile: {why_not}; {eager}"
    if dims.tp > 1 or dims.cp > 1:
        from titan_core.memory.compiled_parallel import parallel_block_bytes

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
