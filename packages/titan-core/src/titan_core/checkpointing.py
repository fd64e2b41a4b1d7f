"""Checkpointing for the trainer: the resolved job's `CheckpointOptions` -> `titan_ckpt.CheckpointManager`.

The trainer calls, in order (see `titan_core.trainer`):

    self.checkpointer = build_checkpointer(job.checkpoint, ...)   # after optimizer + LR schedule
    self.checkpointer.load()                                       # before the loop: step, data, optimizer, LR, RNG
    self.checkpointer.save(step, last_step=...)                    # after every step
    self.checkpointer.close()                                      # at the end, waits for a background save

What a checkpoint holds: model and optimizer tensors (DCP, resharded on load), the moving
average of the weights with `[ema]` ("ema", `titan_core.ema`), and as
JSON the LR schedule ("lr_scheduler"), the data loader's global position
("dataloader", independent of the world size), step and tokens seen ("train_state"),
and the RNG ("rng"); the names are what `checkpoint.exclude_from_loading` accepts.
Each load then puts the config's optimizer settings and LR schedule back over the
checkpoint's (`RunCheckpointer`, `ConfigSettings`): the config says how training goes on.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from titan_ckpt import CheckpointManager, CheckpointOptions, LoadModelFn, SaveModelFn, TensorStateful, parse_dtype
from titan_core.config.errors import ConfigError
from titan_core.config.schema import Checkpoint, Model
from titan_core.job.options import checkpoint_options

__all__ = [
    "ConfigSettings",
    "RunCheckpointer",
    "SchedulersState",
    "another_models_checkpoint",
    "another_optimizers_checkpoint",
    "build_checkpointer",
    "hf_checkpoint_hooks",
]

logger = logging.getLogger("titan")

# Param-group keys that say how torch's step runs rather than what it computes: put back without a word.
_KERNEL_KEYS = frozenset({"foreach", "fused", "capturable", "differentiable"})


class SchedulersState:
    """The LR schedulers of all model parts as one JSON state: they step together, so the
    first one's state is saved and loaded into each.

    Args:
        schedulers: one per optimizer.
    """

    def __init__(self, schedulers: Sequence[torch.optim.lr_scheduler.LRScheduler]):
        self.schedulers = list(schedulers)

    def state_dict(self) -> dict[str, Any]:
        return self.schedulers[0].state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for scheduler in self.schedulers:
            groups = len(scheduler.optimizer.param_groups)
            if len(state.get("base_lrs", [None] * groups)) != groups:  # e.g. saved under AdamW, resumed under Muon
                raise ConfigError(
                    f"the checkpoint's LR schedule has {len(state['base_lrs'])} param groups, this optimizer "
                    f"{groups}; resume with the same optimizer.name, or add 'lr_scheduler' and 'optimizer' to "
                    "checkpoint.exclude_from_loading",
                    keys=("optimizer.name", "checkpoint.exclude_from_loading"),
                )
            scheduler.load_state_dict(dict(state))


class ConfigSettings:
    """Each optimizer param group's settings as this run's config built them, put back after a resume.

    torch's `Optimizer.load_state_dict` restores every group's settings from the checkpoint (peak LR, betas,
    weight decay, ...), its `lr` included, and `LambdaLR.load_state_dict` the peak LRs (`base_lrs`). Alone,
    a run resumed with a new `optimizer.lr` or `optimizer.weight_decay` would train on with the old ones, and
    a finished run extended with more `training.steps` would take its first step at the old schedule's last
    LR (0 at the end of a full decay). Titan's schedule is rebuilt from the config at every start, only its
    step count comes from the checkpoint; `restore` makes the groups follow it: the config's settings, and
    each group's LR the schedule's at the loaded step. With the config unchanged it writes back the values
    the checkpoint held, bit for bit (`LambdaLR`'s own `base_lr * factor(step)`).

    Args:
        optimizers: the run's optimizers, after their LR schedules were built (`initial_lr` set).
    """

    def __init__(self, optimizers: Sequence[torch.optim.Optimizer]):
        self.groups = [
            [{key: value for key, value in group.items() if key not in ("params", "lr")} for group in o.param_groups]
            for o in optimizers
        ]

    def restore(
        self, optimizers: Sequence[torch.optim.Optimizer], schedulers: Sequence[torch.optim.lr_scheduler.LambdaLR]
    ) -> list[str]:
        """Put the built settings back into `optimizers` and set each group's LR from `schedulers`.

        Args:
            optimizers: the optimizers given at construction, after a checkpoint was loaded into them.
            schedulers: their `LambdaLR` schedules (one per optimizer), loaded too or fresh.

        Returns:
            What changed against the checkpoint, e.g. "lr 0.0008 -> 0.0004 (group 0)"; empty when nothing did.
        """
        changed: list[str] = []
        for built_groups, optimizer, scheduler in zip(self.groups, optimizers, schedulers, strict=True):
            for index, (built, group) in enumerate(zip(built_groups, optimizer.param_groups, strict=True)):
                for key, value in built.items():
                    loaded = group.get(key)
                    if _plain(loaded) != _plain(value):
                        # the pipeline stages' optimizers share one config: the first one's changes say it all
                        if key not in _KERNEL_KEYS and optimizer is optimizers[0]:
                            name = "lr" if key == "initial_lr" else key
                            changed.append(f"{name} {_plain(loaded)} -> {_plain(value)} (group {index})")
                        group[key] = value
            scheduler.base_lrs = [group["initial_lr"] for group in optimizer.param_groups]
            step = scheduler.last_epoch
            lrs = [base * factor(step) for base, factor in zip(scheduler.base_lrs, scheduler.lr_lambdas, strict=True)]
            for group, lr in zip(optimizer.param_groups, lrs, strict=True):
                if isinstance(group["lr"], torch.Tensor):
                    group["lr"].fill_(lr)
                else:
                    group["lr"] = lr
            scheduler._last_lr = lrs  # what `get_last_lr()` reads; torch's own `step()` sets it the same way
        return changed


class RunCheckpointer(CheckpointManager):
    """The trainer's `CheckpointManager`: after every load into the live run (the resume at start, a
    rollback), the config's optimizer settings and LR schedule are put back (`ConfigSettings`), and
    what differed from the checkpoint is logged once.

    Args:
        lr_schedulers: the optimizers' LR schedules (one per optimizer), built before this.
        **kwargs: `CheckpointManager`'s arguments.
    """

    def __init__(self, *, lr_schedulers: Sequence[torch.optim.lr_scheduler.LambdaLR], **kwargs: Any):
        super().__init__(**kwargs)
        self.lr_schedulers = list(lr_schedulers)
        self.settings = ConfigSettings(self.optimizers)
        self.settings_changed: list[str] = []  # what the last load's `ConfigSettings.restore` changed

    def load(self) -> int | None:
        step = super().load()
        if step is not None:
            self._follow_config("resume")
        return step

    def restore_latest(self, *, exclude: Sequence[str] = ()) -> int | None:
        step = super().restore_latest(exclude=exclude)
        if step is not None:
            self._follow_config("rollback")
        return step

    def _follow_config(self, load: str) -> None:
        saved_lrs = [_plain(group["lr"]) for group in self.optimizers[0].param_groups]
        self.settings_changed = self.settings.restore(self.optimizers, self.lr_schedulers)
        if self.rank != 0:
            return
        if self.settings_changed:
            logger.info(
                "%s: the config's optimizer settings apply, not the checkpoint's: %s",
                load,
                "; ".join(self.settings_changed),
            )
        # The LR itself: a new peak, warm-up or training.steps moves it even where no group setting changed.
        lrs = [_plain(group["lr"]) for group in self.optimizers[0].param_groups]
        moved = [
            f"{old:.4g} -> {new:.4g} (group {i})"
            for i, (old, new) in enumerate(zip(saved_lrs, lrs, strict=True))
            if old != new
        ]
        if moved:
            logger.info("%s: the next step's LR follows the config's schedule, not the checkpoint's: %s", load,
                        "; ".join(moved))  # fmt: skip


def another_models_checkpoint(
    error: Exception, run_folder: Path, checkpoint_folder: str | Path, name: str, flavor: str
) -> ConfigError | None:
    """The error to tell when the run folder's own checkpoint did not load because an earlier run of another
    model saved it (its `config.toml` says which); None when that is not the case (the error stands).

    Args:
        error: what the load raised.
        run_folder: `job.dump_folder`.
        checkpoint_folder: where the run's `step-N` folders are.
        name: this run's `model.name`.
        flavor: this run's `model.flavor`.
    """
    if str(checkpoint_folder) not in str(error):  # not the folder's own checkpoint (initial_load_path)
        return None
    saved = _saved_section(run_folder, "model")
    if saved is None or (saved.get("name"), saved.get("flavor")) == (name, flavor):
        return None
    return ConfigError(
        f"job.dump_folder {run_folder} holds the checkpoints of a {saved.get('name')}/{saved.get('flavor')} run "
        f"(its config.toml), and this run is {name}/{flavor}: choose another job.dump_folder, or resume that "
        f"run with its model.name and model.flavor ({error})",
        keys=("job.dump_folder", "model.name", "model.flavor"),
    )


def another_optimizers_checkpoint(
    run_folder: Path, checkpoint_folder: str | Path, name: str, weight_decay_exclude: Sequence[str]
) -> ConfigError | None:
    """The error to tell when the run folder's own checkpoint did not load and its earlier run (its `config.toml`)
    built other optimizer param groups: another `optimizer.name`, or weight decay exclusions added or removed (one
    group against two); None when that is not the case (the error stands).

    Args:
        run_folder: `job.dump_folder`.
        checkpoint_folder: where the run's `step-N` folders are.
        name: this run's `optimizer.name`.
        weight_decay_exclude: this run's `optimizer.weight_decay_exclude`.
    """
    if not any(Path(checkpoint_folder).glob("step-*")):  # not the folder's own checkpoint (initial_load_path)
        return None
    saved = _saved_section(run_folder, "optimizer")
    if saved is None:
        return None
    saved_name, saved_exclude = saved.get("name", "AdamW"), list(saved.get("weight_decay_exclude", []))
    if saved_name == name and bool(saved_exclude) == bool(weight_decay_exclude):
        return None
    return ConfigError(
        f"the checkpoints in {run_folder} were saved with optimizer.name = {saved_name!r} and "
        f"optimizer.weight_decay_exclude = {saved_exclude} (its config.toml), which build other param groups than "
        f"this run's {name!r} and {list(weight_decay_exclude)}: resume with those, or add 'optimizer' and "
        f"'lr_scheduler' to checkpoint.exclude_from_loading to start them afresh",  # not the load's own error,
        # which blames the model (the same one)
        keys=("optimizer.name", "optimizer.weight_decay_exclude", "checkpoint.exclude_from_loading"),
    )


def _saved_section(run_folder: Path, section: str) -> dict[str, Any] | None:
    """A section of the config the run folder's earlier run wrote (`config.toml`); None where it cannot be read."""
    import tomllib

    try:
        return dict(tomllib.loads((Path(run_folder) / "config.toml").read_text()).get(section, {}))
    except (OSError, tomllib.TOMLDecodeError):
        return None


def _plain(value: Any) -> Any:
    """A setting as compared and shown: a checkpoint gives back sequences (betas) as lists, tensors as tensors."""
    if isinstance(value, torch.Tensor):
        return value.item()
    return tuple(value) if isinstance(value, list | tuple) else value


def build_checkpointer(
    options: CheckpointOptions | Checkpoint,
    *,
    run_folder: Path | None = None,
    model_parts: Sequence[nn.Module],
    optimizers: Sequence[torch.optim.Optimizer],
    lr_schedulers: Sequence[torch.optim.lr_scheduler.LambdaLR],
    dataloader: Any,
    train_state: Any,
    device: torch.device,
    load_model_fn: LoadModelFn | None = None,
    save_model_fn: SaveModelFn | None = None,
    ema: TensorStateful | None = None,
    diloco: TensorStateful | None = None,
    diloco_window: Any = None,
) -> RunCheckpointer:
    """Build the run's checkpoint manager (disabled: it does nothing); each load puts the config's optimizer
    settings back (`RunCheckpointer`).

    Args:
        options: the resolved job's `checkpoint` (`titan_core.job.Job.checkpoint`); or, the former form,
            the config's `checkpoint` section with `run_folder`.
        run_folder: only with a config section: `job.dump_folder`; checkpoints go to `run_folder / ckpt.folder`.
        model_parts: the model, or this rank's pipeline stages.
        optimizers: one per model part.
        lr_schedulers: one per optimizer.
        dataloader: the `PackedLoader` (its JSON state is the global stream position).
        train_state: the `TrainState` (step, tokens seen).
        device: the device the run computes on.
        load_model_fn: reads `initial_load_path` in Hugging Face format (`checkpoint.initial_load_in_hf`,
            see `hf_checkpoint_hooks`).
        save_model_fn: writes the last save in Hugging Face format (`checkpoint.last_save_in_hf`).
        ema: the moving average of the weights (`[ema]`), saved as the tensor state "ema"; None without one.
        diloco: DiLoCo's anchors and outer momentum (`fault_tolerance.semi_sync_method`), the tensor state
            "diloco"; None without it.
        diloco_window: the JSON state "diloco_sync" (`DiLoCo.window`): which sync a checkpoint saved inside its
            window holds the outer step of; None without DiLoCo.

    The rules across the `checkpoint` keys are checked with the whole job (`titan_core.job`).
    """
    if isinstance(options, Checkpoint):  # the config section: resolved here the way `resolve` does it
        if run_folder is None:
            raise TypeError("build_checkpointer(config section, ...) needs run_folder")
        section = options
        options = checkpoint_options(section, run_folder)
        load_model_fn = load_model_fn if section.initial_load_in_hf else None
        save_model_fn = save_model_fn if section.last_save_in_hf else None
    elif run_folder is not None:
        raise TypeError("build_checkpointer(CheckpointOptions, ...) takes its folder from the options, not run_folder")
    return RunCheckpointer(
        lr_schedulers=lr_schedulers,
        model_parts=model_parts,
        optimizers=optimizers,
        states={
            "lr_scheduler": SchedulersState(lr_schedulers),
            "dataloader": dataloader,
            "train_state": train_state,
            **({"diloco_sync": diloco_window} if diloco_window is not None else {}),
        },
        tensor_states={name: s for name, s in (("ema", ema), ("diloco", diloco)) if s is not None},
        device=device,
        options=options,
        load_model_fn=load_model_fn,
        save_model_fn=save_model_fn,
    )


def hf_checkpoint_hooks(
    ckpt: Checkpoint, model: Model, model_args: Any, hf_source: Any, *, rank: int
) -> dict[str, Any]:
    """`build_checkpointer`'s readers/writers for `checkpoint.initial_load_in_hf` / `last_save_in_hf`.

    Args:
        ckpt: the `checkpoint` config section.
        model: the `model` config section: the family (its Hugging Face adapter) and the tokenizer
            (`hf_assets_path`), whose files the export carries.
        model_args: the model's shape.
        hf_source: the resolved Hugging Face source of `initial_load_path`, or None (then the path itself).
        rank: this process's rank (rank 0 writes the export).
    """
    hooks: dict[str, Any] = {}
    if ckpt.initial_load_in_hf:
        from titan_core.convert import read_hf_weights

        hooks["load_model_fn"] = lambda path: read_hf_weights(hf_source or path, model.name, model_args)
    if ckpt.last_save_in_hf:
        from titan_core.convert import write_hf_weights

        def save_hf(folder, state_dict):
            if rank == 0:
                state, dtype = dict(state_dict), parse_dtype(ckpt.export_dtype)
                write_hf_weights(folder, state, model.name, model_args, dtype, tokenizer=model.hf_assets_path)

        hooks["save_model_fn"] = save_hf
    return hooks
