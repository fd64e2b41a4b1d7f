"""How much device memory each rank of a job needs, before launching it: `titan estimate-memory`.

Three tiers return the same `MemoryEstimate`: `analytic` (arithmetic on per-block figures measured on
fake tensors; quick, any size),
`traced` (the real model and train step under FakeTensorMode with a fake
process group, measured by torch's memory tracker) and `measured` (the real job on
this host's devices at two shallow depths, extrapolated to the full depth). `estimate_memory` picks one,
falls back from traced to analytic where torch cannot trace a layout, and judges
the result against a budget. The formulas and their measured accuracy are in
`docs/memory.md`.
"""

from __future__ import annotations

from titan_core.config.errors import ConfigError
from titan_core.config.schema import JobConfig
from titan_core.memory.report import COMPONENTS, MemoryEstimate, RankMemory, format_bytes, render_text

__all__ = ["COMPONENTS", "MemoryEstimate", "RankMemory", "estimate_memory", "format_bytes", "render_text"]


def estimate_memory(
    cfg: JobConfig,
    world_size: int,
    *,
    gpu_memory: str | None = None,
    traced: bool = False,
    measure: bool = False,
    device_type: str | None = None,
) -> MemoryEstimate:
    """Per-rank peak memory of `cfg` on `world_size` ranks, with a verdict when `gpu_memory` is given.

    Args:
        cfg: the job config.
        world_size: number of ranks (`--nproc-per-node` x `--nnodes`).
        gpu_memory: device memory per rank: a size ("80GiB") or a GPU name ("H100"); None = no verdict.
        traced: trace the real train step (falls back to the analytic tier, with a note, where torch cannot).
        measure: run the job on this host's devices at two shallow depths and extrapolate
            (`titan_core.memory.measured`); the device is this host's, as `titan train` picks it.
        device_type: the target device; None = 'cpu' when `training.device` says so, else 'cuda'.

    Raises:
        ConfigError: the layout breaks a rule; one line naming the key.
        ValueError: `gpu_memory` is neither a size nor a known GPU.
        MeasureError: with `measure`, a measured run ran out of device memory.
    """
    from titan_core.memory.analytic import estimate_analytic
    from titan_core.memory.target_job import check_target_job, target_device

    if traced and measure:
        raise ConfigError("--traced and --measure are two tiers of the estimate; give one of them")
    if measure:
        from titan_core.memory.measured import host_device

        device_type = host_device(cfg)
    device_type = device_type or target_device(cfg)
    budget = None
    if gpu_memory is not None:
        from titan_core.memory.budget import parse_gpu_memory, usable_bytes

        device_bytes, _ = parse_gpu_memory(gpu_memory)
        budget = usable_bytes(device_bytes, device_type)
    estimate = None
    if measure:
        from titan_core.memory.measured import estimate_measured

        estimate = estimate_measured(cfg, world_size)
    if traced:
        from titan_core.memory.traced import TraceUnsupported, estimate_traced

        try:
            estimate = estimate_traced(cfg, world_size, device_type=device_type)
        except TraceUnsupported as e:
            estimate = estimate_analytic(cfg, world_size, device_type=device_type)
            estimate.notes.insert(0, f"not traced: {e}; this is the analytic estimate")
    if estimate is None:
        estimate = estimate_analytic(cfg, world_size, device_type=device_type)
    if budget is not None:
        from titan_core.memory.advise import judge

        job, _ = check_target_job(cfg, world_size, device_type)
        assert job.global_batch is not None, "a job resolved for a world size has its global batch"
        judge(estimate, cfg, budget, device_bytes, job.global_batch, device_type)
    return estimate
