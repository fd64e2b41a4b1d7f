"""The checkpoint folder of a run: `step-N/` folders, complete once they hold a manifest.

    <run>/checkpoint/step-2/        complete: manifest.json + .metadata + __<rank>_<i>.distcp + *.json
    <run>/checkpoint/step-4.tmp/    being written (or left by a crash): never loaded, removed at start-up

A save writes `step-N.tmp/`, and only once every file and the manifest are on disk is
the folder renamed to `step-N/` (one atomic rename), so a crash at any moment leaves
the previous checkpoint the newest complete one. Only rank 0 creates, renames or
deletes folders.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
from pathlib import Path

from titan_ckpt.manifest import MANIFEST_FILE

logger = logging.getLogger("titan")

_STEP = re.compile(r"step-(\d+)")
TMP_SUFFIX = ".tmp"


def step_folder(root: Path, step: int) -> Path:
    """`root/step-N`.

    Args:
        root: the run's checkpoint folder.
        step: the step.
    """
    return root / f"step-{step}"


def tmp_folder(root: Path, step: int) -> Path:
    """`root/step-N.tmp`, where step N is written.

    Args:
        root: the run's checkpoint folder.
        step: the step.
    """
    return root / f"step-{step}{TMP_SUFFIX}"


def list_complete_steps(root: Path) -> list[int]:
    """Steps of the complete checkpoints (a `step-N` folder with a manifest) in `root`, ascending.

    Args:
        root: the run's checkpoint folder (may not exist yet).
    """
    if not root.is_dir():
        return []
    steps = []
    for path in root.iterdir():
        match = _STEP.fullmatch(path.name)
        if match and path.is_dir():
            if (path / MANIFEST_FILE).is_file():
                steps.append(int(match.group(1)))
            else:
                logger.warning(
                    "checkpoint: ignoring %s, which has no %s (not a complete checkpoint)", path, MANIFEST_FILE
                )
    return sorted(steps)


def remove_tmp_folders(root: Path) -> list[Path]:
    """Delete the unfinished `step-N.tmp` folders a crash or a kill left behind; returns them.

    Args:
        root: the run's checkpoint folder.
    """
    if not root.is_dir():
        return []
    removed = sorted(p for p in root.iterdir() if p.is_dir() and p.name.endswith(TMP_SUFFIX))
    for path in removed:
        logger.info("checkpoint: removing unfinished %s", path)
        shutil.rmtree(path, ignore_errors=True)
    return removed


def fsync_dir(path: Path) -> None:
    """Make a rename inside `path` durable (a no-op where directories cannot be opened).

    Args:
        path: the folder the rename happened in.
    """
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def publish(tmp: Path, final: Path) -> None:
    """Rename a finished `step-N.tmp` to `step-N`, replacing an older `step-N` of an abandoned timeline.

    Args:
        tmp: the finished folder (its manifest written).
        final: the `step-N` name it takes.
    """
    if final.exists():  # e.g. resumed with load_step from before it: the new step N wins
        old = final.with_name(final.name + ".replaced" + TMP_SUFFIX)
        shutil.rmtree(old, ignore_errors=True)
        os.rename(final, old)
        os.rename(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(tmp, final)
    fsync_dir(final.parent)


def prune(root: Path, keep_latest_k: int, keep_interval: int = 0) -> list[int]:
    """Delete all but the newest `keep_latest_k` complete checkpoints (0 keeps all) and those whose step is a
    multiple of `keep_interval` (0: none); returns the steps removed.

    Each is first renamed to `step-N.tmp` so a crash mid-delete never leaves a
    damaged `step-N` that looks complete.

    Args:
        root: the run's checkpoint folder.
        keep_latest_k: how many of the newest to keep.
        keep_interval: also keep every step that is a multiple of this (milestones).
    """
    if keep_latest_k <= 0:
        return []
    old = [s for s in list_complete_steps(root)[:-keep_latest_k] if not (keep_interval and s % keep_interval == 0)]
    for step in old:
        doomed = root / f"step-{step}.pruned{TMP_SUFFIX}"
        os.rename(step_folder(root, step), doomed)
        shutil.rmtree(doomed, ignore_errors=True)
    return old
