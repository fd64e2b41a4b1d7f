"""The tokenizer protocol, the offline byte tokenizer, and `build_tokenizer`.

A tokenizer turns a document into token ids and back. The loader wraps each
document as `[bos] + encode(text) + [eos]`, so `encode` adds no special tokens.
Three implementations:

- `ByteTokenizer` (here): UTF-8 bytes, needs nothing; the offline default.
- `HFTokenizer` (`hf_tokenizer.py`): a Hugging Face `tokenizer.json`.
- `TiktokenTokenizer` (`tiktoken_tokenizer.py`): a tiktoken BPE ranks file,
  the format of Llama 3's original `tokenizer.model`.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol, runtime_checkable

from titan_core.config.errors import ConfigError, MissingFileError

__all__ = ["Tokenizer", "ByteTokenizer", "build_tokenizer", "tokenizer_fingerprint", "sha256_of_files"]

_CONFIG_KEY = "model.hf_assets_path"
# A tiktoken ranks file: "<base64 token> <rank>" on every line.
_TIKTOKEN_LINE = re.compile(rb"^[A-Za-z0-9+/=]+ \d+\r?$")


@runtime_checkable
class Tokenizer(Protocol):
    """What the data loader needs from a tokenizer.

    Every id that `encode` returns, and `bos_id`/`eos_id`, is < `vocab_size`.
    """

    bos_id: int
    eos_id: int
    vocab_size: int

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`, without BOS/EOS or any other special token."""
        ...

    def decode(self, ids: Sequence[int]) -> str:
        """The text of `ids` (how special tokens render is up to the tokenizer)."""
        ...


class ByteTokenizer:
    """UTF-8 bytes as tokens: ids 0-255 are bytes, 256 is BOS, 257 is EOS.

    Round trips any Unicode text exactly. Needs no file and no package.
    """

    bos_id = 256
    eos_id = 257
    vocab_size = 258

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`: its UTF-8 bytes.

        Args:
            text: any string.
        """
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        """The text of `ids`; BOS/EOS are dropped, bad UTF-8 becomes U+FFFD.

        Args:
            ids: token ids < 258.
        """
        data = bytes(i for i in ids if i < 256)
        return data.decode("utf-8", errors="replace")

    def fingerprint(self) -> str:
        """A constant: the byte tokenizer never changes (see `tokenizer_fingerprint`)."""
        return "byte-v1"

    def __repr__(self) -> str:
        return "ByteTokenizer()"


def build_tokenizer(path: str | Path | None) -> Tokenizer:
    """The tokenizer that `path` holds.

    Args:
        path: None for the `ByteTokenizer`; a folder holding `tokenizer.json`
            (Hugging Face), else `tokenizer.model` or `*.tiktoken` (tiktoken
            ranks, also looked for under `original/`); or one such file.

    Raises:
        FileNotFoundError: `path` does not exist or holds no tokenizer file.
        ValueError: the file is in a format Titan cannot read.
    """
    if path is None:
        return ByteTokenizer()
    path = Path(path).expanduser()
    if not path.exists():
        raise MissingFileError(
            f"{_CONFIG_KEY}: {path} does not exist; point it at a folder holding "
            "tokenizer.json or tokenizer.model (tiktoken), or leave it unset for the byte tokenizer"
        )
    file = find_tokenizer_file(path) if path.is_dir() else path
    return load_tokenizer_file(file)


def find_tokenizer_file(folder: Path) -> Path:
    """The tokenizer file inside `folder`: `tokenizer.json` first, then tiktoken files.

    Args:
        folder: a model's assets folder.
    """
    for sub in (folder, folder / "original"):
        if (sub / "tokenizer.json").is_file():
            return sub / "tokenizer.json"
        if (sub / "tokenizer.model").is_file():
            return sub / "tokenizer.model"
        tiktoken_files = sorted(sub.glob("*.tiktoken"))
        if tiktoken_files:
            return tiktoken_files[0]
    raise MissingFileError(
        f"{_CONFIG_KEY}: no tokenizer.json, tokenizer.model or *.tiktoken in {folder} "
        "(nor in its original/); download the model's tokenizer files there, "
        "or leave the key unset for the byte tokenizer"
    )


def load_tokenizer_file(file: Path) -> Tokenizer:
    """A tokenizer from one file, chosen by its name and contents.

    Args:
        file: a `tokenizer.json` / `*.json` (Hugging Face) or a tiktoken
            ranks file (`tokenizer.model`, `*.tiktoken`, ...).
    """
    if file.suffix == ".json":
        from titan_core.data.hf_tokenizer import HFTokenizer

        return HFTokenizer(file)
    with open(file, "rb") as f:
        first_line = f.readline()
    if _TIKTOKEN_LINE.match(first_line):
        from titan_core.data.tiktoken_tokenizer import TiktokenTokenizer

        return TiktokenTokenizer(file)
    raise ConfigError(
        f"{_CONFIG_KEY}: {file} is neither a Hugging Face tokenizer.json nor a tiktoken ranks file "
        "(e.g. a SentencePiece model); point the key at a folder holding tokenizer.json instead"
    )


def tokenizer_fingerprint(tokenizer: Tokenizer) -> str:
    """A stable string that changes whenever `tokenizer` would encode differently.

    Pre-tokenized data records it (`titan tokenize`) and the loader compares it
    with the run's tokenizer. Each tokenizer class supplies its own through a
    `fingerprint()` method: a constant for `ByteTokenizer`, the sha256 of the
    tokenizer file(s) for `HFTokenizer` and `TiktokenTokenizer`.

    Args:
        tokenizer: any tokenizer with a `fingerprint()` method.

    Raises:
        TypeError: the tokenizer has no `fingerprint()` method.
    """
    fingerprint = getattr(tokenizer, "fingerprint", None)
    if fingerprint is None:
        raise TypeError(
            f"{tokenizer!r} has no fingerprint() method, so pre-tokenized data cannot be checked against it; "
            "add one returning a string that changes whenever its encoding does"
        )
    return str(fingerprint())


def sha256_of_files(*files: Path, extra: str = "") -> str:
    """The hex sha256 of the files' contents, in order, then of `extra` (names and folders do not count).

    Args:
        files: files to hash; a missing one counts as absent (which differs from empty).
        extra: settings that change the encoding but live outside the files.
    """
    digest = hashlib.sha256()
    for file in files:
        if not file.is_file():
            digest.update(b"absent;")
            continue
        digest.update(f"{file.stat().st_size};".encode())  # each file's length keeps the boundaries
        with open(file, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
    digest.update(extra.encode())
    return digest.hexdigest()
