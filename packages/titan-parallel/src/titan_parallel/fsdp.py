"""Data parallel: FSDP2 (`fully_shard`), HSDP, and DDP, read from a `ModelPlan`.

Each block of `plan.blocks` is one FSDP unit, so its parameters are gathered
just before it runs and freed after; the modules in `plan.fsdp_root_units`
(embeddings, output) are units of their own; the root holds what is left.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Literal

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import Shard

from titan_parallel.expert_parallel import is_expert_parallel, moe_modules
from titan_parallel.modules import get_submodule_or_none, iter_blocks
from titan_parallel.plan import ModelPlan

ReshardPolicy = Literal["default", "always", "never"]


def apply_fsdp(
    model: nn.Module,
    plan: ModelPlan,
    mesh: DeviceMesh,
    *,
    param_dtype: torch.dtype = torch.float32,
    reduce_dtype: torch.dtype = torch.float32,
    reshard_after_forward: ReshardPolicy = "default",
    cpu_offload: bool = False,
    pipeline_parallel: bool = False,
    expert_mesh: DeviceMesh | None = None,
    expert_grad_divide_factor: float | None = None,
) -> nn.Module:
    """Shard `model` in place with FSDP2 over `mesh` (1-D: FSDP, 2-D `(replicate, shard)`: HSDP).

    Args:
        model: the module to shard (a whole model or one pipeline stage).
        plan: names the blocks and the root-level units.
        mesh: the data-parallel mesh, e.g. `mesh["dp_shard_cp"]` or `mesh["dp_replicate", "dp_shard_cp"]`.
        param_dtype: dtype parameters are gathered in for compute (bf16 = mixed precision).
        reduce_dtype: dtype gradients are reduce-scattered in.
        reshard_after_forward: "always" frees gathered parameters after forward (ZeRO-3),
            "never" keeps them until backward (ZeRO-2, more memory, less communication),
            "default" = "always" except under pipeline parallel, where a stage runs
            several microbatches and re-gathering for each would cost too much, and where
            the shard dimension has one rank: there a "gathered" parameter is only its
            compute-dtype copy, and freeing it costs a second cast (and, on torch 2.11, a
            one-rank all-gather copy) per unit in backward.
        cpu_offload: keep sharded parameters, gradients and optimizer state in CPU memory.
        pipeline_parallel: whether `model` is a pipeline stage (see `reshard_after_forward`).
        expert_mesh: under expert parallel, the ranks holding the same experts (`mesh["dp_shard_mod_ep"]`,
            with `dp_replicate` first for HSDP): each MoE layer's `experts` become their own FSDP unit,
            sharded on dim 1 over this mesh (dim 0, the expert, is split by expert parallel).
        expert_grad_divide_factor: what the experts' summed gradients are divided by: every data-parallel
            and context-parallel rank's tokens reach them through the all-to-all, so the mean over ranks
            divides by all of them (`dp_replicate x dp_shard x cp`), not by `expert_mesh`'s size.
    """
    one_rank = mesh.size(mesh.ndim - 1) == 1  # the shard dimension (HSDP: the last); torch 2.11 takes no negative dim
    default = not pipeline_parallel and not one_rank
    reshard = {"always": True, "never": False, "default": default}[reshard_after_forward]
    config: dict = {
        "mesh": mesh,
        "mp_policy": MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype),
    }
    if cpu_offload:
        # Pinned memory needs an accelerator; on a CPU-only host it must be off.
        config["offload_policy"] = CPUOffloadPolicy(pin_memory=torch.cuda.is_available())
    for unit in _root_units(model, plan):
        fully_shard(unit, reshard_after_forward=reshard, **config)
    if expert_mesh is not None:
        for moe in moe_modules(model, plan):
            if is_expert_parallel(moe.get_submodule("experts")):
                experts = fully_shard(
                    moe.get_submodule("experts"),
                    reshard_after_forward=reshard,
                    shard_placement_fn=lambda _: Shard(1),
                    **{**config, "mesh": expert_mesh},
                )
                if expert_grad_divide_factor is not None:
                    experts.set_gradient_divide_factor(expert_grad_divide_factor)
                    if expert_mesh.device_type != "cuda" and expert_mesh.size(expert_mesh.ndim - 1) > 1:
                        # A custom factor reduces with PREMUL_SUM, which gloo lacks: sum, then divide. Not when
                        # the shard dim has one rank: torch 2.15 then divides by the factor in its one-rank copy,
                        # and again after the sum (HSDP's all-reduce sums without PREMUL_SUM anyway).
                        experts.set_force_sum_reduction_for_comms(True)
    # A block's inputs are the residual stream, already in the compute dtype from the units before it, and the
    # model's buffers passed down (the RoPE table): FSDP would cast those to bf16 too, so blocks cast nothing.
    block_policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype, cast_forward_inputs=False)
    for block in iter_blocks(model, plan):
        fully_shard(block, reshard_after_forward=reshard, **{**config, "mp_policy": block_policy})
    # The root's own parameters (e.g. the final norm) are needed right at the end of
    # forward, so they stay gathered for backward.
    fully_shard(model, reshard_after_forward=False if not pipeline_parallel else reshard, **config)
    return model


def _root_units(model: nn.Module, plan: ModelPlan) -> list[nn.Module]:
    """The modules of `plan.fsdp_root_units` present in `model` that share no parameter with
    another unit: tied weights (embedding = output) must stay in one unit, the root's."""
    units = [m for m in (get_submodule_or_none(model, name) for name in plan.fsdp_root_units) if m is not None]
    owners: dict[int, int] = {}
    for unit in units:
        for p in unit.parameters():
            owners[id(p)] = owners.get(id(p), 0) + 1
    return [u for u in units if all(owners[id(p)] == 1 for p in u.parameters())]


def apply_ddp(model: nn.Module, mesh: DeviceMesh) -> nn.Module:
    """Replicate `model` over `mesh` with gradient all-reduce (composable DDP).

    Mixed precision is not applied here: under DDP, parameters stay in their own
    dtype and the step's `mixed_precision_context` (autocast) computes in bf16, on 1
    and N ranks alike (FSDP casts through `MixedPrecisionPolicy` instead).

    Args:
        model: the materialised model (DDP buckets real gradients).
        mesh: the data-parallel replicate mesh, e.g. `mesh["dp_replicate"]`.
    """
    import torch.distributed as dist
    from torch.distributed._composable.replicate import replicate

    if mesh.device_type == "cpu" and dist.get_debug_level() == dist.DebugLevel.DETAIL:
        logging.getLogger(__name__).warning(
            "DDP on gloo under TORCH_DISTRIBUTED_DEBUG=DETAIL: torch 2.15's DDP crashes with SIGSEGV in its first "
            "forward there (the reducer's construction log under DETAIL's wrapper group); if this process dies with "
            "signal 11, unset TORCH_DISTRIBUTED_DEBUG (FSDP and pipeline layouts run under DETAIL)"
        )
    replicate(model, device_mesh=mesh, bucket_cap_mb=100)
    return model


def set_gradient_sync(modules: Iterable[nn.Module], sync: bool, *, reduce_scatter: bool = True) -> None:
    """Whether the next backward synchronises gradients over data parallel (gradient accumulation): False before
    each micro-batch of a step but its last, True before the last.

    What is skipped costs no memory by default: DDP's all-reduce (its gradients are whole anyway) and, under HSDP,
    the all-reduce over the replicas (each replica's reduce-scattered shards accumulate locally; FSDP2 adds them
    into the last micro-batch's before its one all-reduce). FSDP's reduce-scatter is skipped only with
    `reduce_scatter=False`: each rank then keeps its blocks' unsharded gradients until the last micro-batch (the
    parameters' full size in the reduce dtype), for one reduce-scatter per step instead of one per micro-batch.

    Args:
        modules: the model (or each pipeline stage) after `apply_fsdp` / `apply_ddp`; other modules are ignored.
        sync: synchronise in the next backward.
        reduce_scatter: with `sync=False`, also skip FSDP's reduce-scatter.
    """
    from torch.distributed.fsdp import FSDPModule

    for root in modules:
        for module in root.modules():
            if isinstance(module, FSDPModule):
                module.set_requires_gradient_sync(sync or reduce_scatter, recurse=False)  # sets both flags
                module.set_requires_all_reduce(sync, recurse=False)
            elif callable(setter := getattr(module, "set_requires_gradient_sync", None)):  # composable DDP
                setter(sync)
