"""The config as the libraries' own typed options, each built in one place, beside the keys it reads.

Each builder turns config keys into one library's options (`ParallelDims`,
`ParallelOptions`, `PipelineConfig`, `OptimizerOptions`, `CheckpointOptions`);
each `*_KEYS` table says, for every field of that options class, the config key
it comes from. A library error names the fields at fault (its `arguments`), so
the tables are how an error finds the key a user changes (`titan_core.job.naming`).
The float8 / MXFP8 options are built in `titan_core.converters`, with their tables.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, cast

from titan_core.config.schema import Checkpoint, JobConfig

if TYPE_CHECKING:
    import torch

    from titan_ckpt import CheckpointOptions
    from titan_core.optim import OptimizerOptions
    from titan_parallel import ParallelDims, ParallelOptions, PipelineConfig

DEVICE_KEY = "training.device"
"""The key of the device: `resolve_device(device)` and every rule's `device_type`."""

DIMS_KEYS: dict[str, str] = {
    "dp_replicate": "parallelism.data_parallel_replicate_degree",
    "dp_shard": "parallelism.data_parallel_shard_degree",
    "cp": "parallelism.context_parallel_degree",
    "tp": "parallelism.tensor_parallel_degree",
    "pp": "parallelism.pipeline_parallel_degree",
    "ep": "parallelism.expert_parallel_degree",
    "etp": "parallelism.expert_tensor_parallel_degree",
    "world_size": "--nproc-per-node x --nnodes",  # the launch, not a config key
}
"""`ParallelDims` field -> config key."""


def parallel_dims(cfg: JobConfig, world_size: int) -> ParallelDims:
    """The `parallelism.*_degree` keys on `world_size` ranks (`dp_shard = -1` resolved); raises if they do not fit."""
    from titan_parallel import ParallelDims

    p = cfg.parallelism
    return ParallelDims(
        dp_replicate=p.data_parallel_replicate_degree,
        dp_shard=p.data_parallel_shard_degree,
        cp=p.context_parallel_degree,
        tp=p.tensor_parallel_degree,
        pp=p.pipeline_parallel_degree,
        world_size=world_size,
        ep=p.expert_parallel_degree,
        etp=p.expert_tensor_parallel_degree,
    )


PARALLEL_OPTION_KEYS: dict[str, str] = {
    "param_dtype": "training.mixed_precision_param",
    "reduce_dtype": "training.mixed_precision_reduce",
    "reshard_after_forward": "parallelism.fsdp_reshard_after_forward",
    "cpu_offload": "training.enable_cpu_offload",
    "dp_mode": "parallelism.dp_mode",
    "loss_parallel": "parallelism.disable_loss_parallel",
    "async_tp": "parallelism.enable_async_tensor_parallel",
    "cp_rotate_method": "parallelism.context_parallel_rotate_method",
    "cp_method": "parallelism.context_parallel_method",
    "ac_mode": "activation_checkpoint.mode",
    "ac_selective_option": "activation_checkpoint.selective_ac_option",
    "ac_memory_budget": "activation_checkpoint.memory_budget",
    "compile": "compile.enable",
    "compile_backend": "compile.backend",
    "pipeline_parallel": "parallelism.pipeline_parallel_degree",
    "master_weights": "optimizer.master_weights",
}
"""`ParallelOptions` field -> config key."""


def parallel_options(cfg: JobConfig, param_dtype: torch.dtype) -> ParallelOptions:
    """What `parallelize` applies to each model part.

    Args:
        cfg: the job config.
        param_dtype: the compute dtype `training.mixed_precision_param` resolved to on the run's device.
    """
    from titan_ckpt.dtypes import parse_dtype
    from titan_parallel import ParallelOptions

    t, p, ac = cfg.training, cfg.parallelism, cfg.activation_checkpoint
    # Four names are free strings in the config: the rules check them (`check_data_parallel`,
    # `check_rotate_method`, `check_cp_method`, `check_ac`) before any `Job` holds these options.
    return ParallelOptions(
        param_dtype=param_dtype,
        reduce_dtype=parse_dtype(t.mixed_precision_reduce),
        reshard_after_forward=p.fsdp_reshard_after_forward,
        cpu_offload=t.enable_cpu_offload,
        dp_mode=cast(Literal["fsdp", "ddp"], p.dp_mode),
        loss_parallel=not p.disable_loss_parallel,
        async_tp=p.enable_async_tensor_parallel,
        cp_rotate_method=cast(Literal["allgather", "rotate"], p.context_parallel_rotate_method),
        cp_method=cast(Literal["ring", "ulysses"], p.context_parallel_method),
        ac_mode=cast(Literal["none", "selective", "full", "memory_budget"], ac.mode),
        ac_selective_option=ac.selective_ac_option,
        ac_memory_budget=ac.memory_budget,
        compile=cfg.compile.enable and "model" in cfg.compile.components,
        compile_backend=None if cfg.compile.backend == "auto" else cfg.compile.backend,
        pipeline_parallel=p.pipeline_parallel_degree > 1,
    )


PIPELINE_KEYS: dict[str, str] = {
    "schedule": "parallelism.pipeline_parallel_schedule",
    "microbatch_size": "parallelism.pipeline_parallel_microbatch_size",
    "layers_per_stage": "parallelism.pipeline_parallel_layers_per_stage",
    "first_stage_less_layers": "parallelism.pipeline_parallel_first_stage_less_layers",
    "last_stage_less_layers": "parallelism.pipeline_parallel_last_stage_less_layers",
    "module_names_per_stage": "parallelism.module_fqns_per_model_part",
    "schedule_csv": "parallelism.pipeline_parallel_schedule_csv",
}
"""`PipelineConfig` field -> config key."""


def pipeline_config(cfg: JobConfig) -> PipelineConfig:
    """The `parallelism.pipeline_*` keys: how to cut the model into stages and schedule them."""
    from titan_parallel import PipelineConfig

    p = cfg.parallelism
    return PipelineConfig(
        schedule=p.pipeline_parallel_schedule,
        microbatch_size=p.pipeline_parallel_microbatch_size,
        layers_per_stage=p.pipeline_parallel_layers_per_stage,
        first_stage_less_layers=p.pipeline_parallel_first_stage_less_layers,
        last_stage_less_layers=p.pipeline_parallel_last_stage_less_layers,
        module_names_per_stage=p.module_fqns_per_model_part,
        schedule_csv=p.pipeline_parallel_schedule_csv,
    )


def optimizer_options(cfg: JobConfig, model_args: Any = None) -> OptimizerOptions:
    """The `optimizer.*` keys, for `build_optimizer` (its errors name the keys themselves), with muP's learning-rate
    scale for the blocks' matrices when `model_args` has muP on."""
    from titan_core.optim import MuonOptions, OptimizerOptions

    o = cfg.optimizer
    mup = getattr(model_args, "mup", None)
    return OptimizerOptions(
        lr=o.lr,
        name=o.name,
        betas=(o.beta1, o.beta2),
        eps=o.eps,
        weight_decay=o.weight_decay,
        implementation=o.implementation,
        muon=MuonOptions(
            momentum=o.muon_momentum,
            nesterov=o.muon_nesterov,
            ns_steps=o.muon_ns_steps,
            adjust_lr_fn=o.muon_adjust_lr_fn,
            ns_dtype=o.muon_ns_dtype,
            adamw_lr=o.adamw_lr,
            adamw_weight_decay=o.adamw_weight_decay,
        ),
        weight_decay_exclude=tuple(o.weight_decay_exclude),
        hidden_lr_scale=1.0 / mup.width_multiplier(model_args.dim) if mup is not None else 1.0,
    )


CHECKPOINT_KEYS: dict[str, str] = {
    "folder": "checkpoint.folder",
    "enable": "checkpoint.enable",
    "interval": "checkpoint.interval",
    "save_first_step": "checkpoint.enable_first_step_checkpoint",
    "load_only": "checkpoint.load_only",
    "keep_latest_k": "checkpoint.keep_latest_k",
    "keep_interval": "checkpoint.keep_interval",
    "async_mode": "checkpoint.async_mode",
    "last_save_model_only": "checkpoint.last_save_model_only",
    "export_dtype": "checkpoint.export_dtype",
    "load_step": "checkpoint.load_step",
    "exclude_from_loading": "checkpoint.exclude_from_loading",
    "initial_load_path": "checkpoint.initial_load_path",
    "initial_load_model_only": "checkpoint.initial_load_model_only",
    # `CheckpointManager`'s other arguments that a key decides
    "load_model_fn": "checkpoint.initial_load_in_hf",
    "save_model_fn": "checkpoint.last_save_in_hf",
    "model_parts": "model.flavor",
}
"""`CheckpointOptions` field (and `CheckpointManager` argument) -> config key."""


def checkpoint_options(ckpt: Checkpoint, run_folder: Path) -> CheckpointOptions:
    """The `checkpoint` section, for `CheckpointManager(options=...)`.

    Args:
        ckpt: the `checkpoint` section.
        run_folder: `job.dump_folder`; the checkpoints go to `run_folder / ckpt.folder`.
    """
    from titan_ckpt import CheckpointOptions
    from titan_ckpt.dtypes import parse_dtype

    return CheckpointOptions(
        folder=Path(run_folder) / ckpt.folder,
        enable=ckpt.enable,
        interval=ckpt.interval,
        save_first_step=ckpt.enable_first_step_checkpoint,
        load_only=ckpt.load_only,
        keep_latest_k=ckpt.keep_latest_k,
        keep_interval=ckpt.keep_interval,
        async_mode=ckpt.async_mode,
        last_save_model_only=ckpt.last_save_model_only,
        export_dtype=parse_dtype(ckpt.export_dtype),
        load_step=ckpt.load_step,
        exclude_from_loading=tuple(ckpt.exclude_from_loading),
        initial_load_path=ckpt.initial_load_path,
        initial_load_model_only=ckpt.initial_load_model_only,
    )
