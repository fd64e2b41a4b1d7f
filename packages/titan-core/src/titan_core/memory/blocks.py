"""The analytic tier's per-block arithmetic: which measured figures each block of a stage takes, what it keeps
under an activation checkpointing mode, and the block backward at which the stage peaks."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from titan_core.memory.activations import ActivationBytes


def block_activations(act: ActivationBytes, block_names: list[str]) -> list[ActivationBytes]:
    """The `ActivationBytes` of each block named `<blocks>.<layer index>`: the family's `per_block` entry where
    its blocks differ (DeepSeek-V3's dense and MoE blocks), else `act` itself."""
    if not act.per_block:
        return [act] * len(block_names)
    return [act.per_block[int(name.rsplit(".", 1)[1])] for name in block_names]


def saved_per_block(acts: list[ActivationBytes], mode: str, option: str) -> list[int]:
    """Bytes per token each block (of `ActivationBytes` `acts`) keeps for backward under the activation
    checkpointing mode."""
    if mode == "full":
        return [a.block_input for a in acts]
    if mode == "selective" and option == "op":
        return [a.block_op for a in acts]
    if mode == "selective":
        every = int(option)
        return [a.block_input if i % every == 0 else a.block for i, a in enumerate(acts)]
    if mode == "memory_budget":  # what the partitioner keeps at the budget, where measured; else all (a bound)
        return [a.block if a.block_budget is None else a.block_budget for a in acts]
    return [a.block for a in acts]


def block_backward_peak(
    acts: list[ActivationBytes],
    saved: list[int],
    mode: str,
    option: str,
    tokens: int,
    grads: list[int] | None = None,
    grads_before: int = 0,
) -> int:
    """Bytes a block's backward adds to the saved activations, at the block where the sum peaks.

    Block j's backward holds its recompute under AC and the gradients of its activations; by then the blocks
    after it have freed what they kept of this micro-batch (`saved`, bytes per token) and, where no earlier
    micro-batch made them, left their parameters' gradients (`grads`, bytes per block; `grads_before`: those
    of the modules after the blocks, the output projection's). Where every block is alike and keeps more than
    its gradients the last block's backward is the peak; under full AC, the first's.
    """
    best: int | None = None
    freed = 0
    grown = grads_before
    for a, kept, grad in zip(reversed(acts), reversed(saved), reversed(grads or [0] * len(acts)), strict=True):
        recompute = tokens * (a.block if mode == "full" or (mode == "selective" and option != "op") else 0)
        if mode == "selective" and option == "op":
            recompute = tokens * (a.block - a.block_op)
        elif mode == "memory_budget":  # the backward recomputes what the forward did not keep
            recompute = tokens * (a.block - kept)
        net = tokens * a.block_backward + recompute - freed + grown
        best = net if best is None or net > best else best
        freed += tokens * kept
        grown += grad
    assert best is not None, "at least one block (the caller passes the head's figures without blocks)"
    return best
