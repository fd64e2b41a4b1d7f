"""Documents from local `.txt`, `.jsonl` and `.parquet` files (and `.json` ones named or globbed).

`.txt`: the whole file is one document. `.jsonl`: one JSON object per line,
the document is its `text_field`. `.parquet`: one document per row, from the
column `text_field` (pyarrow, imported only when a parquet file is read).
`.json`: JSON Lines as `.jsonl` (what `datasets` writes, and torchtitan's `c4_test/data.json`), or one JSON array
of objects, read whole. A folder's scan leaves `.json` files out (datasets keep metadata such as
`dataset_info.json` beside their data); a file or glob that names them reads them.
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
NAMED_SUFFIXES = (*SUFFIXES, ".json")
"""What a file or glob may name: also `.json`, which a folder's scan leaves out (module docstring)."""


def expand_pattern(pattern: str, key: str) -> list[Path]:
    """The sorted data files that a file, folder or glob names.

    Args:
        pattern: a file, a folder (searched recursively) or a glob.
        key: the config key that holds `pattern`, for error messages.
    """
    expanded = str(Path(pattern).expanduser())
    kinds: tuple[str, ...] = NAMED_SUFFIXES
    if any(ch in expanded for ch in "*?["):
        files = [Path(p) for p in glob.glob(expanded, recursive=True) if Path(p).is_file()]
    elif Path(expanded).is_dir():
        files, kinds = [p for p in Path(expanded).rglob("*") if p.is_file()], SUFFIXES
    elif Path(expanded).is_file():
        if Path(expanded).suffix not in NAMED_SUFFIXES:
            raise ConfigError(f"{key}: {pattern} is not a {_KINDS}/.json file; convert it or point the key elsewhere")
        files = [Path(expanded)]
    else:
        raise MissingFileError(f"{key}: {pattern} does not exist; point it at a file, folder or glob of {_KINDS} files")
    files = sorted((p for p in files if p.suffix in kinds), key=str)
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
    if path.suffix == ".jsonl" or (path.suffix == ".json" and not _json_array(path)):
        with open(path, "rb") as f:
            return sum(1 for line in f if line.strip())
    if path.suffix == ".json":
        return len(_read_json_array(path))
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
    elif path.suffix == ".jsonl" or (path.suffix == ".json" and not _json_array(path)):
        yield from read_jsonl(path, text_field, start, field_key)
    elif path.suffix == ".json":
        for index, record in enumerate(_read_json_array(path)[start:], start=start):
            yield _text_of(record, text_field, f"{path} (record {index})", field_key)
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
            yield _text_of(record, text_field, f"{path}:{line_no}", field_key)


def _text_of(record: object, text_field: str, where: str, field_key: str) -> str:
    """The `text_field` of one JSON record, or a one-line error naming `where` and `field_key`."""
    if not isinstance(record, dict) or text_field not in record:
        fields = list(record) if isinstance(record, dict) else type(record).__name__
        raise ConfigError(
            f"{where} has no field {text_field!r} (has {fields}); set {field_key} to the field of the text"
        )
    return str(record[text_field] or "")


def _json_array(path: Path) -> bool:
    """Whether the `.json` file `path` holds one JSON array (its first non-blank character is '['), not JSON Lines."""
    with open(path, "rb") as f:
        while chunk := f.read(4096):
            text = chunk.lstrip()
            if text:
                return text.startswith(b"[")
    return False


def _read_json_array(path: Path) -> list[object]:
    """The records of the `.json` file `path` that holds one JSON array, parsed whole."""
    try:
        records = json.loads(path.read_text(encoding="utf-8", errors="replace"))
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path} is not valid JSON ({e}); fix it, or write one object per line (.jsonl)") from e
    assert isinstance(records, list), "a file whose first character is '[' parses to a list"
    return records


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

    def __str__(self) -> str:  # what a message names: the file, or the first and last of several
        if len(self.files) == 1:
            return repr(str(self.files[0]))
        return f"{len(self.files)} files {str(self.files[0])!r} ... {str(self.files[-1])!r}"
