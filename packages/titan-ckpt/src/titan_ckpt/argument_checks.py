"""`CheckpointManager`'s arguments checked before anything is built, one `CheckpointError` each.

Every message names the parameter to change (its `arguments`), in the manager's own terms.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Literal, get_args

from titan_ckpt.errors import CheckpointError

AsyncMode = Literal["disabled", "async", "async_with_pinned_mem"]
ASYNC_MODES: tuple[AsyncMode, ...] = get_args(AsyncMode)
"""The values of `async_mode`."""
RESERVED_STATES = ("model", "optimizer", "rng")
"""State names the manager itself saves; the JSON states are named by the caller."""


def check_arguments(
    model_parts: Sequence[Any],
    optimizers: Sequence[Any],
    states: Mapping[str, Any],
    *,
    interval: int,
    keep_latest_k: int,
    async_mode: AsyncMode,
    keep_interval: int = 0,
    load_step: int,
    exclude_from_loading: Sequence[str],
    tensor_states: Mapping[str, Any] | None = None,
) -> None:
    """Fail on arguments of `CheckpointManager` that cannot work (see its docstring for each).

    Args:
        model_parts: the model parts.
        optimizers: one per model part, or none.
        states: the JSON states by name.
        interval: steps between saves.
        keep_latest_k: complete checkpoints kept.
        async_mode: one of `ASYNC_MODES`.
        keep_interval: milestone steps kept besides them (0: none), a multiple of `interval`.
        load_step: step to resume from, or -1.
        exclude_from_loading: state names not restored.
        tensor_states: the tensor states by name.

    Raises:
        CheckpointError: the first argument that cannot work; `arguments` names it.
    """
    tensor_states = tensor_states or {}
    clash = sorted(set(states) & set(RESERVED_STATES))
    if clash:
        raise CheckpointError(
            f"state name '{clash[0]}' is reserved by the checkpoint manager; rename that entry of states",
            arguments=("states",),
        )
    clash = sorted(set(tensor_states) & {*RESERVED_STATES, *states})
    if clash:
        raise CheckpointError(
            f"tensor state name '{clash[0]}' is reserved or a JSON state's; rename that entry of tensor_states",
            arguments=("tensor_states",),
        )
    if optimizers and len(optimizers) != len(model_parts):
        raise CheckpointError(
            f"optimizers has {len(optimizers)} entries for {len(model_parts)} model parts; "
            "pass one optimizer per model part (pipeline stage)",
            arguments=("optimizers",),
        )
    known = (*RESERVED_STATES, *states, *tensor_states)
    unknown = [name for name in exclude_from_loading if name not in known]
    if unknown:
        raise CheckpointError(
            f"exclude_from_loading: unknown state '{unknown[0]}'; choose from {', '.join(known)}",
            arguments=("exclude_from_loading",),
        )
    if async_mode not in ASYNC_MODES:
        raise CheckpointError(
            f"async_mode: unknown '{async_mode}'; choose one of {', '.join(ASYNC_MODES)}", arguments=("async_mode",)
        )
    if interval < 1:
        raise CheckpointError(f"interval={interval}; save every N >= 1 steps", arguments=("interval",))
    if keep_latest_k < 0:
        raise CheckpointError(
            f"keep_latest_k={keep_latest_k}; keep N >= 1 checkpoints, or 0 to keep all", arguments=("keep_latest_k",)
        )
    if keep_interval < 0 or keep_interval % interval:
        raise CheckpointError(
            f"keep_interval={keep_interval}; keep the checkpoints of every N-th step with N a multiple of "
            f"interval={interval} (the steps saved), or 0 for none",
            arguments=("keep_interval", "interval"),
        )
    if load_step < -1:
        raise CheckpointError(
            f"load_step={load_step}; pick a step N >= 0, or -1 for the newest", arguments=("load_step",)
        )
