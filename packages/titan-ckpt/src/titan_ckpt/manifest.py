"""The manifest that makes a checkpoint folder verifiable: every file, its byte size and CRC-32.

A step folder is complete only once `manifest.json` is in it. While DCP writes, each
rank records the size and checksum of the data files it wrote itself in a small
`.sums-rank<R>.json` (so the checksums cost each rank one read of its own files,
from the page cache, in parallel); rank 0 then merges them, adds the files it wrote
(`.metadata`, the JSON states) and writes the manifest. On load the files are
checked against it, split over the ranks, before DCP reads anything.

Written here rather than taken from DCP: DCP records offsets and lengths inside its
files, but neither the files' sizes nor checksums.
"""

from __future__ import annotations

import json
import os
import zlib
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from titan_ckpt.errors import CheckpointError

MANIFEST_FILE = "manifest.json"
MANIFEST_VERSION = 1
SUMS_PREFIX = ".sums-rank"
_CHUNK = 16 << 20  # bytes read at a time when checksumming


def file_crc32(path: str | os.PathLike) -> int:
    """CRC-32 of a file's bytes (zlib's, as an unsigned int).

    Args:
        path: the file.
    """
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            crc = zlib.crc32(chunk, crc)
    return crc


def describe_files(folder: Path, names: Iterable[str], checksums: bool) -> dict[str, dict[str, int]]:
    """`{name: {"bytes": size, "crc32": crc}}` for files of `folder` (no crc32 when `checksums` is off).

    Args:
        folder: the folder the names are relative to.
        names: relative file paths.
        checksums: compute CRC-32 (reads each file once).
    """
    out = {}
    for name in sorted(set(names)):
        entry = {"bytes": (folder / name).stat().st_size}
        if checksums:
            entry["crc32"] = file_crc32(folder / name)
        out[name] = entry
    return out


def write_json_durably(path: Path, obj: Any) -> None:
    """Write `obj` as JSON to `path` via a temporary file, fsync'ed, then renamed into place.

    Args:
        path: destination file.
        obj: JSON-able data.
    """
    tmp = path.with_name(path.name + ".partial")
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1, sort_keys=True)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def write_rank_sums(folder: Path, rank: int, names: Iterable[str], checksums: bool) -> None:
    """Record the size (and CRC-32) of the files this rank wrote, for rank 0's manifest.

    Args:
        folder: the step folder being written.
        rank: this process's global rank.
        names: the files this rank wrote, relative to `folder`.
        checksums: also compute CRC-32.
    """
    write_json_durably(folder / f"{SUMS_PREFIX}{rank}.json", describe_files(folder, names, checksums))


def write_manifest(folder: Path, info: dict[str, Any], checksums: bool) -> dict[str, Any]:
    """Merge the ranks' sums, describe every other file, and write `manifest.json` last.

    Args:
        folder: the finished step folder (all ranks' data and DCP's `.metadata` on disk).
        info: what the checkpoint holds (step, contents, ...), stored beside the file list.
        checksums: compute CRC-32 for the files no rank described.

    Returns:
        The manifest written.
    """
    files: dict[str, dict[str, int]] = {}
    sums_files = sorted(folder.glob(f"{SUMS_PREFIX}*.json"))
    for sums in sums_files:
        files.update(json.loads(sums.read_text()))
    on_disk = {
        str(p.relative_to(folder))
        for p in folder.rglob("*")
        if p.is_file()
        and p.name != MANIFEST_FILE
        and not p.name.startswith(SUMS_PREFIX)
        and not p.name.endswith(".partial")
    }
    missing = sorted(set(files) - on_disk)
    if missing:
        raise CheckpointError(f"{folder / missing[0]} was written by a rank but is gone; the save failed, rerun it")
    for name, entry in files.items():
        size = (folder / name).stat().st_size
        if size != entry["bytes"]:
            raise CheckpointError(
                f"{folder / name} has {size} bytes, its writer recorded {entry['bytes']}; the save failed, rerun it"
            )
    files.update(describe_files(folder, on_disk - set(files), checksums))
    manifest = {"version": MANIFEST_VERSION, **info, "files": files}
    write_json_durably(folder / MANIFEST_FILE, manifest)
    for sums in sums_files:
        sums.unlink()
    return manifest


def read_manifest(folder: Path) -> dict[str, Any]:
    """The manifest of a step folder.

    Args:
        folder: the step folder.

    Raises:
        CheckpointError: no manifest (an unfinished save), or not a titan-ckpt manifest.
    """
    path = folder / MANIFEST_FILE
    if not path.is_file():
        raise CheckpointError(
            f"{path} not found: {folder} is not a complete checkpoint; pick another with load_step",
            arguments=("load_step",),
        )
    try:
        manifest = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise CheckpointError(
            f"{path} is not valid JSON ({err}); pick another checkpoint with load_step", arguments=("load_step",)
        ) from None
    if not isinstance(manifest, dict) or not isinstance(manifest.get("files"), dict):
        raise CheckpointError(
            f"{path} is not a titan-ckpt manifest (no 'files' table); pick another checkpoint with load_step",
            arguments=("load_step",),
        )
    return manifest


PROBLEMS = (
    "is missing",
    "is truncated or changed (size differs from the manifest)",
    "is corrupt (CRC-32 differs from the manifest)",
)
"""What `check_file` can find, by code."""


def check_file(folder: Path, name: str, entry: dict[str, int], checksums: bool) -> int | None:
    """Check one file against its manifest entry; returns an index into `PROBLEMS`, or None if fine.

    Args:
        folder: the step folder.
        name: the file, relative to `folder`.
        entry: its manifest entry (`bytes`, optionally `crc32`).
        checksums: also compare CRC-32 when the manifest has one.
    """
    path = folder / name
    if not path.is_file():
        return 0
    if path.stat().st_size != entry["bytes"]:
        return 1
    if checksums and "crc32" in entry and file_crc32(path) != entry["crc32"]:
        return 2
    return None


def find_damaged_file(
    folder: Path, manifest: dict[str, Any], checksums: bool, group: dist.ProcessGroup | None
) -> tuple[str, str] | None:
    """Check every file of `folder` against its manifest, the files split over the ranks of `group`.

    A collective: every rank gets the same answer, the first damaged file (in name order) and
    what is wrong with it, or None when all are intact.

    Args:
        folder: the step folder.
        manifest: its manifest.
        checksums: also compare CRC-32.
        group: the ranks sharing the work (a CPU/gloo group; None: the default group).
    """
    names = sorted(manifest["files"])
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    first = len(names) * len(PROBLEMS)  # "none found"
    for index in range(rank, len(names), world):
        problem = check_file(folder, names[index], manifest["files"][names[index]], checksums)
        if problem is not None:
            first = index * len(PROBLEMS) + problem
            break
    found = torch.tensor([first], dtype=torch.int64)
    dist.all_reduce(found, op=dist.ReduceOp.MIN, group=group)
    if int(found) == len(names) * len(PROBLEMS):
        return None
    index, problem = divmod(int(found), len(PROBLEMS))
    return names[index], PROBLEMS[problem]
