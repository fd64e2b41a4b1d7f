"""Single-file `torch.save` state dicts (`.pt`, `.bin`), loaded with `weights_only=True`
so no pickled code ever runs."""

from __future__ import annotations

from pathlib import Path

import torch

from titan_ckpt.errors import CheckpointError

TORCH_SUFFIXES = (".pt", ".pth", ".bin")
"""File endings recognised as one-file torch state dicts."""


def read_torch_state_dict(path: str | Path) -> dict[str, torch.Tensor]:
    """Load a state dict saved with `torch.save`; a `{"model": state_dict}` wrapper is unwrapped.

    Args:
        path: the `.pt` / `.bin` file.

    Raises:
        ValueError: not a loadable weights-only file, or not a dict of tensors.
    """
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # truncated zip, pickle with code, ...
        raise CheckpointError(
            f"{path} cannot be loaded with torch.load(weights_only=True) ({type(err).__name__}); "
            "it is damaged or not a plain state dict"
        ) from None
    if isinstance(obj, dict) and isinstance(obj.get("model"), dict):
        obj = obj["model"]
    if not isinstance(obj, dict) or not all(isinstance(v, torch.Tensor) for v in obj.values()):
        raise CheckpointError(
            f"{path} does not hold a state dict (name -> tensor); save one with torch.save(model.state_dict(), path)"
        )
    return obj


def write_torch_state_dict(path: str | Path, state_dict: dict[str, torch.Tensor]) -> None:
    """`torch.save` a state dict (shared tensors stay shared).

    Args:
        path: the file to create; use `atomic_output` around this for atomicity.
        state_dict: tensors by name.
    """
    torch.save(dict(state_dict), path)
