"""DiLoCo across torchft replica groups (`fault_tolerance.semi_sync_method`): each group trains alone for
`sync_steps` steps with its own optimizer (the inner one: AdamW, Muon, ... inside the group's own FSDP/TP layout),
then the groups average their weights' change since the last synchronisation (the pseudo-gradient) and an outer
Nesterov SGD steps from the last synchronised weights, which every group then starts from again (Douillard et al.
2023, arXiv:2311.08105). `local_sgd` averages the weights themselves (outer lr 1, no momentum; Lin et al. 2018).
The groups exchange one all-reduce of the weights every `sync_steps` steps instead of the gradients every step.

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

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from titan_core.fault_tolerance import ReplicaGroups
from titan_parallel import canonical_name

__all__ = ["DiLoCo", "build_diloco"]


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


class DiLoCo:
    """The outer loop of DiLoCo over this job's replica group: the anchors, the outer optimizer, the sync.

    Args:
        parts: this rank's model parts, initialised.
        replicas: this job's seat among the replica groups (built with `semi_sync=True`: synchronous quorums).
        sync_steps: inner steps between two synchronisations.
        outer_lr: the outer SGD's learning rate.
        outer_momentum: its Nesterov momentum; 0 for plain SGD (`local_sgd`: lr 1, momentum 0).
    """

    def __init__(
        self,
        parts: Iterable[nn.Module],
        replicas: ReplicaGroups,
        *,
        sync_steps: int,
        outer_lr: float,
        outer_momentum: float,
    ):
        if sync_steps < 1:
            raise ValueError(f"DiLoCo sync_steps={sync_steps} must be at least 1")
        self.replicas, self.sync_steps = replicas, sync_steps
        self.params = {canonical_name(name): p for part in parts for name, p in part.named_parameters()}
        with torch.no_grad():  # the weights of the last synchronisation; DTensors keep their placements
            self.anchors = {name: p.detach().clone() for name, p in self.params.items()}
            self.momentum = {name: torch.zeros_like(a) for name, a in self.anchors.items()} if outer_momentum else {}
        # torch's SGD over the anchors' local shards (elementwise: no DTensor dispatch); its momentum buffers are
        # given up front (a zero buffer's first step is torch's own first step) so that they are checkpointed.
        self._pairs = [(_local(self.anchors[name]), _local(p)) for name, p in self.params.items()]
        self.outer = torch.optim.SGD(
            [a for a, _ in self._pairs], lr=outer_lr, momentum=outer_momentum, nesterov=outer_momentum > 0
        )
        for (anchor, _), name in zip(self._pairs, self.params, strict=True):
            if name in self.momentum:
                self.outer.state[anchor]["momentum_buffer"] = _local(self.momentum[name])
        self.loaded = False  # whether a checkpoint's anchors were loaded (else they restart from the weights)
        # A group that heals from a peer takes its anchors and momentum too (local shards, as the weights).
        replicas.add_state("diloco", self.state_dict())

    def due(self, step: int) -> bool:
        """Whether step `step` (1-based) ends with a synchronisation.

        Args:
            step: the training step just taken.
        """
        return step % self.sync_steps == 0

    @torch.no_grad()
    def sync(self, step: int) -> bool:
        """Synchronise the groups after step `step`'s inner update; True if the outer step was committed.

        Dropped by the commit vote (a group died mid-all-reduce), the weights go back to the last anchors: the
        inner steps since then are lost, as in torchft's DiLoCo.

        Args:
            step: the training step just taken (1-based).
        """
        self.replicas.quorum(step - 1)  # may load a peer's weights, optimizer, anchors and step (healing)
        # The pseudo-gradients, written straight into one flat buffer per dtype (the all-reduce's), viewed as .grad.
        buckets: dict[tuple[torch.dtype, torch.device], list[tuple[torch.Tensor, torch.Tensor]]] = {}
        for anchor, weight in self._pairs:
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
            self.outer.step()
        self.outer.zero_grad(set_to_none=True)
        torch._foreach_copy_([w for _, w in self._pairs], [a for a, _ in self._pairs])
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


def build_diloco(section: Any, parts: Iterable[nn.Module], replicas: ReplicaGroups | None) -> DiLoCo | None:
    """The run's `DiLoCo` from the [fault_tolerance] section; None without `semi_sync_method` (or replica groups).

    Args:
        section: the config's `fault_tolerance` section.
        parts: this rank's model parts, initialised.
        replicas: this job's replica groups (`build_replica_groups`).
    """
    if replicas is None or section.semi_sync_method == "none":
        return None
    averaging = section.semi_sync_method == "local_sgd"  # the mean of the weights: outer lr 1, no momentum
    return DiLoCo(
        parts,
        replicas,
        sync_steps=section.sync_steps,
        outer_lr=1.0 if averaging else section.outer_lr,
        outer_momentum=0.0 if averaging else section.outer_momentum,
    )
