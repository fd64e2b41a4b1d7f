"""Validation: the loss on held-out data every `validation.freq` steps, under every layout.

Every validation pass reads the same first `steps` batches from a fresh loader,
so the figures of different steps compare. The forward is the step runner's
(`titan_core.step.StepRunner.eval_loss`): the same placement, CP sharding, mixed
precision and loss parallel as training, and under pipeline parallel the
schedule's forward-only pass.

Held out by default: `validation.dataset = "stdlib"` reads the stdlib corpus's
validation files, which training never reads (`titan_core.data.corpus`), and a hub
dataset its `validation` split. Local files that training reads too (the same
`dataset_path`) are the user's choice, and `training_overlap` names them in a
warning at start-up.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn

from titan_core.config.schema import JobConfig
from titan_core.data import MixtureLoader, PackedLoader, TokenShardLoader
from titan_core.data.corpus import looks_like_path


def training_overlap(cfg: JobConfig) -> str | None:
    """A warning when `[validation]` reads local files `[training]` trains on (the same path), else None. The
    stdlib corpus is split, and validation reads a hub dataset's `validation` split, so neither overlaps.

    Args:
        cfg: the job's config.
    """
    v, t = cfg.validation, cfg.training
    if v.sets:
        held_out = [(f"validation.sets[{i}].path", entry.path, False) for i, entry in enumerate(v.sets)]
    elif v.dataset_path:
        held_out = [("validation.dataset_path", v.dataset_path, True)]
    else:
        held_out = [("validation.dataset", v.dataset, False)]
    if t.dataset_mix:
        sources = [(f"training.dataset_mix[{i}].path", entry.path) for i, entry in enumerate(t.dataset_mix)]
    else:
        sources = [("training.dataset_path", t.dataset_path) if t.dataset_path else ("training.dataset", t.dataset)]

    def where(source: str) -> str:
        return os.path.realpath(os.path.expanduser(source))

    for key, name, local in held_out:
        if not local and (name == "stdlib" or not looks_like_path(name)):
            continue  # the stdlib corpus's held-out files, or a hub dataset's validation split
        for train_key, source in sources:
            if source != "stdlib" and where(source) == where(name):
                return (
                    f"{key} reads what training trains on ({train_key} = {source}): the validation loss measures the "
                    f"fit to text the run has seen, not to held-out text; point {key} at other files"
                )
    return None


class Validator:
    """Computes the global mean validation loss of each validation set.

    Args:
        make_loaders: per set, by its label, a function giving a fresh loader over its data, positioned at its
            start (this rank's data-parallel share); one entry with the label "" for `validation.dataset`.
        steps: batches per validation pass of each set.
        eval_loss: `(inputs, labels) -> this batch's mean loss` on this rank, None on pipeline ranks without
            the last stage (`StepRunner.eval_loss`).
        parts: this rank's model parts (put in eval mode for the pass).
        loss_group: the group the loss is averaged over (data- and context-parallel ranks).
        pp_group: the pipeline group under pipeline parallel (the last stage's loss is shared over it).
        device: where the losses live.
    """

    def __init__(
        self,
        make_loaders: Mapping[str, Callable[[], PackedLoader | TokenShardLoader | MixtureLoader]],
        *,
        steps: int,
        eval_loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor | None],
        parts: Sequence[nn.Module],
        loss_group: dist.ProcessGroup,
        pp_group: dist.ProcessGroup | None = None,
        device: torch.device,
    ):
        self.make_loaders, self.steps, self.eval_loss = dict(make_loaders), steps, eval_loss
        self.parts, self.loss_group, self.pp_group, self.device = list(parts), loss_group, pp_group, device

    @torch.no_grad()
    def validate(self) -> dict[str, float]:
        """Each set's mean loss over `steps` batches and all ranks of `loss_group` (one all-reduce for all sets)."""
        modes = [part.training for part in self.parts]
        for part in self.parts:
            part.eval()
        totals = torch.zeros(len(self.make_loaders), device=self.device)
        try:
            for i, make_loader in enumerate(self.make_loaders.values()):
                for (inputs, labels), _ in zip(make_loader(), range(self.steps), strict=False):
                    loss = self.eval_loss(inputs, labels)
                    if loss is not None:
                        totals[i] += loss.float()
        finally:
            for part, mode in zip(self.parts, modes, strict=True):
                part.train(mode)
        totals = totals / self.steps
        dist.all_reduce(totals, op=dist.ReduceOp.SUM, group=self.loss_group)
        if self.pp_group is not None:  # only the last stage's ranks hold a loss; the others add 0
            dist.all_reduce(totals, op=dist.ReduceOp.SUM, group=self.pp_group)
        means = (totals / dist.get_world_size(self.loss_group)).tolist()
        return dict(zip(self.make_loaders, means, strict=True))

    def metrics(self) -> dict[str, object]:
        """A validation pass as log values: `validation/loss`; with several sets also `validation/<name>/loss`
        each, `validation/loss` then their mean."""
        losses = self.validate()
        if list(losses) == [""]:
            return {"validation/loss": losses[""]}
        return {
            "validation/loss": sum(losses.values()) / len(losses),
            **{f"validation/{k}/loss": v for k, v in losses.items()},
        }
