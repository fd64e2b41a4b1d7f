"""Pre-tokenized data on disk: the writer behind `titan tokenize`, and the manifest reader.

A token-shard folder holds

    manifest.json       format + version, dtype, vocab_size, bos_id / eos_id, the tokenizer's
                        fingerprint, total tokens and documents, each shard's counts, the source
    shard-00000.bin     raw tokens, native byte order (little-endian everywhere Titan runs):
                        uint16 when vocab_size <= 65536, else uint32; `np.memmap` reads it as is
    shard-00000.idx     the shard's document boundaries, int64: n_documents + 1 offsets, 0 ... n_tokens
    shard-00001.bin ...

The shards, in order, hold exactly `PackedLoader`'s token stream: every document as
`[bos] + ids + [eos]`, in the source's order, concatenated. A shard holds whole documents
and is closed once it has at least `shard_tokens` tokens.

Writing is atomic: everything goes into a hidden temporary folder next to the output,
which is renamed into place only once the manifest is written; on an error or Ctrl-C the
temporary folder is removed, so an output folder is either complete or absent.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import shutil
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from titan_core.config.errors import ConfigError
from titan_core.data.tokenizer import Tokenizer, tokenizer_fingerprint

__all__ = [
    "FORMAT",
    "VERSION",
    "MANIFEST",
    "DEFAULT_SHARD_TOKENS",
    "ShardInfo",
    "TokenShardManifest",
    "token_dtype",
    "is_token_shard_folder",
    "read_manifest",
    "write_token_shards",
    "check_output",
    "wrap_document",
]

FORMAT = "titan-token-shards"
VERSION = 1
MANIFEST = "manifest.json"
DEFAULT_SHARD_TOKENS = 100_000_000  # 200 MB of uint16 per shard
_DOCS_PER_TASK = 64  # documents a worker encodes per task, at most
_TASK_CHARS = 1 << 18  # characters of text per task, at most: ~256 KB, so that a few long documents still spread


@dataclass(frozen=True)
class ShardInfo:
    """One shard: its token file, its document index, and their lengths."""

    tokens: str
    index: str
    n_tokens: int
    n_documents: int


@dataclass(frozen=True)
class TokenShardManifest:
    """What `manifest.json` says about a token-shard folder (`read_manifest` checks it)."""

    folder: Path
    dtype: str
    vocab_size: int
    bos_id: int
    eos_id: int
    tokenizer: str
    tokenizer_description: str
    total_tokens: int
    total_documents: int
    shards: tuple[ShardInfo, ...]
    source: Any


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 when every id (< `vocab_size`) fits in it, else uint32.

    Args:
        vocab_size: the tokenizer's number of tokens.
    """
    return np.dtype(np.uint16 if vocab_size <= 1 << 16 else np.uint32)


def is_token_shard_folder(path: str | Path | None) -> bool:
    """Whether `path` is a folder whose `manifest.json` is a token-shard manifest.

    Args:
        path: any path (or None).
    """
    if not path:
        return False
    manifest = Path(path).expanduser() / MANIFEST
    if not manifest.is_file():
        return False
    try:
        return json.loads(manifest.read_text(encoding="utf-8")).get("format") == FORMAT
    except (OSError, ValueError, AttributeError):
        return False


def read_manifest(folder: str | Path, key: str = "training.dataset_path") -> TokenShardManifest:
    """The manifest of a token-shard folder, checked against the files beside it.

    Args:
        folder: a folder written by `write_token_shards` (`titan tokenize`).
        key: the config key that names `folder`, for error messages.

    Raises:
        ValueError: the manifest is missing, of another format or version, or
            disagrees with the shard files (truncated or replaced).
    """
    folder = Path(folder).expanduser()
    redo = "re-run `titan tokenize` into a fresh folder"
    try:
        raw = json.loads((folder / MANIFEST).read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ConfigError(f"{key}: cannot read {folder / MANIFEST} ({e}); {redo}") from e
    if not isinstance(raw, dict) or raw.get("format") != FORMAT:
        raise ConfigError(f"{key}: {folder / MANIFEST} is not a {FORMAT} manifest; {redo}")
    if raw.get("version") != VERSION:
        raise ConfigError(
            f"{key}: {folder} is {FORMAT} version {raw.get('version')}, this Titan reads version {VERSION}; {redo}"
        )
    try:
        shards = tuple(
            ShardInfo(s["tokens"], s["index"], int(s["n_tokens"]), int(s["n_documents"])) for s in raw["shards"]
        )
        manifest = TokenShardManifest(
            folder=folder,
            dtype=str(raw["dtype"]),
            vocab_size=int(raw["vocab_size"]),
            bos_id=int(raw["bos_id"]),
            eos_id=int(raw["eos_id"]),
            tokenizer=str(raw["tokenizer"]),
            tokenizer_description=str(raw.get("tokenizer_description", "")),
            total_tokens=int(raw["total_tokens"]),
            total_documents=int(raw["total_documents"]),
            shards=shards,
            source=raw.get("source"),
        )
    except (KeyError, TypeError, ValueError) as e:
        raise ConfigError(f"{key}: {folder / MANIFEST} lacks or garbles {e}; {redo}") from e
    if manifest.dtype not in ("uint16", "uint32") or token_dtype(manifest.vocab_size) != np.dtype(manifest.dtype):
        raise ConfigError(
            f"{key}: {folder / MANIFEST} has dtype {manifest.dtype} for vocab_size {manifest.vocab_size}; {redo}"
        )
    if not shards or manifest.total_tokens != sum(s.n_tokens for s in shards) or manifest.total_tokens < 1:
        raise ConfigError(f"{key}: {folder / MANIFEST} has no tokens or its totals disagree with its shards; {redo}")
    itemsize = np.dtype(manifest.dtype).itemsize
    for shard in shards:
        for name, size in ((shard.tokens, shard.n_tokens * itemsize), (shard.index, (shard.n_documents + 1) * 8)):
            path = folder / name
            if not path.is_file() or path.stat().st_size != size:
                found = path.stat().st_size if path.is_file() else "no file"
                raise ConfigError(
                    f"{key}: {path} should hold {size} bytes, found {found}; the folder is damaged: {redo}"
                )
    return manifest


def write_token_shards(
    documents: Iterable[str],
    tokenizer: Tokenizer,
    output: str | Path,
    *,
    shard_tokens: int = DEFAULT_SHARD_TOKENS,
    workers: int = 1,
    source: Any = None,
    force: bool = False,
    log: Callable[[str], None] | None = None,
) -> TokenShardManifest:
    """Tokenize `documents` into a token-shard folder at `output`, atomically.

    Args:
        documents: the texts, in stream order (one epoch of a `DocumentSource`).
        tokenizer: encodes each text; supplies `bos_id`, `eos_id`, `vocab_size`
            and a fingerprint (`tokenizer_fingerprint`).
        output: the folder to create.
        shard_tokens: a shard is closed once it holds at least this many tokens.
        workers: processes that encode documents (1: encode in this process).
            The document order is kept either way.
        source: a JSON-able description of where the documents came from.
        force: replace an existing token-shard folder (or empty folder) at `output`.
        log: called with a line of progress after each shard.

    Raises:
        FileExistsError: `output` exists and `force` is false, or it is not a
            token-shard folder (never deleted, even with `force`).
        ValueError: no documents, or a token id outside the tokenizer's vocabulary.
    """
    if shard_tokens < 1 or workers < 1:
        raise ConfigError(f"--shard-tokens and --workers must be >= 1, got {shard_tokens} and {workers}")
    output = Path(output).expanduser().absolute()
    check_output(output, force)
    fingerprint = tokenizer_fingerprint(tokenizer)
    dtype = token_dtype(tokenizer.vocab_size)
    tmp = output.parent / f".{output.name}.tmp-{os.getpid()}"
    output.parent.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        writer = _ShardWriter(tmp, dtype, shard_tokens, log)
        for wrapped in _encode_all(documents, tokenizer, dtype, workers):
            writer.add(wrapped)
        shards = writer.finish()
        if not shards:
            raise ConfigError(f"no documents in {source!r}; check the inputs")
        manifest = {
            "format": FORMAT,
            "version": VERSION,
            "dtype": dtype.name,
            "vocab_size": int(tokenizer.vocab_size),
            "bos_id": int(tokenizer.bos_id),
            "eos_id": int(tokenizer.eos_id),
            "tokenizer": fingerprint,
            "tokenizer_description": repr(tokenizer),
            "total_tokens": sum(s.n_tokens for s in shards),
            "total_documents": sum(s.n_documents for s in shards),
            "shard_tokens": shard_tokens,
            "shards": [vars(s) for s in shards],
            "source": source,
        }
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n", encoding="utf-8")
        _move_into_place(tmp, output)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return read_manifest(output, key="--output")


def check_output(output: str | Path, force: bool) -> None:
    """Refuse an existing output without `force`, and anything but a token-shard or empty folder with it.

    Args:
        output: the folder `write_token_shards` would create.
        force: whether an existing token-shard folder may be replaced.
    """
    output = Path(output).expanduser().absolute()
    if not output.exists():
        return
    if not force:
        raise FileExistsError(f"{output} already exists; pass --force to replace it, or choose another --output")
    if not (is_token_shard_folder(output) or (output.is_dir() and not any(output.iterdir()))):
        raise FileExistsError(
            f"{output} exists and is not a token-shard folder, so --force will not delete it; choose another --output"
        )


def _move_into_place(tmp: Path, output: Path) -> None:
    """Rename the finished `tmp` to `output`, replacing an old output only after the new one is complete."""
    old = output.parent / f".{output.name}.old-{os.getpid()}"
    if output.exists():
        output.rename(old)
    try:
        tmp.rename(output)
    except BaseException:
        if old.exists():
            old.rename(output)
        raise
    shutil.rmtree(old, ignore_errors=True)


class _ShardWriter:
    """Appends wrapped documents to `shard-NNNNN.bin`, closing a shard at `shard_tokens`."""

    def __init__(self, folder: Path, dtype: np.dtype, shard_tokens: int, log: Callable[[str], None] | None):
        self.folder, self.dtype, self.shard_tokens, self.log = folder, dtype, shard_tokens, log
        self.shards: list[ShardInfo] = []
        self.file: BinaryIO | None = None
        self.offsets: list[int] = [0]

    def add(self, wrapped: np.ndarray) -> None:
        if self.file is None:
            self.file = open(self.folder / f"shard-{len(self.shards):05d}.bin", "wb")
        wrapped.tofile(self.file)
        self.offsets.append(self.offsets[-1] + len(wrapped))
        if self.offsets[-1] >= self.shard_tokens:
            self.close_shard()

    def close_shard(self) -> None:
        name = f"shard-{len(self.shards):05d}"
        assert self.file is not None  # called with a shard open
        self.file.close()
        self.file = None
        np.asarray(self.offsets, dtype=np.int64).tofile(self.folder / f"{name}.idx")
        self.shards.append(ShardInfo(f"{name}.bin", f"{name}.idx", self.offsets[-1], len(self.offsets) - 1))
        self.offsets = [0]
        if self.log is not None:
            total = sum(s.n_tokens for s in self.shards)
            self.log(f"wrote {name}: {self.shards[-1].n_documents} documents, {total:,} tokens so far")

    def finish(self) -> list[ShardInfo]:
        if self.file is not None:
            self.close_shard()
        return self.shards


# The tokenizer and dtype of a worker process, set once by `_init_worker`.
_WORKER: tuple[Tokenizer, np.dtype] | None = None


def _init_worker(tokenizer: Tokenizer, dtype: np.dtype) -> None:
    global _WORKER
    _WORKER = (tokenizer, dtype)


def _encode_batch(texts: list[str]) -> list[np.ndarray]:
    assert _WORKER is not None  # set by `_init_worker` in each worker process
    return [wrap_document(text, *_WORKER) for text in texts]


def wrap_document(text: str, tokenizer: Tokenizer, dtype: np.dtype) -> np.ndarray:
    """`[bos] + encode(text) + [eos]` as a `dtype` array (`PackedLoader`'s wrapping).

    Args:
        text: one document.
        tokenizer: the tokenizer.
        dtype: the shard's token dtype.

    Raises:
        ValueError: an id is outside `[0, vocab_size)`, so it would not fit or not embed.
    """
    encode_array = getattr(tokenizer, "encode_array", None)  # a tokenizer that returns an array (tiktoken's)
    if encode_array is not None:
        array = encode_array(text)  # unsigned: checked before the cast, which would wrap an id that does not fit
        if array.size and int(array.max()) >= tokenizer.vocab_size:
            raise ValueError(
                f"{tokenizer!r} returned id {int(array.max())} outside its vocab_size {tokenizer.vocab_size}"
            )
        wrapped = np.empty(array.size + 2, dtype=dtype)
        wrapped[0], wrapped[-1] = tokenizer.bos_id, tokenizer.eos_id
        wrapped[1:-1] = array
        return wrapped
    ids = tokenizer.encode(text)
    wrapped = np.empty(len(ids) + 2, dtype=dtype)
    wrapped[0], wrapped[-1] = tokenizer.bos_id, tokenizer.eos_id
    try:
        wrapped[1:-1] = ids  # one conversion, straight into the shard's dtype (unsigned: a negative id overflows)
    except OverflowError:
        bad = next(i for i in ids if not 0 <= i < tokenizer.vocab_size)
        raise ValueError(f"{tokenizer!r} returned id {bad} outside its vocab_size {tokenizer.vocab_size}") from None
    if len(ids) and int(wrapped[1:-1].max()) >= tokenizer.vocab_size:
        bad = int(wrapped[1:-1].max())
        raise ValueError(f"{tokenizer!r} returned id {bad} outside its vocab_size {tokenizer.vocab_size}")
    return wrapped


def _encode_all(documents: Iterable[str], tokenizer: Tokenizer, dtype: np.dtype, workers: int) -> Iterator[np.ndarray]:
    """The wrapped documents, in order; with `workers > 1`, encoded by a process pool.

    At most `2 * workers` tasks are in flight, so a huge corpus never sits in memory.
    Workers are forked where the platform can (the tokenizer is inherited, not pickled).
    """
    if workers == 1:
        for text in documents:
            yield wrap_document(text, tokenizer, dtype)
        return
    method = "fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn"
    with multiprocessing.get_context(method).Pool(workers, _init_worker, (tokenizer, dtype)) as pool:
        pending: deque = deque()
        tasks = _tasks(documents)
        while True:
            while len(pending) < 2 * workers:
                batch = next(tasks, None)
                if batch is None:
                    break
                pending.append(pool.apply_async(_encode_batch, (batch,)))
            if not pending:
                return
            yield from pending.popleft().get()


def _tasks(documents: Iterable[str]) -> Iterator[list[str]]:
    """`documents` in order, grouped into tasks of at most `_DOCS_PER_TASK` documents and about `_TASK_CHARS`
    characters (a longer document is a task of its own): a corpus of a few long documents (books, code files)
    spreads over the workers too."""
    batch: list[str] = []
    chars = 0
    for text in documents:
        if batch and (len(batch) == _DOCS_PER_TASK or chars + len(text) > _TASK_CHARS):
            yield batch
            batch, chars = [], 0
        batch.append(text)
        chars += len(text)
    if batch:
        yield batch
