"""`parallelize`: apply every parallelism to a model, in the one documented order.

    expert parallel -> tensor parallel -> context parallel -> activation checkpointing -> compile -> FSDP/DDP

EP first: it splits the experts of Mixture-of-Experts layers over the `ep` mesh (each
layer's experts then become an FSDP unit of their own), under TP over the `(ep, tp)` mesh
(their hidden dim split too), and TP, which splits the shared experts and replicates the
router over the `tp` mesh, leaves them alone. TP changes parameters into
DTensors on the `tp` mesh that FSDP then shards further; CP swaps the attention core; AC and compile wrap the
blocks TP and CP produced; FSDP last, so its units are the finished blocks.
Pipeline parallel is outermost: the caller cuts the model into stages with
`titan_parallel.pipeline.split_model` first, then calls `parallelize` on each stage.
Every option is checked before the model is touched (`titan_parallel.layout`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn as nn

from titan_parallel.layout import (
    ParallelDims,
    check_ac,
    check_async_tp,
    check_compile_backend,
    check_cp_method,
    check_data_parallel,
    check_rotate_method,
)
from titan_parallel.mesh import ParallelMesh
from titan_parallel.plan import ModelPlan


@dataclass(frozen=True)
class ParallelOptions:
    """What to apply beyond the mesh's degrees; defaults apply nothing optional.

    Args:
        param_dtype: compute dtype (bf16 = mixed precision): FSDP's when it is not fp32 (see `uses_fsdp`),
            autocast's under DDP.
        reduce_dtype: gradient reduction dtype under FSDP.
        reshard_after_forward: FSDP policy, "default" | "always" | "never".
        cpu_offload: FSDP keeps parameters and optimizer state on the CPU.
        dp_mode: "fsdp" (also HSDP when the mesh has replicas) or "ddp" (see `check_data_parallel`).
        loss_parallel: under TP, keep logits sharded on the vocab dim for a sharded cross-entropy.
        async_tp: overlap TP communication with matmuls (tp > 1, CUDA and compile; see `check_async_tp`).
        cp_rotate_method: how ring attention exchanges K/V, "allgather" | "rotate".
        cp_method: context parallel's attention, "ring" | "ulysses" (see `check_cp_method`).
        ac_mode: activation checkpointing, "none" | "selective" | "full" | "memory_budget" (compiled blocks only).
        ac_selective_option: "op" or every Nth block (a positive int as a string).
        ac_memory_budget: under "memory_budget", the share of their activations the compiled blocks keep, in [0, 1].
        compile: compile each block.
        compile_backend: the blocks' `torch.compile` backend (see `check_compile_backend`); None: Inductor,
            "aot_eager" for TP on CPU (`titan_parallel.compile.compile_backend`).
        pipeline_parallel: the model is one pipeline stage.
        master_weights: one data-parallel rank computes in `param_dtype` through copies an optimizer writes
            (`titan_parallel.master_weights`), not through FSDP; `master_weights_blockers` says when it can.
    """

    param_dtype: torch.dtype = torch.float32
    reduce_dtype: torch.dtype = torch.float32
    reshard_after_forward: Literal["default", "always", "never"] = "default"
    cpu_offload: bool = False
    dp_mode: Literal["fsdp", "ddp"] = "fsdp"
    loss_parallel: bool = True
    async_tp: bool = False
    cp_rotate_method: Literal["allgather", "rotate"] = "allgather"
    cp_method: Literal["ring", "ulysses"] = "ring"
    ac_mode: Literal["none", "selective", "full", "memory_budget"] = "none"
    ac_selective_option: str = "2"
    ac_memory_budget: float = 0.5
    compile: bool = False
    compile_backend: str | None = None
    pipeline_parallel: bool = False
    master_weights: bool = False


def uses_fsdp(mesh: ParallelMesh | ParallelDims, options: ParallelOptions) -> bool:
    """Whether `parallelize` wraps the model with FSDP for this mesh and options.

    The one place this is decided: `parallelize` wraps by it, and the model setup asks it once
    for the step (autocast only where it is False) and for float8 (how many ranks gather).
    Under `dp_mode="fsdp"` FSDP runs when:

    - the data-parallel mesh (`dp_replicate` x `dp_shard_cp`) has more than one rank;
    - the compute dtype (`param_dtype`) is not fp32, even on a single data-parallel rank
      (one process, or TP / PP alone): FSDP's `MixedPrecisionPolicy` then casts for one
      rank as for N (bf16 parameters and activations, gradients reduced in `reduce_dtype`),
      so bf16 means the same on every world size. `torch.autocast` would compute otherwise
      (fp32 embeddings, residual stream and norms around bf16 matmuls). On one process
      this costs the default run ~6% tokens/s on a 2-core CPU (docs/performance.md);
    - CPU offload, which is FSDP's.

    `master_weights` skips FSDP on one data-parallel rank: fp32 masters with compute copies the
    optimizer writes give the same bf16 numbers without FSDP's casts and copies (`ComputeCopies`).
    fp32 on one data-parallel rank skips FSDP: nothing to cast or shard, and FSDP would only
    turn every parameter into a DTensor (the optimizer over DTensors measured ~2.5x slower
    than over plain tensors). Under `dp_mode="ddp"` FSDP never runs: DDP computes bf16 by
    `titan_parallel.precision.mixed_precision_context` (autocast) on 1 and N ranks alike.

    Args:
        mesh: the parallel mesh.
        options: the parallel options (`dp_mode`, `param_dtype`, `cpu_offload`).
    """
    if options.dp_mode == "ddp":
        return False
    if isinstance(mesh, ParallelDims):  # the degrees alone (memory estimates, before any mesh exists)
        data_parallel = mesh.dp_replicate * mesh.dp_shard * mesh.cp > 1
    else:
        data_parallel = mesh["dp_replicate"].size() * mesh["dp_shard_cp"].size() > 1
    if options.master_weights and not data_parallel:
        return False
    return data_parallel or options.param_dtype != torch.float32 or options.cpu_offload


def check_options(mesh: ParallelMesh, options: ParallelOptions) -> None:
    """Raise `ParallelConfigError` for options that cannot run on `mesh` (what `parallelize` checks first).

    Args:
        mesh: the parallel mesh.
        options: the parallel options; errors name their field names.
    """
    check_data_parallel(mesh.dims, options.dp_mode)
    check_rotate_method(options.cp_rotate_method)
    check_cp_method(options.cp_method)
    check_ac(
        options.ac_mode, options.ac_selective_option, ac_memory_budget=options.ac_memory_budget, compile=options.compile
    )
    if options.async_tp:
        check_async_tp(mesh.dims.tp, mesh.device_type, options.compile)
    if options.compile:
        check_compile_backend(options.compile_backend, mesh.device_type, mesh.dims.tp, options.ac_mode)


def parallelize(
    model: nn.Module, plan: ModelPlan, mesh: ParallelMesh, options: ParallelOptions = ParallelOptions()
) -> nn.Module:
    """Apply TP, CP, AC, compile and data parallel to `model` in place, as `mesh`'s degrees ask.

    Args:
        model: the model (or one pipeline stage), on the meta device or real.
        plan: how the model may be split.
        mesh: the mesh from `ParallelDims.build_mesh` (dims pp, dp_replicate, dp_shard, cp, tp; under
            expert parallel dp_shard split into dp_shard_mod_ep x dp_shard_in_ep, see `titan_parallel.mesh`).
        options: dtypes and the optional features (checked first, `check_options`).
    """
    check_options(mesh, options)
    # Imported here, as EP, TP and CP below: `ParallelOptions` and the checks stay light to import (FSDP's and
    # compile's modules pull DTensor and sympy, ~3 s of a process's start on a 2-core AVX2-only AMD EPYC, for a
    # job check).
    from titan_parallel.activation_checkpoint import apply_ac
    from titan_parallel.compile import apply_compile, compile_backend, compile_granularity
    from titan_parallel.fsdp import apply_ddp, apply_fsdp

    if mesh.dims.ep > 1:
        from titan_parallel.expert_parallel import apply_ep, ep_tp_mesh, experts_split_by_tp

        split_by_tp = mesh["tp"].size() > 1 and experts_split_by_tp(plan) and not mesh.dims.ep_spans_tp
        apply_ep(model, plan, ep_tp_mesh(mesh["ep"], mesh["tp"]) if split_by_tp else mesh["ep"])
    if mesh["tp"].size() > 1:
        from titan_parallel.tensor_parallel import apply_tp

        apply_tp(
            model,
            plan,
            mesh["tp"],
            loss_parallel=options.loss_parallel,
            async_tp=options.async_tp,
            compile=options.compile,
            ep_spans_tp=mesh.dims.ep_spans_tp,
        )
    if mesh["cp"].size() > 1:
        from titan_parallel.context_parallel import apply_cp

        apply_cp(model, plan, mesh["cp"], cp_rotate_method=options.cp_rotate_method, cp_method=options.cp_method)
    if mesh.dims.ep_spans_tp:
        from titan_parallel.expert_parallel import set_sequence_group

        # Each MoE layer routes its rank's part of a sequence that CP x TP split (after `apply_cp`, which sets CP's).
        set_sequence_group(model, plan, mesh["cp_tp"].get_group())
    apply_ac(model, plan, options.ac_mode, options.ac_selective_option)
    if options.compile:
        tp = mesh["tp"].size()
        apply_compile(
            model,
            plan,
            **compile_granularity(tp, mesh["cp"].size(), options.cp_method),
            backend=options.compile_backend or compile_backend(mesh["tp"].device_type, tp),
            memory_budget=options.ac_memory_budget if options.ac_mode == "memory_budget" else None,
        )
    if options.dp_mode == "ddp":
        return apply_ddp(model, mesh["dp_replicate"]) if mesh["dp_replicate"].size() > 1 else model
    if not uses_fsdp(mesh, options):
        return model
    hsdp = mesh["dp_replicate"].size() > 1
    dp_mesh = mesh["dp_replicate", "dp_shard_cp"] if hsdp else mesh["dp_shard_cp"]
    expert_mesh = None
    if mesh.dims.ep > 1:
        expert_mesh = mesh["dp_replicate", "dp_shard_mod_ep"] if hsdp else mesh["dp_shard_mod_ep"]
    return apply_fsdp(
        model,
        plan,
        dp_mesh,
        param_dtype=options.param_dtype,
        reduce_dtype=options.reduce_dtype,
        reshard_after_forward=options.reshard_after_forward,
        cpu_offload=options.cpu_offload,
        pipeline_parallel=options.pipeline_parallel,
        expert_mesh=expert_mesh,
        expert_grad_divide_factor=float(mesh["dp_cp"].size()) if expert_mesh is not None else None,
    )
