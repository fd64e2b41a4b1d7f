"""`resolve(cfg, world_size)`: the config, once every rule passed, as one frozen `Job`."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from titan_core.config.schema import JobConfig
from titan_core.job.meta_model import build_meta_model
from titan_core.job.naming import naming
from titan_core.job.options import checkpoint_options, optimizer_options
from titan_core.job.rules import RULES, Draft

if TYPE_CHECKING:
    import torch.nn as nn

    from titan_ckpt import CheckpointOptions
    from titan_core.batch_ramp import BatchRamp
    from titan_core.converters import Converters
    from titan_core.optim import OptimizerOptions
    from titan_models import ModelSpec
    from titan_parallel import ParallelDims, ParallelOptions, PipelineConfig


@dataclass(frozen=True)
class Job:
    """A job every rule passed, in the terms the run is built from: the libraries' own options.

    Args:
        cfg: the job config.
        world_size: number of processes; None when not known yet (an elastic `--nnodes` range).
        device_type: "cuda" or "cpu", as `training.device` resolves here (or the target device of an estimate).
        dims: the parallel degrees (`dp_shard = -1` resolved); None when `world_size` is.
        spec: the model family.
        model_args: the model's shape (flavor, widened to the tokenizer's vocab and `training.seq_len`).
        hf_source: the Hugging Face checkpoint folder the shape came from, if any.
        names_per_stage: module names of each pipeline stage, as `check_pipeline` cut them; None without
            pipeline parallel.
        global_batch: sequences per optimizer step over all ranks; None when `world_size` is.
        accum_steps: micro-batches accumulated per step (after a batch-size ramp-up); None when `world_size` is.
        batch_ramp: the global batch and micro-batches of each step (`training.batch_size_rampup_*`); None when
            `world_size` is.
        tokenizer_vocab_size: the tokenizer's number of tokens.
        vocab_widened_from: the flavor's vocab size when the tokenizer widened it, else None.
        parallel: what `parallelize` applies (`param_dtype` is `training.mixed_precision_param` resolved
            for the device).
        dtype_reason: why `parallel.param_dtype` is what it is, for the log.
        dtype_warning: a warning about that dtype for the run to say once (bf16 without native support),
            else None.
        weights_reason: how the compute dtype is applied when `parallel.master_weights` is set, for the log;
            else "".
        pipeline: how to cut and schedule pipeline stages.
        converters: the float8 / MXFP8 linears `model.converters` asks for.
        optimizer: what `build_optimizer` builds.
        warmup_steps: the LR schedule's warmup (`lr_scheduler.warmup_steps`, or its default fitted to the run).
        warmup_note: why the default warmup was shortened, for the log; else None.
        checkpoint: the `CheckpointManager`'s settings; `folder` is under `job.dump_folder`.
    """

    cfg: JobConfig
    world_size: int | None
    device_type: str
    dims: ParallelDims | None
    spec: ModelSpec
    model_args: Any  # the family's args dataclass (`ModelSpec[ArgsT]`)
    hf_source: str | None
    names_per_stage: list[list[str]] | None
    global_batch: int | None
    accum_steps: int | None
    batch_ramp: BatchRamp | None
    tokenizer_vocab_size: int
    vocab_widened_from: int | None
    parallel: ParallelOptions
    dtype_reason: str
    dtype_warning: str | None
    pipeline: PipelineConfig
    converters: Converters
    optimizer: OptimizerOptions
    checkpoint: CheckpointOptions
    weights_reason: str = ""
    warmup_steps: int = 0
    warmup_note: str | None = None
    _meta: dict[str, nn.Module] = field(default_factory=dict, repr=False, compare=False)

    def meta_model(self) -> nn.Module:
        """The whole model on the meta device (built once, costs no memory), for its structure and shapes."""
        if "model" not in self._meta:
            self._meta["model"] = build_meta_model(self.spec, self.model_args)
        return self._meta["model"]


def resolve(
    cfg: JobConfig, world_size: int | None, *, tokenizer_vocab_size: int = 0, target_device: str | None = None
) -> Job:
    """Run every rule of `RULES` once on `cfg`; raise `ConfigError` (one line naming the keys) at the first
    broken one, else return the job the run is built from.

    Args:
        cfg: the job config.
        world_size: the number of processes; None skips the rules that need it (an elastic range).
        tokenizer_vocab_size: the tokenizer's size when the caller has built it already (0: build it).
        target_device: check the job for this device type ("cuda" / "cpu") instead of this host's.
    """
    d = Draft(cfg, world_size, target_device, tokenizer_vocab_size)
    for rule in RULES:
        with naming(rule.keys):
            rule.check(d)
    return Job(
        cfg=cfg,
        world_size=world_size,
        device_type=d.device_type,
        dims=d.dims,
        spec=d.spec,
        model_args=d.model_args,
        hf_source=d.hf_source,
        names_per_stage=d.names_per_stage,
        global_batch=d.global_batch,
        accum_steps=d.accum_steps,
        batch_ramp=d.batch_ramp,
        tokenizer_vocab_size=d.tokenizer_vocab_size,
        vocab_widened_from=d.vocab_widened_from,
        parallel=d.parallel,
        dtype_reason=d.dtype_reason,
        dtype_warning=d.dtype_warning,
        pipeline=d.pipeline,
        converters=d.converters,
        optimizer=optimizer_options(cfg, d.model_args),
        checkpoint=checkpoint_options(cfg.checkpoint, Path(cfg.job.dump_folder)),
        weights_reason=d.weights_reason,
        warmup_steps=d.warmup_steps,
        warmup_note=d.warmup_note,
        _meta={} if d.meta is None else {"model": d.meta},
    )
