"""Model and optimizer state of the model parts (the whole model, or this rank's pipeline
stages) as one flat dict of tensors for DCP, and back.

DCP keys: the model's parameter names as they are (torchtitan's layout,
`layers.0.attention.wq.weight`), optimizer tensors as `optimizer.state.<param>.<name>`
(`optimizer.state.layers.0.attention.wq.weight.exp_avg`). `get_model_state_dict` /
`get_optimizer_state_dict` give these names whatever the wrapping (FSDP, TP, activation
checkpointing, compile) with DTensor values, and pipeline stages keep the full model's
names, so each rank's dict is a slice of one global dict and a checkpoint loads into
any layout. The optimizer's hyperparameters (lr, betas, ...) are not tensors: they are
returned apart, for a JSON file.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from titan_ckpt.errors import CheckpointError

OPTIMIZER_PREFIX = "optimizer.state."


def plain_tensor(value: torch.Tensor) -> torch.Tensor:
    """`value` without weight-wrapper tensor subclasses that hold one plain tensor of the same shape and
    dtype (torchao's float8 / MXFP8 training weights), also as a DTensor's local shard. DCP would pickle
    such a wrapper (a checkpoint that `weights_only` loading, or a run without torchao, then refuses)
    and safetensors cannot write one; the inner tensor is the parameter's own storage, so loading into
    it in place still fills the parameter.

    Args:
        value: a tensor, DTensor or wrapper subclass.
    """
    from torch.distributed.tensor import DTensor
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    if isinstance(value, DTensor):
        local = value.to_local()
        inner = plain_tensor(local)
        if inner is local:
            return value
        return DTensor.from_local(
            inner, value.device_mesh, value.placements, run_check=False, shape=value.shape, stride=value.stride()
        )
    while is_traceable_wrapper_subclass(value):
        inner = getattr(value, value.__tensor_flatten__()[0][0])
        if inner.shape != value.shape or inner.dtype != value.dtype:
            break
        value = inner
    return value


def get_part_states(model_parts: Sequence[nn.Module]) -> list[dict[str, torch.Tensor]]:
    """Each part's model state dict (DTensors where sharded; they share the parameters' storage).

    Args:
        model_parts: the model, or this rank's pipeline stages.

    Raises:
        CheckpointError: a non-tensor entry (a module's `get_extra_state`), which DCP would pickle.
    """
    states: list[dict[str, torch.Tensor]] = []
    for part in model_parts:
        state: dict[str, torch.Tensor] = {}
        for key, value in get_model_state_dict(part).items():
            if not isinstance(value, torch.Tensor):
                raise CheckpointError(
                    f"model state '{key}' is a {type(value).__name__}, not a tensor; DCP would pickle it, "
                    "so the checkpoint manager refuses it: keep module extra state in tensors or buffers"
                )
            state[key] = plain_tensor(value)
        states.append(state)
    return states


def set_part_states(model_parts: Sequence[nn.Module], states: Sequence[dict[str, torch.Tensor]]) -> None:
    """Load each part's state dict (from `get_part_states`, filled by DCP) into the part.

    Args:
        model_parts: the model parts.
        states: one state dict per part.
    """
    for part, state in zip(model_parts, states, strict=True):
        # torch types the state as a dict of `ValueType` (invariant), not a Mapping: a typing gap
        set_model_state_dict(part, state)  # type: ignore[arg-type]


def get_optimizer_states(
    model_parts: Sequence[nn.Module], optimizers: Sequence[torch.optim.Optimizer]
) -> list[dict[str, Any]]:
    """`get_optimizer_state_dict` of each (part, optimizer) pair; an empty optimizer state is
    initialised first (a zero-lr step), so a fresh optimizer gives the tensors to load into.

    Args:
        model_parts: the model parts.
        optimizers: one per part.

    Raises:
        CheckpointError: not one optimizer per model part.
    """
    if len(optimizers) != len(model_parts):
        raise CheckpointError(
            f"optimizers has {len(optimizers)} entries for {len(model_parts)} model parts; "
            "pass one optimizer per model part (pipeline stage)",
            arguments=("optimizers",),
        )
    return [get_optimizer_state_dict(part, optim) for part, optim in zip(model_parts, optimizers, strict=True)]


def flatten_optimizer_tensors(states: Sequence[dict[str, Any]]) -> dict[str, torch.Tensor]:
    """The tensors of optimizer state dicts under `optimizer.state.<param>.<name>` keys (same objects, no copy).

    Args:
        states: the optimizer state dicts (`get_optimizer_states`).

    Raises:
        CheckpointError: a non-tensor value in the per-parameter state.
    """
    flat = {}
    for state in states:
        for fqn, per_param in state["state"].items():
            for name, value in per_param.items():
                if not isinstance(value, torch.Tensor):
                    raise CheckpointError(
                        f"optimizer state '{fqn}.{name}' is a {type(value).__name__}, not a tensor; "
                        "the checkpoint manager saves tensor optimizer state only: "
                        "pass optimizers that keep tensors (torch.optim's do)",
                        arguments=("optimizers",),
                    )
                flat[f"{OPTIMIZER_PREFIX}{fqn}.{name}"] = value
    return flat


def param_group_settings(state: dict[str, Any]) -> list[dict[str, Any]]:
    """The hyperparameters of each param group (everything but the parameter list).

    Args:
        state: an optimizer state dict.
    """
    return [{k: v for k, v in group.items() if k != "params"} for group in state["param_groups"]]


def set_optimizer_states(
    model_parts: Sequence[nn.Module],
    optimizers: Sequence[torch.optim.Optimizer],
    states: Sequence[dict[str, Any]],
    settings: list[dict[str, Any]] | None,
) -> None:
    """Load optimizer state dicts (from `get_optimizer_states`, filled by DCP), with saved hyperparameters.

    Args:
        model_parts: the model parts.
        optimizers: one per part.
        states: the filled state dicts.
        settings: saved hyperparameters per param group (the same for every part), or None to keep the live ones.

    Raises:
        CheckpointError: the saved param groups do not match the optimizer's.
    """
    for part, optim, state in zip(model_parts, optimizers, states, strict=True):
        groups = state["param_groups"]
        if settings is not None:
            if len(settings) != len(groups):
                raise CheckpointError(
                    f"the checkpoint's optimizer has {len(settings)} param groups, this one {len(groups)}; "
                    "resume with the same optimizer, or add 'optimizer' to exclude_from_loading",
                    arguments=("exclude_from_loading",),
                )
            groups = [
                {**group, **{k: tuple(v) if isinstance(group.get(k), tuple) else v for k, v in saved.items()}}
                for group, saved in zip(groups, settings, strict=True)
            ]
        set_optimizer_state_dict(part, optim, {"state": state["state"], "param_groups": groups})


def check_against_metadata(wanted: dict[str, torch.Tensor], metadata: Metadata, where: str) -> None:
    """Fail clearly when the checkpoint lacks a tensor this run needs or holds it in another shape.

    Args:
        wanted: the tensors to load, by DCP key (global shapes for DTensors).
        metadata: the checkpoint's DCP metadata.
        where: the checkpoint folder, for messages.

    Raises:
        CheckpointError: a missing key or a shape mismatch (the first one, and how many more).
    """
    shapes = {
        key: tuple(meta.size)
        for key, meta in metadata.state_dict_metadata.items()
        if isinstance(meta, TensorStorageMetadata)
    }
    missing = [k for k in wanted if k not in shapes]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise CheckpointError(
            f"{where} has no tensor '{missing[0]}'{more}; it was saved from another model: "
            "pick model_parts of the model it was saved from, or leave that state out with exclude_from_loading",
            arguments=("model_parts", "exclude_from_loading"),
        )
    for key, tensor in wanted.items():
        if shapes[key] != tuple(tensor.shape):
            raise CheckpointError(
                f"{where}: '{key}' has shape {shapes[key]} in the checkpoint "
                f"but {tuple(tensor.shape)} in this run; "
                "pick model_parts of the shape it was saved with",
                arguments=("model_parts",),
            )


def get_full_model_state(model_parts: Sequence[nn.Module], dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """This rank's parts as full (unsharded) CPU tensors, floating ones cast to `dtype` (a collective
    over each part's mesh: every rank calls it).

    Args:
        model_parts: the model parts.
        dtype: cast floating-point tensors to this; None keeps them.
    """
    out = {}
    for part in model_parts:
        for key, value in get_model_state_dict(part, options=StateDictOptions(full_state_dict=True)).items():
            assert isinstance(value, torch.Tensor), f"model state '{key}' is not a tensor"
            value = plain_tensor(value)
            cast = dtype if dtype is not None and value.is_floating_point() else value.dtype
            out[key] = value.to(device="cpu", dtype=cast)
    return out


def set_full_model_state(
    model_parts: Sequence[nn.Module],
    read: Callable[[], Mapping[str, torch.Tensor]],
    where: str,
    pg: dist.ProcessGroup | None = None,
) -> None:
    """Load full (unsharded) tensors into the parts, each rank keeping its shards.

    With several processes, only rank 0 calls `read`: every other rank receives each tensor from it in turn (torch's
    `broadcast_from_rank0`), holding one full tensor at a time, so a node holds one copy of the weights, not one
    per rank, and the source is read once. Every rank must pass the same number of parts.

    Args:
        model_parts: the model parts.
        read: gives at least every parameter of every rank's parts, by name (on rank 0 only).
        where: the source, for messages.
        pg: the group for the key check (a gloo group where the default one is NCCL); None: the default group.

    Raises:
        CheckpointError: a parameter of some rank's parts is missing from what `read` gives (on every rank), or
            (on the other ranks) `read` failed on rank 0, which raises its own error.
    """
    several = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
    rank = dist.get_rank() if several else 0
    full: dict[str, torch.Tensor] = {}
    failure: BaseException | None = None
    if rank == 0:
        try:
            full = dict(read())
        except Exception as e:  # the other ranks wait on rank 0: tell them before raising
            if not several:
                raise
            failure = e
    names: list[Any] = [f"{type(failure).__name__}: {failure}" if failure else sorted(full)]
    if several:
        dist.broadcast_object_list(names, src=0, group=pg)
    if failure is not None:
        raise failure
    if isinstance(names[0], str):
        raise CheckpointError(f"rank 0 could not read {where} ({names[0]}); see rank 0's error")
    available = set(names[0])
    parts_keys = [list(get_model_state_dict(part)) for part in model_parts]
    keys = [k for part_keys in parts_keys for k in part_keys]
    missing = [k for k in keys if k not in available]
    found = [(rank, missing[0], len(missing), len(keys))] if missing else []
    if several:
        everywhere: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(everywhere, found, group=pg)
        found = [f for ranks_found in everywhere for f in ranks_found]
    if found:
        which, first, count, total = found[0]
        on = f" (rank {which}'s parts)" if several else ""
        raise CheckpointError(
            f"{where} lacks '{first}' ({count} of {total} model tensors missing{on}); "
            "load weights of the model in model_parts",
            arguments=("model_parts",),
        )
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=several, strict=not several)
    for part, part_keys in zip(model_parts, parts_keys, strict=True):
        # rank 0 hands every tensor over (each rank takes its parts' own); a single process, its parts' only
        given: dict[str, Any] = dict(full) if several else {k: full[k] for k in part_keys}
        set_model_state_dict(part, given, options=options)
