"""Gaps in torch's pipeline schedules, closed for every torch release Titan runs on (2.11 up).

Each function here is a no-op, or costs nothing that matters, where torch has no such gap;
`titan_parallel.pipeline` applies them when it builds the stages and the schedule.

- `skip_warm_up_sends_to_self`: torch 2.11's link warm-up hangs gloo under V schedules.
- `keep_custom_loss_node`: torch 2.11's split backward loses a loss computed by a Python
  `autograd.Function` (the fused loss) between its input and weight halves.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

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
    2.11 detaches the loss in place to free the graph above those nodes; torch holds a Python
    function's node only weakly, so when the loss's graph was its last owner it died there, and the
    weight half failed with "Attribute '_input_metadata' is invalid".

    When such a node lies on the single path below the loss's root (`_SEARCH_DEPTH` nodes down), the
    root node is kept on the loss tensor, which the schedule holds until its step ends: the detach
    then frees nothing the weight half needs, and the node's saved tensors still go when its
    backward has run. A loss that is the function's own output is first copied (`clone`, exact),
    as a Python node cannot hold itself. Other losses come back unchanged: a plain cross-entropy's
    graph keeps freeing at the detach.
    """
    node = loss.grad_fn
    for _ in range(_SEARCH_DEPTH):
        if node is None or isinstance(node, BackwardCFunction):
            break
        inputs = [n for n, _ in node.next_functions if n is not None]
        node = inputs[0] if len(inputs) == 1 else None
    if not isinstance(node, BackwardCFunction):
        return loss
    if isinstance(loss.grad_fn, BackwardCFunction):
        loss = loss.clone()
    setattr(loss, "_titan_loss_root", loss.grad_fn)  # noqa: B010  # a C++ node: its Python object owns it
    return loss
