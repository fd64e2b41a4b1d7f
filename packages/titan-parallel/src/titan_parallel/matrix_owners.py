"""Whole matrices of sharded parameters: each gathered on one owner rank, transformed there, sent back.

Muon orthogonalises each weight matrix's momentum by Newton-Schulz iterations, which need the whole
matrix; FSDP2, tensor parallel and expert parallel leave each rank a piece of it (a `DTensor` shard).
`MatrixOwners` gives every matrix one owner among the ranks holding pieces of it, spread so that
they share the work (the layer-wise assignment of distributed Muon: greedy by Newton-Schulz cost,
largest first), and at each step:

    1. every rank sends its pieces, cast to the exchange dtype, to each matrix's owner   (all-to-all)
    2. each owner assembles its whole matrices and applies `fn` to each (Newton-Schulz)
    3. each owner sends every piece of the result back to the rank that holds it        (all-to-all)

A parameter's group is the ranks of the mesh dims that shard it (`Shard`, `_StridedShard`); ranks
along `Replicate` dims (HSDP's replicas, tensor parallel for a replicated weight) do the same work
side by side. The pieces are what DCP saves: `compute_local_shape_and_global_offset`, one box each.

    layout              a matrix's placements                          group           owners
    one process, DDP,   plain tensor (or Replicate)                    none            this rank
      PP alone
    FSDP, HSDP          Shard(0) on dp_shard_cp (Replicate on replica)  dp_shard_cp     spread over it
    TP                  Shard(0) colwise, Shard(1) rowwise on tp         tp              spread over it
    FSDP x TP           (_StridedShard(0) | Shard(0), Shard(0|1))        dp_shard_cp x tp  spread over it
    EP (3-D stacks,     (Shard(1) on dp_shard_mod_ep, Shard(0) on ep)    both dims       the ranks holding
      per expert)                                                                        the expert: with
                                                                                         dp_shard_mod_ep = 1
                                                                                         each rank its own

Pipeline stages keep their own optimizer, so each stage's ranks only exchange their own matrices.

Cost per optimizer step, for P elements of matrices sharded over W ranks (W = 1: none of it):

- communication: two all-to-alls per group in the exchange dtype (bf16, 2 B). Each rank sends about
  2 B x P/W x (W-1)/W (its pieces of the matrices others own) and receives as much (the pieces of its
  own), then the same back: about 4 B x P (W-1)/W^2 each way. FSDP's own step moves about
  8 B x P (W-1)/W each way (bf16 all-gather in forward and in backward, fp32 reduce-scatter), so the
  exchange adds about 1/(2W) of it. An all-gather of every matrix to every rank (`full_tensor()`)
  would add 2 B x P (W-1)/W and W times the Newton-Schulz work; this does neither.
- compute: each rank orthogonalises about 1/W of the matrices (by m n min(m, n) cost).
- memory, transient at the step: the pieces to send (2 B x P/W), the owned whole matrices and their
  results (2 x 2 B x about P/W), the pieces coming back (2 B x P/W), and `fn`'s temporaries for one
  matrix. Nothing persists but the plan.

Written here because torch has no such exchange: `torch.optim.Muon` takes whole 2-D tensors on one
device, and DTensor redistributes to every rank (`Replicate`), not to one owner per matrix.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

MatrixFn = Callable[[int, torch.Tensor], torch.Tensor]
"""`(parameter index, whole matrix (m, n)) -> transformed matrix (m, n)`."""


@dataclass(frozen=True)
class _Box:
    """One rank's piece of a matrix: rows `r0 : r0 + h`, columns `c0 : c0 + w` (empty when h w = 0)."""

    r0: int = 0
    h: int = 0
    c0: int = 0
    w: int = 0

    @property
    def numel(self) -> int:
        return self.h * self.w

    def slices(self) -> tuple[slice, slice]:
        return slice(self.r0, self.r0 + self.h), slice(self.c0, self.c0 + self.w)


@dataclass
class _Matrix:
    param: int  # index into the parameters
    index: int | None  # the matrix's index along dim 0 of a 3-D stack; None for a 2-D parameter
    shape: tuple[int, int]
    boxes: list[_Box]  # per rank of the group
    owner: int = 0  # rank in the group
    local: bool = False  # the owner holds all of it: no exchange


@dataclass
class _Group:
    handle: dist.ProcessGroup | None  # None: this rank alone
    rank: int
    size: int
    matrices: list[_Matrix] = field(default_factory=list)


class MatrixOwners:
    """The owner of every matrix of `params` and the exchange that brings each whole to its owner.

    Construction is collective over each parameter's group (one `all_gather_object` of the pieces'
    boxes per group, and one `new_group` where a parameter is sharded over several mesh dims): every
    rank holding these parameters builds it at the same point, with the parameters in the same order.

    Args:
        params: 2-D matrices, or 3-D stacks of them (dim 0 the stack, e.g. experts), plain tensors or
            `DTensor`s; the same list in the same order on every rank of their groups.
        names: the parameters' names, for errors; None = their indices.
        dtype: what the pieces travel in and the results come back in (torch's Newton-Schulz
            computes in bf16: sending bf16 is sending what it would cast to).
    """

    def __init__(
        self, params: Sequence[torch.Tensor], names: Sequence[str] | None = None, dtype: torch.dtype = torch.bfloat16
    ):
        self.dtype = dtype
        self.names = list(names) if names is not None else [f"params[{i}]" for i in range(len(params))]
        self._first: list[int] = []  # per parameter: this rank's first index along dim 0 (3-D stacks)
        self._subgroups: dict[tuple[int, ...], dist.ProcessGroup] = {}
        by_ranks: dict[tuple[int, ...], tuple[dist.ProcessGroup | None, list[int]]] = {}
        boxes: list[tuple[tuple[int, ...], tuple[int, ...]]] = []
        for i, p in enumerate(params):
            if p.ndim not in (2, 3):
                raise ValueError(
                    f"{self.names[i]} has shape {tuple(p.shape)}; MatrixOwners takes 2-D matrices or 3-D stacks "
                    "of them: give other parameters to another optimizer"
                )
            ranks, handle = self._group_of(p)
            by_ranks.setdefault(ranks, (handle, []))[1].append(i)
            boxes.append(_local_box(p))
            self._first.append(boxes[-1][1][0])
        self.groups = [self._plan(params, handle, members, boxes) for handle, members in by_ranks.values()]

    def _group_of(self, p: torch.Tensor) -> tuple[tuple[int, ...], dist.ProcessGroup | None]:
        """The global ranks sharding `p` with this rank (in mesh order), and their process group."""
        if not isinstance(p, DTensor):
            return (), None
        mesh = p.device_mesh
        for placement in p.placements:
            if placement.is_partial():
                raise ValueError(f"a parameter is a Partial DTensor ({p.placements}); reduce it before the step")
        dims = [d for d, pl in enumerate(p.placements) if not pl.is_replicate() and mesh.size(d) > 1]
        if not dims:
            return (), None
        coordinate = mesh.get_coordinate()
        assert coordinate is not None, "a rank holds a parameter of a mesh it is part of"
        index = tuple(slice(None) if d in dims else coordinate[d] for d in range(mesh.ndim))
        ranks = tuple(int(r) for r in mesh.mesh[index].flatten().tolist())
        if len(dims) == 1:
            return ranks, mesh.get_group(dims[0])
        if ranks not in self._subgroups:  # only the ranks of the group call this (local synchronization)
            group = dist.new_group(list(ranks), use_local_synchronization=True)
            assert isinstance(group, dist.ProcessGroup), "this rank is one of the group's"
            self._subgroups[ranks] = group
        return ranks, self._subgroups[ranks]

    def _plan(
        self,
        params: Sequence[torch.Tensor],
        handle: dist.ProcessGroup | None,
        members: list[int],
        boxes: list[tuple[tuple[int, ...], tuple[int, ...]]],
    ) -> _Group:
        """Every rank's box of each matrix of the group's parameters, and each matrix's owner."""
        size = 1 if handle is None else dist.get_world_size(handle)
        group = _Group(handle, 0 if handle is None else dist.get_rank(handle), size)
        gathered: list = [[boxes[i] for i in members]]
        if handle is not None:
            gathered = [None] * size
            dist.all_gather_object(gathered, [boxes[i] for i in members], group=handle)
        for n, i in enumerate(members):
            shape = tuple(params[i].shape)
            stack = [None] if len(shape) == 2 else list(range(shape[0]))
            for index in stack:
                per_rank = [_matrix_box(held[n][0], held[n][1], index) for held in gathered]
                matrix = _Matrix(i, index, (shape[-2], shape[-1]), per_rank)
                if sum(b.numel for b in per_rank) != shape[-2] * shape[-1]:
                    where = self.names[i] + ("" if index is None else f"[{index}]")
                    raise ValueError(
                        f"the pieces of {where} on its {size} ranks do not tile it ({per_rank}); "
                        "shard it with Shard/_StridedShard placements only"
                    )
                group.matrices.append(matrix)
        _assign_owners(group.matrices)
        return group

    def apply(self, pieces: Sequence[torch.Tensor | None], fn: MatrixFn) -> list[torch.Tensor | None]:
        """`fn` of every whole matrix, on its owner; returns this rank's piece of each result.

        Args:
            pieces: per parameter, this rank's piece of the tensor to transform (its local shape, e.g.
                a momentum buffer's `to_local()`), or None to leave that parameter out (then every rank
                of its group leaves it out: a gradient FSDP or TP did not produce).
            fn: `(parameter index, whole matrix (m, n)) -> (m, n)`, run once per matrix on its owner.

        Returns:
            Per parameter, this rank's piece of the result in `dtype`, None where `pieces` had None.
        """
        out: list[torch.Tensor | None] = [
            None if x is None else torch.empty(x.shape, dtype=self.dtype, device=x.device) for x in pieces
        ]
        for group in self.groups:
            active = [m for m in group.matrices if pieces[m.param] is not None]
            for m in active:
                if m.local and m.owner == group.rank:
                    piece = self._piece(pieces, m)
                    self._piece(out, m).copy_(fn(m.param, piece))
            exchanged = [m for m in active if not m.local]
            if exchanged:
                self._exchange(group, exchanged, pieces, out, fn)
        return out

    def _exchange(
        self,
        group: _Group,
        matrices: list[_Matrix],
        pieces: Sequence[torch.Tensor | None],
        out: list[torch.Tensor | None],
        fn: MatrixFn,
    ) -> None:
        """Steps 1-3 of the module docstring for one group: pieces to owners, `fn`, results back."""
        me, size = group.rank, group.size
        device = next(x for x in pieces if x is not None).device
        by_owner: list[list[_Matrix]] = [[] for _ in range(size)]
        for m in matrices:
            by_owner[m.owner].append(m)
        # 1. to each owner, in matrix order, this rank's piece of each matrix it owns
        sends = [self._piece(pieces, m) for owned in by_owner for m in owned if m.boxes[me].numel]
        send_sizes = [sum(m.boxes[me].numel for m in owned) for owned in by_owner]
        mine = by_owner[me]
        recv_sizes = [sum(m.boxes[k].numel for m in mine) for k in range(size)]
        received = self._all_to_all(sends, recv_sizes, send_sizes, group, device)
        # 2. assemble this rank's matrices (from each rank, in matrix order) and transform them
        wholes = [torch.empty(m.shape, dtype=self.dtype, device=device) for m in mine]
        at = 0
        for k in range(size):
            for m, whole in zip(mine, wholes, strict=True):
                box = m.boxes[k]
                if box.numel:
                    whole[box.slices()] = received[at : at + box.numel].view(box.h, box.w)
                    at += box.numel
        results = [fn(m.param, whole).to(self.dtype) for m, whole in zip(mine, wholes, strict=True)]
        del wholes, received
        # 3. each piece of the results back to the rank holding it
        backs = [r[m.boxes[k].slices()] for k in range(size) for m, r in zip(mine, results, strict=True)
                 if m.boxes[k].numel]  # fmt: skip
        returned = self._all_to_all(backs, send_sizes, recv_sizes, group, device)
        at = 0
        for owned in by_owner:
            for m in owned:
                box = m.boxes[me]
                if box.numel:
                    self._piece(out, m).copy_(returned[at : at + box.numel].view(box.h, box.w))
                    at += box.numel

    def _all_to_all(
        self, chunks: list[torch.Tensor], recv_sizes: list[int], send_sizes: list[int], group: _Group, device
    ) -> torch.Tensor:
        """One `all_to_all_single` of `chunks` (copied in rank order into one buffer of the exchange dtype)."""
        send = torch.empty(sum(send_sizes), dtype=self.dtype, device=device)
        at = 0
        for chunk in chunks:
            send[at : at + chunk.numel()].view(chunk.shape).copy_(chunk)
            at += chunk.numel()
        received = torch.empty(sum(recv_sizes), dtype=self.dtype, device=device)
        dist.all_to_all_single(received, send, recv_sizes, send_sizes, group=group.handle)
        return received

    def _piece(self, tensors: Sequence[torch.Tensor | None], m: _Matrix) -> torch.Tensor:
        """This rank's piece of matrix `m` in its parameter's local tensor in `tensors` (a view)."""
        local = tensors[m.param]
        assert local is not None, "an active matrix has a tensor"
        return local if m.index is None else local[m.index - self._first[m.param]]


def _local_box(p: torch.Tensor) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(local shape, global offset) of this rank's piece of `p`, as DCP computes it."""
    if not isinstance(p, DTensor):
        return tuple(p.shape), (0,) * p.ndim
    shape, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
    local = tuple(p.to_local().shape)
    if tuple(shape) != local:
        raise ValueError(f"a DTensor's local shape {local} is not its placements' {tuple(shape)} ({p.placements})")
    return tuple(shape), tuple(offset)


def _matrix_box(shape: tuple[int, ...], offset: tuple[int, ...], index: int | None) -> _Box:
    """The part of matrix `index` (of a 3-D stack; None: the 2-D parameter) inside a rank's piece."""
    if index is None:
        return _Box(offset[0], shape[0], offset[1], shape[1]) if shape[0] * shape[1] else _Box()
    if not offset[0] <= index < offset[0] + shape[0] or not shape[1] * shape[2]:
        return _Box()
    return _Box(offset[1], shape[1], offset[2], shape[2])


def _assign_owners(matrices: list[_Matrix]) -> None:
    """Each matrix to the least-loaded rank holding a piece of it, largest (by m n min(m, n)) first;
    a matrix one rank holds whole stays there. Every rank computes the same assignment."""
    load: dict[int, int] = {}
    order = sorted(matrices, key=lambda m: -m.shape[0] * m.shape[1] * min(m.shape))
    for m in order:
        holders = [k for k, box in enumerate(m.boxes) if box.numel]
        if len(holders) == 1:
            m.owner, m.local = holders[0], True
            continue
        m.owner = min(holders, key=lambda k: (load.get(k, 0), k))
        load[m.owner] = load.get(m.owner, 0) + m.shape[0] * m.shape[1] * min(m.shape)
