"""The pipeline's layout rules, with no torch: schedules, stage counts and placement, cuts, microbatches.

`titan_parallel.pipeline.check_pipeline` runs them all; errors name its
arguments and `PipelineConfig`'s fields (`schedule`, `pp`, `layers_per_stage`,
`microbatch_size`, ...).

Stages go to ranks in one of three ways (pp = 2 ranks):

- single (GPipe, 1F1B): one stage per rank -> rank 0: (0,), rank 1: (1,).
- loop (Interleaved1F1B, InterleavedZeroBubble): two or more per rank, rank r
  owns r, r + pp, r + 2 pp, ... -> 4 stages: rank 0: (0, 2), rank 1: (1, 3).
- V (ZBVZeroBubble, DualPipeV): exactly two per rank, rank r owns r and
  2 pp - 1 - r -> rank 0: (0, 3), rank 1: (1, 2); the last stage is on rank 0.

A model is cut into "units" in forward order: the `pp_first` modules, each
block, the `pp_last` modules. The first and last stages also carry the
embeddings and the output; counting those as `*_less_layers` blocks' worth of
work makes those stages lighter (torchtitan's `generate_llm_fqn_per_model_part`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from titan_parallel.layout import ParallelConfigError, at_least
from titan_parallel.plan import ModelPlan


@dataclass(frozen=True)
class ScheduleKind:
    """How a pipeline schedule uses its stages.

    Args:
        placement: "single" (1 stage per rank), "loop" (>= 2 per rank, rank r owns
            r, r + pp, ...) or "v" (exactly 2 per rank, rank r owns r and 2 pp - 1 - r).
        microbatch_per_stage: torch refuses fewer microbatches than stages.
    """

    placement: Literal["single", "loop", "v"]
    microbatch_per_stage: bool = False


SCHEDULE_KINDS: dict[str, ScheduleKind] = {
    "GPipe": ScheduleKind("single"),
    "1F1B": ScheduleKind("single", microbatch_per_stage=True),
    "Interleaved1F1B": ScheduleKind("loop"),
    "InterleavedZeroBubble": ScheduleKind("loop"),
    "ZBVZeroBubble": ScheduleKind("v"),
    "DualPipeV": ScheduleKind("v", microbatch_per_stage=True),
}
"""Every schedule titan-parallel runs, by its `torch.distributed.pipelining` name."""

SCHEDULE_NAMES = tuple(SCHEDULE_KINDS)

_STAGES_PER_RANK = {"single": "exactly 1 stage", "loop": "at least 2 stages", "v": "exactly 2 stages"}


def _places(placement: str, per_rank: int) -> bool:
    """The placement rule: whether a schedule of `placement` runs `per_rank` stages on each rank."""
    return {"single": per_rank == 1, "loop": per_rank >= 2, "v": per_rank == 2}[placement]


def available_schedules() -> tuple[str, ...]:
    """The names in `SCHEDULE_NAMES` that the installed torch provides (imports its pipelining)."""
    from torch.distributed.pipelining import schedules

    available = []
    for name in SCHEDULE_NAMES:
        try:
            schedules.get_schedule_class(name)
        except ValueError:
            continue
        available.append(name)
    return tuple(available)


def schedule_kind(schedule: str) -> ScheduleKind:
    """The `ScheduleKind` of a schedule name; needs no torch.

    Args:
        schedule: a name of `SCHEDULE_NAMES`.
    """
    if schedule not in SCHEDULE_KINDS:
        raise ParallelConfigError(
            f"schedule={schedule!r} is unknown; choose one of {', '.join(SCHEDULE_NAMES)}", arguments=("schedule",)
        )
    return SCHEDULE_KINDS[schedule]


def check_schedule(schedule: str) -> None:
    """Raise unless `schedule` is known and the installed torch has it.

    Args:
        schedule: a name of `SCHEDULE_NAMES`.
    """
    schedule_kind(schedule)
    available = available_schedules()
    if schedule not in available:
        raise ParallelConfigError(
            f"schedule={schedule!r} is not in this torch's pipelining; choose one of {', '.join(available)}",
            arguments=("schedule",),
        )


def stages_per_rank(
    n_stages: int, pp: int, schedule: str, *, origin: str = "", origin_arguments: tuple[str, ...] = ()
) -> int:
    """How many stages each rank runs; raise unless the stages divide over the ranks as `schedule` places them.

    The placement rule: single-stage schedules run exactly 1 stage per rank, loop
    schedules at least 2, V schedules exactly 2.

    Args:
        n_stages: total number of stages over all ranks.
        pp: pipeline parallel degree.
        schedule: a name of `SCHEDULE_NAMES`.
        origin: how `n_stages` came about, for the message, e.g. "layers_per_stage=2 cuts 8 units into 4 stages".
        origin_arguments: the arguments `origin` names.
    """
    kind = schedule_kind(schedule)
    at_least(1, n_stages=n_stages, pp=pp)
    where = origin or f"{n_stages} stages"
    if n_stages % pp:
        raise ParallelConfigError(
            f"{where}, which do not divide over pp={pp} ranks; use a multiple of {pp} stages",
            arguments=("pp", *origin_arguments),
        )
    per_rank = n_stages // pp
    if not _places(kind.placement, per_rank):
        fits = [n for n, k in SCHEDULE_KINDS.items() if _places(k.placement, per_rank)]
        wanted = {"single": f"{pp}", "loop": f"a multiple of {pp}, at least {2 * pp},", "v": f"{2 * pp}"}[
            kind.placement
        ]
        raise ParallelConfigError(
            f"schedule={schedule!r} runs {_STAGES_PER_RANK[kind.placement]} per rank, but {where} "
            f"= {per_rank} per rank on pp={pp}; use {wanted} stages "
            f"or a schedule running {per_rank} per rank ({', '.join(fits)})",
            arguments=("schedule", "pp", *origin_arguments),
        )
    return per_rank


def stage_indices(pp_rank: int, pp: int, n_stages: int, schedule: str) -> tuple[int, ...]:
    """The stages pipeline rank `pp_rank` runs, in the schedule's placement (see the module docstring).

    Args:
        pp_rank: this rank's coordinate on the `pp` mesh dim.
        pp: pipeline parallel degree.
        n_stages: total number of stages.
        schedule: a name of `SCHEDULE_NAMES`.
    """
    per_rank = stages_per_rank(n_stages, pp, schedule)
    if schedule_kind(schedule).placement == "v":
        return (pp_rank, n_stages - 1 - pp_rank)
    return tuple(pp_rank + s * pp for s in range(per_rank))


def count_stages(
    n_layers: int,
    pp: int,
    schedule: str,
    *,
    layers_per_stage: int | None = None,
    first_stage_less_layers: int = 1,
    last_stage_less_layers: int = 1,
) -> int:
    """The total number of pipeline stages (over all ranks), checked against the schedule's placement.

    Args:
        n_layers: number of blocks in the model.
        pp: pipeline parallel degree.
        schedule: a name of `SCHEDULE_NAMES`.
        layers_per_stage: units per stage: `ceil((n_layers + first + last) / layers_per_stage)`
            stages. None: 1 stage per rank for single-stage schedules, else 2.
        first_stage_less_layers: blocks' worth of work the `pp_first` modules count for.
        last_stage_less_layers: blocks' worth of work the `pp_last` modules count for.
    """
    at_least(1, n_layers=n_layers, pp=pp)
    at_least(0, first_stage_less_layers=first_stage_less_layers, last_stage_less_layers=last_stage_less_layers)
    if layers_per_stage is None:
        n_stages = pp if schedule_kind(schedule).placement == "single" else 2 * pp
        return stages_per_rank(n_stages, pp, schedule) * pp
    at_least(1, layers_per_stage=layers_per_stage)
    units = n_layers + first_stage_less_layers + last_stage_less_layers
    n_stages = math.ceil(units / layers_per_stage)
    origin = f"layers_per_stage={layers_per_stage} cuts {units} units into {n_stages} stages"
    return stages_per_rank(n_stages, pp, schedule, origin=origin, origin_arguments=("layers_per_stage",)) * pp


def pipeline_units(plan: ModelPlan, n_layers: int) -> list[str]:
    """The modules a model is cut between, in forward order: `pp_first`, each block, `pp_last`.

    Args:
        plan: names the blocks container and the first/last-stage modules.
        n_layers: number of blocks (keys "0".."n_layers-1").
    """
    return [*plan.pp_first, *(f"{plan.blocks}.{i}" for i in range(n_layers)), *plan.pp_last]


def stage_module_names(
    plan: ModelPlan, n_layers: int, n_stages: int, *, first_stage_less_layers: int = 1, last_stage_less_layers: int = 1
) -> list[list[str]]:
    """Module names per stage, cutting the blocks as evenly as the weighted units allow.

    The `n_layers + first + last` units are spread evenly (the first `units % n_stages`
    stages get one more). E.g. 6 layers, 2 stages, 1 and 1: 8 units, 4 each ->
    `[tok_embeddings, layers.0-2]`, `[layers.3-5, norm, output]`.

    Args:
        plan: names the blocks container (`plan.blocks`) and `pp_first` / `pp_last`.
        n_layers: number of blocks.
        n_stages: total number of stages over all ranks (see `count_stages`).
        first_stage_less_layers: blocks' worth of work the `pp_first` modules count for.
        last_stage_less_layers: blocks' worth of work the `pp_last` modules count for.
    """
    at_least(1, n_stages=n_stages)
    layers = [f"{plan.blocks}.{i}" for i in range(n_layers)]
    if n_stages == 1:
        return [[*plan.pp_first, *layers, *plan.pp_last]]
    first, last = first_stage_less_layers, last_stage_less_layers
    units = n_layers + first + last
    if n_stages > units:
        raise ParallelConfigError(
            f"{n_stages} stages but only {units} units to cut (n_layers={n_layers} + first_stage_less_layers={first} "
            f"+ last_stage_less_layers={last}); use at most {units} stages: "
            "fewer pp ranks or a larger layers_per_stage",
            arguments=("n_layers", "first_stage_less_layers", "last_stage_less_layers", "pp", "layers_per_stage"),
        )
    per_stage, extra = divmod(units, n_stages)
    for name, weight in (("first_stage_less_layers", first), ("last_stage_less_layers", last)):
        if weight > per_stage:
            raise ParallelConfigError(
                f"{name}={weight} exceeds the {per_stage} units per stage ({units} units over {n_stages} stages); "
                f"lower {name} or use fewer stages",
                arguments=(name,),
            )
    names: list[list[str]] = []
    next_layer = 0
    for stage in range(n_stages):
        n_units = per_stage + (1 if stage < extra else 0)
        is_first, is_last = stage == 0, stage == n_stages - 1
        n_blocks = n_units - (first if is_first else 0) - (last if is_last else 0)
        stage_names = list(plan.pp_first) if is_first else []
        stage_names += layers[next_layer : next_layer + n_blocks]
        next_layer += n_blocks
        names.append(stage_names + (list(plan.pp_last) if is_last else []))
    return names


def check_module_names(plan: ModelPlan, n_layers: int, module_names_per_stage: Sequence[Sequence[str]]) -> None:
    """Raise unless explicit stages hold every unit, in forward order, each block once.

    A `pp_first` / `pp_last` module may be listed on more than one stage: each of those stages holds a copy
    (`split_model(..., shared=True)` with `titan_parallel.SharedWeights` keeping them equal), e.g. the
    embedding on the last stage for multi-token-prediction depths. Its first listing places it in forward order.

    Args:
        plan: the model's plan (defines the units, see `pipeline_units`).
        n_layers: number of blocks.
        module_names_per_stage: module names per stage.
    """
    units = pipeline_units(plan, n_layers)
    position = {name: i for i, name in enumerate(units)}
    copyable = {*plan.pp_first, *plan.pp_last}
    seen: dict[str, int] = {}
    previous_end = -1

    def refuse(what: str) -> ParallelConfigError:
        return ParallelConfigError(f"module_names_per_stage: {what}", arguments=("module_names_per_stage",))

    for stage, names in enumerate(module_names_per_stage):
        if not names:
            raise refuse(f"stage {stage} is empty; give every stage at least one module")
        placed = []  # the names this stage is the first to hold
        for name in names:
            if name not in position:
                valid = [*plan.pp_first, f"{plan.blocks}.0 .. {plan.blocks}.{n_layers - 1}", *plan.pp_last]
                raise refuse(f"unknown module '{name}' in stage {stage}; valid names: {', '.join(valid)}")
            if name in seen:
                if name not in copyable or seen[name] == stage:
                    raise refuse(f"module '{name}' is in stage {seen[name]} and stage {stage}; list it once")
                continue  # a copy (kept equal with SharedWeights)
            seen[name] = stage
            placed.append(name)
        if not placed:
            continue
        start = min(position[n] for n in placed)
        if start < previous_end:
            raise refuse(
                f"stage {stage} holds '{units[start]}', which runs before modules of stage {stage - 1}; "
                "stages must cut the model in forward order"
            )
        previous_end = max(position[n] for n in placed)
    missing = [name for name in units if name not in seen]
    if missing:
        raise refuse(f"modules {missing} are in no stage; add each to one stage")


def count_microbatches(local_batch_size: int, microbatch_size: int, n_stages: int, schedule: str) -> int:
    """`local_batch_size // microbatch_size`, refused where it does not divide or the schedule needs more.

    1F1B and DualPipeV need at least one microbatch per stage (torch refuses fewer);
    the others run with any number, though fewer microbatches than stages leave
    the pipeline mostly idle (bubbles).

    Args:
        local_batch_size: sequences per data-parallel rank per step.
        microbatch_size: sequences per microbatch.
        n_stages: total number of stages over all ranks.
        schedule: a name of `SCHEDULE_NAMES`.
    """
    kind = schedule_kind(schedule)
    at_least(1, local_batch_size=local_batch_size, microbatch_size=microbatch_size)
    if local_batch_size % microbatch_size:
        raise ParallelConfigError(
            f"local_batch_size={local_batch_size} is not divisible by microbatch_size={microbatch_size}; "
            "make the batch a multiple of the microbatch",
            arguments=("local_batch_size", "microbatch_size"),
        )
    n_microbatches = local_batch_size // microbatch_size
    if kind.microbatch_per_stage and n_microbatches < n_stages:
        raise ParallelConfigError(
            f"schedule={schedule!r} with {n_stages} stages needs >= {n_stages} microbatches per step, but "
            f"local_batch_size={local_batch_size} / microbatch_size={microbatch_size} gives {n_microbatches}; "
            "raise local_batch_size or lower microbatch_size",
            arguments=("schedule", "local_batch_size", "microbatch_size"),
        )
    return n_microbatches
