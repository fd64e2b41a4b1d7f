"""Filling a parallelized model with the values of a full, unsharded one.

On CUDA, DTensor's random ops give each shard the slice of one global random
stream, so `init_weights` can run on the sharded model directly. Off CUDA they
do not (every shard would draw the same values), so there each rank builds the
full model, initialises it from the same seed, and keeps only its own shards:
no communication, and every layout starts from bit-identical weights.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, distribute_tensor

# Wrappers that add a level to parameter names without changing the model.
_WRAPPER_PREFIXES = ("_checkpoint_wrapped_module.", "_orig_mod.", "_fsdp_wrapped_module.")


def canonical_name(name: str) -> str:
    """A parameter name with wrapper levels (activation checkpoint, compile) removed.

    Args:
        name: a parameter or buffer name of a wrapped model.
    """
    for prefix in _WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name


@torch.no_grad()
def copy_full_state(model: nn.Module, full_state: Mapping[str, torch.Tensor], *, strict: bool = True) -> None:
    """Copy full tensors into `model`'s (possibly sharded) parameters and persistent buffers.

    Args:
        model: a model, possibly sharded (DTensor parameters) or a pipeline stage.
        full_state: unsharded tensors by canonical name (as the unwrapped model names them).
        strict: every parameter of `model` must be found in `full_state`.
    """
    params = dict(model.named_parameters())
    tensors = {**params, **dict(model.named_buffers())}
    for name, tensor in tensors.items():
        key = canonical_name(name)
        if key not in full_state:
            if strict and name in params:
                raise KeyError(f"parameter '{key}' missing from the full state ({len(full_state)} entries)")
            continue
        full = full_state[key].to(device=tensor.device, dtype=tensor.dtype)
        if isinstance(tensor, DTensor):
            # src_data_rank=None: every rank holds the same full tensor; each keeps its slice, no communication.
            local = distribute_tensor(full, tensor.device_mesh, tensor.placements, src_data_rank=None).to_local()
            tensor.to_local().copy_(local)
        else:
            tensor.copy_(full)
