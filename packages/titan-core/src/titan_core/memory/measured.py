"""The measured tier: the real job on this host's devices at two shallow depths, extrapolated to the full depth.

`estimate_measured` runs the layout for real, as `titan train` would on this host
(the same `Trainer`, one process per rank: torchrun with `--nproc-per-node` when the
world size is above one, gloo on the CPU, NCCL on GPUs), with the model cut to
`MEASURED_BLOCKS` = 2 and then 3 blocks per pipeline stage (the flavor's shape
otherwise), two train steps each, and records each rank's peak
(`titan_core.memory.measure_run`: `torch.cuda.max_memory_allocated` on CUDA, the peak
of live tensor bytes of torch's `MemTracker` on the CPU). A rank's peak grows by the
same bytes with every block it holds (parameters, gradients, optimizer states,
activations and FSDP's buffers all scale per block; the embedding, output, loss
and their optimizer state do not), so the two depths separate a fixed part and a
per-block part, and for a rank holding `B` blocks in the full job:

    peak(B) = peak(b1) + (B - b1) x (peak(b2) - peak(b1)) / (b2 - b1)

with `b1`, `b2` the blocks that rank held in the two runs; each tracker category is
extrapolated the same way, so the components add up to the total. Two and three
blocks, not one and two: with one block per stage FSDP has no next block to
prefetch, and the step peaks at another moment than the full model's (on the CPU
test's FSDP job, one and two blocks extrapolate 2.6% high; two and three exactly).
A model with no more blocks per stage than that is measured whole.

Why measure: the other tiers derive what the device's kernels and allocator do; this
one asks them (what compiled graphs save, fused kernels, cuBLAS's workspaces and
whatever else goes through the caching allocator). It costs two short runs on the
user's devices; a host without the job's devices is refused before anything runs
(`check_measurable`), and a run out of device memory is a `MeasureError`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from titan_core.config.errors import ConfigError
from titan_core.config.schema import JobConfig
from titan_core.job import Job
from titan_core.memory.analytic import compute_dtype_bytes, describe_layout
from titan_core.memory.report import MemoryEstimate, RankMemory, format_bytes
from titan_core.memory.target_job import check_target_job

MEASURED_BLOCKS = (2, 3)
"""Blocks per pipeline stage of the two measured runs."""
AUTO_DTYPES = {2: "bfloat16", 4: "float32"}
"""What `training.mixed_precision_param = 'auto'` resolves to, by its bytes per element."""

Run = tuple[JobConfig, int, int | None]
"""One measured run: the config, the blocks of its cut model, and blocks per pipeline stage (None: the config's
own pipeline cut)."""


class MeasureError(Exception):
    """A measured run failed on the device (e.g. out of memory even at two blocks per stage); one line."""


def host_device(cfg: JobConfig) -> str:
    """The device type `titan train` would use on this host for `cfg`: 'cuda' or 'cpu'.

    Raises:
        ConfigError: `training.device = 'cuda'` on a host without a CUDA GPU.
    """
    import torch

    if cfg.training.device == "cpu":
        return "cpu"
    if torch.cuda.is_available():
        return "cuda"
    if cfg.training.device == "cuda":
        raise ConfigError(
            "--measure runs the job on this host, which has no CUDA GPU but training.device='cuda'; "
            "measure on the CPU with --training.device cpu, or estimate without --measure (--traced)"
        )
    return "cpu"


def blocks_per_pp_rank(job: Job) -> list[int]:
    """The blocks each pipeline rank holds in `job` (one entry without pipeline parallel), multi-token-prediction
    depths included: a measured run counts the entries of its blocks container, depths among them."""
    from titan_parallel.pipeline_layout import stage_indices

    assert job.dims is not None, "a job resolved for a world size has its degrees"
    if job.names_per_stage is None:
        return [job.model_args.n_layers + getattr(job.model_args, "n_mtp_layers", 0)]
    prefix = job.spec.plan.blocks + "."
    per_stage = [sum(name.startswith(prefix) for name in names) for names in job.names_per_stage]
    schedule, pp = job.cfg.parallelism.pipeline_parallel_schedule, job.dims.pp
    return [sum(per_stage[s] for s in stage_indices(r, pp, len(per_stage), schedule)) for r in range(pp)]


def check_measurable(job: Job, world_size: int, device_type: str) -> None:
    """Raise `ConfigError` (one line naming the key or option and the fix) where this host cannot measure `job`."""
    cfg = job.cfg
    if device_type == "cuda":
        import torch

        gpus = torch.cuda.device_count()
        if gpus < world_size:
            raise ConfigError(
                f"--measure runs all {world_size} ranks on this host, which has {gpus} CUDA GPU(s); "
                f"measure a layout of at most {gpus} ranks (--nproc-per-node), or estimate without --measure"
            )
    if cfg.fault_tolerance.enable:
        raise ConfigError(
            "--measure: fault_tolerance.enable makes each run a torchft replica group, which waits for its lighthouse "
            "and peers; measure with --fault_tolerance.enable false, or estimate without --measure (the analytic "
            "tier adds the replica all-reduce's flat copy of the gradients)"
        )
    if cfg.checkpoint.initial_load_in_hf:
        raise ConfigError(
            "--measure: checkpoint.initial_load_in_hf takes the model's shape from the checkpoint, which the "
            "measured runs do not load; set model.flavor to that shape and checkpoint.initial_load_in_hf false"
        )
    dense = getattr(job.model_args, "n_dense_layers", 0)
    if 0 < dense < job.model_args.n_layers:
        raise ConfigError(
            f"--measure cuts the model to a few blocks of one kind, but model.flavor={cfg.model.flavor!r} mixes "
            f"{dense} dense blocks with Mixture-of-Experts blocks; estimate it without --measure"
        )


def measure_runs(runs: list[Run], world_size: int, *, timeout_s: float | None = None) -> list[list[dict[str, Any]]]:
    """Run each of `runs` for real on `world_size` processes of this host, in one launch; each rank's records.

    One process runs alone; more run under torchrun (`--standalone`), as `titan train`
    starts them. Everything the runs write stays in a temporary folder, removed after.

    Args:
        runs: (config, blocks, blocks per pipeline stage or None) of each run, in order.
        world_size: processes.
        timeout_s: wall-clock limit of the launch; None = none.

    Returns:
        Per rank, per run: `titan_core.memory.measure_run.measure_depth`'s record.

    Raises:
        ConfigError: a run's config is refused (one line naming the key).
        MeasureError: a rank ran out of device memory.
        RuntimeError: the launch failed otherwise (the ranks' output is in the message).
    """
    with tempfile.TemporaryDirectory(prefix="titan-measure-") as folder:
        spec = Path(folder) / "runs.json"
        items = []
        for cfg, n_layers, per_stage in runs:
            run_cfg = cfg.model_copy(deep=True)
            run_cfg.job.dump_folder = str(Path(folder) / "run")  # whatever a run writes is removed with the folder
            items.append(
                {"config": run_cfg.model_dump(mode="json"), "n_layers": n_layers, "layers_per_stage": per_stage}
            )
        spec.write_text(json.dumps({"runs": items}))
        worker = ["-m", "titan_core.memory.measure_run", str(spec), folder]
        if world_size > 1:
            torchrun = ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world_size}"]
            worker = [*torchrun, "--module", *worker[1:]]
        env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR")}
        proc = subprocess.run(
            [sys.executable, *worker], capture_output=True, text=True, env=env, timeout=timeout_s, check=False
        )
        outputs = [Path(folder) / f"rank{rank}.json" for rank in range(world_size)]
        results = [json.loads(p.read_text()) if p.is_file() else None for p in outputs]
    errors = [r["error"] for r in results if isinstance(r, dict)]
    if errors:
        line = errors[0].removeprefix("titan: error: ")
        raise (MeasureError if "out of device memory" in line else ConfigError)(line)
    if proc.returncode != 0 or any(r is None for r in results):
        raise RuntimeError(
            f"the measured runs failed (exit {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
        )
    return [r for r in results if isinstance(r, list)]


def extrapolate(first: dict[str, Any], second: dict[str, Any], blocks: int) -> tuple[dict[str, int], int]:
    """One rank's peak categories and parameter-shard bytes at `blocks` blocks, on the line through two runs.

    Args:
        first: the rank's record at the smaller depth (`measure_depth`'s).
        second: its record at the larger depth.
        blocks: blocks the rank holds in the full job.

    Returns:
        Bytes by category (its 'Total' the sum of the others), and the rank's parameter-shard bytes.
    """
    b1, b2 = first["blocks"], second["blocks"]
    if b2 <= b1:
        raise RuntimeError(f"the measured runs held {b1} and {b2} blocks on one rank; the second must be larger")

    def line(v1: int, v2: int) -> int:
        return round(v1 + (blocks - b1) * (v2 - v1) / (b2 - b1))

    categories = {name: line(value, second["categories"][name]) for name, value in first["categories"].items()}
    if "Activation" in categories:  # the tracker's categories: the total is their sum, rounding included
        categories["Total"] = sum(value for name, value in categories.items() if name != "Total")
    return categories, line(first["sharded_params"], second["sharded_params"])


def rank_from_peak(categories: dict[str, int], sharded_params: int) -> RankMemory:
    """A `RankMemory` from a rank's measured (or extrapolated) peak.

    On the CPU the tracker's categories give the components (`titan_core.memory.traced.rank_memory`);
    on CUDA only the peak is measured, with the rank's parameters, buffers and optimizer states
    read off its tensors: the rest of the peak (gradients, activations, FSDP's buffers,
    temporaries, kernel workspaces) is reported under `temporary`.
    """
    from titan_core.memory.traced import rank_memory

    if "Activation" in categories:
        return rank_memory(categories, sharded_params)
    parameters, optimizer, peak = (
        categories["Parameter"] + categories["Buffer"],
        categories["Optstate"],
        categories["Total"],
    )
    return RankMemory(
        parameters=parameters,
        optimizer=optimizer,
        temporary=peak - parameters - optimizer,
        detail={"max_memory_allocated": peak},
    )


def _largest_per_stage(records: list[list[dict[str, Any]]], full: list[int], whole: bool) -> list[RankMemory]:
    """Per pipeline rank, the `RankMemory` of its largest rank at the full depth.

    Extrapolated ranks carry the line in their `detail`: `measured_fixed` + `measured_blocks` x
    `measured_per_block` bytes = the total.

    Args:
        records: per rank, its records of the two measured depths (of the whole model when `whole`).
        full: the blocks each pipeline rank holds in the full job.
        whole: the records are of the whole model: nothing to extrapolate.
    """
    best: dict[int, RankMemory] = {}
    for rank_records in records:
        pp_rank = rank_records[0]["pp_rank"]
        if whole:
            (last,) = rank_records
            memory = rank_from_peak(last["categories"], last["sharded_params"])
        else:
            first, last = rank_records
            memory = rank_from_peak(*extrapolate(first, last, full[pp_rank]))
            per_block = (last["peak"] - first["peak"]) / (last["blocks"] - first["blocks"])
            memory.detail["measured_blocks"] = full[pp_rank]
            memory.detail["measured_per_block"] = round(per_block)
            memory.detail["measured_fixed"] = memory.total - round(full[pp_rank] * per_block)
        memory.stage = pp_rank
        if pp_rank not in best or memory.total > best[pp_rank].total:
            best[pp_rank] = memory
    return [best[r] for r in sorted(best)]


def estimate_measured(
    cfg: JobConfig, world_size: int, *, blocks_per_stage: tuple[int, int] = MEASURED_BLOCKS
) -> MemoryEstimate:
    """Per-rank peak memory of `cfg` on `world_size` ranks, measured on this host at two depths and extrapolated.

    Args:
        cfg: the job config.
        world_size: ranks, all started on this host.
        blocks_per_stage: blocks per pipeline stage of the two measured runs, smaller first.

    Returns:
        A `MemoryEstimate` with tier "measured": one `RankMemory` per pipeline stage, that of the
        stage's largest rank.

    Raises:
        ConfigError: the layout breaks a rule, or this host cannot run it (`check_measurable`).
        MeasureError: a rank ran out of device memory at the measured depth.
    """
    device_type = host_device(cfg)
    job, notes = check_target_job(cfg, world_size, device_type)
    check_measurable(job, world_size, device_type)
    assert job.dims is not None, "a job resolved for a world size has its degrees"
    full = blocks_per_pp_rank(job)
    stages = len(job.names_per_stage) if job.names_per_stage is not None else 1
    whole = max(full) <= blocks_per_stage[1] * (stages // job.dims.pp)
    if whole:
        runs: list[Run] = [(cfg, job.model_args.n_layers, None)]
    else:
        per_stage = [k if job.dims.pp > 1 else None for k in blocks_per_stage]
        runs = [(cfg, k * stages, s) for k, s in zip(blocks_per_stage, per_stage, strict=True)]
    started = time.perf_counter()
    ranks = _largest_per_stage(measure_runs(runs, world_size), full, whole)
    took = time.perf_counter() - started
    device = (
        "CUDA (torch.cuda.max_memory_allocated)" if device_type == "cuda" else "CPU (live tensor bytes, MemTracker)"
    )
    depths = (
        f"the whole model ({job.model_args.n_layers} blocks)"
        if whole
        else (
            f"{blocks_per_stage[0]} and {blocks_per_stage[1]} blocks per stage, extrapolated to "
            + " / ".join(str(b) for b in full)
            + " blocks per rank"
        )
    )
    processes = f"{world_size} process" + ("es" if world_size > 1 else "")
    notes.append(f"measured on this host's {device}: {processes}, {depths}, two steps each, {took:.0f} s")
    for r in ranks if not whole else []:
        d = r.detail
        stage = f"stage {r.stage}: " if len(ranks) > 1 else ""
        notes.append(
            f"{stage}peak = fixed + blocks x per block = {format_bytes(d['measured_fixed'])} + "
            f"{d['measured_blocks']} x {format_bytes(d['measured_per_block'])}"
        )
    if cfg.activation_checkpoint.mode == "selective" and cfg.activation_checkpoint.selective_ac_option != "op":
        notes.append("selective AC every N blocks: the measured depths hold a different share of checkpointed blocks")
    dtype = dtype_note(cfg, device_type)
    if dtype is not None:
        notes.append(dtype)
    layout = describe_layout(job, compute_dtype_bytes(cfg, device_type))
    return MemoryEstimate("measured", world_size, layout, ranks, notes=notes)


def dtype_note(cfg: JobConfig, device_type: str) -> str | None:
    """A note when this host measures in another compute dtype than the other tiers assume, else None.

    Without `training.device = 'cpu'` the analytic and traced tiers estimate for a GPU, where
    `training.mixed_precision_param = 'auto'` computes in bf16; a CPU without native bf16 runs fp32.

    Args:
        cfg: the job config.
        device_type: the device the job was measured on (`host_device`).
    """
    if device_type != "cpu" or cfg.training.device == "cpu":
        return None
    here, target = compute_dtype_bytes(cfg, "cpu"), compute_dtype_bytes(cfg, "cuda")
    if here == target:
        return None
    return (
        f"measured in {AUTO_DTYPES[here]}, which this CPU computes in (training.mixed_precision_param 'auto'); "
        f"a GPU computes in {AUTO_DTYPES[target]}, as the analytic and traced tiers assume: compare with "
        "--training.device cpu (their estimate for this host), or measure bf16 here with "
        "--training.mixed_precision_param bfloat16"
    )
