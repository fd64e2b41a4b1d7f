"""The loss a step backpropagates, and the plain losses it is built from.

The loss is normalised in exactly one place, `StepLoss`: each micro-batch's mean
token loss is divided by the number of equal micro-batches this rank runs in the
step (accumulation steps x pipeline micro-batches). Every micro-batch holds the
same number of tokens, so this is the sum of the step's token losses over the
rank's token count (torchtitan's sum / global-token normalisation), and data
parallel's gradient average over the dp x cp ranks makes it the global batch's
mean: accumulation, pipeline micro-batches, CP and DP agree by construction.
Mixture-of-Experts auxiliary losses take the same divisor (see `StepLoss.divisor`).
With multi-token prediction (`mtp.layers`), the training forward returns the main rows and
each depth's stacked on the batch dim, and `StepLoss` adds `mtp.loss_weight` times the
depths' mean cross-entropy (each depth's labels shifted left once more) to the micro-batch's;
the step's reported loss stays the language-model loss, the depths' mean is `loss/mtp` (and each depth's
`loss/mtp_<k>` with several).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

if TYPE_CHECKING:
    from titan_models.moe import MoE

__all__ = ["HeadLoss", "StepLoss", "cross_entropy_loss", "loss_is_compiled", "sequence_loss_sums", "shift_labels"]


def cross_entropy_loss(
    logits: torch.Tensor, labels: torch.Tensor, z_loss: float = 0.0, z_loss_out: list[torch.Tensor] | None = None
) -> torch.Tensor:
    """Mean token cross-entropy in fp32; logits `(bs, seqlen, vocab)`, labels `(bs, seqlen)`. With `z_loss` > 0
    and autograd recording (training), plus `z_loss` times the mean of `logsumexp(logits)**2` over the labelled
    tokens (`training.z_loss_weight`; forward-only evaluation reports the cross-entropy alone), which is also
    appended, detached, to `z_loss_out` where given."""
    flat, targets = logits.flatten(0, 1).float(), labels.flatten()  # (tokens, vocab), (tokens,)
    loss = F.cross_entropy(flat, targets)
    if z_loss and torch.is_grad_enabled():
        valid = targets != -100  # F.cross_entropy's ignore_index
        z_term = z_loss * (torch.logsumexp(flat, dim=-1).square() * valid).sum() / valid.sum()
        if z_loss_out is not None:
            z_loss_out.append(z_term.detach())
        loss = loss + z_term
    return loss


class HeadLoss:
    """`(hidden states, labels) -> mean token loss` through the fused output projection
    (`titan_parallel.fuse_output_loss`): the model returns hidden states, and this head turns them
    into the loss in token chunks, so the full logits never exist.

    Args:
        head: the model's output projection, made a `LinearCrossEntropyHead`.
    """

    def __init__(self, head: torch.nn.Module):
        self.head = head

    def __call__(self, hidden: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.head(hidden, labels=labels)  # through the module call: FSDP's and TP's hooks run


def loss_is_compiled(compile_loss: bool, tp: int, loss_parallel: bool) -> bool:
    """Whether the plain loss runs compiled: `compile.components` has "loss", and no TP loss parallel (a compiled
    cross-entropy does not see `loss_parallel()`'s DTensor rules: on vocab-sharded logits it returned 0, torch 2.15).

    Args:
        compile_loss: `compile.enable` and "loss" in `compile.components`.
        tp: the tensor-parallel degree.
        loss_parallel: whether TP computes the loss on vocab-sharded logits.
    """
    return compile_loss and not (tp > 1 and loss_parallel)


class StepLoss:
    """The loss the backward starts from: a micro-batch's mean token loss over `divisor`.

    Training sets `divisor` to the micro-batches this rank runs per step (accumulation
    steps x pipeline micro-batches), so the step's gradient is that of its mean token
    loss; evaluation sets it to the pipeline micro-batches of one batch, so the
    pipeline's summed losses are the batch's mean. The pipeline schedule calls this
    object as its loss function and adds nothing (`scale_grads=False`). MoE layers
    divide their auxiliary loss by the same divisor (`moe.aux_loss_scale`, set here).

    Args:
        fn: `(logits, labels) -> mean token loss` (possibly compiled).
        divisor: see above.
    """

    def __init__(self, fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], divisor: int = 1):
        self.fn = fn
        self.divisor = divisor
        self.aux_layers: list[MoE] = []  # MoE layers whose auxiliary loss follows the divisor
        self.z_terms: list[torch.Tensor] = []  # each training call's z-loss term (`training.z_loss_weight`)
        self.mtp_depths = 0  # multi-token-prediction depths the training forward returns rows for
        self.mtp_weight = 0.0  # `mtp.loss_weight`
        self.mtp_terms: list[torch.Tensor] = []  # each training call's MTP cross-entropy per depth, (D,) detached
        self.depth_weights: torch.Tensor | None = None  # (D,) each depth's loss factor on a CP rank (`place`)

    def __call__(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        if self.mtp_depths and logits.shape[0] == labels.shape[0] * (1 + self.mtp_depths):
            return self._with_mtp(logits, labels)
        return self.fn(logits, labels) / self.divisor

    def _with_mtp(self, output: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """The main rows' loss plus `mtp_weight` x the mean of the depths' (depth k's targets: `labels` shifted left
        k places, -100 at the end). The z-loss terms the depths add stay in the loss, not in `z_terms`."""
        parts = output.chunk(1 + self.mtp_depths, dim=0)
        if labels.dim() == 3:  # (bs, 1 + D, seqlen): each depth's targets taken on whole sequences (CP shards)
            labels, *each = labels.unbind(1)
        else:
            each = [shift_labels(labels, k) for k in range(1, self.mtp_depths + 1)]
        loss = self.fn(parts[0], labels)
        first_z = len(self.z_terms)
        depth_losses = [self.fn(part, depth_labels) for part, depth_labels in zip(parts[1:], each, strict=True)]
        if self.depth_weights is not None:  # CP: each rank's share of the whole sequences' targets
            depth_losses = [d * w for d, w in zip(depth_losses, self.depth_weights.unbind(), strict=True)]
        del self.z_terms[first_z:]
        mtp = sum(depth_losses[1:], depth_losses[0]) / self.mtp_depths
        full = [d.full_tensor() if isinstance(d, DTensor) else d for d in depth_losses]  # loss parallel
        self.mtp_terms.append(torch.stack(full).detach())
        return (loss + self.mtp_weight * mtp) / self.divisor

    @contextlib.contextmanager
    def divided_by(self, divisor: int) -> Iterator[None]:
        """Use `divisor` (and the same auxiliary-loss scale) inside the block."""
        saved = self.divisor
        self.set_divisor(divisor)
        try:
            yield
        finally:
            self.set_divisor(saved)

    def set_divisor(self, divisor: int) -> None:
        """Divide the language-model loss and every MoE layer's auxiliary loss by `divisor`."""
        self.divisor = divisor
        for moe in self.aux_layers:
            moe.aux_loss_scale = 1.0 / divisor


def shift_labels(labels: torch.Tensor, k: int) -> torch.Tensor:
    """`labels` `(bs, seqlen)` shifted left `k` places, the last `k` positions -100 (no target): the targets of
    multi-token-prediction depth `k`, whose row `i` predicts token `i + k + 1`.

    Args:
        labels: the main targets (token `i + 1` at position `i`), -100 where no loss is taken.
        k: the depth (>= 1).
    """
    return torch.cat([labels[:, k:], labels.new_full((labels.shape[0], min(k, labels.shape[1])), -100)], dim=1)


def sequence_loss_sums(
    mean_loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], output: torch.Tensor, labels: torch.Tensor
) -> torch.Tensor:
    """Each row's summed token loss `(batch,)` from a mean-token-loss function: the row's mean times its
    labelled tokens, 0 where a row has none (its mean is 0/0).

    Args:
        mean_loss: `(output, labels) -> mean token loss` (the plain, compiled or fused loss).
        output: `(batch, seqlen, ...)` logits or hidden states; a DTensor under TP.
        labels: `(batch, seqlen)`, -100 where no loss is taken.
    """
    means = []
    for row in range(labels.shape[0]):
        mean = mean_loss(output[row : row + 1], labels[row : row + 1])
        means.append(mean.full_tensor() if isinstance(mean, DTensor) else mean)  # loss parallel
    counts = (labels != -100).sum(dim=-1)  # (batch,)
    return torch.where(counts > 0, torch.stack(means).float() * counts, 0.0)
