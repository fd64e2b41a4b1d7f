"""Cutting a model into pipeline stages, read from a `ModelPlan`.

A stage is the same model class with what it does not own removed: blocks are
deleted from the `plan.blocks` `nn.ModuleDict`, the `plan.pp_first` /
`plan.pp_last` modules are set to None, and the model's forward skips them.
Parameter names therefore stay the same in every stage (`layers.5.attention.wq.weight`
is called that wherever it lives), so checkpoints do not depend on the layout.

The model is cut into "units" in forward order: the `pp_first` modules, each
block, the `pp_last` modules. The first and last stages also carry the
embeddings and the output; counting those as `*_less_layers` blocks' worth of
work makes those stages lighter (torchtitan's `generate_llm_fqn_per_model_part`).

Stages go to ranks in one of two orders (pp = 2, 4 stages):

- loop (GPipe, 1F1B, Interleaved*): rank r owns stages r, r + pp, r + 2 pp, ...
  -> rank 0: (0, 2), rank 1: (1, 3).
- V (ZBVZeroBubble, DualPipeV): rank r owns stages r and 2 pp - 1 - r
  -> rank 0: (0, 3), rank 1: (1, 2); the last stage is on rank 0.
"""

from __future__ import annotations

import copy
import math

import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from titan_parallel.dims import ParallelConfigError
from titan_parallel.modules import get_submodule_or_none
from titan_parallel.pipeline_schedule import is_single_stage_schedule, is_v_schedule
from titan_parallel.plan import ModelPlan

_FQNS_KEY = "parallelism.module_fqns_per_model_part"
_LPS_KEY = "parallelism.pipeline_parallel_layers_per_stage"


def count_stages(
    n_layers: int,
    pp: int,
    schedule_name: str,
    *,
    layers_per_stage: int | None = None,
    first_stage_less_layers: int = 1,
    last_stage_less_layers: int = 1,
) -> int:
    """The total number of pipeline stages (over all ranks) for a schedule.

    Single-stage schedules (GPipe, 1F1B) put one stage on each rank; multi-stage
    ones at least two (default two); V schedules exactly two.

    Args:
        n_layers: number of blocks in the model.
        pp: pipeline parallel degree (ranks in the pipeline).
        schedule_name: a name from `available_schedules()`.
        layers_per_stage: blocks per stage (`parallelism.pipeline_parallel_layers_per_stage`);
            the stage count is `ceil((n_layers + first + last) / layers_per_stage)`. None: the default.
        first_stage_less_layers: blocks' worth of work the embeddings count for.
        last_stage_less_layers: blocks' worth of work the final norm and output count for.
    """
    single = is_single_stage_schedule(schedule_name)
    if layers_per_stage is None:
        return pp if single else 2 * pp
    units = n_layers + first_stage_less_layers + last_stage_less_layers
    n_stages = math.ceil(units / layers_per_stage)
    where = f"{_LPS_KEY}={layers_per_stage} gives {n_stages} stages for {units} units ({n_layers} layers + embeddings/output)"
    if n_stages % pp:
        raise ParallelConfigError(f"{where}, not a multiple of the pipeline degree {pp}; pick a value giving a multiple of {pp}")
    per_rank = n_stages // pp
    if single and per_rank != 1:
        raise ParallelConfigError(
            f"{where} = {per_rank} per rank, but schedule '{schedule_name}' runs 1 per rank; "
            f"set {_LPS_KEY} >= {math.ceil(units / pp)} or pick a multi-stage schedule"
        )
    if is_v_schedule(schedule_name) and per_rank != 2:
        raise ParallelConfigError(f"{where} = {per_rank} per rank, but schedule '{schedule_name}' runs exactly 2 per rank; change {_LPS_KEY}")
    if not single and per_rank < 2:
        raise ParallelConfigError(f"{where} = {per_rank} per rank, but schedule '{schedule_name}' needs >= 2 per rank; lower {_LPS_KEY}")
    return n_stages


def pipeline_units(plan: ModelPlan, n_layers: int) -> list[str]:
    """The modules a model is cut between, in forward order: `pp_first`, each block, `pp_last`.

    Args:
        plan: names the blocks container and the first/last-stage modules.
        n_layers: number of blocks (keys "0".."n_layers-1").
    """
    return [*plan.pp_first, *(f"{plan.blocks}.{i}" for i in range(n_layers)), *plan.pp_last]


def stage_module_names(
    plan: ModelPlan,
    n_layers: int,
    n_stages: int,
    *,
    first_stage_less_layers: int = 1,
    last_stage_less_layers: int = 1,
) -> list[list[str]]:
    """Module names per stage, cutting the blocks as evenly as the weighted units allow.

    The embeddings count as `first_stage_less_layers` blocks and the norm + output
    as `last_stage_less_layers`; the `n_layers + first + last` units are spread
    evenly (the first `units % n_stages` stages get one more). E.g. 6 layers,
    2 stages, 1 and 1: 8 units, 4 each -> `[tok_embeddings, layers.0-2]`,
    `[layers.3-5, norm, output]`.

    Args:
        plan: names the blocks container (`plan.blocks`) and `pp_first` / `pp_last`.
        n_layers: number of blocks.
        n_stages: total number of stages over all ranks (see `count_stages`).
        first_stage_less_layers: blocks' worth of work the `pp_first` modules count for
            (`parallelism.pipeline_parallel_first_stage_less_layers`).
        last_stage_less_layers: blocks' worth of work the `pp_last` modules count for
            (`parallelism.pipeline_parallel_last_stage_less_layers`).
    """
    if n_stages < 1:
        raise ParallelConfigError(f"the number of pipeline stages must be >= 1, got {n_stages}; check parallelism.pipeline_parallel_degree")
    layers = [f"{plan.blocks}.{i}" for i in range(n_layers)]
    if n_stages == 1:
        return [[*plan.pp_first, *layers, *plan.pp_last]]
    units = n_layers + first_stage_less_layers + last_stage_less_layers
    if n_stages > units:
        raise ParallelConfigError(
            f"{n_stages} pipeline stages but only {units} units ({n_layers} layers + first/last stage weights); "
            "lower parallelism.pipeline_parallel_degree or raise parallelism.pipeline_parallel_layers_per_stage"
        )
    per_stage, extra = divmod(units, n_stages)
    for key, weight in (("first", first_stage_less_layers), ("last", last_stage_less_layers)):
        if weight > per_stage:
            raise ParallelConfigError(
                f"parallelism.pipeline_parallel_{key}_stage_less_layers={weight} exceeds the {per_stage} units per stage "
                f"({n_layers} layers over {n_stages} stages); lower it or use fewer stages"
            )
    names: list[list[str]] = []
    next_layer = 0
    for stage in range(n_stages):
        n_units = per_stage + (1 if stage < extra else 0)
        first, last = stage == 0, stage == n_stages - 1
        n_blocks = n_units - (first_stage_less_layers if first else 0) - (last_stage_less_layers if last else 0)
        stage_names = list(plan.pp_first) if first else []
        stage_names += layers[next_layer : next_layer + n_blocks]
        next_layer += n_blocks
        names.append(stage_names + (list(plan.pp_last) if last else []))
    return names


def check_module_names(plan: ModelPlan, n_layers: int, names_per_stage: list[list[str]]) -> None:
    """Refuse a stage layout that misses, repeats, misnames or reorders a unit.

    Args:
        plan: the model's plan (defines the units, see `pipeline_units`).
        n_layers: number of blocks.
        names_per_stage: module names per stage, e.g. from `parallelism.module_fqns_per_model_part`.
    """
    units = pipeline_units(plan, n_layers)
    position = {name: i for i, name in enumerate(units)}
    seen: dict[str, int] = {}
    previous_end = -1
    for stage, names in enumerate(names_per_stage):
        if not names:
            raise ParallelConfigError(f"{_FQNS_KEY}: stage {stage} is empty; give every stage at least one module")
        for name in names:
            if name not in position:
                valid = [*plan.pp_first, f"{plan.blocks}.0 .. {plan.blocks}.{n_layers - 1}", *plan.pp_last]
                raise ParallelConfigError(f"{_FQNS_KEY}: unknown module '{name}' in stage {stage}; valid names: {', '.join(valid)}")
            if name in seen:
                raise ParallelConfigError(f"{_FQNS_KEY}: module '{name}' is in stage {seen[name]} and stage {stage}; list it once")
            seen[name] = stage
        start = min(position[n] for n in names)
        if start < previous_end:
            raise ParallelConfigError(f"{_FQNS_KEY}: stage {stage} holds '{units[start]}', which runs before modules of stage {stage - 1}; stages must cut the model in forward order")
        previous_end = max(position[n] for n in names)
    missing = [name for name in units if name not in seen]
    if missing:
        raise ParallelConfigError(f"{_FQNS_KEY}: modules {missing} are in no stage; add each to one stage")


def stage_indices(pp_rank: int, pp: int, n_stages: int, schedule_name: str) -> tuple[int, ...]:
    """The stages pipeline rank `pp_rank` runs: loop order, or V order for V schedules.

    Args:
        pp_rank: this rank's coordinate on the `pp` mesh dim.
        pp: pipeline parallel degree.
        n_stages: total number of stages.
        schedule_name: decides loop or V order.
    """
    if n_stages % pp:
        raise ParallelConfigError(f"{n_stages} pipeline stages do not divide over parallelism.pipeline_parallel_degree={pp}; use a multiple of {pp} stages")
    per_rank = n_stages // pp
    if is_single_stage_schedule(schedule_name) and per_rank != 1:
        raise ParallelConfigError(f"schedule '{schedule_name}' runs 1 stage per rank but got {per_rank}; use a multi-stage parallelism.pipeline_parallel_schedule or {pp} stages")
    if not is_single_stage_schedule(schedule_name) and per_rank < 2:
        raise ParallelConfigError(f"schedule '{schedule_name}' needs >= 2 stages per rank but got {per_rank}; use a single-stage parallelism.pipeline_parallel_schedule or more stages")
    if is_v_schedule(schedule_name):
        if per_rank != 2:
            raise ParallelConfigError(f"schedule '{schedule_name}' runs exactly 2 stages per rank but got {per_rank}; use {2 * pp} stages")
        return (pp_rank, n_stages - 1 - pp_rank)
    return tuple(pp_rank + s * pp for s in range(per_rank))


def split_model(
    model: nn.Module, plan: ModelPlan, names_per_stage: list[list[str]], pp_mesh: DeviceMesh, schedule_name: str
) -> list[tuple[int, nn.Module]]:
    """Copy `model` once per stage this rank owns and remove from each copy what the stage does not own.

    Call it on the meta-device model, before `parallelize` and materialisation.

    Args:
        model: the whole model (meta device is best: copies cost nothing).
        plan: names the blocks container and the `pp_first` / `pp_last` modules.
        names_per_stage: module names per stage (from `stage_module_names` or
            `parallelism.module_fqns_per_model_part`); checked with `check_module_names`.
        pp_mesh: the 1-D `pp` mesh (`mesh["pp"]`); its local rank picks the stages.
        schedule_name: decides loop or V placement of stages on ranks.

    Returns:
        `(stage_index, stage_module)` for each stage this rank runs, in stage order.
    """
    container = get_submodule_or_none(model, plan.blocks)
    if not isinstance(container, nn.ModuleDict):
        raise ParallelConfigError(f"ModelPlan.blocks='{plan.blocks}' must name an nn.ModuleDict in the model to cut pipeline stages")
    check_module_names(plan, len(container), names_per_stage)
    _check_untied_across_stages(model, plan, names_per_stage)
    n_stages = len(names_per_stage)
    indices = stage_indices(pp_mesh.get_local_rank(), pp_mesh.size(), n_stages, schedule_name)
    return [(i, _prune_to_stage(model, plan, set(names_per_stage[i]))) for i in sorted(indices)]


def _prune_to_stage(model: nn.Module, plan: ModelPlan, keep: set[str]) -> nn.Module:
    """A deep copy of `model` without the blocks and first/last modules not in `keep`."""
    stage = copy.deepcopy(model)
    blocks = stage.get_submodule(plan.blocks)
    for key in list(blocks.keys()):
        if f"{plan.blocks}.{key}" not in keep:
            del blocks[key]
    for path in (*plan.pp_first, *plan.pp_last):
        if path not in keep:
            parent_path, _, leaf = path.rpartition(".")
            setattr(stage.get_submodule(parent_path) if parent_path else stage, leaf, None)
    return stage


def _check_untied_across_stages(model: nn.Module, plan: ModelPlan, names_per_stage: list[list[str]]) -> None:
    """Every parameter must belong to exactly one unit, and a shared (tied) one to a single stage."""
    stage_of = {name: stage for stage, names in enumerate(names_per_stage) for name in names}
    owners: dict[int, tuple[str, int]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        unit = next((u for u in stage_of if name.startswith(u + ".")), None)
        if unit is None:
            raise ParallelConfigError(
                f"parameter '{name}' belongs to no pipeline unit; add its module to ModelPlan.pp_first or pp_last (or to the blocks)"
            )
        first = owners.setdefault(id(param), (name, stage_of[unit]))
        if first[1] != stage_of[unit]:
            raise ParallelConfigError(
                f"'{first[0]}' and '{name}' share one weight but sit on stages {first[1]} and {stage_of[unit]}; "
                "untie them (e.g. tie_word_embeddings=False) or put both on one stage with " + _FQNS_KEY
            )
