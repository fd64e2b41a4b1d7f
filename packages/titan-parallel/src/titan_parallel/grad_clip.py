"""Gradient clipping with the norm taken over the whole model, however it is split.

Under FSDP/TP the gradients are DTensors. They are grouped by mesh and placements
(under expert parallel the experts' gradients live on another mesh than the rest;
under FSDP x TP a norm's weight is sharded on one mesh dim, a matrix on two): each
group's norm is taken on this rank's shards, and its square summed over the mesh dims
the group is sharded on: one all-reduce per mesh dim for every group sharded there
(a vector of scalars), then one root; the groups' norms are then combined. DTensor's
own norm of a multi-dim mesh redistributes the partial norms one dim after another,
and torch 2.15 warns about that on every step of an FSDP x TP run. A pipeline stage
holds only its own layers, so the squared norms of all stages are summed over the
`pp` mesh as well.

`grouped_norms` takes the same global norms per group of tensors (each block's gradients or
parameters, for logging), with one all-reduce per mesh dim for all the groups together.

`clip_grad_norm_` scales the gradients in place (one read and one write of every
gradient). An optimizer whose kernel divides the gradients by a `grad_scale` as it
reads them (torch's fused Adam and AdamW, the kernels `torch.amp.GradScaler` drives)
can take the clipping there instead: `grad_norm` + `clip_divisor`, and the separate
pass over the gradients disappears (~3 ms of a 1B step on an H100).

On CPU each tensor's norm is taken over chunks of `CPU_NORM_CHUNK` elements, then over the chunks'
norms: torch's CPU L2 norm accumulates a whole tensor in one fp32 vector (pytorch/pytorch#169237,
open), which on torch 2.11 and 2.15 was 1.0e-3 off at 20M elements, and worse the larger (10% and
more past 100M: a 1B model's output weight has 262M). Chunks of 1,024 kept a 20M-element norm within 1.2e-7
of fp64 (fp32 and bf16 gradients; chunks of 32,768: 2e-6 from bf16) at torch's own speed (2.4 vs 3.6 ms in
fp32 on a 2-core AMD EPYC with AVX-512, torch 2.15).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement

_Layout = tuple[DeviceMesh, tuple[Placement, ...]] | None
"""A gradient's mesh and placements; None for a plain tensor."""

CPU_NORM_CHUNK = 1 << 10
"""Elements per partial norm of a large CPU tensor (see the module docstring)."""
CPU_NORM_LARGE = 1 << 16
"""CPU tensors above this many elements take their norm in chunks; torch's is within ~1e-7 below it."""


@torch.no_grad()
def clip_grad_norm_(
    parameters: Iterable[torch.nn.Parameter],
    max_norm: float,
    *,
    pp_mesh: DeviceMesh | None = None,
    foreach: bool | None = None,
    copies: Iterable[torch.nn.Parameter] = (),
) -> torch.Tensor:
    """Scale gradients in place so their global L2 norm is at most `max_norm`; returns that norm.

    Args:
        parameters: the parameters of this rank's model (or pipeline stages).
        max_norm: the largest allowed norm; <= 0 measures only.
        pp_mesh: the pipeline mesh when the model is pipelined, else None.
        foreach: use the multi-tensor kernels (None = torch's choice).
        copies: those of `parameters` that copy a weight counted elsewhere (`SharedWeights.copies`, after its
            `reduce_grads`): scaled, not counted in the norm.
    """
    parameters = list(parameters)
    skip = {id(p) for p in copies}
    total = _total_norm(_by_layout(p for p in parameters if id(p) not in skip), pp_mesh, foreach)
    if max_norm > 0:
        for group in _by_layout(parameters).values():  # DTensors of different meshes do not mix in one foreach op
            torch.nn.utils.clip_grads_with_norm_(group, max_norm, total, foreach=foreach)
    return total


@torch.no_grad()
def grad_norm(
    parameters: Iterable[torch.nn.Parameter],
    *,
    pp_mesh: DeviceMesh | None = None,
    foreach: bool | None = None,
    copies: Iterable[torch.nn.Parameter] = (),
) -> torch.Tensor:
    """The global L2 norm of the gradients, as `clip_grad_norm_` takes it, without scaling them.

    Args:
        parameters: the parameters of this rank's model (or pipeline stages).
        pp_mesh: the pipeline mesh when the model is pipelined, else None.
        foreach: use the multi-tensor kernels (None = torch's choice).
        copies: those of `parameters` not counted (see `clip_grad_norm_`).
    """
    skip = {id(p) for p in copies}
    return _total_norm(_by_layout(p for p in parameters if id(p) not in skip), pp_mesh, foreach)


def clip_divisor(total_norm: torch.Tensor, max_norm: float) -> torch.Tensor:
    """What to divide the gradients by so their norm is at most `max_norm`: a 0-dim fp32 tensor on the norm's
    device, `max(1, (total_norm + 1e-6) / max_norm)`, the inverse of `clip_grads_with_norm_`'s clamped factor.

    Set it as a fused Adam / AdamW optimizer's `grad_scale` attribute (the kernel divides each gradient by it as
    it reads it) in place of `clip_grad_norm_`'s in-place scaling.

    Args:
        total_norm: the global gradient norm (`grad_norm`).
        max_norm: the largest allowed norm (> 0).
    """
    if max_norm <= 0:
        raise ValueError(f"clip_divisor needs max_norm > 0, got {max_norm}")
    return ((total_norm.float() + 1e-6) / max_norm).clamp(min=1.0)


@torch.no_grad()
def grouped_norms(groups: Sequence[Sequence[torch.Tensor]], *, pp_mesh: DeviceMesh | None = None) -> torch.Tensor:
    """The global L2 norm of each group of tensors (plain tensors or DTensors of any layout, e.g. one block's
    gradients), as `clip_grad_norm_` takes the norm of all of them: shards summed over the mesh dims they are
    split on, all groups in one all-reduce per mesh dim (and one over `pp_mesh`).

    Every rank of a collective passes the same number of groups in the same order; a group may be empty on a rank
    (its tensors live on another pipeline stage), which then adds 0 to it.

    Args:
        groups: the tensors of each group on this rank.
        pp_mesh: the pipeline mesh when the model is pipelined (the groups' squares are summed over it), else None.

    Returns:
        `(len(groups),)` fp32 norms, the same on every rank (on the tensors' device; CPU when there are none).
    """
    tensors = [t for group in groups for t in group]
    device = tensors[0].device if tensors else torch.device("cpu")
    squares = torch.zeros(len(groups), dtype=torch.float32, device=device)
    entries: list[tuple[int, torch.Tensor]] = []  # (group, this rank's square of one layout's tensors)
    over: dict[tuple[DeviceMesh, int], list[int]] = {}  # (mesh, dim) -> the entries sharded on it
    for index, group in enumerate(groups):
        by_layout: dict[_Layout, list[torch.Tensor]] = {}
        for t in group:
            by_layout.setdefault((t.device_mesh, tuple(t.placements)) if isinstance(t, DTensor) else None, []).append(t)
        for key, members in by_layout.items():
            if key is None or any(placement.is_partial() for placement in key[1]):
                norm = _norm(members, None)
                entries.append((index, (norm.full_tensor() if isinstance(norm, DTensor) else norm).float() ** 2))
                continue
            local = [t.to_local() if isinstance(t, DTensor) else t for t in members]
            entries.append((index, _norm(local, None).float() ** 2))
            for dim, placement in enumerate(key[1]):
                if not placement.is_replicate() and key[0].size(dim) > 1:
                    over.setdefault((key[0], dim), []).append(len(entries) - 1)
    reduced = dict(enumerate(square for _, square in entries))
    _sum_over_mesh_dims(reduced, over)
    for entry, (index, _) in enumerate(entries):
        squares[index] += reduced[entry]
    if pp_mesh is not None and pp_mesh.size() > 1:
        dist.all_reduce(squares, op=dist.ReduceOp.SUM, group=pp_mesh.get_group())
    return squares.sqrt()


def _sum_over_mesh_dims(squares: dict[int, torch.Tensor], over: dict[tuple[DeviceMesh, int], list[int]]) -> None:
    """Sum each entry of `squares` over the mesh dims `over` lists it under, in place: one all-reduce of a vector
    per mesh dim, in `over`'s order (the same on every rank of each collective)."""
    for (mesh, dim), members in over.items():
        summed = torch.stack([squares[i] for i in members])
        dist.all_reduce(summed, op=dist.ReduceOp.SUM, group=mesh.get_group(dim))
        squares.update(zip(members, summed.unbind(), strict=True))


def _by_layout(parameters: Iterable[torch.nn.Parameter]) -> dict[_Layout, list[torch.nn.Parameter]]:
    """The parameters that have gradients, grouped by the (mesh, placements) of their gradients (None: plain
    tensors)."""
    by_layout: dict[_Layout, list[torch.nn.Parameter]] = {}
    for p in parameters:
        if p.grad is not None:
            key: _Layout = (p.grad.device_mesh, tuple(p.grad.placements)) if isinstance(p.grad, DTensor) else None
            by_layout.setdefault(key, []).append(p)
    return by_layout


def _fp32_norms(grads: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each gradient's L2 norm taken in fp32, whatever its dtype (a 16-bit norm keeps 3 significant digits): one
    multi-tensor kernel per dtype where torch has it (one reduction per tensor cost 2.4 ms of an 8B-shaped step)."""
    return list(torch._foreach_norm(grads, 2.0, dtype=torch.float32))


def _cpu_norm(tensor: torch.Tensor) -> torch.Tensor:
    """One CPU tensor's L2 norm in fp32, as the norm of its chunks' norms (`CPU_NORM_CHUNK`)."""
    flat = tensor.reshape(-1)
    whole = flat.numel() // CPU_NORM_CHUNK * CPU_NORM_CHUNK
    parts = [torch.linalg.vector_norm(flat[:whole].view(-1, CPU_NORM_CHUNK), 2.0, dim=1, dtype=torch.float32)]
    if whole < flat.numel():
        parts.append(torch.linalg.vector_norm(flat[whole:], 2.0, dtype=torch.float32).reshape(1))
    return torch.linalg.vector_norm(torch.cat(parts), 2.0)


def _norm(grads: list[torch.Tensor], foreach: bool | None) -> torch.Tensor:
    """The L2 norm of `grads` together (plain tensors, or DTensors of one layout)."""
    plain_cpu = all(not isinstance(g, DTensor) and g.device.type == "cpu" for g in grads)
    large = [g for g in grads if g.numel() > CPU_NORM_LARGE] if plain_cpu else []
    if large:  # torch's own norm is off on large CPU tensors: those in chunks, the rest in one multi-tensor kernel
        small = [g for g in grads if g.numel() <= CPU_NORM_LARGE]
        norms = [_cpu_norm(g) for g in large] + (_fp32_norms(small) if small else [])
        return torch.linalg.vector_norm(torch.stack(norms), 2.0)
    if any(g.dtype != torch.float32 for g in grads):  # bf16 gradients (`ComputeCopies`): fp32 norms, as FSDP's
        return torch.linalg.vector_norm(torch.stack(_fp32_norms(grads)), 2.0)
    return torch.nn.utils.get_total_norm(grads, norm_type=2.0, foreach=foreach)


def _total_norm(
    by_layout: dict[_Layout, list[torch.nn.Parameter]], pp_mesh: DeviceMesh | None, foreach: bool | None
) -> torch.Tensor:
    norms: list[torch.Tensor] = []  # each group's norm: global, or this rank's shards' until reduced below
    over: dict[tuple[DeviceMesh, int], list[int]] = {}  # (mesh, dim) -> the groups (indices) sharded on it
    for key, group in by_layout.items():
        grads = [p.grad for p in group if p.grad is not None]  # all of them (filtered above); narrows the type
        if key is None or any(placement.is_partial() for placement in key[1]):
            norm = _norm(grads, foreach)  # plain tensors; or Partial gradients: DTensor's own reduction
            norms.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
            continue
        mesh, placements = key
        norms.append(_norm([g.to_local() if isinstance(g, DTensor) else g for g in grads], foreach))
        for dim, placement in enumerate(placements):
            if not placement.is_replicate() and mesh.size(dim) > 1:  # Shard, or FSDP x TP's _StridedShard
                over.setdefault((mesh, dim), []).append(len(norms) - 1)
    reduced = sorted({i for members in over.values() for i in members})
    squares = {i: norms[i] ** 2 for i in reduced}  # summed over each mesh dim in turn, then one root
    _sum_over_mesh_dims(squares, over)
    for i in reduced:
        norms[i] = squares[i] ** 0.5
    if not norms:
        total = torch.zeros(())
    else:
        total = norms[0] if len(norms) == 1 else torch.stack(norms).square().sum().sqrt()
    if pp_mesh is not None and pp_mesh.size() > 1:
        total = total**2
        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=pp_mesh.get_group())
        total = total.sqrt()
    return total
