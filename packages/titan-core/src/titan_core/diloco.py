"""DiLoCo across torchft replica groups (`fault_tolerance.semi_sync_method`): each group trains alone for
`sync_steps` steps with its own optimizer (the inner one: AdamW, Muon, ... inside the group's own FSDP/TP layout),
then the groups average their weights' change since the last synchronisation (the pseudo-gradient) and an outer
Nesterov SGD steps from the last synchronised weights, which every group then starts from again (Douillard et al.
2023, arXiv:2311.08105). `local_sgd` averages the weights themselves (outer lr 1, no momentum; Lin et al. 2018).
The groups exchange one all-reduce of the weights every `sync_steps` steps instead of the gradients every step.
With `fragments` (Streaming DiLoCo, Douillard et al. 2025, arXiv:2501.18512) the blocks are cut into that many
contiguous fragments (the embedding with the first, the final norm and output with the last), each synced every
`sync_steps` steps at its own offset (`(f + 1) * sync_steps / fragments`): each sync sends one fragment, so the peak
bandwidth drops by that factor.

    sync at step s (s % sync_steps == 0), after the inner optimizer's step:
        quorum          torchft's, synchronous: a group behind (fresh or restarted) heals from a peer here
        delta = anchor - weights        (this rank's shards; the same shards in every group)
        delta = mean over the groups    one all-reduce per dtype (torchft's Manager)
        commit vote     torchft's `should_commit`; dropped: the weights go back to `anchor`
        anchor = outer_sgd(anchor, delta); weights = anchor

Why not torchft's `DiLoCo`: it keeps the synchronised weights as local shards in a name-keyed dict on the host,
which a checkpoint cannot reshard, and counts its own steps in a hook on the optimizer, which a resumed run or a
group that took a peer's step would have to set by hand. Here the synchronised weights ("anchors") and the outer
momentum are DTensors beside the parameters, as `[ema]`'s average: saved in every checkpoint as the tensor state
"diloco" and resharded on load, so a group resumes bit-exactly; the schedule follows the run's step counter. The
outer step is torch's `SGD(nesterov=True)`; the quorum, all-reduce, vote and live recovery are torchft's, as in
the per-step mode (`titan_core.fault_tolerance`).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import nn

from titan_core.fault_tolerance import ReplicaGroups, local_shard
from titan_parallel import canonical_name

__all__ = ["DiLoCo", "build_diloco", "model_fragments"]

logger = logging.getLogger("titan")


class DiLoCo:
    """The outer loop of DiLoCo over this job's replica group: the anchors, the outer optimizer, the sync.

    Args:
        parts: this rank's model parts, initialised.
        replicas: this job's seat among the replica groups (built with `semi_sync=True`: synchronous quorums).
        sync_steps: inner steps between two synchronisations.
        outer_lr: the outer SGD's learning rate.
        outer_momentum: its Nesterov momentum; 0 for plain SGD (`local_sgd`: lr 1, momentum 0).
        fragments: the parameter names of each fragment, in sync order (`model_fragments`); None: one, the whole
            model.
    """

    def __init__(
        self,
        parts: Iterable[nn.Module],
        replicas: ReplicaGroups,
        *,
        sync_steps: int,
        outer_lr: float,
        outer_momentum: float,
        fragments: Sequence[Sequence[str]] | None = None,
    ):
        self.params = {canonical_name(name): p for part in parts for name, p in part.named_parameters()}
        fragments = [list(self.params)] if fragments is None else [list(f) for f in fragments]
        if sync_steps < 1 or sync_steps % len(fragments):
            raise ValueError(
                f"DiLoCo sync_steps={sync_steps} must be a positive multiple of its {len(fragments)} fragments"
            )
        if sorted(n for f in fragments for n in f) != sorted(self.params):
            raise ValueError("DiLoCo fragments must hold every parameter of the parts once")
        self.replicas, self.sync_steps = replicas, sync_steps
        with torch.no_grad():  # the weights of the last synchronisation; DTensors keep their placements
            self.anchors = {name: p.detach().clone() for name, p in self.params.items()}
            self.momentum = {name: torch.zeros_like(a) for name, a in self.anchors.items()} if outer_momentum else {}
        # torch's SGD over the anchors' local shards (elementwise: no DTensor dispatch); its momentum buffers are
        # given up front (a zero buffer's first step is torch's own first step) so that they are checkpointed.
        self._pairs = [(local_shard(self.anchors[name]), local_shard(p)) for name, p in self.params.items()]
        self.outer = torch.optim.SGD(
            [a for a, _ in self._pairs], lr=outer_lr, momentum=outer_momentum, nesterov=outer_momentum > 0
        )
        for (anchor, _), name in zip(self._pairs, self.params, strict=True):
            if name in self.momentum:
                self.outer.state[anchor]["momentum_buffer"] = local_shard(self.momentum[name])
        position = {name: i for i, name in enumerate(self.params)}
        self._fragments = [[self._pairs[position[name]] for name in names] for names in fragments]
        self.loaded = False  # whether a checkpoint's anchors were loaded (else they restart from the weights)
        # A group that heals from a peer takes its anchors and momentum too (local shards, as the weights).
        replicas.add_state("diloco", self.state_dict())

    def fragment_at(self, step: int) -> int | None:
        """The fragment step `step` (1-based) syncs after its inner update, or None.

        Args:
            step: the training step just taken.
        """
        every = self.sync_steps // len(self._fragments)
        if step % every:
            return None
        return (step // every - 1) % len(self._fragments)

    def due(self, step: int) -> bool:
        """Whether step `step` (1-based) ends with a synchronisation (of one fragment).

        Args:
            step: the training step just taken.
        """
        return self.fragment_at(step) is not None

    @torch.no_grad()
    def sync(self, step: int) -> bool:
        """Synchronise the groups' fragment due after step `step`'s inner update; True if its outer step was
        committed.

        Dropped by the commit vote (a group died mid-all-reduce), the fragment's weights go back to its last
        anchors: its inner steps since then are lost, as in torchft's DiLoCo.

        Args:
            step: the training step just taken (1-based).
        """
        fragment = self.fragment_at(step)
        if fragment is None:
            raise ValueError(f"DiLoCo: no fragment syncs after step {step}")
        pairs_now = self._fragments[fragment]
        self.replicas.quorum(step - 1)  # may load a peer's weights, optimizer, anchors and step (healing)
        # The pseudo-gradients, written straight into one flat buffer per dtype (the all-reduce's), viewed as .grad.
        buckets: dict[tuple[torch.dtype, torch.device], list[tuple[torch.Tensor, torch.Tensor]]] = {}
        for anchor, weight in pairs_now:
            buckets.setdefault((anchor.dtype, anchor.device), []).append((anchor, weight))
        flats = []
        for (dtype, device), pairs in buckets.items():
            flat = torch.empty(sum(a.numel() for a, _ in pairs), dtype=dtype, device=device)
            offset = 0
            for anchor, weight in pairs:
                anchor.grad = torch.sub(anchor, weight, out=flat[offset : offset + anchor.numel()].view_as(anchor))
                offset += anchor.numel()
            flats.append(flat)
        self.replicas.average_flat(flats)
        committed = self.replicas.commit()
        if committed:
            self.outer.step()  # torch's SGD skips the anchors without a gradient: the other fragments'
        self.outer.zero_grad(set_to_none=True)
        torch._foreach_copy_([w for _, w in pairs_now], [a for a, _ in pairs_now])
        return committed

    @torch.no_grad()
    def restart(self) -> None:
        """Anchor at the weights, no momentum (a checkpoint without DiLoCo's state was loaded)."""
        torch._foreach_copy_([a for a, _ in self._pairs], [w for _, w in self._pairs])
        for buf in self.momentum.values():
            buf.zero_()

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The live anchors and momentum buffers (`titan_ckpt.TensorStateful`): saved as they are, loaded in place."""
        return {
            **{f"anchor.{name}": a for name, a in self.anchors.items()},
            **{f"momentum.{name}": m for name, m in self.momentum.items()},
        }

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        live = self.state_dict()
        with torch.no_grad():
            for key, value in state.items():
                if value is not live[key]:
                    live[key].copy_(value)
        self.loaded = True


def model_fragments(names: Sequence[str], blocks: str, count: int) -> list[list[str]]:
    """`names` (in the model's order) cut into `count` fragments of contiguous blocks, their sizes apart by one at
    most: the parameters before the first block (the embedding) join the first fragment, those after it (the final
    norm, the output) the last.

    Args:
        names: the model's parameter names, as `named_parameters` gives them.
        blocks: the block container's name (`layers`): blocks are `<blocks>.<i>.`.
        count: fragments.
    """
    prefix, depth = blocks + ".", blocks.count(".") + 1  # `<blocks>.<i>.`: the block id is part `depth`
    block_ids = list(dict.fromkeys(n.split(".")[depth] for n in names if n.startswith(prefix)))
    if not 1 <= count <= max(len(block_ids), 1):
        raise ValueError(f"{count} DiLoCo fragments for a model of {len(block_ids)} blocks: use 1 to {len(block_ids)}")
    fragment_of = {block: i * count // len(block_ids) for i, block in enumerate(block_ids)}
    out: list[list[str]] = [[] for _ in range(count)]
    after_blocks = False
    for name in names:
        if name.startswith(prefix):
            out[fragment_of[name.split(".")[depth]]].append(name)
            after_blocks = True
        else:
            out[count - 1 if after_blocks else 0].append(name)
    return out


def build_diloco(
    section: Any, parts: Sequence[nn.Module], replicas: ReplicaGroups | None, blocks: str, steps: int
) -> DiLoCo | None:
    """The run's `DiLoCo` from the [fault_tolerance] section; None without `semi_sync_method` (or replica groups).
    Rank 0 says how it syncs, and when the run's last step leaves the groups apart.

    Args:
        section: the config's `fault_tolerance` section.
        parts: this rank's model parts, initialised.
        replicas: this job's replica groups (`build_replica_groups`).
        blocks: the model's block container (`ModelPlan.blocks`), which `num_fragments` cuts.
        steps: the run's `training.steps`.
    """
    if replicas is None or section.semi_sync_method == "none":
        return None
    averaging = section.semi_sync_method == "local_sgd"  # the mean of the weights: outer lr 1, no momentum
    lr, momentum = (1.0, 0.0) if averaging else (section.outer_lr, section.outer_momentum)
    names = [canonical_name(name) for part in parts for name, _ in part.named_parameters()]
    count, every = section.num_fragments, section.sync_steps
    if replicas.rank == 0:
        fragments = f" in {count} fragments, one every {every // count} steps" if count > 1 else ""
        logger.info(
            "fault tolerance: %s, a sync every %d steps%s; outer SGD lr %g, Nesterov momentum %g",
            "local SGD" if averaging else "DiLoCo",
            every,
            fragments,
            lr,
            momentum,
        )
        if count == 1 and steps % every:
            logger.warning(
                "fault tolerance: training.steps=%d ends %d steps after the last sync, each group on its own weights; "
                "make it a multiple of fault_tolerance.sync_steps=%d to end on weights the groups share",
                steps,
                steps % every,
                every,
            )
    return DiLoCo(
        parts,
        replicas,
        sync_steps=every,
        outer_lr=lr,
        outer_momentum=momentum,
        fragments=model_fragments(names, blocks, count),
    )
