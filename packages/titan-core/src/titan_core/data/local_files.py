"""Documents from local `.txt`, `.jsonl` and `.parquet` files.

`.txt`: the whole file is one document. `.jsonl`: one JSON object per line,
the document is its `text_field`. `.parquet`: one document per row, from the
column `text_field` (pyarrow, imported only when a parquet file is read).
"""

from __future__ import annotations

import glob
import json
from collections.abc import Iterator
from pathlib import Path

from titan_core.config.errors import ConfigError, MissingFileError, MissingPackageError

__all__ = ["LocalFileSource", "SUFFIXES", "expand_pattern", "count_documents", "read_documents"]

SUFFIXES = (".txt", ".jsonl", ".parquet")
_KINDS = "/".join(SUFFIXES)


def expand_pattern(pattern: str, key: str) -> list[Path]:
    """The sorted data files that a file, folder or glob names.

    Args:
        pattern: a file, a folder (searched recursively) or a glob.
        key: the config key that holds `pattern`, for error messages.
    """
    expanded = str(Path(pattern).expanduser())
    if any(ch in expanded for ch in "*?["):
        files = [Path(p) for p in glob.glob(expanded, recursive=True) if Path(p).is_file()]
    elif Path(expanded).is_dir():
        files = [p for p in Path(expanded).rglob("*") if p.is_file()]
    elif Path(expanded).is_file():
        if Path(expanded).suffix not in SUFFIXES:
            raise ConfigError(f"{key}: {pattern} is not a {_KINDS} file; convert it or point the key elsewhere")
        files = [Path(expanded)]
    else:
        raise MissingFileError(f"{key}: {pattern} does not exist; point it at a file, folder or glob of {_KINDS} files")
    files = sorted((p for p in files if p.suffix in SUFFIXES), key=str)
    if not files:
        raise MissingFileError(f"{key}: no {_KINDS} files match {pattern}; fix the path or pattern")
    return files


def count_documents(path: Path, text_field: str) -> int:
    """How many documents `path` holds, without parsing them.

    Args:
        path: a `.txt`, `.jsonl` or `.parquet` file.
        text_field: the JSON field / parquet column of the text (unused here).
    """
    if path.suffix == ".txt":
        return 1
    if path.suffix == ".jsonl":
        with open(path, "rb") as f:
            return sum(1 for line in f if line.strip())
    return import_parquet().ParquetFile(path).metadata.num_rows


def read_documents(
    path: Path, text_field: str, start: int = 0, *, field_key: str = "training.dataset_text_field"
) -> Iterator[str]:
    """The documents of `path`, from its `start`-th on.

    Args:
        path: a `.txt`, `.jsonl` or `.parquet` file.
        text_field: the JSON field / parquet column of the text.
        start: how many of the file's documents to skip.
        field_key: the setting that holds `text_field`, named when a record lacks it.
    """
    if path.suffix == ".txt":
        if start == 0:
            yield path.read_text(encoding="utf-8", errors="replace")
    elif path.suffix == ".jsonl":
        yield from read_jsonl(path, text_field, start, field_key)
    else:
        yield from read_parquet(path, text_field, start, field_key)


def read_jsonl(path: Path, text_field: str, start: int, field_key: str) -> Iterator[str]:
    """The `text_field` of each JSON line of `path`, from the `start`-th on (blank lines skipped)."""
    index = 0
    with open(path, encoding="utf-8", errors="replace") as f:
        for line_no, line in enumerate(f, start=1):
            if not line.strip():
                continue
            index += 1
            if index <= start:
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise ConfigError(f"{path}:{line_no} is not valid JSON ({e}); fix the line or remove it") from e
            if not isinstance(record, dict) or text_field not in record:
                fields = list(record) if isinstance(record, dict) else type(record).__name__
                raise ConfigError(
                    f"{path}:{line_no} has no field {text_field!r} (has {fields}); "
                    f"set {field_key} to the field of the text"
                )
            yield str(record[text_field] or "")


def read_parquet(path: Path, text_field: str, start: int, field_key: str) -> Iterator[str]:
    """The `text_field` column of `path`, row group by row group, from row `start` on."""
    parquet_file = import_parquet().ParquetFile(path)
    if text_field not in parquet_file.schema_arrow.names:
        raise ConfigError(
            f"{path} has no column {text_field!r} (has {parquet_file.schema_arrow.names}); "
            f"set {field_key} to the column of the text"
        )
    for group in range(parquet_file.num_row_groups):
        n_rows = parquet_file.metadata.row_group(group).num_rows
        if start >= n_rows:
            start -= n_rows
            continue
        column = parquet_file.read_row_group(group, columns=[text_field]).column(0)
        for text in column.to_pylist()[start:]:
            yield str(text or "")
        start = 0


def import_parquet():
    """The `pyarrow.parquet` module, or a one-line error saying how to install it."""
    try:
        import pyarrow.parquet
    except ImportError as e:
        raise MissingPackageError(
            "reading .parquet files needs pyarrow: pip install 'titan-core[hf]' (or pyarrow)"
        ) from e
    return pyarrow.parquet


class LocalFileSource:
    """The documents of a sorted list of local files, in order.

    Iterating starts at the first document every time; `skip(n)` starts at the
    n-th, skipping whole files by their document counts (no text parsed).

    Args:
        files: `.txt` / `.jsonl` / `.parquet` files, in reading order.
        text_field: the JSON field / parquet column of the text.
        field_key: the setting that holds `text_field` (a config key or a command's option), named when a
            record lacks the field.
    """

    def __init__(self, files: list[Path], text_field: str = "text", *, field_key: str = "training.dataset_text_field"):
        self.files = list(files)
        self.text_field = text_field
        self.field_key = field_key
        self._counts: dict[Path, int] = {}

    def __iter__(self) -> Iterator[str]:
        return self.skip(0)

    def skip(self, n_docs: int) -> Iterator[str]:
        """The documents from the `n_docs`-th on (an empty iterator past the end).

        Args:
            n_docs: how many documents to skip.
        """
        for path in self.files:
            if n_docs > 0:
                if path not in self._counts:
                    self._counts[path] = count_documents(path, self.text_field)
                if n_docs >= self._counts[path]:
                    n_docs -= self._counts[path]
                    continue
            yield from read_documents(path, self.text_field, n_docs, field_key=self.field_key)
            n_docs = 0

    def __repr__(self) -> str:
        return f"LocalFileSource({len(self.files)} files, text_field={self.text_field!r})"
