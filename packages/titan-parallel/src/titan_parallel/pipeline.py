"""Pipeline parallel: cut a model into stages, run them with a `torch.distributed.pipelining` schedule.

Pipeline parallel is the outermost parallelism. Each rank, with the whole model on
the meta device:

    n_stages = count_stages(n_layers, pp, schedule_name, layers_per_stage=...)
    names = stage_module_names(plan, n_layers, n_stages)         # or module_fqns_per_model_part
    parts = split_model(model, plan, names, mesh["pp"], schedule_name)
    for _, part in parts:
        parallelize(part, plan, mesh, ParallelOptions(pipeline_parallel=True, ...))
        # ... to_empty, init_weights / load a checkpoint
    stages = build_stages(parts, n_stages, mesh["pp"], device)
    n_microbatches = count_microbatches(local_batch_size, microbatch_size, n_stages, schedule_name)
    schedule = build_schedule(stages, schedule_name, n_microbatches, loss_fn)
    loss = pipeline_step(schedule, stages, inputs, labels, mesh["pp"])   # None off the last stage

How stages are cut lives in `pipeline_split`, how they are run in `pipeline_schedule`.
"""

from titan_parallel.pipeline_schedule import (
    SCHEDULE_NAMES,
    available_schedules,
    build_schedule,
    build_stages,
    count_microbatches,
    get_schedule_class,
    is_single_stage_schedule,
    is_v_schedule,
    pipeline_step,
)
from titan_parallel.pipeline_split import (
    check_module_names,
    count_stages,
    pipeline_units,
    split_model,
    stage_indices,
    stage_module_names,
)

__all__ = [
    "SCHEDULE_NAMES",
    "available_schedules",
    "build_schedule",
    "build_stages",
    "check_module_names",
    "count_microbatches",
    "count_stages",
    "get_schedule_class",
    "is_single_stage_schedule",
    "is_v_schedule",
    "pipeline_step",
    "pipeline_units",
    "split_model",
    "stage_indices",
    "stage_module_names",
]
