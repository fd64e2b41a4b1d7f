"""Building the model a rank trains: on meta, cut into pipeline stages, parallelized, materialised.

    meta model -> [float8 / MXFP8 linears] -> [pipeline split] -> parallelize each part (TP, CP, AC, compile, FSDP)
               -> to_empty -> seeded init -> [pipeline stages + schedule]

A rank holds one model part without pipeline parallel, else one part per
pipeline stage it runs; every part keeps the full model's parameter names.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
from titan_models import ModelSpec
from titan_parallel.dims import ParallelDims, ParallelMesh
from titan_parallel.materialize import copy_full_state
from titan_parallel.parallelize import ParallelOptions, parallelize, uses_fsdp

from titan_core.converters import Converters


@dataclass(frozen=True)
class PipelineOptions:
    """The `parallelism.pipeline_*` keys, as plain values."""

    schedule: str = "1F1B"
    schedule_csv: str | None = None
    microbatch_size: int = 1
    layers_per_stage: int | None = None
    first_stage_less_layers: int = 1
    last_stage_less_layers: int = 1
    module_names_per_stage: list[list[str]] | None = None


@dataclass
class ModelParts:
    """What one rank trains: its model parts, and under pipeline parallel the stages and schedule."""

    parts: list[nn.Module]
    schedule: Any | None = None
    stages: list[Any] | None = None

    def parameters(self) -> list[nn.Parameter]:
        return [p for part in self.parts for p in part.parameters()]

    @property
    def has_last_stage(self) -> bool:
        return self.stages is None or any(stage.is_last for stage in self.stages)


def build_model_parts(
    spec: ModelSpec,
    model_args: Any,
    mesh: ParallelMesh,
    dims: ParallelDims,
    options: ParallelOptions,
    device: torch.device,
    seed: int,
    *,
    pipeline: PipelineOptions = PipelineOptions(),
    local_batch_size: int = 1,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
    converters: Converters = Converters(),
) -> ModelParts:
    """Build, split, parallelize and initialise this rank's share of the model.

    Args:
        spec: the model family (builder and plan).
        model_args: the model's shape.
        mesh: the parallel mesh.
        dims: the parallel degrees.
        options: what `parallelize` applies to each part.
        device: where parameters live.
        seed: the init seed, the same on every rank.
        pipeline: how to cut and schedule stages (used when dims.pp > 1).
        local_batch_size: sequences per micro-batch on this rank (split into pipeline micro-batches).
        loss_fn: `(logits, labels) -> loss` for the pipeline's last stage.
        converters: float8 / MXFP8 linears, swapped in on the meta model before anything is split.
    """
    with torch.device("meta"):
        model = spec.build(model_args)
    plan = spec.plan
    if converters.float8 is not None:
        from titan_parallel.float8 import apply_float8

        fsdp_shards = mesh["dp_shard_cp"].size() if uses_fsdp(mesh, options) else 1
        apply_float8(model, converters.float8, fsdp_shards=fsdp_shards)
    if converters.mx is not None:
        from titan_parallel.float8 import apply_mx

        apply_mx(model, converters.mx)
    if dims.pp > 1:
        from titan_parallel import pipeline as pp

        n_layers = len(getattr(model, plan.blocks))
        names = pipeline.module_names_per_stage
        if names is None:
            n_stages = pp.count_stages(
                n_layers, dims.pp, pipeline.schedule,
                layers_per_stage=pipeline.layers_per_stage,
                first_stage_less_layers=pipeline.first_stage_less_layers,
                last_stage_less_layers=pipeline.last_stage_less_layers,
            )
            names = pp.stage_module_names(
                plan, n_layers, n_stages,
                first_stage_less_layers=pipeline.first_stage_less_layers,
                last_stage_less_layers=pipeline.last_stage_less_layers,
            )
        indexed = pp.split_model(model, plan, names, mesh["pp"], pipeline.schedule)
    else:
        indexed = [(0, model)]
    parts = [part for _, part in indexed]
    if options.dp_mode == "ddp":
        # DDP buckets the gradients of real parameters: materialise first, then wrap.
        init_weights(parts, spec, model_args, device, seed)
        parts = [parallelize(part, plan, mesh, options) for part in parts]
    else:
        parts = [parallelize(part, plan, mesh, options) for part in parts]
        init_weights(parts, spec, model_args, device, seed)
    if dims.pp == 1:
        return ModelParts(parts)
    stages = pp.build_stages([(i, part) for (i, _), part in zip(indexed, parts)], len(names), mesh["pp"], device)
    n_micro = pp.count_microbatches(local_batch_size, pipeline.microbatch_size, len(names), pipeline.schedule)
    schedule = pp.build_schedule(stages, pipeline.schedule, n_micro, loss_fn, csv_path=pipeline.schedule_csv)
    return ModelParts(parts, schedule, stages)


@torch.no_grad()
def init_weights(parts: list[nn.Module], spec: ModelSpec, model_args: Any, device: torch.device, seed: int) -> None:
    """Materialise meta parts with the seeded init, identical for every layout.

    On CUDA each part initialises its own shards (DTensor's RNG slices one global
    stream). Elsewhere each rank initialises a full copy from the seed and keeps
    its shards (`titan_parallel.materialize`).
    """
    for part in parts:
        part.to_empty(device=device)
        if device.type == "cuda":
            torch.manual_seed(seed)
            part.init_weights(buffer_device=device)
            continue
        with warnings.catch_warnings():  # DTensor warns that CPU random ops are not sharded: overwritten below
            warnings.simplefilter("ignore", UserWarning)
            part.init_weights(buffer_device=device)  # buffers (RoPE); parameters are overwritten next
    if device.type == "cuda":
        return
    reference = spec.build(model_args)
    torch.manual_seed(seed)
    reference.init_weights()
    full = reference.state_dict()
    for part in parts:
        copy_full_state(part, full)
