"""Linears that read the same input, computed as one matmul while generating: `fuse_shared_input_linears`.

At batch 1 a decode step is a chain of small matrix-vector products, each one a
kernel: the step's time is their count as much as their bytes. A block's query,
key and value projections (and the feed-forward's `w1` and `w3`) read the same
input one after another, so while generating each group runs as one matmul over
its concatenated weights: three kernels become one for attention, two become one
for the feed-forward, and the key / value projections (a quarter of the query's
size under grouped-query attention) stop being too small to reach the memory
bandwidth. The model's plan names the groups (`ModelPlan.shared_input_linears`);
the model's code is unchanged.

While fused, the group's first linear is replaced by `_GroupHead`, which computes
the whole group's output and returns its own slice; the others by `_GroupMember`,
which return theirs. The original weights become views into the concatenated
weight, so no memory is added, and on exit the original modules return with the
same values. Under `torch.compile` the hand-over between them is traced as plain
attribute updates and the slices stay inside the graph.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch
from torch import nn

from titan_parallel.plan import ModelPlan


class _Handover:
    """The slices a group's head computed for the members still to be called."""

    def __init__(self) -> None:
        self.parts: tuple[torch.Tensor, ...] = ()


class _GroupHead(nn.Module):
    """The group's first linear: computes the whole group, returns its own slice, hands the rest over."""

    def __init__(self, fused: nn.Linear, sizes: Sequence[int], handover: _Handover):
        super().__init__()
        self.fused, self.sizes, self.handover = fused, list(sizes), handover

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        first, *rest = self.fused(x).split(self.sizes, dim=-1)  # each (..., out_features of its linear)
        self.handover.parts = tuple(rest)
        return first


class _GroupMember(nn.Module):
    """A later linear of the group: returns the slice the head computed from the same input."""

    def __init__(self, handover: _Handover, index: int, last: bool):
        super().__init__()
        self.handover, self.index, self.last = handover, index, last

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        parts = self.handover.parts
        if len(parts) < self.index:
            raise RuntimeError(
                "a fused linear was called before its group's first linear: the model's forward no longer calls "
                "ModelPlan.shared_input_linears in order; fix the plan or generate with fuse_linears=False"
            )
        if self.last:
            self.handover.parts = ()  # nothing outlives the block's forward
        return parts[self.index - 1]


@contextlib.contextmanager
def fuse_shared_input_linears(model: nn.Module, plan: ModelPlan) -> Iterator[int]:
    """Within the context, compute each of the plan's `shared_input_linears` groups as one matmul.

    Yields the number of groups fused. Groups that a block lacks, or whose linears are not plain
    `nn.Linear`s of one input size, dtype and device without biases (e.g. tensor-parallel DTensors), stay
    as they are.

    Args:
        model: the model (whole, unsharded), in eval mode; its weights are not trained meanwhile.
        plan: the family's plan.
    """
    blocks = model.get_submodule(plan.blocks) if plan.shared_input_linears else None
    restore: list[tuple[nn.Module, str, nn.Module]] = []
    fused = 0
    try:
        for block in blocks.children() if blocks is not None else ():
            for group in plan.shared_input_linears:
                found = [_plain_linear(block, path) for path in group]
                linears = [lin for lin in found if lin is not None]
                if len(linears) < 2 or len(linears) < len(found) or not _fusable(linears):
                    continue
                restore += _fuse(block, group, linears)
                fused += 1
        yield fused
    finally:
        for parent, name, original in reversed(restore):
            setattr(parent, name, original)


def _plain_linear(block: nn.Module, path: str) -> nn.Linear | None:
    try:
        module = block.get_submodule(path)
    except AttributeError:
        return None
    return module if type(module) is nn.Linear else None


def _fusable(linears: Sequence[nn.Linear]) -> bool:
    """Plain parameters (not DTensors) of one input size, dtype and device, and no biases."""
    first = linears[0].weight
    return all(
        type(lin.weight) is nn.Parameter
        and lin.bias is None
        and (lin.weight.size(1), lin.weight.dtype, lin.weight.device) == (first.size(1), first.dtype, first.device)
        for lin in linears
    )


def _fuse(
    block: nn.Module, group: Sequence[str], linears: Sequence[nn.Linear]
) -> list[tuple[nn.Module, str, nn.Module]]:
    """Swap the group's modules in `block`; returns (parent, name, original module) to restore."""
    sizes = [lin.out_features for lin in linears]
    with torch.no_grad():
        weight = torch.cat([lin.weight for lin in linears])  # (sum of out_features, in_features)
        offset = 0
        for lin, size in zip(linears, sizes, strict=True):
            lin.weight.data = weight[offset : offset + size]  # a view: the old storage is freed
            offset += size
    fused = nn.Linear(linears[0].in_features, sum(sizes), bias=False, device="meta")
    fused.weight = nn.Parameter(weight, requires_grad=False)
    handover = _Handover()
    swapped: list[tuple[nn.Module, str, nn.Module]] = []
    for index, (path, lin) in enumerate(zip(group, linears, strict=True)):
        parent_path, _, name = path.rpartition(".")
        parent = block.get_submodule(parent_path) if parent_path else block
        replacement: nn.Module = (
            _GroupHead(fused, sizes, handover) if index == 0 else _GroupMember(handover, index, index == len(group) - 1)
        )
        setattr(parent, name, replacement)
        swapped.append((parent, name, lin))
    return swapped
