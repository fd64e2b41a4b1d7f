"""DCP storage reader and writer with two additions: checksums and a safe `.metadata`.

- `ChecksummingWriter` is DCP's `FileSystemWriter` that, once this rank's data files
  are written, records their sizes and CRC-32 for the manifest (`titan_ckpt.manifest`).
- `SafeFileSystemReader` is DCP's `FileSystemReader` whose `.metadata` (a pickle, in
  DCP's format) is unpickled with an allow-list of DCP's own metadata classes, torch
  dtypes and sizes: a tampered `.metadata` cannot run code. Tensor data DCP already
  reads with `torch.load(weights_only=True)`; non-tensor items, which DCP would
  unpickle freely, the manager never puts in DCP (they go to JSON files).
"""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint.metadata as dcp_metadata
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from titan_ckpt.errors import CheckpointError
from titan_ckpt.manifest import write_rank_sums

_ALLOWED_GLOBALS = {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
    ("pathlib", "WindowsPath"),
    ("pathlib", "PureWindowsPath"),
    ("collections", "OrderedDict"),
}


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP metadata, refusing any global outside DCP's metadata types."""

    def find_class(self, module: str, name: str) -> Any:
        if module == dcp_metadata.__name__ and isinstance(getattr(dcp_metadata, name, None), type):
            return getattr(dcp_metadata, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if (module, name) in _ALLOWED_GLOBALS:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"refusing to load global {module}.{name}")


def read_metadata_safely(path: Path) -> Metadata:
    """Unpickle a DCP `.metadata` file with the allow-list.

    Args:
        path: the `.metadata` file.

    Raises:
        CheckpointError: the file refers to anything but DCP metadata types, or is damaged.
    """
    try:
        with open(path, "rb") as f:
            metadata = _MetadataUnpickler(f).load()
    except pickle.UnpicklingError as err:
        raise CheckpointError(
            f"{path}: {err}; it is not plain DCP metadata, so it is not loaded "
            "(restore the checkpoint or pick another with load_step)",
            arguments=("load_step",),
        ) from None
    except (EOFError, ValueError, TypeError, AttributeError) as err:
        raise CheckpointError(
            f"{path} is damaged ({type(err).__name__}: {err}); pick another checkpoint with load_step",
            arguments=("load_step",),
        ) from None
    if not isinstance(metadata, Metadata):
        raise CheckpointError(
            f"{path} holds a {type(metadata).__name__}, not DCP metadata; pick another checkpoint with load_step",
            arguments=("load_step",),
        )
    return metadata


class SafeFileSystemReader(FileSystemReader):
    """`FileSystemReader` that reads `.metadata` with `read_metadata_safely`.

    Args:
        path: the DCP checkpoint folder.
    """

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        metadata = read_metadata_safely(Path(self._get_metadata_path(kwargs.get("rank"))))
        storage_meta = getattr(metadata, "storage_meta", None)
        if storage_meta is None:
            storage_meta = metadata.storage_meta = StorageMeta()
        storage_meta.load_id = self.load_id
        return metadata


class ChecksummingWriter(FileSystemWriter):
    """`FileSystemWriter` that records its data files' sizes and CRC-32 once written.

    Args:
        path: the step folder being written (`step-N.tmp`).
        rank: this process's global rank (names its sums file).
        checksums: compute CRC-32 (one read of the rank's own files, from the page cache).
        thread_count: threads writing this rank's files.
    """

    def __init__(self, path: str | Path, *, rank: int, checksums: bool = True, thread_count: int = 1):
        super().__init__(str(path), thread_count=thread_count)
        self.rank = rank
        self.checksums = checksums

    def write_data(self, plan: Any, planner: Any) -> Any:
        future = super().write_data(plan, planner)
        results = future.wait()
        assert self.rank is not None  # set again by set_up_storage_writer, before any write
        write_rank_sums(Path(self.path), self.rank, {r.storage_data.relative_path for r in results}, self.checksums)
        return future
