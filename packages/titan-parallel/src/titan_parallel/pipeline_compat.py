"""Gaps in torch's pipeline schedules, closed for every torch release Titan runs on (2.11 up).

Each function here is a no-op, or costs nothing that matters, where torch has no such gap;
`titan_parallel.pipeline` applies them when it builds the stages and the schedule.

- `skip_warm_up_sends_to_self`: torch 2.11's link warm-up hangs gloo under V schedules.
- `keep_custom_loss_node`: torch 2.11's split backward loses a loss computed by a Python
  `autograd.Function` (the fused loss) between its input and weight halves.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch.autograd.function import BackwardCFunction

if TYPE_CHECKING:
    from torch.distributed.pipelining import PipelineStage

__all__ = ["keep_custom_loss_node", "skip_warm_up_sends_to_self"]

_SEARCH_DEPTH = 4
"""Nodes followed down from a loss's root, one input each, looking for a Python `autograd.Function`:
the fused loss sits under at most the caller's and the schedule's divisions."""


def skip_warm_up_sends_to_self(stage: PipelineStage) -> None:
    """Leave out the sends and receives of a stage's link warm-up whose peer is its own rank.

    torch 2.11's schedules open every stage's links at the first step with a dummy send and
    receive to each neighbouring stage (`_get_init_p2p_neighbors_ops`), the stage's own rank
    included when a V schedule (ZBVZeroBubble, DualPipeV) puts neighbouring stages on one rank.
    gloo never completes a send to the sending rank itself, so the first step hung until the
    process group's timeout. Neighbours on one rank pass tensors in memory and need no link.
    Later torch releases have no such warm-up; NCCL completes sends to self and keeps torch's ops.

    Args:
        stage: a stage of this rank, changed in place (its warm-up, where it has one).
    """
    warm_up = getattr(stage, "_get_init_p2p_neighbors_ops", None)
    if warm_up is None:
        return
    own_rank = torch.distributed.get_rank()

    def warm_up_with_peers() -> list[torch.distributed.P2POp]:
        return [op for op in warm_up() if op.peer != own_rank]

    stage._get_init_p2p_neighbors_ops = warm_up_with_peers  # type: ignore[attr-defined]  # torch 2.11 only


def keep_custom_loss_node(loss: torch.Tensor) -> torch.Tensor:
    """`loss`, made to keep the Python `autograd.Function` node it comes from alive as long as it lives.

    Zero-bubble schedules (InterleavedZeroBubble, ZBVZeroBubble, DualPipeV) split a stage's backward:
    the input gradients first, the weight gradients later, from the autograd nodes where the two
    paths meet (the fused loss's node, for the output projection's weight). Between the halves torch
    detaches the loss in place to free the graph above those nodes; torch 2.11 holds a Python
    function's node only weakly, so when the loss's graph was its last owner it died there, and the
    weight half failed with "Attribute '_input_metadata' is invalid".

    On such a torch (`_weak_function_nodes`), when a Python function node that takes a weight lies on
    the single path below the loss's root (`_SEARCH_DEPTH` nodes down), the root node is kept on the
    loss tensor, which the schedule holds until its step ends: the detach then frees nothing the
    weight half needs, and the node's saved tensors still go when its backward has run. A loss that
    is the function's own output is first copied (`clone`, exact), as a Python node cannot hold
    itself. Any other loss comes back unchanged, and so does every loss on a torch that keeps the
    nodes (2.15): a plain or compiled cross-entropy's graph, logits included, still frees at the detach.

    Args:
        loss: a micro-batch's loss, as the schedule's loss function returns it.
    """
    if loss.grad_fn is None or not _weak_function_nodes():
        return loss
    node = _down_to(loss.grad_fn, lambda n: isinstance(n, BackwardCFunction))
    takes_a_weight = node is not None and any(
        _down_to(child, lambda n: type(n).__name__ == "AccumulateGrad") for child, _ in node.next_functions
    )  # a weight's gradient leaf, directly or through single-input nodes (a cast, a view, DTensor's `to_local`)
    if not takes_a_weight:
        return loss
    if isinstance(loss.grad_fn, BackwardCFunction):
        loss = loss.clone()
    setattr(loss, "_titan_loss_root", loss.grad_fn)  # noqa: B010  # a C++ node: its Python object owns it
    return loss


def _down_to(node: Any, found: Callable[[Any], bool]) -> Any:
    """The first node for which `found` holds on the path from `node` (itself included) down through nodes with
    one input each, `_SEARCH_DEPTH` steps at most; None when there is none."""
    for _ in range(_SEARCH_DEPTH + 1):
        if node is None or found(node):
            return node
        inputs = [n for n, _ in node.next_functions if n is not None]
        node = inputs[0] if len(inputs) == 1 else None
    return None


@functools.cache
def _weak_function_nodes() -> bool:
    """Whether this torch frees a Python `autograd.Function`'s node once no tensor or node holds it, its
    Python object left behind (torch 2.11; 2.15 keeps the node while the object lives): probed once."""

    class Probe(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
            return x.clone()

        @staticmethod
        def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
            return grad

    with torch.enable_grad():
        out = Probe.apply(torch.zeros(1, requires_grad=True))
    node = out.grad_fn
    del out
    try:
        node._input_metadata  # noqa: B018  # raises once the C++ node is gone
    except RuntimeError:
        return True
    return False
