"""The rules about how a one-rank or replicated run trains rather than how it is laid out: torchft's replica
groups and master weights. Part of `titan_core.job.rules.RULES`, which runs them after every layout rule.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
from typing import TYPE_CHECKING

from titan_core.config.errors import ConfigError, MissingPackageError

if TYPE_CHECKING:
    from titan_core.job.rules import Draft

if TYPE_CHECKING:
    from titan_core.config.schema import JobConfig

__all__ = ["fault_tolerance", "master_weights", "master_weights_config_blockers"]


def fault_tolerance(d: Draft) -> None:
    """[fault_tolerance]: torchft installed, a lighthouse, replica_id < group_size; no layout or policy that
    would set one replica group apart from the others (pipeline stages, a rollback, MoE expert biases)."""
    ft = d.cfg.fault_tolerance
    if not ft.enable:
        if ft.semi_sync_method != "none":
            raise ConfigError(
                f"fault_tolerance.semi_sync_method = '{ft.semi_sync_method}' synchronises torchft replica groups: "
                "set fault_tolerance.enable = true (with its group_size, replica_id and lighthouse)"
            )
        return
    if ft.semi_sync_method == "local_sgd":
        for key in sorted({"outer_lr", "outer_momentum"} & ft.model_fields_set):
            raise ConfigError(
                f"fault_tolerance.{key} is DiLoCo's; semi_sync_method = 'local_sgd' averages the weights (outer lr 1, "
                "no momentum): set semi_sync_method = 'diloco' or leave it unset"
            )
    from titan_core.fault_tolerance import MISSING_TORCHFT

    if importlib.util.find_spec("torchft") is None:
        raise MissingPackageError(MISSING_TORCHFT)
    if ft.replica_id >= ft.group_size:
        raise ConfigError(
            f"fault_tolerance.replica_id={ft.replica_id} must be below fault_tolerance.group_size={ft.group_size}; "
            "number the replica groups 0 .. group_size - 1"
        )
    if ft.min_replica_size > ft.group_size:
        raise ConfigError(
            f"fault_tolerance.min_replica_size={ft.min_replica_size} exceeds fault_tolerance.group_size="
            f"{ft.group_size}: no step could commit; lower it"
        )
    if not ft.lighthouse and not os.environ.get("TORCHFT_LIGHTHOUSE"):
        raise ConfigError(
            "fault_tolerance.lighthouse is empty and $TORCHFT_LIGHTHOUSE unset: start `titan lighthouse` and set "
            "fault_tolerance.lighthouse to the address it prints"
        )
    if d.cfg.parallelism.pipeline_parallel_degree > 1:
        raise ConfigError(
            "fault_tolerance.enable does not support pipeline parallel (one commit vote over the stages' optimizers "
            "is not built); set parallelism.pipeline_parallel_degree = 1"
        )
    for key, skip in (("on_nonfinite", "skip_step"), ("on_loss_spike", "skip")):
        if getattr(d.cfg.training, key) == "rollback":
            raise ConfigError(
                f"training.{key} = 'rollback' would reload a checkpoint in one replica group only "
                f"(fault_tolerance.enable); set training.{key} = '{skip}'"
            )
    if d.spec.plan.moe is not None:
        raise ConfigError(
            f"fault_tolerance.enable: {d.cfg.model.name}'s MoE expert biases follow each group's own token counts "
            "and would drift apart between replica groups; train a dense model.name or set fault_tolerance.enable "
            "to false"
        )


def master_weights(d: Draft) -> None:
    """`optimizer.master_weights`: on one data-parallel rank, fp32 masters with bf16 copies the Adam/AdamW step
    writes replace FSDP ('auto': on CUDA, where one Triton kernel writes both); 'on' is refused where it cannot."""
    from titan_parallel import master_weights_blockers

    cfg, dims, choice = d.cfg, d.dims, d.cfg.optimizer.master_weights
    if choice == "off" or dims is None:
        return
    model_parallel = dims.tp * dims.cp * dims.pp * dims.ep > 1
    blockers = master_weights_blockers(
        dims.dp_replicate * dims.dp_shard, model_parallel, d.parallel.param_dtype, d.parallel.cpu_offload,
        d.accum_steps or 1,
    )  # fmt: skip
    blockers += master_weights_config_blockers(cfg)
    if choice == "on" and blockers:
        raise ConfigError(f"optimizer.master_weights = 'on' cannot train this job: {blockers[0]}; set 'auto' or 'off'")
    if choice == "auto" and (blockers or d.device_type != "cuda"):
        return
    d.parallel = dataclasses.replace(d.parallel, master_weights=True)
    why = "as configured" if choice == "on" else "auto: one CUDA rank, where one kernel writes masters and copies"
    d.weights_reason = f"fp32 masters whose bf16 copies the step writes, no FSDP; {why}"


def master_weights_config_blockers(cfg: JobConfig) -> list[str]:
    """What in `cfg`, beside the layout (`titan_parallel.master_weights_blockers`), keeps master weights off."""
    blockers = []
    if cfg.optimizer.name not in ("Adam", "AdamW"):
        blockers.append(f"optimizer.name = {cfg.optimizer.name!r} has no master-weight step (Adam and AdamW do)")
    if cfg.parallelism.dp_mode == "ddp":
        blockers.append("parallelism.dp_mode = 'ddp' computes in bf16 through autocast")
    if cfg.fault_tolerance.enable:
        blockers.append("fault_tolerance.enable averages gradients over replica groups")
    return blockers
