"""Validation: the loss on held-out data every `validation.freq` steps.

Every validation pass reads the same first `steps` batches from a fresh loader,
so the figures of different steps compare.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

from titan_core.data import PackedLoader

Batch = tuple[torch.Tensor, torch.Tensor]


class Validator:
    """Computes the global mean validation loss of a (non-pipelined) model.

    Args:
        make_loader: a fresh loader over the validation data, positioned at its start
            (this rank's data-parallel share).
        steps: batches per validation pass.
        loss_group: the group the loss is averaged over (data- and context-parallel ranks).
        prepare: `(inputs, labels) -> (inputs, labels)` placed and sharded as training does.
        loss_context: the context the forward and loss run in (mixed precision, loss parallel).
    """

    def __init__(
        self,
        make_loader: Callable[[], PackedLoader],
        *,
        steps: int,
        loss_group: dist.ProcessGroup,
        prepare: Callable[[torch.Tensor, torch.Tensor], Batch],
        loss_context: Callable[[], contextlib.AbstractContextManager],
    ):
        self.make_loader, self.steps = make_loader, steps
        self.loss_group, self.prepare, self.loss_context = loss_group, prepare, loss_context

    @torch.no_grad()
    def validate(self, model: nn.Module, loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> float:
        """Mean loss over `steps` batches and all ranks of `loss_group`."""
        was_training = model.training
        model.eval()
        total = None
        for (inputs, labels), _ in zip(self.make_loader(), range(self.steps)):
            inputs, labels = self.prepare(inputs, labels)
            with self.loss_context():
                loss = loss_fn(model(inputs), labels)
            if isinstance(loss, DTensor):
                loss = loss.full_tensor()
            total = loss if total is None else total + loss
        model.train(was_training)
        total = total / self.steps
        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=self.loss_group)
        return total.item() / dist.get_world_size(self.loss_group)
