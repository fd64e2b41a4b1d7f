"""All-or-nothing file output: write into a hidden sibling, rename onto the destination at the end.

A crash, a bad input or a failed check leaves no half-written checkpoint behind:
the destination either does not exist or is complete. (Not to be confused with DCP's
async "staging", the copy of tensors into CPU buffers that `CheckpointManager` does.)
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def atomic_output(dst: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path beside `dst`; rename it to `dst` when the block succeeds,
    delete it when the block raises.

    The temporary path does not exist yet: create a folder or a file there.

        with atomic_output("out/model-dcp") as tmp:
            write_dcp_state_dict(tmp, state_dict)   # out/model-dcp appears only now, complete

    Args:
        dst: the final file or folder; it must not exist (nothing is overwritten).

    Raises:
        FileExistsError: `dst` exists.
    """
    dst = Path(dst)
    if dst.exists():
        raise FileExistsError(f"{dst} already exists; choose a new destination or delete it first")
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = dst.parent / f".{dst.name}.partial-{os.getpid()}"
    _remove(tmp)
    try:
        yield tmp
        if dst.exists():
            raise FileExistsError(f"{dst} appeared while it was being written; choose a new destination")
        os.replace(tmp, dst)
    finally:
        _remove(tmp)


def _remove(path: Path) -> None:
    """Delete a file or a folder tree if it exists."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()
