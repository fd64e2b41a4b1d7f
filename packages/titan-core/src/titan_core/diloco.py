"""DiLoCo across torchft replica groups (`fault_tolerance.semi_sync_method`): each group trains alone for
`sync_steps` steps with its own optimizer (the inner one: AdamW, Muon, ... inside the group's own FSDP/TP layout),
then the groups average their weights' change since the last synchronisation (the pseudo-gradient) and an outer
Nesterov SGD steps from the last synchronised weights, which every group then starts from again (Douillard et al.
2023, arXiv:2311.08105). `local_sgd` averages the weights themselves (outer lr 1, no momentum; Lin et al. 2018).
The groups exchange one all-reduce of the weights every `sync_steps` steps instead of the gradients every step.
With `fragments` (Streaming DiLoCo, Douillard et al. 2025, arXiv:2501.18512) the blocks are cut into that many
contiguous fragments (the embedding with the first, the final norm and output with the last), each synced every
`sync_steps` steps at its own offset (`(f + 1) * sync_steps / fragments`): each sync sends one fragment, so the peak
bandwidth drops by that factor. With a `delay` of tau steps the fragment's all-reduce starts tau steps before its
outer step and runs behind those steps' compute (the paper's overlapping communication); with `alpha` the synced
weights keep that share of the group's own (the paper's mixing, `(1 - alpha) anchor + alpha weights`). The model's
persistent floating-point buffers (MoE expert biases: `synced_buffers`) sync with their block's fragment as local
SGD would, to their mean over the groups (an outer step of lr 1 without momentum).

    after step s - tau (the sync of step s, s % (sync_steps / fragments) == 0), after the inner optimizer's step:
        quorum          torchft's, synchronous: a group behind (fresh or restarted) heals from a peer here
        delta = anchor - weights        (this rank's shards; the same shards in every group)
        delta = mean over the groups    one all-reduce per dtype (torchft's Manager), started, not waited for;
                                        sent in `sync_dtype` (bf16: half the bytes) where it is narrower
    after step s (the same call when tau = 0):
        wait; commit vote               torchft's `should_commit`; dropped: the weights go back to `anchor`
        anchor = outer_sgd(anchor, delta); weights = anchor.lerp(weights, alpha)

A checkpoint saved inside the window (after step s - tau, before s) waits for the all-reduce and takes the outer step
then, so that it holds the anchors step s merges with: a run resumed from it merges at step s without the vote (its
all-reduce finished before the save), bit for bit as the run that saved it; that run keeps the anchors of before
the step until its vote, and takes them back if the vote drops the sync.

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
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from titan_core.fault_tolerance import ReplicaGroups, local_shard
from titan_parallel import canonical_name, grouped_norms

__all__ = ["DiLoCo", "build_diloco", "model_fragments", "synced_buffers"]

logger = logging.getLogger("titan")

_Pairs = list[tuple[torch.Tensor, torch.Tensor]]  # (anchor, weight) local shards


@dataclass
class _Sync:
    """One fragment's synchronisation in flight: its all-reduce started after step `end - delay`."""

    end: int  # the step after whose inner update the outer step is taken
    pairs: _Pairs
    sent: list[torch.Tensor]  # each anchor's pseudo-gradient in the all-reduce's flat buffers (the wire's dtype)
    works: list[Any]  # the all-reduces (torchft's)
    waited: bool = False
    before: list[torch.Tensor] | None = None  # anchors and momentum before an early outer step (a checkpoint's)


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
        delay: inner steps a fragment's all-reduce runs behind, below `sync_steps / len(fragments)`; 0: none.
        alpha: the share of the group's own weights a sync keeps, 0 to 1: the weights become
            `(1 - alpha) anchor + alpha weights`.
        last_step: no sync starts whose outer step would come after this step (None: no end).
        sync_dtype: the dtype the pseudo-gradients cross between the groups in (e.g. torch.bfloat16: half the
            bytes of fp32 anchors; the outer step reads them back in the anchors' dtype); None: the anchors'.
        pp_mesh: the pipeline mesh when `parts` are stages (the outer gradient's norm sums over it; a stage may hold
            nothing of a fragment), else None.
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
        delay: int = 0,
        alpha: float = 0.0,
        last_step: int | None = None,
        sync_dtype: torch.dtype | None = None,
        pp_mesh: DeviceMesh | None = None,
    ):
        parts = list(parts)
        self.params = {canonical_name(name): p for part in parts for name, p in part.named_parameters()}
        self.buffers = dict(synced_buffers(parts))
        tracked = {**self.params, **self.buffers}  # the buffers' anchors step with lr 1 and no momentum: their mean
        fragments = [list(tracked)] if fragments is None else [list(f) for f in fragments]
        if sync_steps < 1 or sync_steps % len(fragments):
            raise ValueError(
                f"DiLoCo sync_steps={sync_steps} must be a positive multiple of its {len(fragments)} fragments"
            )
        if sorted(n for f in fragments for n in f) != sorted(tracked):
            raise ValueError("DiLoCo fragments must hold every parameter and synced buffer of the parts once")
        if not 0 <= delay < sync_steps // len(fragments):
            raise ValueError(
                f"DiLoCo delay={delay} must be from 0 to below sync_steps / fragments = {sync_steps // len(fragments)}"
            )
        if not 0 <= alpha <= 1:
            raise ValueError(f"DiLoCo alpha={alpha} must be from 0 to 1")
        self.replicas, self.sync_steps = replicas, sync_steps
        self.delay, self.alpha, self.last_step, self.sync_dtype = delay, alpha, last_step, sync_dtype
        self.pp_mesh = pp_mesh
        with torch.no_grad():  # the weights of the last synchronisation; DTensors keep their placements
            self.anchors = {name: t.detach().clone() for name, t in tracked.items()}
            self.momentum = {name: torch.zeros_like(self.anchors[name]) for name in self.params}
            self.momentum = self.momentum if outer_momentum else {}
        # torch's SGD over the anchors' local shards (elementwise: no DTensor dispatch); its momentum buffers are
        # given up front (a zero buffer's first step is torch's own first step) so that they are checkpointed.
        self._pairs = [(local_shard(self.anchors[name]), local_shard(t)) for name, t in tracked.items()]
        anchor_of = {name: anchor for name, (anchor, _) in zip(tracked, self._pairs, strict=True)}
        groups: list[dict[str, Any]] = [{"params": [anchor_of[name] for name in self.params]}]
        if self.buffers:  # the mean of the groups' buffers: outer lr 1, no momentum (local SGD's rule)
            means = [anchor_of[name] for name in self.buffers]
            groups.append({"params": means, "lr": 1.0, "momentum": 0.0, "nesterov": False})
        self.outer = torch.optim.SGD(groups, lr=outer_lr, momentum=outer_momentum, nesterov=outer_momentum > 0)
        for name, buf in self.momentum.items():
            self.outer.state[anchor_of[name]]["momentum_buffer"] = local_shard(buf)
        self._buffer_anchors = {id(anchor_of[name]) for name in self.buffers}
        position = {name: i for i, name in enumerate(tracked)}
        self._fragments = [[self._pairs[position[name]] for name in names] for names in fragments]
        self.loaded = False  # whether a checkpoint's anchors were loaded (else they restart from the weights)
        self._live = {
            **{f"anchor.{name}": a for name, a in self.anchors.items()},
            **{f"momentum.{name}": m for name, m in self.momentum.items()},
        }
        # each local anchor's DTensor, keyed by the local tensor `_pairs` holds (DTensor.to_local makes a new one
        # per call with grad enabled, so another call's id would not match)
        self._layouts: dict[int, DTensor] = {}
        for (anchor, _), name in zip(self._pairs, tracked, strict=True):
            if isinstance(full := self.anchors[name], DTensor):
                self._layouts[id(anchor)] = full
        self._wait_s: float | None = None  # the last sync's wait for its all-reduce, and its outer gradient's norm
        self._outer_norm: torch.Tensor | None = None
        self._sync: _Sync | None = None
        self._resumed_end: int | None = None  # a checkpoint saved inside this sync's window was loaded: merge only
        self.window = _Window(self)  # the checkpoint's JSON state "diloco_sync"
        # A group that heals from a peer takes its anchors and momentum too (local shards, as the weights). Quorums
        # come only where no sync is in flight (windows do not overlap), so these are never half-stepped.
        replicas.add_state("diloco", self._live)

    def fragment_at(self, step: int) -> int | None:
        """The fragment step `step` (1-based) syncs after its inner update, or None.

        Args:
            step: the training step just taken.
        """
        every = self.sync_steps // len(self._fragments)
        if step % every:
            return None
        return (step // every - 1) % len(self._fragments)

    def starts_at(self, step: int) -> bool:
        """Whether a fragment's all-reduce starts after step `step`'s inner update (its outer step `delay` later).

        Args:
            step: the training step just taken (1-based).
        """
        end = step + self.delay
        return self.fragment_at(end) is not None and (self.last_step is None or end <= self.last_step)

    @torch.no_grad()
    def advance(self, step: int) -> bool:
        """What is due after step `step`'s inner update: the outer step of the sync in flight (or the merge of one a
        loaded checkpoint was saved in), then the start of the next; True if the weights changed.

        Args:
            step: the training step just taken (1-based).
        """
        changed, resumed_end = False, self._resumed_end
        if self._sync is not None and self._sync.end == step:
            self._finish(self._sync)
            changed = True
        elif resumed_end == step and self.loaded:  # its outer step is in the loaded anchors
            fragment = self.fragment_at(step)
            if fragment is not None:  # (unless the schedule changed since)
                self._merge(self._fragments[fragment])
                changed = True
        if resumed_end is not None and step >= resumed_end:
            self._resumed_end = None
        # The sync a loaded checkpoint holds is not started again (a resume with a shorter fragment_sync_delay).
        if self.starts_at(step) and step + self.delay != resumed_end:
            self._start(step, step + self.delay)
            if self.delay == 0:
                assert self._sync is not None
                self._finish(self._sync)
                changed = True
        return changed

    def _start(self, step: int, end: int) -> None:
        """The quorum, then the fragment's pseudo-gradients averaged across the groups: started, not waited for."""
        fragment = self.fragment_at(end)
        assert fragment is not None and self._sync is None
        self.replicas.quorum(step - 1)  # may load a peer's weights, optimizer, anchors and step (healing)
        # The pseudo-gradients, written straight into one flat buffer per dtype (the all-reduce's): in the wire's
        # dtype where it is narrower (one parameter's difference at a time in the anchors' own).
        pairs_now = self._fragments[fragment]
        buckets: dict[tuple[torch.dtype, torch.device], _Pairs] = {}
        for anchor, weight in pairs_now:
            buckets.setdefault((anchor.dtype, anchor.device), []).append((anchor, weight))
        flats, sent = [], {}
        for (dtype, device), pairs in buckets.items():
            wire = (
                self.sync_dtype if self.sync_dtype is not None and self.sync_dtype.itemsize < dtype.itemsize else dtype
            )
            flat = torch.empty(sum(a.numel() for a, _ in pairs), dtype=wire, device=device)
            offset = 0
            for anchor, weight in pairs:
                view = flat[offset : offset + anchor.numel()].view_as(anchor)
                if wire == dtype:
                    torch.sub(anchor, weight, out=view)
                else:
                    view.copy_(anchor - weight)
                sent[id(anchor)] = view
                offset += anchor.numel()
            flats.append(flat)
        works = self.replicas.start_average(flats)
        self._sync = _Sync(end, pairs_now, [sent[id(a)] for a, _ in pairs_now], works)

    def _finish(self, sync: _Sync) -> bool:
        """Wait for the sync's all-reduce, vote, take the outer step and merge; True if committed.

        Dropped by the commit vote (a group died mid-all-reduce), the fragment's weights go back to its last
        anchors: its inner steps since then are lost, as in torchft's DiLoCo.
        """
        self._sync = None
        self._wait(sync)
        committed = self.replicas.commit(sync.end)
        if committed and sync.before is None:
            self.outer.step()  # torch's SGD skips the anchors without a gradient: the other fragments'
        elif not committed and sync.before is not None:  # the early step (a checkpoint's) is taken back
            torch._foreach_copy_(self._stepped(sync), sync.before)
        self.outer.zero_grad(set_to_none=True)
        if committed:
            self._merge(sync.pairs)
        else:
            torch._foreach_copy_([w for _, w in sync.pairs], [a for a, _ in sync.pairs])
        return committed

    def _wait(self, sync: _Sync) -> None:
        """Wait for the sync's all-reduce (once), timed; the norm of the averaged pseudo-gradient (the outer
        gradient), taken before the outer step (torch's Nesterov SGD adds the momentum into it)."""
        if sync.waited:
            return
        began = time.perf_counter()
        self.replicas.wait(sync.works)
        self._wait_s, sync.waited = time.perf_counter() - began, True
        views = []  # the local shards as their anchors' DTensors: the norm sums over the group's shards
        for (anchor, _), averaged in zip(sync.pairs, sync.sent, strict=True):
            # the outer step's gradient: a view of the flat buffer, or its copy in the anchor's dtype
            anchor.grad = grad = averaged if averaged.dtype == anchor.dtype else averaged.to(anchor.dtype)
            if id(anchor) in self._buffer_anchors:  # the parameters' norm only
                continue
            layout = self._layouts.get(id(anchor))
            if layout is not None:
                grad = DTensor.from_local(
                    grad, layout.device_mesh, layout.placements, shape=layout.shape, stride=layout.stride()
                )
            views.append(grad)
        self._outer_norm = grouped_norms([views], pp_mesh=self.pp_mesh)[0]

    def metrics(self) -> dict[str, float]:
        """`ft/sync_wait_ms` (how long the last sync's outer step waited for its all-reduce: what the delay did not
        hide) and `ft/outer_grad_norm` (the norm of its averaged pseudo-gradient, its fragment's); none before the
        first sync. Reads a device value: call at log steps."""
        if self._wait_s is None or self._outer_norm is None:
            return {}
        return {"ft/sync_wait_ms": 1000 * self._wait_s, "ft/outer_grad_norm": float(self._outer_norm.item())}

    def _merge(self, pairs: _Pairs) -> None:
        """The fragment's weights from its new anchors: `(1 - alpha) anchor + alpha weights`."""
        if not pairs:  # a pipeline stage without this fragment's blocks
            return
        weights, anchors = [w for _, w in pairs], [a for a, _ in pairs]
        if self.alpha:
            torch._foreach_lerp_(weights, anchors, 1.0 - self.alpha)
        else:
            torch._foreach_copy_(weights, anchors)

    def _stepped(self, sync: _Sync) -> list[torch.Tensor]:
        """What the outer step writes for the sync's fragment: its anchors, then its momentum buffers."""
        anchors = [a for a, _ in sync.pairs]
        momentum = [self.outer.state[a]["momentum_buffer"] for a in anchors if a in self.outer.state]
        return anchors + momentum

    @torch.no_grad()
    def restart(self) -> None:
        """Anchor at the weights, no momentum (a checkpoint without DiLoCo's state was loaded)."""
        torch._foreach_copy_([a for a, _ in self._pairs], [w for _, w in self._pairs])
        for buf in self.momentum.values():
            buf.zero_()

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The live anchors and momentum buffers (`titan_ckpt.TensorStateful`): saved as they are, loaded in place.

        Inside a sync's window (a checkpoint between its start and its outer step) the all-reduce is waited for and
        the outer step taken now, the anchors of before kept for the vote (`window` says so in the checkpoint).
        """
        self._step_early()
        return self._live

    @torch.no_grad()
    def _step_early(self) -> _Sync | None:
        """The sync in flight, its outer step taken (once) unless its all-reduce failed."""
        sync = self._sync
        if sync is not None and sync.before is None:
            self._wait(sync)
            if not self.replicas.errored():
                sync.before = [t.clone() for t in self._stepped(sync)]
                self.outer.step()
        return sync

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        with torch.no_grad():
            for key, value in state.items():
                if value is not self._live[key]:
                    self._live[key].copy_(value)
        self.loaded = True


class _Window:
    """The JSON state "diloco_sync" (`titan_ckpt.JsonStateful`): the step whose sync a checkpoint saved inside its
    window holds the outer step of (`DiLoCo.state_dict`), 0 for none; a run resumed from it only merges then."""

    def __init__(self, diloco: DiLoCo):
        self.diloco = diloco

    def state_dict(self) -> dict[str, int]:  # after the tensor state's (`DiLoCo.state_dict`), which steps early
        sync = self.diloco._sync
        return {"stepped_sync_end": sync.end if sync is not None and sync.before is not None else 0}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.diloco._resumed_end = int(state["stepped_sync_end"]) or None


def synced_buffers(parts: Sequence[nn.Module]) -> list[tuple[str, torch.Tensor]]:
    """The parts' persistent floating-point buffers by canonical name (a checkpoint's state beside the parameters that
    training moves: the MoE layers' `expert_bias`), which each sync averages over the groups as local SGD would.

    Args:
        parts: this rank's model parts.
    """
    found = []
    for part in parts:
        for module_name, module in part.named_modules():
            for name, buffer in module.named_buffers(recurse=False):
                if name not in module._non_persistent_buffers_set and buffer.is_floating_point():
                    found.append((canonical_name(f"{module_name}.{name}" if module_name else name), buffer))
    return found


def model_fragments(
    names: Sequence[str], blocks: str, count: int, block_ids: Sequence[str] | None = None
) -> list[list[str]]:
    """`names` (in the model's order) cut into `count` fragments of contiguous blocks, their sizes apart by one at
    most: the parameters before the first block (the embedding) join the first fragment, those after it (the final
    norm, the output) the last.

    Args:
        names: the model's parameter names, as `named_parameters` gives them.
        blocks: the block container's name (`layers`): blocks are `<blocks>.<i>.`.
        count: fragments.
        block_ids: the whole model's block ids in order, when `names` are one pipeline stage's (the stage's
            fragments are its share of the model's, some of them empty); None: the blocks in `names`.
    """
    prefix, depth = blocks + ".", blocks.count(".") + 1  # `<blocks>.<i>.`: the block id is part `depth`
    if block_ids is None:
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
    section: Any,
    parts: Sequence[nn.Module],
    replicas: ReplicaGroups | None,
    blocks: str,
    steps: int,
    *,
    n_blocks: int | None = None,
    pp_mesh: DeviceMesh | None = None,
) -> DiLoCo | None:
    """The run's `DiLoCo` from the [fault_tolerance] section; None without `semi_sync_method` (or replica groups).
    Rank 0 says how it syncs, and when the run's last step leaves the groups apart.

    Args:
        section: the config's `fault_tolerance` section.
        parts: this rank's model parts, initialised.
        replicas: this job's replica groups (`build_replica_groups`).
        blocks: the model's block container (`ModelPlan.blocks`), which `num_fragments` cuts.
        steps: the run's `training.steps`.
        n_blocks: the model's blocks (`<blocks>.0` ..): under pipeline parallel, the fragments are the whole model's.
        pp_mesh: the pipeline mesh when `parts` are stages, else None.
    """
    if replicas is None or section.semi_sync_method == "none":
        return None
    averaging = section.semi_sync_method == "local_sgd"  # the mean of the weights: outer lr 1, no momentum
    lr, momentum = (1.0, 0.0) if averaging else (section.outer_lr, section.outer_momentum)
    names = [canonical_name(name) for part in parts for name, _ in part.named_parameters()]
    names += [name for name, _ in synced_buffers(parts)]  # in their blocks' fragments
    # a pipeline stage cuts its share of the whole model's fragments
    block_ids = [str(i) for i in range(n_blocks)] if pp_mesh is not None and n_blocks is not None else None
    count, every = section.num_fragments, section.sync_steps
    if replicas.rank == 0:
        fragments = f" in {count} fragments, one every {every // count} steps" if count > 1 else ""
        delay, alpha = section.fragment_sync_delay, section.fragment_update_alpha
        overlap = f", each all-reduce behind {delay} inner steps" if delay else ""
        keeps = f", keeping {alpha:g} of each group's own weights" if alpha else ""
        keeps += "; pseudo-gradients sent in bfloat16" if section.sync_dtype == "bfloat16" else ""
        logger.info(
            "fault tolerance: %s, a sync every %d steps%s%s; outer SGD lr %g, Nesterov momentum %g%s",
            "local SGD" if averaging else "DiLoCo",
            every,
            fragments,
            overlap,
            lr,
            momentum,
            keeps,
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
        fragments=model_fragments(names, blocks, count, block_ids),
        delay=section.fragment_sync_delay,
        alpha=section.fragment_update_alpha,
        last_step=steps,
        sync_dtype=torch.bfloat16 if section.sync_dtype == "bfloat16" else None,
        pp_mesh=pp_mesh,
    )
