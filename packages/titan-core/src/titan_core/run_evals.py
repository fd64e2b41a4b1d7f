"""What a run measures besides its training loss, built from the trainer's parts: the held-out validation sets
(`[validation]`, and `[ema]`'s average on them with `ema.validation`) and the multiple-choice tasks (`[eval]`).
The trainer calls them at `validation.freq` / `eval.freq` steps (`titan_core.trainer`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

from titan_core.config import JobConfig
from titan_core.data import loader_factory
from titan_core.downstream_eval import DownstreamEvaluator, MultipleChoiceTask
from titan_core.ema import WeightEMA
from titan_core.job.run_rules import validation_set_names
from titan_core.validation import Validator, check_first_batch
from titan_parallel.mesh import ParallelMesh

__all__ = ["build_downstream_eval", "build_validator", "ema_validation"]


def build_validator(
    cfg: JobConfig,
    tokenizer: Any,
    *,
    mesh: ParallelMesh,
    dp: int,
    pp: int,
    eval_loss: Callable[..., Any],
    parts: list[torch.nn.Module],
    device: torch.device,
) -> Validator | None:
    """The run's `Validator` over `validation.dataset` or each of `validation.sets`; None without [validation].

    Args:
        cfg: the job config.
        tokenizer: the run's tokenizer.
        mesh: the run's device mesh (its `dp`, `dp_cp` and `pp` dims).
        dp: the data-parallel degree (each rank reads its slice).
        pp: the pipeline degree.
        eval_loss: the step runner's forward-only loss (`StepRunner.eval_loss`).
        parts: this rank's model parts.
        device: the training device.
    """
    v, t = cfg.validation, cfg.training
    if not v.enable:
        return None
    make = functools.partial(
        loader_factory,
        tokenizer=tokenizer,
        seq_len=v.seq_len or t.seq_len,
        local_batch_size=v.local_batch_size or t.local_batch_size,
        dp_rank=mesh["dp"].get_local_rank(),
        dp_world=dp,
        prefetch=t.prefetch_batches,
        section="validation",
    )
    if v.sets:  # several held-out sets, each under its label
        loaders = {
            name: make(
                entry.path,
                None,
                entry.text_field or t.dataset_text_field,
                dataset_key=f"validation.sets[{i}].path",
                field_key=f"validation.sets[{i}].text_field" if entry.text_field else "training.dataset_text_field",
            )
            for i, (name, entry) in enumerate(zip(validation_set_names(v.sets), v.sets, strict=True))
        }
    else:
        loaders = {"": make(v.dataset, v.dataset_path, t.dataset_text_field)}
    for make_loader in loaders.values():  # each set has documents (and, for steps = -1, fills one batch)
        check_first_batch(make_loader, whole_pass=v.steps == -1)
    return Validator(
        loaders,
        steps=v.steps,
        eval_loss=eval_loss,
        parts=parts,
        loss_group=mesh["dp_cp"].get_group(),
        pp_group=mesh["pp"].get_group() if pp > 1 else None,
        device=device,
    )


def build_downstream_eval(
    cfg: JobConfig,
    tokenizer: Any,
    *,
    mesh: ParallelMesh,
    dp: int,
    pp: int,
    sequence_losses: Callable[..., Any],
    parts: list[torch.nn.Module],
    device: torch.device,
    rank: int,
    tasks: list[MultipleChoiceTask],
) -> DownstreamEvaluator | None:
    """The run's `DownstreamEvaluator` over `eval.tasks`; None without [eval].

    Args:
        cfg: the job config.
        tokenizer: the run's tokenizer.
        mesh: the run's device mesh (its `dp`, `dp_cp` and `pp` dims).
        dp: the data-parallel degree (each rank scores its slice of the examples).
        pp: the pipeline degree.
        sequence_losses: the step runner's per-sequence loss (`StepRunner.eval_sequence_losses`).
        parts: this rank's model parts.
        device: the training device.
        rank: this process's rank.
        tasks: `eval.tasks`, read (`titan_core.downstream_eval.load_tasks`).
    """
    e, t = cfg.eval, cfg.training
    if not e.enable:
        return None
    return DownstreamEvaluator(
        tasks,
        tokenizer,
        seq_len=t.seq_len,  # the training shapes: nothing recompiles, the pipeline schedule runs unchanged
        local_batch_size=t.local_batch_size,
        sequence_losses=sequence_losses,
        parts=parts,
        dp_rank=mesh["dp"].get_local_rank(),
        dp_world=dp,
        loss_group=mesh["dp_cp"].get_group(),
        pp_group=mesh["pp"].get_group() if pp > 1 else None,
        device=device,
        rank=rank,
    )


def ema_validation(
    validator: Validator,
    ema: WeightEMA | None,
    *,
    enabled: bool,
    parts: list[torch.nn.Module],
    copies: Any,
    refresh: Callable[[], None] | None,
) -> dict[str, object]:
    """`ema.validation`: the same validation pass on the averaged weights, as `validation_ema/...`; {} without it.

    Args:
        validator: the run's validator.
        ema: the moving average of the weights, or None.
        enabled: `ema.validation`.
        parts: this rank's model parts.
        copies: the bf16 compute copies (`optimizer.master_weights`), or None.
        refresh: what follows new weights (float8's scales), or None.
    """
    if ema is None or not enabled:
        return {}
    from torch.distributed.fsdp import FSDPModule

    def prepare() -> None:  # the parameters as the optimizer writes them, no gathered or compute copy kept
        if copies is not None:
            copies.use_masters()
        for part in parts:
            for module in part.modules():
                if isinstance(module, FSDPModule):
                    module.reshard()

    with ema.swapped(prepare=prepare, refresh=refresh):
        values = validator.metrics()
    return {key.replace("validation/", "validation_ema/", 1): value for key, value in values.items()}
