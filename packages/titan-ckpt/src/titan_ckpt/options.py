"""`CheckpointOptions`: `CheckpointManager`'s plain settings as one frozen value.

A caller that resolves its settings before it builds the model (a launcher checking
a whole job) keeps them here and passes `CheckpointManager(options=...)`; the
keyword form (`CheckpointManager(folder, interval=...)`) builds the same value.
Errors name these fields, as the manager's keywords are named.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from titan_ckpt.argument_checks import AsyncMode


@dataclass(frozen=True)
class CheckpointOptions:
    """Where and how often a `CheckpointManager` saves, and what it loads.

    Args:
        folder: the run's checkpoint folder; it holds the `step-N` folders.
        enable: when False, `load` restores nothing and `save` writes nothing.
        interval: save every this many steps (and at the last step).
        save_first_step: also save after step 1 (an early proof that saving works, and a state to go back to).
        load_only: load as set, never save (e.g. evaluating or debugging from a checkpoint).
        keep_latest_k: keep this many newest complete checkpoints; 0 keeps all.
        keep_interval: also keep every checkpoint whose step is a multiple of this (milestones, which
            `keep_latest_k` never removes); 0: none. A multiple of `interval`.
        async_mode: "disabled", "async" or "async_with_pinned_mem" (see `CheckpointManager`).
        last_save_model_only: the last step saves only the model weights (plus the small JSON states).
        export_dtype: dtype of the weights in that model-only save.
        load_step: step to resume from; -1 = the newest complete one.
        exclude_from_loading: states not restored, from "model", "optimizer", "rng" and the manager's `states` names.
        initial_load_path: a checkpoint to start from when `folder` has none.
        initial_load_model_only: load only the model weights from `initial_load_path`.
        checksums: record and check CRC-32 of every file (else sizes only).
    """

    folder: str | Path
    enable: bool = True
    interval: int = 500
    save_first_step: bool = False
    load_only: bool = False
    keep_latest_k: int = 10
    keep_interval: int = 0
    async_mode: AsyncMode = "disabled"
    last_save_model_only: bool = False
    export_dtype: torch.dtype = torch.float32
    load_step: int = -1
    exclude_from_loading: tuple[str, ...] = ()
    initial_load_path: str | Path | None = None
    initial_load_model_only: bool = True
    checksums: bool = True


def one_form(
    folder: str | Path | None, options: CheckpointOptions | None, keywords: CheckpointOptions
) -> CheckpointOptions:
    """The settings a manager was given: `options`, or `folder` with the setting keywords, never a mix.

    Args:
        folder: the `folder` argument.
        options: the `options` argument.
        keywords: the setting keywords as given (their defaults where not given), with `folder` or "".
    """
    if options is None:
        if folder is None:
            raise TypeError("CheckpointManager needs a folder, or options=CheckpointOptions(folder=...)")
        return keywords
    if folder is not None or keywords != CheckpointOptions(folder=""):
        raise TypeError("CheckpointManager takes options= or folder with the setting keywords, not both")
    return options
