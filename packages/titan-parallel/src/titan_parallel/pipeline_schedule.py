"""Running pipeline stages with a `torch.distributed.pipelining` schedule.

Losses and gradients: the batch is cut into `n_microbatches` equal microbatches.
The schedule calls the loss function once per microbatch and backpropagates
each result, accumulating gradients. We divide each microbatch's mean loss by
`n_microbatches` (and pass `scale_grads=False`, so the schedule does not divide
again), so the accumulated gradient is that of the mean of the microbatch means
= the whole batch's mean loss, and the sum of the reported microbatch losses is
that mean. Data parallel then averages over the data-parallel ranks as usual.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining import schedules as _schedules

from titan_parallel.dims import ParallelConfigError

SCHEDULE_NAMES = ("GPipe", "1F1B", "Interleaved1F1B", "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")
"""The schedules Titan supports (those the installed torch lacks are refused)."""

_SCHEDULE_KEY = "parallelism.pipeline_parallel_schedule"


def available_schedules() -> tuple[str, ...]:
    """The names in `SCHEDULE_NAMES` that the installed torch provides."""
    available = []
    for name in SCHEDULE_NAMES:
        try:
            _schedules.get_schedule_class(name)
        except ValueError:
            continue
        available.append(name)
    return tuple(available)


def get_schedule_class(schedule_name: str) -> type:
    """The `torch.distributed.pipelining` schedule class for `schedule_name` (exact name).

    Args:
        schedule_name: one of `available_schedules()`.
    """
    if schedule_name not in available_schedules():
        raise ParallelConfigError(f"{_SCHEDULE_KEY}='{schedule_name}' is unknown; choose one of {', '.join(available_schedules())}")
    return _schedules.get_schedule_class(schedule_name)


def is_single_stage_schedule(schedule_name: str) -> bool:
    """Whether the schedule runs exactly one stage per rank (GPipe, 1F1B)."""
    return issubclass(get_schedule_class(schedule_name), _schedules.PipelineScheduleSingle)


def is_v_schedule(schedule_name: str) -> bool:
    """Whether the schedule places two stages per rank in V order (ZBVZeroBubble, DualPipeV)."""
    return issubclass(get_schedule_class(schedule_name), _classes_named("ZBVZeroBubble", "DualPipeV"))


def _classes_named(*schedule_names: str) -> tuple[type, ...]:
    """The schedule classes of those of `schedule_names` the installed torch has."""
    return tuple(_schedules.get_schedule_class(name) for name in schedule_names if name in available_schedules())


def count_microbatches(local_batch_size: int, microbatch_size: int, n_stages: int, schedule_name: str) -> int:
    """`local_batch_size // microbatch_size`, refused where it does not divide or the schedule needs more.

    1F1B and DualPipeV need at least one microbatch per stage (torch refuses fewer);
    the others run with any number, though fewer microbatches than stages leave
    the pipeline mostly idle (bubbles).

    Args:
        local_batch_size: sequences per data-parallel rank per step (`training.local_batch_size`).
        microbatch_size: sequences per microbatch (`parallelism.pipeline_parallel_microbatch_size`).
        n_stages: total number of stages over all ranks.
        schedule_name: one of `available_schedules()`.
    """
    schedule_class = get_schedule_class(schedule_name)
    if local_batch_size % microbatch_size:
        raise ParallelConfigError(
            f"training.local_batch_size={local_batch_size} is not divisible by "
            f"parallelism.pipeline_parallel_microbatch_size={microbatch_size}; make the batch a multiple of the microbatch"
        )
    n_microbatches = local_batch_size // microbatch_size
    needed = n_stages if issubclass(schedule_class, _classes_named("1F1B", "DualPipeV")) else 1
    if n_microbatches < needed:
        raise ParallelConfigError(
            f"schedule '{schedule_name}' with {n_stages} stages needs >= {needed} microbatches, got {n_microbatches} "
            f"(training.local_batch_size={local_batch_size} / parallelism.pipeline_parallel_microbatch_size={microbatch_size}); "
            "raise the batch or lower the microbatch size"
        )
    return n_microbatches


def build_stages(parts: list[tuple[int, torch.nn.Module]], n_stages: int, pp_mesh: DeviceMesh, device: torch.device) -> list[PipelineStage]:
    """Wrap this rank's stage modules as `PipelineStage`s on the `pp` process group.

    The modules may still be on the meta device: shapes are found at the first step.

    Args:
        parts: `(stage_index, module)` from `split_model` (after `parallelize`).
        n_stages: total number of stages over all ranks.
        pp_mesh: the 1-D `pp` mesh.
        device: the device the stages compute on.
    """
    group = pp_mesh.get_group()
    return [PipelineStage(module, index, n_stages, device, group=group) for index, module in parts]


def build_schedule(
    stages: list[PipelineStage],
    schedule_name: str,
    n_microbatches: int,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    *,
    csv_path: str | None = None,
) -> _schedules._PipelineSchedule:
    """Build the schedule running `stages` over `n_microbatches` microbatches per step.

    Args:
        stages: this rank's stages, in stage order (from `build_stages`).
        schedule_name: one of `available_schedules()`; with `csv_path`, it still
            decides how stages sit on ranks and must match the CSV.
        n_microbatches: microbatches per step (see `count_microbatches`).
        loss_fn: `loss_fn(output, target)` -> the mean loss of one microbatch.
        csv_path: a custom schedule, one row of actions per rank
            (`parallelism.pipeline_parallel_schedule_csv`), run by `_PipelineScheduleRuntime`.
    """
    if csv_path is not None:
        if not os.path.isfile(csv_path):
            raise FileNotFoundError(f"parallelism.pipeline_parallel_schedule_csv='{csv_path}' is not a file; fix the path or unset it")
        schedule_class = _schedules._PipelineScheduleRuntime
    else:
        schedule_class = get_schedule_class(schedule_name)
    single = issubclass(schedule_class, _schedules.PipelineScheduleSingle)
    if single and len(stages) != 1:
        raise ParallelConfigError(f"{_SCHEDULE_KEY}='{schedule_name}' runs one stage per rank but this rank has {len(stages)}")

    def scaled_loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return loss_fn(output, target) / n_microbatches

    schedule = schedule_class(
        stages[0] if single else stages,
        n_microbatches=n_microbatches,
        loss_fn=scaled_loss,
        scale_grads=False,
    )
    if csv_path is not None:
        schedule._load_csv(csv_path)
    return schedule


def pipeline_step(
    schedule: _schedules._PipelineSchedule,
    stages: list[PipelineStage],
    inputs: torch.Tensor,
    labels: torch.Tensor,
    pp_mesh: DeviceMesh | None = None,
) -> torch.Tensor | None:
    """Run one forward + backward of the whole local batch through the pipeline.

    Every pipeline rank calls it with its data-parallel batch; the rank with the
    first stage feeds `inputs`, the one with the last stage (rank 0 under V
    schedules) scores against `labels`. Gradients end up in the stages' parameters.

    Args:
        schedule: from `build_schedule`.
        stages: this rank's stages (the ones the schedule was built with).
        inputs: `(local_bs, seqlen)` token ids.
        labels: `(local_bs, seqlen)` target ids.
        pp_mesh: the 1-D `pp` mesh, to check the stages were built on it; optional.

    Returns:
        The batch's mean loss (detached, 0-dim) on the rank holding the last stage, else None.
    """
    if pp_mesh is not None and stages[0].group_size != pp_mesh.size():
        raise ValueError(f"the stages span {stages[0].group_size} pipeline ranks but pp_mesh has {pp_mesh.size()}; pass mesh['pp']")
    has_first = any(stage.is_first for stage in stages)
    has_last = any(stage.is_last for stage in stages)
    losses: list[torch.Tensor] | None = [] if has_last else None
    args = (inputs,) if has_first else ()
    schedule.step(*args, target=labels if has_last else None, losses=losses, return_outputs=False)
    if losses is None:
        return None
    return torch.stack([loss.detach() for loss in losses]).sum()  # each already divided by n_microbatches
