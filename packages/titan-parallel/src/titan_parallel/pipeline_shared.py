"""Weights held by more than one pipeline stage, kept equal.

Two cases put one weight on several stages: a tie across the cut (an embedding on the first stage whose
weight is also the output's, on the last), and a `pp_first` / `pp_last` module listed on several stages
(`module_names_per_stage`), e.g. the embedding that multi-token-prediction depths on the last stage read.
Each holding stage keeps its own copy under the name it has in the whole model, so checkpoints do not
depend on the layout (DCP writes a weight two ranks hold once). `SharedWeights` keeps the copies equal:

    weights = find_shared_weights(model, plan, names)     # on the whole (meta) model, before split_model
    parts = split_model(model, plan, names, mesh["pp"], schedule, shared=True)
    # ... parallelize, materialise
    shared = SharedWeights(weights, parts, mesh["pp"], schedule, n_stages=len(names))
    shared.sync_weights()                                   # the lowest stage's values everywhere
    # each optimizer step: the pipeline's backward(s), then
    shared.reduce_grads()                                   # every copy gets the sum of the copies' gradients
    clip_grad_norm_(params, max_norm, pp_mesh=mesh["pp"], copies=shared.copies)  # counted once

With equal values, equal gradients and the same optimizer, the copies take the same update and stay
equal. This is Megatron-LM's "embedding group" (its first and last stages all-reduce the tied word
embeddings' gradients); `torch.distributed.pipelining` has no such thing, so it is written here: one
process group per set of pipeline ranks holding a weight, made once with
`torch.distributed.new_subgroups_by_enumeration`; copies on one rank (V schedules put the first and last
stages together) are summed locally.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import cast

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from titan_parallel.layout import ParallelConfigError
from titan_parallel.pipeline_layout import stage_indices
from titan_parallel.plan import ModelPlan

__all__ = ["SharedWeight", "SharedWeights", "find_shared_weights"]


@dataclass(frozen=True)
class SharedWeight:
    """One weight several stages hold.

    Args:
        names: `(stage, parameter name in that stage)` for each holding stage, in stage order; the first
            stage's copy is the one `sync_weights` spreads and norms count.
    """

    names: tuple[tuple[int, str], ...]


def find_shared_weights(
    model: nn.Module, plan: ModelPlan, module_names_per_stage: Sequence[Sequence[str]]
) -> list[SharedWeight]:
    """The weights the stages of `module_names_per_stage` would hold more than once (empty: none).

    Raises for a parameter in no unit of the cut (its module is not a block, `pp_first` or `pp_last`).

    Args:
        model: the whole model (meta device is fine), ties in place.
        plan: names the blocks container and the `pp_first` / `pp_last` modules.
        module_names_per_stage: module names per stage, a `pp_first` / `pp_last` one possibly on several.
    """
    stages_of: dict[str, list[int]] = {}
    for stage, names in enumerate(module_names_per_stage):
        for name in names:
            stages_of.setdefault(name, []).append(stage)
    holders: dict[int, dict[int, str]] = {}  # id(param) -> stage -> the first name it has there
    for name, param in model.named_parameters(remove_duplicate=False):
        unit = next((u for u in stages_of if name.startswith(u + ".")), None)
        if unit is None:
            raise ValueError(
                f"parameter '{name}' belongs to no pipeline unit; "
                f"add its module to ModelPlan.pp_first or pp_last (or to {plan.blocks!r})"
            )
        for stage in stages_of[unit]:
            holders.setdefault(id(param), {}).setdefault(stage, name)
    return [SharedWeight(tuple(sorted(by_stage.items()))) for by_stage in holders.values() if len(by_stage) > 1]


def check_unshared(weights: Sequence[SharedWeight]) -> None:
    """Refuse a cut that puts one weight on several stages, for callers that do not keep copies equal.

    Args:
        weights: `find_shared_weights`' result for the cut.
    """
    if weights:
        (first_stage, first), (stage, name) = weights[0].names[:2]
        what = f"'{first}' sits" if first == name else f"'{first}' and '{name}' share one weight but sit"
        raise ParallelConfigError(
            f"{what} on stages {first_stage} and {stage}; keep the copies equal with "
            "titan_parallel.SharedWeights and pass shared=True, untie them in the model, or put them on one stage "
            "with module_names_per_stage",
            arguments=("module_names_per_stage", "shared"),
        )


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's shard of `tensor` (the tensor itself when it is not a DTensor); the same storage."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


@dataclass
class _Held:
    params: list[nn.Parameter]  # this rank's copies, in stage order
    owner_here: bool  # the weight's first stage is on this rank (its copy is params[0])
    group: dist.ProcessGroup | None  # the pipeline ranks holding it, with this rank; None: all on this rank
    owner_rank: int  # the global rank holding the first stage (of this rank's pipeline)


class SharedWeights:
    """Keeps the copies of each shared weight equal over this rank's stages and the pipeline ranks holding it.

    Every rank builds it (a collective: process groups are made), after `parallelize` and materialisation.

    Args:
        weights: `find_shared_weights`' result for the cut the stages were split with.
        parts: this rank's stages (`split_model`'s result, parallelized; `(index, module)` pairs).
        pp_mesh: the 1-D `pp` mesh.
        schedule: the schedule's name (it places stages on ranks).
        n_stages: stages over all ranks.
    """

    def __init__(
        self,
        weights: Sequence[SharedWeight],
        parts: Sequence[tuple[int, nn.Module]],
        pp_mesh: DeviceMesh,
        schedule: str,
        n_stages: int,
    ):
        self.held: list[_Held] = []
        if not weights:
            return
        pp = pp_mesh.size()
        rank_of = {stage: r for r in range(pp) for stage in stage_indices(r, pp, n_stages, schedule)}
        here = dict(parts)
        pipeline_ranks: list[int] = pp_mesh.mesh.tolist()  # global rank of each pp rank, this rank's pipeline
        everyone: list[list[int] | None] = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, pipeline_ranks)  # every pipeline: one group per set of holders in each
        pipelines = sorted({tuple(ranks) for ranks in everyone if ranks is not None})
        groups: dict[tuple[int, ...], dist.ProcessGroup | None] = {}
        for weight in weights:
            holder_ranks = tuple(sorted({rank_of[stage] for stage, _ in weight.names}))
            if holder_ranks not in groups:
                groups[holder_ranks] = None
                if len(holder_ranks) > 1:  # collective: every rank calls it, in the same order
                    enumeration = [[pipeline[r] for r in holder_ranks] for pipeline in pipelines]
                    group, _ = dist.new_subgroups_by_enumeration(enumeration)
                    groups[holder_ranks] = cast(dist.ProcessGroup, group)  # None where this rank holds no copy
            params = [here[stage].get_parameter(name) for stage, name in weight.names if stage in here]
            if not params:
                continue
            owner = weight.names[0][0]
            shapes = {tuple(_local(p).shape) for p in params}
            if len(shapes) > 1:
                raise ValueError(
                    f"the copies of '{weight.names[0][1]}' on this rank have different local shapes {sorted(shapes)}; "
                    "parallelize the stages holding it alike"
                )
            group = groups[holder_ranks] if len(holder_ranks) > 1 else None
            self.held.append(_Held(params, owner in here, group, pipeline_ranks[rank_of[owner]]))

    @property
    def copies(self) -> list[nn.Parameter]:
        """This rank's copies other than the first stage's: a norm over all parameters skips them (it would count
        a shared weight twice), clipping scales them with the rest."""
        return [p for held in self.held for p in (held.params[1:] if held.owner_here else held.params)]

    @torch.no_grad()
    def sync_weights(self) -> None:
        """Give every copy the first stage's values (after initialisation; a checkpoint loads equal ones)."""
        for held in self.held:
            first = _local(held.params[0])
            if held.group is not None:
                dist.broadcast(first, src=held.owner_rank, group=held.group)
            for param in held.params[1:]:
                _local(param).copy_(first)

    @torch.no_grad()
    def reduce_grads(self) -> None:
        """Set every copy's gradient to the sum of all copies' (a missing one counts as zeros). Call it once per
        optimizer step, after the last backward and before clipping or any norm."""
        for held in self.held:
            for param in held.params:
                if param.grad is None:
                    param.grad = torch.zeros_like(param)
            grads = [_local(p.grad) for p in held.params if p.grad is not None]
            total = grads[0]
            for grad in grads[1:]:
                total.add_(grad)
            if held.group is not None:
                dist.all_reduce(total, group=held.group)
            for grad in grads[1:]:
                grad.copy_(total)
