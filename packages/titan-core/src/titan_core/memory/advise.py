"""The verdict and the cheapest fix: what to change when a layout does not fit.

`CHANGES` lists single changes from the cheapest in step time to the dearest: keep
gathered weights less, let compiled blocks recompute their cheapest quarter or half
(a memory budget of 0.75 or 0.5: the partitioner picks the least recompute for the
bytes), recompute the cheap half of each block (selective "op"), smaller micro-batches
(same global batch), a memory budget of 0.25, recompute everything, CPU offload, then
more model parallelism. The first whose analytic estimate fits is the one
`titan estimate-memory` suggests.
"""

from __future__ import annotations

from collections.abc import Callable

from titan_core.config.errors import ConfigError
from titan_core.config.schema import JobConfig
from titan_core.memory.report import MemoryEstimate, format_bytes

Change = Callable[[JobConfig, int], "tuple[str, dict[str, object]] | None"]
"""`(cfg, global batch) -> (the change as flags, {key: value})`, or None where it does not apply."""


def _reshard(cfg: JobConfig, global_batch: int):
    if cfg.parallelism.fsdp_reshard_after_forward == "never":
        return "--parallelism.fsdp_reshard_after_forward always", {"parallelism.fsdp_reshard_after_forward": "always"}
    return None


def _selective_op(cfg: JobConfig, global_batch: int):
    if cfg.activation_checkpoint.mode == "none":
        return (
            "--activation_checkpoint.mode selective --activation_checkpoint.selective_ac_option op",
            {"activation_checkpoint.mode": "selective", "activation_checkpoint.selective_ac_option": "op"},
        )
    return None


def _memory_budget(share: float) -> Change:
    def change(cfg: JobConfig, global_batch: int):
        ac = cfg.activation_checkpoint
        compiled_blocks = cfg.compile.enable and "model" in cfg.compile.components
        now = ac.memory_budget if ac.mode == "memory_budget" else 1.0
        if not compiled_blocks or ac.mode not in ("none", "memory_budget") or share >= now:
            return None
        return (
            f"--activation_checkpoint.mode memory_budget --activation_checkpoint.memory_budget {share:g} "
            "(the compiled blocks recompute the rest)",
            {"activation_checkpoint.mode": "memory_budget", "activation_checkpoint.memory_budget": share},
        )

    return change


def _full_ac(cfg: JobConfig, global_batch: int):
    if cfg.activation_checkpoint.mode != "full":
        return "--activation_checkpoint.mode full", {"activation_checkpoint.mode": "full"}
    return None


def _smaller_batch(divisor: int):
    def change(cfg: JobConfig, global_batch: int):
        t = cfg.training
        if t.local_batch_size % divisor:
            return None
        local = t.local_batch_size // divisor
        if cfg.parallelism.pipeline_parallel_degree > 1 and local % cfg.parallelism.pipeline_parallel_microbatch_size:
            return None
        return (
            f"--training.local_batch_size {local} (the global batch is kept by gradient accumulation)",
            {"training.local_batch_size": local, "training.global_batch_size": global_batch},
        )

    return change


def _cpu_offload(cfg: JobConfig, global_batch: int):
    if not cfg.training.enable_cpu_offload and cfg.parallelism.dp_mode == "fsdp":
        return "--training.enable_cpu_offload (parameters, gradients and optimizer state in host memory)", {
            "training.enable_cpu_offload": True
        }
    return None


def _more_tp(cfg: JobConfig, global_batch: int):
    p = cfg.parallelism
    return (
        f"--parallelism.tensor_parallel_degree {2 * p.tensor_parallel_degree}",
        {"parallelism.tensor_parallel_degree": 2 * p.tensor_parallel_degree},
    )


CHANGES: tuple[Change, ...] = (
    _reshard,
    _memory_budget(0.75),
    _memory_budget(0.5),
    _selective_op,
    _smaller_batch(2),
    _smaller_batch(4),
    _memory_budget(0.25),
    _full_ac,
    _cpu_offload,
    _more_tp,
)
"""Single changes, cheapest in step time first: a smaller micro-batch with gradient accumulation keeps the global
batch and costs only the per-micro-batch overheads, full recomputation costs a third more compute."""


def cheapest_fix(
    cfg: JobConfig, world_size: int, budget: int, global_batch: int, device_type: str | None = None
) -> str | None:
    """The first change of `CHANGES` after which the analytic estimate fits `budget`, or None.

    Args:
        cfg: the job config that does not fit.
        world_size: number of ranks.
        budget: usable bytes per rank.
        global_batch: sequences per step now (kept by the batch changes).
        device_type: the target device.
    """
    from titan_core.memory.analytic import estimate_analytic

    for change in CHANGES:
        proposal = change(cfg, global_batch)
        if proposal is None:
            continue
        text, updates = proposal
        candidate = cfg.model_copy(deep=True)
        for key, value in updates.items():
            section, field = key.split(".")
            setattr(getattr(candidate, section), field, value)
        try:
            estimate = estimate_analytic(candidate, world_size, device_type=device_type)
        except ConfigError:
            continue
        if estimate.peak <= budget:
            return f"{text}: peak {format_bytes(estimate.peak)}"
    return None


def judge(
    estimate: MemoryEstimate, cfg: JobConfig, budget: int, device_bytes: int, global_batch: int, device_type: str | None
) -> None:
    """Set the estimate's budget, and its fix when it does not fit."""
    estimate.budget, estimate.device_memory = budget, device_bytes
    if not estimate.fits:
        estimate.fix = cheapest_fix(cfg, estimate.world_size, budget, global_batch, device_type)
