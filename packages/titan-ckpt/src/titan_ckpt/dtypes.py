"""Dtype names (as in `config.json`'s `torch_dtype`) and the cast applied when writing."""

from __future__ import annotations

import torch

from titan_ckpt.errors import CheckpointError

DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
"""The dtype names `parse_dtype` accepts (also `torch_dtype` in `config.json`)."""


def parse_dtype(name: str) -> torch.dtype:
    """A dtype name -> `torch.dtype`.

    Args:
        name: one of `DTYPES`.

    Raises:
        ValueError: unknown name; the message lists the valid ones.
    """
    if name not in DTYPES:
        raise CheckpointError(f"unknown dtype '{name}'; choose one of: {', '.join(DTYPES)}")
    return DTYPES[name]


def dtype_name(dtype: torch.dtype) -> str:
    """`torch.bfloat16` -> "bfloat16".

    Args:
        dtype: any torch dtype.
    """
    return str(dtype).removeprefix("torch.")


def cast_floating(state_dict: dict[str, torch.Tensor], dtype: torch.dtype | None) -> dict[str, torch.Tensor]:
    """Cast every floating-point tensor to `dtype`, keeping tensors that share storage shared.

    Args:
        state_dict: tensors by name.
        dtype: target dtype; None returns `state_dict` unchanged.
    """
    if dtype is None:
        return state_dict
    cast: dict[int, torch.Tensor] = {}  # id(source tensor) -> cast tensor, so tied weights stay tied
    out = {}
    for name, tensor in state_dict.items():
        if not tensor.is_floating_point():
            out[name] = tensor
            continue
        if id(tensor) not in cast:
            cast[id(tensor)] = tensor.to(dtype)
        out[name] = cast[id(tensor)]
    return out


def state_dict_dtype(state_dict: dict[str, torch.Tensor]) -> torch.dtype:
    """The dtype of the most bytes of floating-point weights (float32 for an empty dict).

    Args:
        state_dict: tensors by name.
    """
    sizes: dict[torch.dtype, int] = {}
    for tensor in state_dict.values():
        if tensor.is_floating_point():
            sizes[tensor.dtype] = sizes.get(tensor.dtype, 0) + tensor.numel() * tensor.element_size()
    return max(sizes, key=sizes.__getitem__) if sizes else torch.float32
