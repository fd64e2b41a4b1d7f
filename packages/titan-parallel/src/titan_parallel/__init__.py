"""Composable parallelism for any PyTorch model: FSDP2/HSDP, tensor, sequence, loss, pipeline and context parallel.

A model states how it may be split as a `ModelPlan` (a table); the functions
here read it. The order, for a model (or each pipeline stage) on the meta device:

    dims = ParallelDims(dp_shard=-1, tp=2, world_size=world)    # checks the degrees
    mesh = dims.build_mesh(device.type)                         # after init_distributed
    parallelize(model, plan, mesh, ParallelOptions(...))        # TP -> CP -> AC -> compile -> FSDP
    model.to_empty(device=device); copy_full_state(model, full) # or init_weights

Every rule of a valid layout is a function a launcher can call before any
process starts (`check_*`, `ParallelDims`); each raises `ParallelConfigError`,
whose `arguments` name the parameters at fault. Names load lazily: importing
`ParallelDims` or `titan_parallel.layout` does not import torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

__all__ = [
    # degrees, mesh and the rules of a valid layout
    "ParallelConfigError",
    "ParallelDims",
    "ParallelMesh",
    "check_ac",
    "check_async_tp",
    "check_compile_backend",
    "check_cp",
    "check_cp_method",
    "check_data_parallel",
    "check_rotate_method",
    "check_tp",
    # the model's plan
    "ModelPlan",
    "TPStyle",
    # applying parallelism, in order: TP -> CP -> AC -> compile -> FSDP/DDP
    "ParallelOptions",
    "check_options",
    "parallelize",
    "uses_fsdp",
    "apply_tp",
    "apply_cp",
    "apply_ac",
    "apply_compile",
    "apply_fsdp",
    "apply_ddp",
    "set_gradient_sync",
    # float8 / MXFP8 linears (torchao, optional), before all of the above
    "Float8Options",
    "MXOptions",
    "apply_float8",
    "apply_mx",
    "check_float8",
    "check_mx",
    # pipeline parallel, outermost
    "SCHEDULE_NAMES",
    "Pipeline",
    "PipelineConfig",
    "StageModule",
    "build_pipeline",
    "check_pipeline",
    "pipeline_step",
    "split_model",
    "SharedWeights",
    "find_shared_weights",
    # context parallel: the batch's sequence shards
    "shard_sequence",
    "unshard_sequence",
    # precision, gradients, materialisation
    "mixed_precision_context",
    "native_bf16",
    "resolve_param_dtype",
    "ComputeCopies",
    "MasterAdam",
    "MasterAdamW",
    "master_weights_blockers",
    "clip_grad_norm_",
    "clip_divisor",
    "grad_norm",
    "grouped_norms",
    "canonical_name",
    "copy_full_state",
    # processes and devices
    "init_distributed",
    "resolve_device",
    "shutdown_distributed",
    # hangs become errors: timeouts, the stuck rank's name, the flight recorder
    "CollectiveError",
    "CommWatch",
    "set_collective_timeout",
]

_MODULES: dict[str, tuple[str, ...]] = {
    "layout": (
        "ParallelConfigError",
        "ParallelDims",
        "check_ac",
        "check_async_tp",
        "check_compile_backend",
        "check_cp",
        "check_cp_method",
        "check_data_parallel",
        "check_rotate_method",
    ),
    "mesh": ("ParallelMesh",),
    "plan": ("ModelPlan", "TPStyle"),
    "parallelize_model": ("ParallelOptions", "check_options", "parallelize", "uses_fsdp"),
    "tensor_parallel": ("apply_tp",),
    "tensor_parallel_layout": ("check_tp",),
    "context_parallel": ("apply_cp", "shard_sequence", "unshard_sequence"),
    "activation_checkpoint": ("apply_ac",),
    "compile": ("apply_compile",),
    "fsdp": ("apply_fsdp", "apply_ddp", "set_gradient_sync"),
    "float8": ("Float8Options", "MXOptions", "apply_float8", "apply_mx", "check_float8", "check_mx"),
    "pipeline_layout": ("SCHEDULE_NAMES",),
    "pipeline_shared": ("SharedWeights", "find_shared_weights"),
    "pipeline": (
        "Pipeline",
        "PipelineConfig",
        "StageModule",
        "build_pipeline",
        "check_pipeline",
        "pipeline_step",
        "split_model",
    ),
    "precision": ("mixed_precision_context", "native_bf16", "resolve_param_dtype"),
    "master_weights": ("ComputeCopies", "MasterAdam", "MasterAdamW", "master_weights_blockers"),
    "grad_clip": ("clip_divisor", "clip_grad_norm_", "grad_norm", "grouped_norms"),
    "materialize": ("canonical_name", "copy_full_state"),
    "distributed": ("init_distributed", "resolve_device", "shutdown_distributed"),
    "comm_watch": ("CollectiveError", "CommWatch", "set_collective_timeout"),
}
"""The module each public name lives in, imported on first use."""

_EXPORTS = {name: module for module, names in _MODULES.items() for name in names}


def __getattr__(name: str) -> object:
    """Import a public name's module on first use (module-level `__getattr__`, PEP 562)."""
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'titan_parallel' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"titan_parallel.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})


if TYPE_CHECKING:  # for type checkers and IDEs; at run time names load lazily above
    from titan_parallel.activation_checkpoint import apply_ac
    from titan_parallel.comm_watch import CollectiveError, CommWatch, set_collective_timeout
    from titan_parallel.compile import apply_compile
    from titan_parallel.context_parallel import apply_cp, shard_sequence, unshard_sequence
    from titan_parallel.distributed import init_distributed, resolve_device, shutdown_distributed
    from titan_parallel.float8 import Float8Options, MXOptions, apply_float8, apply_mx, check_float8, check_mx
    from titan_parallel.fsdp import apply_ddp, apply_fsdp, set_gradient_sync
    from titan_parallel.grad_clip import clip_divisor, clip_grad_norm_, grad_norm, grouped_norms
    from titan_parallel.layout import (
        ParallelConfigError,
        ParallelDims,
        check_ac,
        check_async_tp,
        check_compile_backend,
        check_cp,
        check_cp_method,
        check_data_parallel,
        check_rotate_method,
    )
    from titan_parallel.master_weights import ComputeCopies, MasterAdam, MasterAdamW, master_weights_blockers
    from titan_parallel.materialize import canonical_name, copy_full_state
    from titan_parallel.mesh import ParallelMesh
    from titan_parallel.parallelize_model import ParallelOptions, check_options, parallelize, uses_fsdp
    from titan_parallel.pipeline import (
        Pipeline,
        PipelineConfig,
        StageModule,
        build_pipeline,
        check_pipeline,
        pipeline_step,
        split_model,
    )
    from titan_parallel.pipeline_layout import SCHEDULE_NAMES
    from titan_parallel.pipeline_shared import SharedWeights, find_shared_weights
    from titan_parallel.plan import ModelPlan, TPStyle
    from titan_parallel.precision import mixed_precision_context, native_bf16, resolve_param_dtype
    from titan_parallel.tensor_parallel import apply_tp, check_tp
