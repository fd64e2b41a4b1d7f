"""The traced tier: the real `Trainer` and train step on fake tensors, measured by torch's memory tracker.

One CPU process stands in for rank 0 (every rank holds the same without pipeline
parallel, which it does not trace). It starts a fake
process group of `world_size` ranks (collectives return at once, moving
nothing), builds the real `Trainer` with the mesh made outside and everything
else inside `FakeTensorMode` (tensors with shapes, dtypes and storages but no
memory), and runs two train steps, the second (with the optimizer state the first
made) under `torch.distributed._tools.mem_tracker.MemTracker`, which counts each live
tensor storage once, by category. The peak it saw is the estimate.

Where torch cannot run a layout on fake tensors in one process, `TraceUnsupported`
says which feature, and `titan_core.memory.estimate_memory` uses the analytic tier.
The kernels traced are the CPU ones, even for a CUDA job: CUDA kernels' workspaces
and NCCL's buffers are not seen. Why not a `torch.cuda.memory` snapshot: it needs
the GPUs; this runs on any host, in seconds for an 8B model.
"""

from __future__ import annotations

import warnings

import torch

from titan_core.config.schema import JobConfig
from titan_core.memory.analytic import compute_dtype_bytes, describe_layout
from titan_core.memory.report import MemoryEstimate, RankMemory
from titan_core.memory.target_job import check_target_job, target_device
from titan_core.memory.torch_patches import (
    allow_repeated_forwards,
    building,
    own_propagation_mode,
    peak_tracker,
    quiet_torch_logs,
)


class TraceUnsupported(Exception):
    """The layout uses a feature torch cannot trace on fake tensors in one process; the analytic tier is used
    instead."""


def untraceable_feature(cfg: JobConfig) -> str | None:
    """The first feature of `cfg` the traced tier cannot run, as a sentence naming its config key; None if all can.

    Args:
        cfg: the job config.
    """
    p, t = cfg.parallelism, cfg.training
    if cfg.compile.enable:
        return (
            "compile (compile.enable): the trace runs the eager step, which saves more than the compiled graph "
            "(+29% on the 1B compile, H100); the analytic tier measures the compiled blocks and loss instead"
        )
    if cfg.fault_tolerance.enable:
        return (
            "torchft replica groups (fault_tolerance.enable): a replica group waits for its lighthouse and peers; "
            "the analytic tier counts the replica all-reduce's flat copy of the gradients"
        )
    if p.pipeline_parallel_degree > 1:
        return (
            "pipeline parallel (parallelism.pipeline_parallel_degree > 1): torch's pipeline schedules learn each "
            "stage's shapes by exchanging them with the peer stages, which a fake process group cannot"
        )
    if t.enable_cpu_offload:
        return (
            "CPU offload (training.enable_cpu_offload): the tracker cannot tell host from device memory on a CPU trace"
        )
    if cfg.model.converters:
        return f"model.converters = {list(cfg.model.converters)}: float8 / MXFP8 kernels need a GPU"
    if p.enable_async_tensor_parallel:
        return (
            "async tensor parallel (parallelism.enable_async_tensor_parallel): its symmetric-memory kernels need a GPU"
        )
    if p.dp_mode == "ddp" and p.data_parallel_replicate_degree > 1:
        return "DDP (parallelism.dp_mode = 'ddp'): its reducer buckets need real gradients"
    if cfg.checkpoint.initial_load_in_hf:
        return (
            "checkpoint.initial_load_in_hf: the model's shape comes from the checkpoint, which the trace does not load"
        )
    from titan_models import get_model_spec

    if get_model_spec(cfg.model.name).plan.moe is not None:
        return (
            f"Mixture-of-Experts routing (model.name = '{cfg.model.name}'): how many tokens reach each expert "
            "depends on the values, which fake tensors do not have"
        )
    return None


def drop_side_outputs(out: JobConfig) -> None:
    """In place: what a memory measurement of `out` must not read or write. The built-in corpus for the data,
    the byte tokenizer where the tokenizer file is not on this host (the flavor's vocab is kept, as
    `check_target_job` assumed); no checkpoints, profiles, metrics sinks or validation.

    Args:
        out: a copy of the job config, changed in place.
    """
    from pathlib import Path

    out.training.dataset, out.training.dataset_path = "stdlib", None
    assets = out.model.hf_assets_path
    if assets is not None and not Path(assets).expanduser().exists():
        out.model.hf_assets_path = None
    out.checkpoint.enable = False
    out.checkpoint.initial_load_path = None
    out.checkpoint.last_save_in_hf = False
    out.checkpoint.create_seed_checkpoint = False
    out.profiling.enable_profiling = False
    out.profiling.enable_memory_snapshot = False
    out.metrics.enable_tensorboard = False
    out.metrics.enable_wandb = False
    out.validation.enable = False


def trace_config(cfg: JobConfig, device_type: str) -> JobConfig:
    """`cfg` as the trace runs it: on the CPU, eager, on the offline corpus, without checkpoints or logs.

    None of the changes moves device memory of the train step: the data source, the
    tokenizer file when it is not on this host (the flavor's vocab is kept), checkpoints,
    metrics and profiling live outside it. Compile is dropped (eager is traced); a
    compute dtype of 'auto' becomes the one the target device resolves it to.

    Args:
        cfg: the job config.
        device_type: the target device, "cuda" or "cpu".
    """
    out = cfg.model_copy(deep=True)
    t = out.training
    t.device = "cpu"
    if t.mixed_precision_param == "auto":
        t.mixed_precision_param = "bfloat16" if compute_dtype_bytes(cfg, device_type) == 2 else "float32"
    drop_side_outputs(out)
    out.compile.enable = False
    out.debug.deterministic = False
    if out.debug.seed is None:
        out.debug.seed = 0
    return out


def estimate_traced(cfg: JobConfig, world_size: int, *, device_type: str | None = None) -> MemoryEstimate:
    """Per-rank peak memory of `cfg` on `world_size` ranks, from a traced train step of rank 0.

    Without pipeline parallel (`untraceable_feature`) every rank holds the same: rank 0 stands for all.

    Args:
        cfg: the job config.
        world_size: number of ranks (`--nproc-per-node` x `--nnodes`).
        device_type: the target device; None = 'cpu' when `training.device` says so, else 'cuda'.

    Returns:
        A `MemoryEstimate` with tier "traced": one `RankMemory`, whose total is the tracker's
        peak; the tracker's own categories are in its `detail`.

    Raises:
        ConfigError: the layout breaks a rule of `titan_core.job_check`.
        TraceUnsupported: the layout uses a feature the trace cannot run (`untraceable_feature`).
        RuntimeError: this process already has a process group (run the estimate in its own process).
    """
    import torch.distributed as dist

    device_type = device_type or target_device(cfg)
    job, notes = check_target_job(cfg, world_size, device_type)
    feature = untraceable_feature(cfg)
    if feature is None and cfg.optimizer.name == "Muon" and world_size > 1:
        feature = (
            "Muon on several ranks (optimizer.name = 'Muon'): each matrix's owner is planned from the pieces "
            "the ranks report, which a fake process group does not deliver"
        )
    if feature is not None:
        raise TraceUnsupported(feature)
    if dist.is_initialized():
        raise RuntimeError(
            "estimate_traced starts its own fake process group, but this process already has one; "
            "call it from a process without torch.distributed (e.g. `titan estimate-memory --traced`)"
        )
    peaks, sharded = trace_rank(trace_config(cfg, device_type), world_size, 0, job.model_args)
    if device_type == "cuda":
        notes.append(
            "traced with CPU kernels on fake tensors: CUDA kernels' workspaces (cuBLAS, attention) and NCCL buffers "
            "are not counted; the budget's headroom covers them and the allocator's rounding"
        )
    layout = describe_layout(job, compute_dtype_bytes(cfg, device_type))
    return MemoryEstimate("traced", world_size, layout, [rank_memory(peaks, sharded)], notes=notes)


def trace_rank(cfg: JobConfig, world_size: int, rank: int, model_args=None) -> tuple[dict[str, int], int]:
    """Build the `Trainer` of `rank` on fake tensors, run one train step, and trace the second.

    Args:
        cfg: the config to run (`trace_config`'s).
        world_size: ranks of the fake process group.
        rank: the rank this process plays.
        model_args: the checked job's model shape; the trainer's must match it.

    Returns:
        The tracker's peak bytes by category (its names: 'Parameter', 'Buffer', 'Gradient',
        'Activation', 'Temp', 'Optstate', 'Other', 'Total'), and the bytes of the rank's own
        (sharded) parameters.
    """
    from torch._subclasses.fake_tensor import FakeTensorMode

    from titan_core.memory.fake_run import fake_process_group
    from titan_core.trainer import Trainer

    rng = torch.random.get_rng_state()
    try:
        with fake_process_group(rank, world_size), warnings.catch_warnings(), quiet_torch_logs():
            warnings.simplefilter("ignore")
            mode = FakeTensorMode(allow_non_fake_inputs=True)
            with building(mode):  # the whole trainer on fake tensors, but its device meshes
                trainer = Trainer(cfg, host_memory_check=False)  # nothing real is allocated
            if model_args is not None and trainer.model_args != model_args:
                raise RuntimeError(
                    f"the traced model's shape {trainer.model_args} differs from the checked job's {model_args}; "
                    "report this as a bug of titan_core.memory.traced"
                )
            t = cfg.training
            with mode, own_propagation_mode():
                batches = [
                    (torch.zeros(t.local_batch_size, t.seq_len, dtype=torch.long),) * 2  # (bs, seqlen) inputs, labels
                    for _ in range(trainer.accum_steps)
                ]
                # The first step allocates the optimizer state; its peak is below the second's, which runs with
                # that state: only the second is tracked (the tracker's bookkeeping is most of the cost).
                trainer.train_step(batches)
                tracker = peak_tracker()
                allow_repeated_forwards(tracker, trainer.model.parts)
                tracker.track_external(*trainer.model.parts, *trainer.optimizers)
                with tracker:
                    trainer.train_step(batches)
                peak = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]
            sharded = _storage_bytes(p for part in trainer.model.parts for p in part.parameters())
            return {str(getattr(k, "value", k)): int(v) for k, v in peak.items()}, sharded
    finally:
        torch.random.set_rng_state(rng)


def rank_memory(peaks: dict[str, int], sharded_params: int) -> RankMemory:
    """A `RankMemory` from the tracker's peak categories; its total is the tracker's 'Total'.

    The tracker counts FSDP's all-gathered (unsharded) parameters as parameters: what
    exceeds the rank's own shards is reported as communication.

    Args:
        peaks: the tracker's peak bytes by category (`trace_rank`).
        sharded_params: bytes of the rank's own parameter shards.
    """
    gathered = max(0, peaks["Parameter"] - sharded_params)
    memory = RankMemory(
        parameters=peaks["Parameter"] - gathered + peaks["Buffer"],
        gradients=peaks["Gradient"],
        optimizer=peaks["Optstate"],
        activations=peaks["Activation"],
        communication=gathered,
        temporary=peaks["Temp"] + peaks.get("Other", 0),
        detail={f"tracker_{name.lower()}": value for name, value in peaks.items()},
    )
    if memory.total != peaks["Total"]:
        raise RuntimeError(f"the traced components sum to {memory.total}, not the tracker's peak {peaks['Total']}")
    return memory


def _storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind `tensors` (a DTensor's local shard)."""
    from torch.distributed.tensor import DTensor

    seen: dict[int, int] = {}
    for tensor in tensors:
        local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
        storage = local.untyped_storage()
        seen[storage._cdata] = storage.nbytes()
    return sum(seen.values())
