"""Distributed Checkpoint (DCP) folders read and written by one process, no process group.

Used to move a plain full state dict in or out of the format `CheckpointManager`'s
checkpoints use (`.metadata` plus `__<rank>_<n>.distcp` files). A DCP folder written
by an N-rank job (FSDP/TP shards) reads back here as full tensors.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from titan_ckpt.dcp_io import SafeFileSystemReader, read_metadata_safely  # never unpickles arbitrary objects
from titan_ckpt.dtypes import dtype_name, state_dict_dtype
from titan_ckpt.errors import CheckpointError, CheckpointNotFoundError
from titan_ckpt.hf_safetensors import copy_extra_files, write_hf_config

METADATA_FILE = ".metadata"


def read_dcp_tensor_shapes(folder: str | Path) -> dict[str, tuple[torch.Size, torch.dtype]]:
    """Shape and dtype of every tensor a DCP checkpoint holds, from its `.metadata`.

    Args:
        folder: the DCP checkpoint folder.

    Raises:
        FileNotFoundError: no `.metadata`; ValueError: unreadable metadata.
    """
    folder = Path(folder)
    if not (folder / METADATA_FILE).is_file():
        raise CheckpointNotFoundError(
            f"{folder / METADATA_FILE} not found; point to a DCP checkpoint folder (e.g. a step-N folder)"
        )
    try:
        metadata = read_metadata_safely(folder / METADATA_FILE)
    except Exception as err:  # DCP raises assorted types for damaged files
        raise CheckpointError(
            f"{folder / METADATA_FILE} cannot be read ({type(err).__name__}: {err}); the checkpoint is damaged"
        ) from None
    return {
        name: (meta.size, meta.properties.dtype)
        for name, meta in metadata.state_dict_metadata.items()
        if isinstance(meta, TensorStorageMetadata)
    }


def read_dcp_state_dict(folder: str | Path, names: Iterable[str]) -> dict[str, torch.Tensor]:
    """Load the named tensors of a DCP checkpoint as full CPU tensors in their stored dtype.

    Args:
        folder: the DCP checkpoint folder.
        names: keys to load (other entries, e.g. optimizer state, are not read).

    Raises:
        KeyError: a name the checkpoint does not hold.
        ValueError: the data files are missing or damaged.
    """
    shapes = read_dcp_tensor_shapes(folder)
    state_dict = {}
    for name in names:
        if name not in shapes:
            raise KeyError(name)
        size, dtype = shapes[name]
        state_dict[name] = torch.empty(size, dtype=dtype)
    try:
        with warnings.catch_warnings():  # "torch.distributed is ... uninitialized": single process is the intent
            warnings.simplefilter("ignore", UserWarning)
            dcp.load(state_dict, storage_reader=SafeFileSystemReader(str(folder)), no_dist=True)
    except Exception as err:  # DCP wraps per-rank failures in CheckpointException
        raise CheckpointError(
            f"{folder}: DCP data files cannot be read ({type(err).__name__}); the checkpoint is incomplete or damaged"
        ) from None
    return state_dict


def write_dcp_state_dict(folder: str | Path, state_dict: Mapping[str, torch.Tensor]) -> None:
    """Save a full state dict as a single-process DCP checkpoint.

    Args:
        folder: a new folder (created); use `atomic_output` around this for atomicity.
        state_dict: tensors by name (tensors shared between names are fine).
    """
    Path(folder).mkdir(parents=True, exist_ok=False)
    with warnings.catch_warnings():  # "torch.distributed is ... uninitialized": single process is the intent
        warnings.simplefilter("ignore", UserWarning)
        dcp.save(dict(state_dict), checkpoint_id=str(folder), no_dist=True)


def write_dcp_checkpoint(
    folder: str | Path,
    state_dict: Mapping[str, torch.Tensor],
    config: dict[str, Any] | None = None,
    extra_files_from: str | Path | None = None,
) -> None:
    """A DCP checkpoint folder with the model's `config.json` and tokenizer files beside the weights,
    so the folder alone says what model it holds (the DCP counterpart of `write_hf_checkpoint`).

    Args:
        folder: a new folder (created); use `atomic_output` around this for atomicity.
        state_dict: tensors by name.
        config: the `config.json` content, its `torch_dtype` set to the weights' dtype; None writes none.
        extra_files_from: a folder whose `HF_EXTRA_FILES` (tokenizer, generation config) are copied when present.
    """
    write_dcp_state_dict(folder, state_dict)
    if config is not None:
        write_hf_config(folder, {**config, "torch_dtype": dtype_name(state_dict_dtype(dict(state_dict)))})
    if extra_files_from is not None:
        copy_extra_files(extra_files_from, folder)
