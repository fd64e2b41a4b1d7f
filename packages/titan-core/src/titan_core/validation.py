"""Validation: the loss on held-out data every `validation.freq` steps.

Every validation pass reads the same first `validation.steps` batches of its
dataset (a fresh loader each time), so the figures of different steps compare.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

from titan_core.data import PackedLoader, build_source


class Validator:
    """Computes the global mean validation loss of a (non-pipelined) model.

    Args:
        dataset: `validation.dataset` ("stdlib", a path/glob, or a Hub name).
        dataset_path: `validation.dataset_path`.
        text_field: field holding the text.
        tokenizer: the training tokenizer.
        seq_len: tokens per sequence (the training `seq_len`).
        local_batch_size: sequences per rank per batch.
        steps: batches per validation pass.
        dp_rank, dp_world: this rank's data-parallel coordinates.
        loss_group: the group the loss is averaged over (data and context parallel ranks).
        prepare: `(inputs, labels) -> (inputs, labels)` placed and sharded as training does.
        loss_context: context manager factory the loss is computed under (loss parallel).
    """

    def __init__(self, dataset, dataset_path, text_field, tokenizer, *, seq_len, local_batch_size, steps,
                 dp_rank, dp_world, loss_group, prepare: Callable, loss_context: Callable):
        self.source = build_source(dataset, dataset_path, text_field)
        self.tokenizer, self.seq_len, self.local_batch_size = tokenizer, seq_len, local_batch_size
        self.steps, self.dp_rank, self.dp_world = steps, dp_rank, dp_world
        self.loss_group, self.prepare, self.loss_context = loss_group, prepare, loss_context

    @torch.no_grad()
    def validate(self, model: nn.Module, loss_fn: Callable) -> float:
        """Mean loss over `steps` batches and all data-parallel ranks."""
        loader = PackedLoader(self.source, self.tokenizer, seq_len=self.seq_len,
                              local_batch_size=self.local_batch_size, dp_rank=self.dp_rank, dp_world=self.dp_world)
        was_training = model.training
        model.eval()
        total = None
        for (inputs, labels), _ in zip(loader, range(self.steps)):
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
