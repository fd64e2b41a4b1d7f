"""Context parallel: each rank of the `cp` mesh holds a load-balanced slice of every sequence.

Layout "head-tail": a sequence of length T is cut into `2 * cp` chunks and rank r
holds chunks r and `2 * cp - 1 - r`, concatenated (`cp_positions`), so every rank
does the same causal-attention work. Three pieces:

- `shard_sequence(inputs, labels, cp_mesh=...)`: the caller slices the batch
  before the forward; the loss is then the local mean, and averaging gradients
  over `dp_shard_cp` (FSDP does) gives the global mean, since every rank holds
  the same number of tokens.
- `apply_cp`: swaps every block's attention core (`ModelPlan.attention`) for
  `RingAttention` (method "ring"), which attends the local queries to the global
  keys/values, or wraps it in `UlyssesAttention` (method "ulysses"), which
  all-to-alls q/k/v to head shards of whole sequences, runs the core, and back.
  Both keep the head-tail layout: Ulysses puts the chunks in order as it unpacks
  its all-to-all, so the batch, the positions and the loss do not depend on the method.
- a forward pre-hook on the model passes `positions=` (absolute RoPE positions of
  the local tokens) when the caller gives none, so a pipeline stage that gets only
  hidden states also rotates by the right positions.
"""

from __future__ import annotations

import functools
from typing import Any, Literal, cast

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from titan_parallel.layout import check_cp, check_cp_method, check_rotate_method
from titan_parallel.modules import get_submodule_or_none, iter_blocks
from titan_parallel.plan import ModelPlan, TPStyle
from titan_parallel.ring_attention import RingAttention, RotateMethod, cp_positions
from titan_parallel.ulysses_attention import UlyssesAttention

CPMethod = Literal["ring", "ulysses"]

__all__ = ["apply_cp", "cp_positions", "shard_sequence", "unshard_sequence"]


def shard_sequence(*tensors: torch.Tensor, cp_mesh: DeviceMesh, seq_dim: int = 1) -> tuple[torch.Tensor, ...]:
    """This rank's head-tail slice of each tensor along `seq_dim` (no communication).

    Args:
        tensors: full sequences, e.g. inputs and labels `(bs, seqlen)`, identical on every cp rank.
        cp_mesh: the 1-D context-parallel mesh, e.g. `mesh["cp"]`.
        seq_dim: the sequence dimension.

    Returns:
        One tensor per input, `(bs, seqlen/cp, ...)`, positions `cp_positions(seqlen/cp, rank, cp)`.
    """
    size, rank = cp_mesh.size(), cp_mesh.get_local_rank()
    shards = []
    for tensor in tensors:
        seq_len = tensor.size(seq_dim)
        check_cp(seq_len, size)  # (bs, seqlen) -> 2 * cp equal chunks
        index = cp_positions(seq_len // size, rank, size, device=tensor.device)
        shards.append(tensor.index_select(seq_dim, index))
    return tuple(shards)


@torch.no_grad()
def unshard_sequence(tensor: torch.Tensor, cp_mesh: DeviceMesh, seq_dim: int = 1) -> torch.Tensor:
    """Inverse of `shard_sequence`: all-gather the cp slices and put them back in sequence order.

    Not differentiable; for evaluation, generation and tests.

    Args:
        tensor: this rank's slice, `(bs, seqlen/cp, ...)`.
        cp_mesh: the 1-D context-parallel mesh.
        seq_dim: the sequence dimension.

    Returns:
        `(bs, seqlen, ...)` on every rank.
    """
    size = cp_mesh.size()
    tensor = tensor.contiguous()
    parts = [torch.empty_like(tensor) for _ in range(size)]
    dist.all_gather(parts, tensor, group=cp_mesh.get_group())
    gathered = torch.cat(parts, dim=seq_dim)  # rank-major, head-tail within each rank
    local = tensor.size(seq_dim)
    positions = torch.cat([cp_positions(local, r, size, device=tensor.device) for r in range(size)])
    return torch.empty_like(gathered).index_copy_(seq_dim, positions, gathered)


def apply_cp(
    model: nn.Module,
    plan: ModelPlan,
    cp_mesh: DeviceMesh,
    *,
    cp_rotate_method: RotateMethod = "allgather",
    cp_method: CPMethod = "ring",
) -> nn.Module:
    """Make `model` run on head-tail sequence shards over `cp_mesh`, in place.

    Swaps each block's `plan.attention` module for `RingAttention` (or wraps it in
    `UlyssesAttention`) and registers a forward pre-hook that passes
    `positions=cp_positions(local_seqlen, rank, cp)` when the caller gives none. The
    model's `forward(x, positions=None)` must accept absolute RoPE positions. A block's
    `plan.moe` module with a `sequence_group` attribute gets the CP group there (the
    ranks holding the rest of each sequence), for statistics over whole sequences. Apply
    after tensor parallel: on sequence-parallel hidden states (a pipeline stage's
    input) the local length is the input's times the TP degree.

    Args:
        model: the model or pipeline stage (meta or real).
        plan: names the attention core inside each block.
        cp_mesh: the 1-D context-parallel mesh, e.g. `mesh["cp"]`.
        cp_rotate_method: ring attention's K/V exchange, "allgather" or "rotate" (see `check_rotate_method`).
        cp_method: "ring" or "ulysses" (see `check_cp_method`); Ulysses needs the attention core to hold
            no parameters or buffers (it keeps the core as its child `core`).

    Returns:
        `model`, changed in place.
    """
    check_cp_method(cp_method)
    check_rotate_method(cp_rotate_method)
    if plan.attention is None:
        raise ValueError(
            f"model {type(model).__name__} names no attention core (ModelPlan.attention); "
            "give its plan one, or run it without context parallel"
        )
    group = cp_mesh.get_group()
    parent_path, _, name = plan.attention.rpartition(".")
    for block in iter_blocks(model, plan):
        parent = get_submodule_or_none(block, parent_path) if parent_path else block
        if parent is None or not isinstance(getattr(parent, name, None), nn.Module):
            raise ValueError(
                f"block {type(block).__name__} has no module at ModelPlan.attention '{plan.attention}'; "
                "fix the model's plan"
            )
        core = getattr(parent, name)
        moe = get_submodule_or_none(block, plan.moe) if plan.moe else None
        if moe is not None and hasattr(moe, "sequence_group"):
            cast(Any, moe).sequence_group = group  # per-sequence statistics count the other chunks too
        if cp_method == "ulysses":
            if next(core.parameters(), None) is not None or next(core.buffers(), None) is not None:
                raise ValueError(
                    f"the attention core {type(core).__name__} at ModelPlan.attention '{plan.attention}' holds "
                    "parameters or buffers, which Ulysses would rename under 'core.'; use cp_method='ring'"
                )
            setattr(parent, name, UlyssesAttention(core, group))
        else:
            setattr(parent, name, RingAttention(group, cp_rotate_method, scale=getattr(core, "scale", None)))
    hook = functools.partial(
        _supply_positions,
        cp_rank=cp_mesh.get_local_rank(),
        cp_size=cp_mesh.size(),
        sp_degree=_sequence_parallel_degree(model, plan),
    )
    model.register_forward_pre_hook(hook, with_kwargs=True)
    return model


def _sequence_parallel_degree(model: nn.Module, plan: ModelPlan) -> int:
    """How many ways tensor parallel shards the hidden states between blocks on the sequence dim (1 without TP)."""
    first_block = next(iter_blocks(model, plan), None)
    candidates = [(model, path) for path, style in plan.tp if style is TPStyle.NORM]
    if first_block is not None:
        candidates += [(first_block, path) for path, style in plan.block_tp if style is TPStyle.NORM]
    for root, path in candidates:
        module = get_submodule_or_none(root, path)
        weight = getattr(module, "weight", None) if module is not None else None
        if isinstance(weight, DTensor) and all(p.is_replicate() for p in weight.placements):
            return weight.device_mesh.size()  # SequenceParallel replicates norm weights over the tp mesh
    return 1


def _supply_positions(module: nn.Module, args: tuple, kwargs: dict, *, cp_rank: int, cp_size: int, sp_degree: int):
    """Forward pre-hook: add this rank's absolute positions when the caller passed none."""
    if kwargs.get("positions") is not None or (len(args) > 1 and args[1] is not None):
        return None
    x = args[0] if args else next(iter(kwargs.values()))  # tokens (bs, seqlen) or hidden states (bs, seqlen, dim)
    seqlen = x.shape[1]
    if not isinstance(x, DTensor) and x.is_floating_point():
        seqlen *= sp_degree  # sequence-parallel hidden states: (bs, seqlen/(cp*tp), dim) locally
    positions = cp_positions(seqlen, cp_rank, cp_size, device=x.device)  # (seqlen/cp,)
    if len(args) > 1:
        return (args[0], positions, *args[2:]), kwargs
    return args, {**kwargs, "positions": positions}
