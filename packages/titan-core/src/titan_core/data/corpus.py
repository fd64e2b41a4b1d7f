"""Corpus sources: documents (strings) in a fixed order, re-iterable.

Every source iterates from its first document each time it is iterated (one
epoch), and `skip(n_docs)` iterates from the `n_docs`-th document on, skipping
cheaply (whole files, unparsed lines) so that a resumed run does not re-read
what it already trained on. `build_source` picks the source from the config:

- `"stdlib"` (the default): the Python standard library's own `.py` files, a
  corpus every Python install already has. Titan's offline default. Its files
  split in two, so that validation on it is held out: a file whose path's CRC-32
  is 0 mod 20 (34 of 601 files, 0.5 of 11 MB, on Python 3.11) is validation's
  (`split="validation"`), every other file training's. The rule is per file, so a
  Python version that adds or drops files leaves the others where they were.
- a local file, folder or glob of `.txt` / `.jsonl` / `.parquet` files.
- torchtitan's dataset names, read as torchtitan reads them (`TORCHTITAN_DATASETS`), so that its TOML files run as
  written: `c4` (the hub's `allenai/c4:en`), `c4_validation` (its validation split) and `c4_test` (the test corpus
  of a torchtitan checkout, `./tests/assets/c4_test`), unless a local path of that name exists.
- anything else: a Hugging Face hub dataset, streamed.
"""

from __future__ import annotations

import builtins
import glob
import importlib
import os
import sys
import sysconfig
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Literal, Protocol, runtime_checkable

from titan_core.config.errors import MissingFileError
from titan_core.data.hf_dataset import HFDatasetSource
from titan_core.data.local_files import SUFFIXES, LocalFileSource, expand_pattern

__all__ = ["DocumentSource", "StdlibSource", "build_source", "looks_like_path", "torchtitan_dataset"]

# Stdlib folders that are not library code (tests, the IDE, installed packages).
_STDLIB_SKIP = frozenset({"test", "tests", "idlelib", "site-packages", "dist-packages", "lib2to3", "__pycache__"})
VALIDATION_EVERY = 20
"""One stdlib file in this many (by its path's CRC-32) is held out for validation."""
Split = Literal["train", "validation", "all"]

TORCHTITAN_DATASETS: dict[str, tuple[str, Split | None]] = {
    "c4": ("allenai/c4:en", None),
    "c4_validation": ("allenai/c4:en", "validation"),
    "c4_test": ("tests/assets/c4_test/*.json", None),
}
"""torchtitan's dataset name -> (what Titan reads for it, the hub split it always reads, or None for the section's):
torchtitan v0.2's registry (`hf_datasets/text_datasets.py`), where `c4_test` is a folder of its repository that
`datasets` reads relative to the working directory (a `data.json` of JSON Lines)."""


@runtime_checkable
class DocumentSource(Protocol):
    """Documents in a fixed order; iterating again starts a new epoch."""

    def __iter__(self) -> Iterator[str]:
        """The documents from the first."""
        ...

    def skip(self, n_docs: int) -> Iterator[str]:
        """The documents from the `n_docs`-th on (empty past the end)."""
        ...


def build_source(
    dataset: str,
    dataset_path: str | None = None,
    text_field: str = "text",
    split: Split = "train",
    section: str = "training",
    dataset_key: str | None = None,
    field_key: str = "training.dataset_text_field",
) -> DocumentSource:
    """The document source that the config names.

    Args:
        dataset: `"stdlib"`, a local path/glob, or a Hugging Face dataset name.
        dataset_path: local files (a file, folder or glob); when set, it wins
            over `dataset`.
        text_field: the JSON field / parquet column / record field of the text.
        split: which part of the stdlib corpus (`StdlibSource`), or of a hub dataset (its `validation` split for
            `"validation"`, else `train`); local files are read whole.
        section: the config section the keys belong to (`training`, `validation`), for error messages.
        dataset_key: the config key `dataset` comes from, for messages; None = `<section>.dataset`.
        field_key: the config key `text_field` comes from, for messages.
    """
    key = dataset_key or f"{section}.dataset"
    if dataset_path:
        return LocalFileSource(expand_pattern(dataset_path, f"{section}.dataset_path"), text_field, field_key=field_key)
    if dataset == "stdlib":
        return StdlibSource(split=split)
    if (torchtitan := torchtitan_dataset(dataset)) is not None:
        name = dataset
        dataset, forced = torchtitan
        split = forced or split
        if looks_like_path(dataset) and not glob.glob(dataset):
            raise MissingFileError(
                f"{key}: {name!r} is torchtitan's test corpus, which it reads from {dataset} under the working "
                f"directory (a torchtitan checkout's); run from there, or point {key} at your own files or 'stdlib'"
            )
    if looks_like_path(dataset):
        return LocalFileSource(expand_pattern(dataset, key), text_field, field_key=field_key)
    held_out = "validation" if split == "validation" else "train"
    return HFDatasetSource(dataset, text_field, key=key, field_key=field_key, split=held_out)


def torchtitan_dataset(name: str) -> tuple[str, Split | None] | None:
    """What Titan reads for torchtitan's dataset `name` (`TORCHTITAN_DATASETS`); None for another name, or where a
    local path of that name exists (it wins).

    Args:
        name: a section's `dataset`.
    """
    return TORCHTITAN_DATASETS.get(name) if not os.path.exists(name) else None


def looks_like_path(name: str) -> bool:
    """Whether `name` is a local path or glob rather than a hub dataset name.

    Args:
        name: the `training.dataset` value.
    """
    return (
        name.startswith(("/", "./", "../", "~", "."))
        or any(ch in name for ch in "*?[")
        or name.endswith(SUFFIXES)
        or os.path.exists(name)
    )


class StdlibSource:
    """The Python standard library's `.py` files, sorted, one document per file.

    Skips the `test`/`tests`/`idlelib`/`site-packages`/`lib2to3` folders. On an
    install stripped of its `.py` files, falls back to the docstrings of the
    builtin modules (one document per module): still offline, never a download.
    Those split by their index: every 20th, from the first, is validation's.

    Args:
        root: the stdlib folder; `sysconfig.get_paths()["stdlib"]` by default.
        split: `"train"` (the default), `"validation"` (the files held out from training: module docstring), or
            `"all"`.
    """

    def __init__(self, root: str | Path | None = None, split: Split = "train"):
        self.root = Path(root if root is not None else sysconfig.get_paths()["stdlib"])
        self.split = split
        self._files: list[Path] | None = None
        self._fallback: list[str] | None = None

    @property
    def files(self) -> list[Path]:
        """The stdlib `.py` files of this split, sorted by their path under `root`."""
        if self._files is None:
            files = list_stdlib_files(self.root)
            self._files = [f for f in files if self._keeps(zlib.crc32(f.relative_to(self.root).as_posix().encode()))]
        return self._files

    def _keeps(self, number: int) -> bool:
        """Whether the document of `number` (its path's CRC-32; a fallback document's index) is in this split."""
        return self.split == "all" or (number % VALIDATION_EVERY == 0) == (self.split == "validation")

    def __iter__(self) -> Iterator[str]:
        return self.skip(0)

    def skip(self, n_docs: int) -> Iterator[str]:
        """The documents from the `n_docs`-th on.

        Args:
            n_docs: how many documents to skip.
        """
        if not self.files:
            if self._fallback is None:
                self._fallback = [doc for i, doc in enumerate(collect_builtin_docs()) if self._keeps(i)]
            yield from self._fallback[n_docs:]
            return
        for path in self.files[n_docs:]:
            yield path.read_text(encoding="utf-8", errors="replace")

    def __repr__(self) -> str:
        return f"StdlibSource({str(self.root)!r}, split={self.split!r})"


def list_stdlib_files(root: Path) -> list[Path]:
    """The `.py` files under `root`, sorted, outside the skipped folders.

    Args:
        root: the stdlib folder.
    """
    files: list[Path] = []
    for folder, subfolders, names in os.walk(root):
        subfolders[:] = [name for name in subfolders if name not in _STDLIB_SKIP]
        files.extend(Path(folder, name) for name in names if name.endswith(".py"))
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def collect_builtin_docs() -> list[str]:
    """One document per builtin module: its docstring and its members' docstrings.

    The corpus of last resort: it comes with the interpreter itself.
    """
    modules = [builtins]
    for name in sorted(sys.builtin_module_names):
        try:
            modules.append(importlib.import_module(name))
        except ImportError:
            continue
    documents = []
    for module in dict.fromkeys(modules):
        parts = [f"{module.__name__}\n\n{module.__doc__ or ''}"]
        for name, member in sorted(vars(module).items()):
            doc = getattr(member, "__doc__", None)
            if callable(member) and not name.startswith("_") and isinstance(doc, str) and doc.strip():
                parts.append(f"{name}\n{doc}")
        documents.append("\n\n".join(parts))
    return documents
