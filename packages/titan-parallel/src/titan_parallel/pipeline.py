"""Pipeline parallel: cut a model into stages, run them with a `torch.distributed.pipelining` schedule.

Pipeline parallel is the outermost parallelism. Each rank, with the whole model
on the meta device:

    config = PipelineConfig(schedule="1F1B", microbatch_size=1)
    names = check_pipeline(config, pp=2, n_layers=8, local_batch_size=4, plan=plan)  # every rule, no processes
    parts = split_model(model, plan, names, mesh["pp"], config.schedule)              # this rank's stages
    for part in parts:
        parallelize(part.module, plan, mesh, ParallelOptions(pipeline_parallel=True))
        # ... to_empty, init_weights or load a checkpoint
    pipe = build_pipeline(parts, config, n_stages=len(names), pp_mesh=mesh["pp"], device=device,
                          local_batch_size=4, loss_fn=loss_fn)
    loss = pipeline_step(pipe.schedule, pipe.stages, inputs, labels)   # None off the last stage

Cutting: a stage is the same model class with what it does not own removed:
blocks are deleted from the `plan.blocks` `nn.ModuleDict`, the `plan.pp_first` /
`plan.pp_last` modules are set to None, and the model's forward skips them.
Parameter names therefore stay the same in every stage (`layers.5.attention.wq.weight`
is called that wherever it lives), so checkpoints do not depend on the layout.
Which units each stage holds, and which stages each rank runs, is arithmetic in
`titan_parallel.pipeline_layout`.

Losses and gradients: the batch is cut into `n_microbatches` equal microbatches.
The schedule calls the loss function once per microbatch and backpropagates
each result, accumulating gradients (`scale_grads=False`: torch's schedule adds
no scaling of its own). By default (`scale_loss=True`) each microbatch's mean
loss is divided by `n_microbatches`, so the accumulated gradient is that of the
whole batch's mean loss, and the sum of the reported microbatch losses is that
mean. A caller that normalises the loss itself (Titan's step runner divides by
accumulation steps x microbatches in one place) passes `scale_loss=False` and
gets its loss function's values unchanged. Data parallel then averages over the
data-parallel ranks as usual.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple, cast

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from titan_parallel.layout import ParallelConfigError
from titan_parallel.modules import get_submodule_or_none
from titan_parallel.pipeline_compat import keep_custom_loss_node, skip_warm_up_sends_to_self
from titan_parallel.pipeline_layout import (
    SCHEDULE_NAMES,
    available_schedules,
    check_module_names,
    check_schedule,
    count_microbatches,
    count_stages,
    pipeline_units,
    schedule_kind,
    stage_indices,
    stage_module_names,
    stages_per_rank,
)
from titan_parallel.pipeline_shared import check_unshared, find_shared_weights
from titan_parallel.plan import ModelPlan

if TYPE_CHECKING:
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining.schedules import _PipelineSchedule

__all__ = [
    "SCHEDULE_NAMES",
    "LossFn",
    "Pipeline",
    "PipelineConfig",
    "StageModule",
    "available_schedules",
    "build_pipeline",
    "build_schedule",
    "build_stages",
    "check_pipeline",
    "pipeline_step",
    "split_model",
]

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
"""`loss_fn(output, target)` -> the mean loss of one microbatch."""


@dataclass(frozen=True)
class PipelineConfig:
    """How to cut a model into pipeline stages and run them.

    Args:
        schedule: a name of `SCHEDULE_NAMES`; it also decides how stages sit on ranks.
        microbatch_size: sequences per microbatch; the local batch is run as
            `local_batch_size // microbatch_size` microbatches.
        layers_per_stage: units per stage, giving `ceil((n_layers + first + last) / layers_per_stage)`
            stages. None: 1 stage per rank for single-stage schedules, else 2.
        first_stage_less_layers: blocks' worth of work the `pp_first` modules (embeddings) count for.
        last_stage_less_layers: blocks' worth of work the `pp_last` modules (norm, output) count for.
        module_names_per_stage: explicit module names per stage, in forward order;
            replaces the three above.
        schedule_csv: a custom schedule, one row of actions per rank, run by torch's
            `_PipelineScheduleRuntime`; `schedule` still places stages and must match it.
    """

    schedule: str = "1F1B"
    microbatch_size: int = 1
    layers_per_stage: int | None = None
    first_stage_less_layers: int = 1
    last_stage_less_layers: int = 1
    module_names_per_stage: Sequence[Sequence[str]] | None = None
    schedule_csv: str | None = None


def check_pipeline(
    config: PipelineConfig, *, pp: int, n_layers: int, local_batch_size: int, plan: ModelPlan
) -> list[list[str]]:
    """Every pipeline rule, before any process starts; returns the module names of each stage.

    The schedule is known (and in the installed torch); a CSV schedule exists; the
    stage count divides over `pp` ranks as the schedule places stages; explicit
    stages hold every unit once, in order; derived stages leave room for the
    first/last weights; the local batch divides into enough microbatches. Errors
    name `PipelineConfig`'s fields and this function's arguments. With `pp=1` there
    is no pipeline: only the schedule and the CSV are checked, and the whole model
    is the one stage.

    Args:
        config: the pipeline's settings.
        pp: pipeline parallel degree.
        n_layers: number of blocks in the model.
        local_batch_size: sequences per data-parallel rank per step.
        plan: the model's plan (blocks, `pp_first`, `pp_last`).
    """
    # With no pipeline only the name is checked (no import of torch's pipelining, ~1 s).
    check_schedule(config.schedule) if pp > 1 else schedule_kind(config.schedule)
    if config.schedule_csv is not None and not os.path.isfile(config.schedule_csv):
        raise ParallelConfigError(
            f"schedule_csv={config.schedule_csv!r} is not a file; fix the path or leave it unset",
            arguments=("schedule_csv",),
        )
    if pp == 1:
        return [pipeline_units(plan, n_layers)]
    if config.module_names_per_stage is not None:
        names = [list(stage) for stage in config.module_names_per_stage]
        check_module_names(plan, n_layers, names)
        origin = f"module_names_per_stage lists {len(names)} stages"
        stages_per_rank(len(names), pp, config.schedule, origin=origin, origin_arguments=("module_names_per_stage",))
    else:
        n_stages = count_stages(
            n_layers,
            pp,
            config.schedule,
            layers_per_stage=config.layers_per_stage,
            first_stage_less_layers=config.first_stage_less_layers,
            last_stage_less_layers=config.last_stage_less_layers,
        )
        names = stage_module_names(
            plan,
            n_layers,
            n_stages,
            first_stage_less_layers=config.first_stage_less_layers,
            last_stage_less_layers=config.last_stage_less_layers,
        )
    count_microbatches(local_batch_size, config.microbatch_size, len(names), config.schedule)
    return names


class StageModule(NamedTuple):
    """One pipeline stage this rank runs (a tuple, so `for index, module in parts` works).

    Args:
        index: the stage's global index, 0 .. n_stages - 1.
        module: the pruned copy of the model the stage runs.
    """

    index: int  # type: ignore[assignment]  # the field shadows tuple.index, as the public name has since v0.1
    module: nn.Module


def split_model(
    model: nn.Module,
    plan: ModelPlan,
    module_names_per_stage: Sequence[Sequence[str]],
    pp_mesh: DeviceMesh,
    schedule: str,
    *,
    shared: bool = False,
) -> list[StageModule]:
    """Copy `model` once per stage this rank owns and remove from each copy what the stage does not own.

    Call it on the meta-device model, before `parallelize` and materialisation. A weight several stages hold
    (tied across the cut, or a `pp_first` / `pp_last` module listed on several stages) is refused unless
    `shared`: then each holding stage keeps a copy, which `titan_parallel.SharedWeights` keeps equal.

    Args:
        model: the whole model (meta device is best: copies cost nothing).
        plan: names the blocks container and the `pp_first` / `pp_last` modules.
        module_names_per_stage: module names per stage, e.g. from `check_pipeline`.
        pp_mesh: the 1-D `pp` mesh (`mesh["pp"]`); its local rank picks the stages.
        schedule: a name of `SCHEDULE_NAMES`; decides which stages this rank runs.
        shared: allow weights on several stages; the caller builds `SharedWeights` from
            `find_shared_weights(model, plan, module_names_per_stage)` and keeps the copies equal with it.

    Returns:
        A `StageModule` for each stage this rank runs, in stage order.
    """
    container = get_submodule_or_none(model, plan.blocks)
    if not isinstance(container, nn.ModuleDict):
        raise ValueError(
            f"ModelPlan.blocks='{plan.blocks}' must name an nn.ModuleDict in the model to cut pipeline stages"
        )
    names = [list(stage) for stage in module_names_per_stage]
    check_module_names(plan, len(container), names)
    weights = find_shared_weights(model, plan, names)  # also: every parameter is in some unit
    if not shared:
        check_unshared(weights)
    indices = stage_indices(pp_mesh.get_local_rank(), pp_mesh.size(), len(names), schedule)
    return [StageModule(i, _prune_to_stage(model, plan, set(names[i]))) for i in sorted(indices)]


def _prune_to_stage(model: nn.Module, plan: ModelPlan, keep: set[str]) -> nn.Module:
    """A deep copy of `model` without the blocks and first/last modules not in `keep`."""
    stage = copy.deepcopy(model)
    blocks = cast(nn.ModuleDict, stage.get_submodule(plan.blocks))
    for key in list(blocks.keys()):
        if f"{plan.blocks}.{key}" not in keep:
            del blocks[key]
    for path in (*plan.pp_first, *plan.pp_last):
        if path not in keep:
            parent_path, _, leaf = path.rpartition(".")
            setattr(stage.get_submodule(parent_path) if parent_path else stage, leaf, None)
    return stage


def build_stages(
    parts: Sequence[StageModule], n_stages: int, pp_mesh: DeviceMesh, device: torch.device
) -> list[PipelineStage]:
    """Wrap this rank's stage modules as `PipelineStage`s on the `pp` process group.

    The modules may still be on the meta device: shapes are found at the first step.

    Args:
        parts: this rank's stages from `split_model` (after `parallelize`).
        n_stages: total number of stages over all ranks.
        pp_mesh: the 1-D `pp` mesh.
        device: the device the stages compute on.
    """
    from torch.distributed.pipelining import PipelineStage

    group = pp_mesh.get_group()
    stages = [PipelineStage(module, index, n_stages, device, group=group) for index, module in parts]
    if torch.distributed.get_backend(group) == "gloo":
        for stage in stages:
            skip_warm_up_sends_to_self(stage)
    return stages


def build_schedule(
    stages: Sequence[PipelineStage],
    schedule: str,
    n_microbatches: int,
    loss_fn: LossFn,
    *,
    schedule_csv: str | None = None,
    scale_loss: bool = True,
) -> _PipelineSchedule:
    """Build the schedule running `stages` over `n_microbatches` microbatches per step.

    Args:
        stages: this rank's stages, in stage order (from `build_stages`).
        schedule: a name of `SCHEDULE_NAMES`.
        n_microbatches: microbatches per step (see `pipeline_layout.count_microbatches`).
        loss_fn: `loss_fn(output, target)` -> the mean loss of one microbatch.
        schedule_csv: a custom schedule run by `_PipelineScheduleRuntime` instead (see `PipelineConfig`).
        scale_loss: divide each microbatch's loss by `n_microbatches` (the batch mean); False: backpropagate
            `loss_fn`'s value as it is (the caller normalises).
    """
    from torch.distributed.pipelining import schedules

    check_schedule(schedule)
    if schedule_csv is not None:
        schedule_class = schedules._PipelineScheduleRuntime
    else:
        schedule_class = schedules.get_schedule_class(schedule)
    single = issubclass(schedule_class, schedules.PipelineScheduleSingle)
    if single and len(stages) != 1:
        raise ValueError(
            f"schedule '{schedule}' runs one stage per rank but this rank has {len(stages)}; "
            "split with the same schedule"
        )

    def schedule_loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        loss = loss_fn(output, target)
        return keep_custom_loss_node(loss / n_microbatches if scale_loss else loss)

    built = schedule_class(
        stages[0] if single else list(stages),
        n_microbatches=n_microbatches,
        loss_fn=schedule_loss,
        scale_grads=False,
    )
    if schedule_csv is not None:
        built._load_csv(schedule_csv)
    return built


@dataclass
class Pipeline:
    """What one rank runs of a pipeline.

    Args:
        parts: this rank's stage modules, in stage order.
        stages: their `PipelineStage`s.
        schedule: the schedule running them.
        n_microbatches: microbatches per step.
    """

    parts: list[StageModule]
    stages: list[PipelineStage]
    schedule: _PipelineSchedule
    n_microbatches: int

    def step(self, inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor | None:
        """`pipeline_step` with this pipeline's schedule and stages."""
        return pipeline_step(self.schedule, self.stages, inputs, labels)


def build_pipeline(
    parts: Sequence[StageModule],
    config: PipelineConfig,
    *,
    n_stages: int,
    pp_mesh: DeviceMesh,
    device: torch.device,
    local_batch_size: int,
    loss_fn: LossFn,
    scale_loss: bool = True,
) -> Pipeline:
    """Wrap this rank's parallelized stages and build the schedule that runs them.

    Args:
        parts: this rank's stages from `split_model`, parallelized (meta or materialised).
        config: the pipeline's settings (schedule, microbatch size, CSV schedule).
        n_stages: total number of stages over all ranks (`len` of `check_pipeline`'s result).
        pp_mesh: the 1-D `pp` mesh.
        device: the device the stages compute on.
        local_batch_size: sequences per data-parallel rank per step.
        loss_fn: `loss_fn(output, target)` -> the mean loss of one microbatch.
        scale_loss: see `build_schedule`; False when the caller normalises the loss itself.
    """
    n_microbatches = count_microbatches(local_batch_size, config.microbatch_size, n_stages, config.schedule)
    stages = build_stages(parts, n_stages, pp_mesh, device)
    schedule = build_schedule(
        stages, config.schedule, n_microbatches, loss_fn, schedule_csv=config.schedule_csv, scale_loss=scale_loss
    )
    return Pipeline(list(parts), stages, schedule, n_microbatches)


def pipeline_step(
    schedule: _PipelineSchedule,
    stages: Sequence[PipelineStage],
    inputs: torch.Tensor,
    labels: torch.Tensor,
    pp_mesh: DeviceMesh | None = None,
) -> torch.Tensor | None:
    """Run one forward + backward of the whole local batch through the pipeline.

    Every pipeline rank calls it with its data-parallel batch; the rank with the
    first stage feeds `inputs`, the one with the last stage (rank 0 under V
    schedules) scores against `labels`. Gradients end up in the stages' parameters.

    Args:
        schedule: from `build_pipeline` (or `build_schedule`).
        stages: this rank's stages (the ones the schedule was built with).
        inputs: `(local_bs, seqlen)` token ids.
        labels: `(local_bs, seqlen)` target ids.
        pp_mesh: the 1-D `pp` mesh, to check the stages were built on it; optional.

    Returns:
        The batch's mean loss (detached, 0-dim) on the rank holding the last stage, else None.
    """
    if pp_mesh is not None and stages[0].group_size != pp_mesh.size():
        raise ValueError(
            f"the stages span {stages[0].group_size} pipeline ranks but pp_mesh has {pp_mesh.size()}; pass mesh['pp']"
        )
    has_first = any(stage.is_first for stage in stages)
    has_last = any(stage.is_last for stage in stages)
    losses: list[torch.Tensor] | None = [] if has_last else None
    args = (inputs,) if has_first else ()
    schedule.step(*args, target=labels if has_last else None, losses=losses, return_outputs=False)
    if losses is None:
        return None
    return torch.stack([loss.detach() for loss in losses]).sum()  # the batch mean with scale_loss
