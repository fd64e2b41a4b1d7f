"""Validation: the loss on held-out data every `validation.freq` steps, under every layout.

Every validation pass reads the same first `steps` batches from a fresh loader,
so the figures of different steps compare; `steps = -1` reads all of the data, to
the last batch that does not wrap past its end (every rank reads the global
position, so all agree on where that is without a collective). The forward is the step runner's
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

import itertools
import os
from collections.abc import Callable, Iterator, Mapping, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn

from titan_core.config.errors import ConfigError
from titan_core.config.schema import JobConfig
from titan_core.data import MixtureLoader, PackedLoader, TokenShardLoader
from titan_core.data.corpus import looks_like_path
from titan_core.data.token_loader import Batch


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


def check_first_batch(
    make_loader: Callable[[], PackedLoader | TokenShardLoader | MixtureLoader], *, whole_pass: bool
) -> None:
    """Read a set's first batch when the run starts, so data with no documents is refused before training, not
    at the first validation; with `whole_pass` (`validation.steps = -1`), also refuse data that does not fill one
    global validation batch (a pass over all of it would hold no batch). Each refusal names the config key the
    loader reads (its `key`).

    Args:
        make_loader: gives a fresh loader over the set, at its start.
        whole_pass: each pass reads all of the set's data, to its end.
    """
    loader = make_loader()
    try:
        next(loader)
        if not whole_pass or isinstance(loader, MixtureLoader) or not loader.wrapped():
            return
        tokens, key = loader.dp_world * loader.local_batch_size * (loader.seq_len + 1), loader.key
    finally:
        loader.close()
    raise ConfigError(
        f"{key}: the data holds fewer tokens than one validation batch ({tokens:,} over all ranks), so "
        "validation.steps = -1 (all of it) has no batch to read; give it more data, lower "
        "validation.local_batch_size or validation.seq_len, or give validation.steps a number (batches then repeat)"
    )


class Validator:
    """Computes the global mean validation loss of each validation set.

    Args:
        make_loaders: per set, by its label, a function giving a fresh loader over its data, positioned at its
            start (this rank's data-parallel share); one entry with the label "" for `validation.dataset`.
        steps: batches per validation pass of each set; -1 = all of each set's data, one pass to its end.
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
        counts = [0] * len(self.make_loaders)
        try:
            for i, make_loader in enumerate(self.make_loaders.values()):
                loader = make_loader()
                try:
                    for inputs, labels in self._batches(loader):
                        counts[i] += 1
                        loss = self.eval_loss(inputs, labels)
                        if loss is not None:
                            totals[i] += loss.float()
                finally:
                    loader.close()
        finally:
            for part, mode in zip(self.parts, modes, strict=True):
                part.train(mode)
        # every set holds a batch (`check_first_batch` checked it for steps = -1)
        totals = totals / torch.tensor(counts, device=self.device)
        dist.all_reduce(totals, op=dist.ReduceOp.SUM, group=self.loss_group)
        if self.pp_group is not None:  # only the last stage's ranks hold a loss; the others add 0
            dist.all_reduce(totals, op=dist.ReduceOp.SUM, group=self.pp_group)
        means = (totals / dist.get_world_size(self.loss_group)).tolist()
        return dict(zip(self.make_loaders, means, strict=True))

    def _batches(self, loader: PackedLoader | TokenShardLoader | MixtureLoader) -> Iterator[Batch]:
        """A pass's batches: the first `steps`, or (-1) each one that does not read past the data's end."""
        if self.steps != -1:
            yield from itertools.islice(loader, self.steps)
            return
        if isinstance(loader, MixtureLoader):
            raise TypeError("a validation pass over all of the data reads one source in order, not a mixture")
        for batch in loader:
            if loader.wrapped():
                return
            yield batch

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
