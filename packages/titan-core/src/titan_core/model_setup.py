"""Building the model a rank trains: on meta, cut into pipeline stages, parallelized, materialised.

    meta model -> [float8 / MXFP8 linears] -> [pipeline split] -> parallelize each part (TP, CP, AC, compile, FSDP)
               -> to_empty -> seeded init -> [pipeline stages + schedule]

A rank holds one model part without pipeline parallel, else one part per
pipeline stage it runs; every part keeps the full model's parameter names.
"""

from __future__ import annotations

import logging
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn as nn

from titan_core.converters import Converters
from titan_models import ModelSpec
from titan_parallel import (
    ParallelMesh,
    ParallelOptions,
    PipelineConfig,
    canonical_name,
    copy_full_state,
    parallelize,
    uses_fsdp,
)
from titan_parallel.float8_matmul import Float8Loss
from titan_parallel.pipeline import LossFn, StageModule
from titan_parallel.plan import ModelPlan

if TYPE_CHECKING:
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining.schedules import _PipelineSchedule

    from titan_core.job import Job
    from titan_parallel import ComputeCopies, SharedWeights

logger = logging.getLogger("titan")


@dataclass
class ModelParts:
    """What one rank trains: its model parts, whether FSDP wraps them (then its mixed-precision policy
    casts to the compute dtype), and under pipeline parallel the stages, the schedule and the
    microbatches it runs per step."""

    parts: list[nn.Module]
    fsdp: bool = False
    head: nn.Module | None = None
    """The output projection computing the loss (`titan_parallel.fuse_output_loss`), on the rank holding it."""
    head_owner: nn.Module | None = None
    """The part holding `head`: inside the step it returns hidden states (`hidden_states_out`)."""
    schedule: _PipelineSchedule | None = None
    stages: list[PipelineStage] | None = None
    n_microbatches: int = 1
    copies: ComputeCopies | None = None
    """The compute copies the optimizer writes (`ParallelOptions.master_weights`), else None."""
    shared: SharedWeights | None = None
    """Weights several pipeline stages hold (a tie across the cut, the embedding the last stage's
    multi-token-prediction depths read): their gradients are summed before clipping; None without any."""

    def parameters(self) -> list[nn.Parameter]:
        return [p for part in self.parts for p in part.parameters()]


def build_model_parts(job: Job, mesh: ParallelMesh, device: torch.device, seed: int, *, loss_fn: LossFn) -> ModelParts:
    """Build, split, parallelize and initialise this rank's share of the job's model.

    Args:
        job: the resolved job (model, options, converters, pipeline stages as its rules cut them).
        mesh: the parallel mesh built from `job.dims`.
        device: where parameters live.
        seed: the init seed, the same on every rank.
        loss_fn: `(logits, labels) -> loss` for the pipeline's last stage, already normalised
            (`titan_core.step_loss.StepLoss`): the schedule backpropagates it unchanged.
    """
    return assemble_model(
        job.spec,
        job.model_args,
        mesh,
        job.parallel,
        device,
        seed,
        names_per_stage=job.names_per_stage,
        pipeline=job.pipeline,
        local_batch_size=job.cfg.training.local_batch_size,
        loss_fn=loss_fn,
        converters=job.converters,
        fused_loss=job.cfg.training.fused_loss,
        compiled_loss=job.cfg.compile.enable and "loss" in job.cfg.compile.components,
        z_loss=job.cfg.training.z_loss_weight,
    )


def float8_loss_of(model: nn.Module, plan: ModelPlan, converters: Converters) -> Float8Loss | None:
    """The fused loss's float8 GEMMs where [float8] selects the output projection under the tensorwise
    recipe (`titan_parallel.float8.float8_loss_for`: it then stays a plain linear); else None."""
    if converters.float8 is None:
        return None
    from titan_parallel.float8 import float8_loss_for
    from titan_parallel.linear_cross_entropy import output_projection_path

    return float8_loss_for(model, output_projection_path(plan), converters.float8)


def precasts_float8_weights(master_weights: bool, converters: Converters) -> bool:
    """Whether the tensorwise float8 weights keep a copy cast once per optimizer step
    (`titan_parallel.float8_precast`): under master weights, where nothing gathers them in float8."""
    return master_weights and converters.float8 is not None and converters.float8.recipe_name == "tensorwise"


def loss_compiled_for(job: Job) -> bool:
    """Whether `job` runs the plain loss compiled (`titan_core.step_loss.loss_is_compiled`)."""
    from titan_core.step_loss import loss_is_compiled

    assert job.dims is not None, "a job resolved for a world size has its degrees"
    compile_loss = job.cfg.compile.enable and "loss" in job.cfg.compile.components
    return loss_is_compiled(compile_loss, job.dims.tp, job.parallel.loss_parallel)


def assemble_model(
    spec: ModelSpec,
    model_args: Any,
    mesh: ParallelMesh,
    options: ParallelOptions,
    device: torch.device,
    seed: int,
    *,
    names_per_stage: list[list[str]] | None = None,
    pipeline: PipelineConfig | None = None,
    local_batch_size: int = 1,
    loss_fn: LossFn | None = None,
    converters: Converters | None = None,
    fused_loss: bool = False,
    compiled_loss: bool = False,
    z_loss: float = 0.0,
) -> ModelParts:
    """`build_model_parts` from plain arguments (for tests that build a model without a job config).

    Args:
        spec: the model family (builder and plan).
        model_args: the model's shape.
        mesh: the parallel mesh (its `dims` say the degrees).
        options: what `parallelize` applies to each part.
        device: where parameters live.
        seed: the init seed, the same on every rank.
        names_per_stage: under pipeline parallel, each stage's module names (`check_pipeline`'s result).
        pipeline: how to schedule the stages (pipeline parallel only).
        local_batch_size: sequences per micro-batch on this rank (split into pipeline micro-batches).
        loss_fn: the pipeline's last-stage loss, already normalised.
        converters: float8 / MXFP8 linears, swapped in on the meta model before anything is split.
        fused_loss: the output projection computes the loss in token chunks (`titan_parallel.fuse_output_loss`);
            `ModelParts.head` is it, and the parts return hidden states.
        compiled_loss: compile the fused loss's per-chunk arithmetic.
        z_loss: the fused loss's z-loss weight in training (`titan_parallel.fuse_output_loss`).
    """
    dims, converters = mesh.dims, converters or Converters()
    fsdp = uses_fsdp(mesh, options)  # decided once here, as `parallelize` decides it
    with torch.device("meta"):
        model = spec.build(model_args)
    plan = spec.plan
    float8_loss = float8_loss_of(model, plan, converters) if fused_loss else None
    if converters.float8 is not None:
        from titan_parallel import apply_float8
        from titan_parallel.linear_cross_entropy import output_projection_path

        fsdp_shards = mesh["dp_shard_cp"].size() if fsdp else 1
        exclude = [output_projection_path(plan) or ""] if float8_loss is not None else []
        apply_float8(model, converters.float8, fsdp_shards=fsdp_shards, exclude=exclude)
        if float8_loss is not None:
            logger.info("float8: the output projection's GEMMs run in float8 inside the fused loss (tensorwise)")
    if converters.mx is not None:
        from titan_parallel import apply_mx

        apply_mx(model, converters.mx, device.type)
    if dims.pp > 1:
        from titan_parallel import build_pipeline, split_model

        if names_per_stage is None or pipeline is None or loss_fn is None:
            raise ValueError("pipeline parallel needs names_per_stage, pipeline and loss_fn (the job has them)")
        from titan_parallel import find_shared_weights

        names = names_per_stage
        shared_weights = find_shared_weights(model, plan, names)
        stage_modules = split_model(model, plan, names, mesh["pp"], pipeline.schedule, shared=True)
    else:
        stage_modules = [StageModule(0, model)]
    head = None
    if fused_loss:
        from titan_parallel.linear_cross_entropy import fuse_output_loss

        for _, module in stage_modules:
            head = (
                fuse_output_loss(
                    module,
                    plan,
                    compiled=compiled_loss,
                    backend=options.compile_backend or "inductor",
                    float8=float8_loss,
                    z_loss=z_loss,
                )
                or head
            )
    if options.dp_mode == "ddp":
        # DDP buckets the gradients of real parameters: materialise first, then wrap.
        init_weights([s.module for s in stage_modules], spec, model_args, device, seed)
        stage_modules = [StageModule(i, parallelize(m, plan, mesh, options)) for i, m in stage_modules]
    else:
        stage_modules = [StageModule(i, parallelize(m, plan, mesh, options)) for i, m in stage_modules]
        init_weights([s.module for s in stage_modules], spec, model_args, device, seed)
    parts = [s.module for s in stage_modules]
    copies = None
    if options.master_weights:  # bf16 without FSDP: the optimizer writes the copies (titan_parallel.master_weights)
        from titan_parallel import ComputeCopies

        copies = ComputeCopies(parts, options.param_dtype)
        if precasts_float8_weights(True, converters):
            from titan_parallel.float8_precast import PrecastFloat8Weights

            inductor = options.compile_backend in (None, "inductor")  # its casts are Inductor kernels
            precast = PrecastFloat8Weights(
                parts, copies, compiled=options.compile and inductor and device.type == "cuda"
            )
            logger.info(
                "float8: %d weights cast to float8 once per optimizer step (master weights), not in every "
                "forward, recompute and backward",
                len(precast.linears),
            )
    head_owner = next((p for p in parts if any(m is head for m in p.modules())), None) if head is not None else None
    if dims.pp == 1 or pipeline is None or loss_fn is None:
        return ModelParts(parts, fsdp, head, head_owner, copies=copies)
    shared = None
    if shared_weights:
        from titan_parallel import SharedWeights

        shared = SharedWeights(shared_weights, stage_modules, mesh["pp"], pipeline.schedule, len(names))
        shared.sync_weights()  # CUDA initialises each stage's copy from its own RNG offsets
    pipe = build_pipeline(
        stage_modules,
        pipeline,
        n_stages=len(names),
        pp_mesh=mesh["pp"],
        device=device,
        local_batch_size=local_batch_size,
        loss_fn=loss_fn,
        scale_loss=False,  # the step runner's `StepLoss` normalises, in one place
    )
    return ModelParts(parts, fsdp, head, head_owner, pipe.schedule, pipe.stages, pipe.n_microbatches, copies, shared)


@torch.no_grad()
def init_weights(parts: list[nn.Module], spec: ModelSpec, model_args: Any, device: torch.device, seed: int) -> None:
    """Materialise meta parts with the seeded init, identical for every layout.

    On CUDA each part initialises its own shards (DTensor's RNG slices one global
    stream). Elsewhere each rank initialises a full copy from the seed and keeps
    its shards (`titan_parallel.copy_full_state`), buffers included (the RoPE table):
    the parts' own init would run its random ops on DTensors first, which all-gather.
    """
    for part in parts:
        ties = tied_names(part)
        part.to_empty(device=device)
        retie(part, ties)  # `to_empty` gives each name its own tensor: a tied weight would train as two
        if device.type == "cuda":
            torch.manual_seed(seed)
            part.init_weights(buffer_device=device)  # type: ignore[operator]  # the model's own method
    if device.type == "cuda":
        return
    reference = spec.build(model_args)
    torch.manual_seed(seed)
    reference.init_weights()  # type: ignore[operator]
    full = {**dict(reference.named_buffers()), **reference.state_dict()}  # + the non-persistent buffers
    for part in parts:
        if any(canonical_name(n) not in full for n, _ in part.named_buffers()):  # a buffer the plain model lacks
            with warnings.catch_warnings():  # DTensor warns that CPU random ops are not sharded: overwritten next
                warnings.simplefilter("ignore", UserWarning)
                part.init_weights(buffer_device=device)  # type: ignore[operator]  # the model's own method
        copy_full_state(part, full)


def tied_names(module: nn.Module) -> list[list[str]]:
    """The names of each parameter `module` holds under more than one name (a tied embedding and output)."""
    names: dict[int, list[str]] = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    return [group for group in names.values() if len(group) > 1]


def retie(module: nn.Module, ties: list[list[str]]) -> None:
    """Make each group of `tied_names` one parameter again: the first name's."""
    for first, *others in ties:
        param = module.get_parameter(first)
        for name in others:
            parent, _, leaf = name.rpartition(".")
            setattr(module.get_submodule(parent) if parent else module, leaf, param)
