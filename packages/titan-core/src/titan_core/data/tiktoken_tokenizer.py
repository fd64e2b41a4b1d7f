"""A tiktoken BPE ranks file as a tokenizer: Llama 3's original `tokenizer.model`.

The file holds one `<base64 token> <rank>` per line. Special tokens follow the
ranks, laid out as in Meta's llama3 `tokenizer.py`: `<|begin_of_text|>` = n_ranks,
`<|end_of_text|>` = n_ranks + 1, ..., 256 of them in all.
"""

from __future__ import annotations

import base64
import re
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np

from titan_core.config.errors import ConfigError, MissingPackageError

__all__ = ["TiktokenTokenizer", "LLAMA3_PATTERN", "GPT2_PATTERN", "llama3_special_tokens"]

# Llama 3's pre-tokenizer split pattern (Meta's llama3 tokenizer.py).
LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# GPT-2's split pattern, for the GPT-2 ranks file.
GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""

# tiktoken's Rust core overflows its stack on very long inputs or very long
# runs of (non-)whitespace, so text is cut before encoding (as Meta does).
_MAX_ENCODE_CHARS = 400_000
_MAX_RUN_CHARS = 25_000


def llama3_special_tokens(n_reserved: int = 256) -> list[str]:
    """Llama 3's special token names, in id order after the ranks.

    Args:
        n_reserved: how many special tokens in all (256 for Llama 3).
    """
    named = [
        "<|begin_of_text|>",
        "<|end_of_text|>",
        "<|reserved_special_token_0|>",
        "<|reserved_special_token_1|>",
        "<|reserved_special_token_2|>",
        "<|reserved_special_token_3|>",
        "<|start_header_id|>",
        "<|end_header_id|>",
        "<|reserved_special_token_4|>",
        "<|eot_id|>",
    ]
    reserved = [f"<|reserved_special_token_{i}|>" for i in range(5, n_reserved - 5)]
    return named + reserved


def read_tiktoken_ranks(path: Path) -> dict[bytes, int]:
    """The `{token bytes: rank}` table of a tiktoken ranks file.

    Args:
        path: a file of `<base64 token> <rank>` lines.
    """
    ranks: dict[bytes, int] = {}
    with open(path, "rb") as f:
        for line_no, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                token, rank = line.split()
                ranks[base64.b64decode(token, validate=True)] = int(rank)
            except ValueError as e:
                raise ConfigError(
                    f"{path}:{line_no} is not a '<base64 token> <rank>' line; "
                    "model.hf_assets_path must point at a tiktoken ranks file or a tokenizer.json"
                ) from e
    return ranks


class TiktokenTokenizer:
    """A tiktoken ranks file plus Llama 3-style special tokens.

    Args:
        path: the ranks file (`tokenizer.model`, `*.tiktoken`).
        pattern: the pre-tokenizer split regex; Llama 3's by default,
            `GPT2_PATTERN` for GPT-2's ranks.
        n_special: how many special tokens follow the ranks (Llama 3: 256).
    """

    def __init__(self, path: str | Path, pattern: str = LLAMA3_PATTERN, n_special: int = 256):
        try:
            import tiktoken
        except ImportError as e:
            raise MissingPackageError(
                f"reading the tiktoken tokenizer {path} needs the tiktoken package: pip install 'titan-core[tiktoken]'"
            ) from e
        self.path = Path(path)
        self.pattern, self.n_special = pattern, n_special
        ranks = read_tiktoken_ranks(self.path)
        n_ranks = len(ranks)
        names = llama3_special_tokens(n_special)
        self.special_tokens = {name: n_ranks + i for i, name in enumerate(names)}
        self._encoding = tiktoken.Encoding(
            name=self.path.name,
            pat_str=pattern,
            mergeable_ranks=ranks,
            special_tokens=self.special_tokens,
        )
        self.bos_id = self.special_tokens["<|begin_of_text|>"]
        self.eos_id = self.special_tokens["<|end_of_text|>"]
        self.vocab_size = n_ranks + len(names)

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`; special-token names in it are encoded as plain text.

        Args:
            text: any string.
        """
        ids: list[int] = []
        for piece in split_for_tiktoken(text):
            ids.extend(self._encoding.encode_ordinary(piece))  # special-token names as plain text
        return ids

    def encode_array(self, text: str) -> np.ndarray:
        """`encode(text)` as a uint32 array, through tiktoken's buffer path: no Python int per token, which made
        `titan tokenize` ~20% faster on one core (`benchmarks/tokenize_speed.py`).

        Args:
            text: any string.
        """
        try:
            parts = [  # allowed_special=set() with no disallowed check: special-token names as plain text
                self._encoding.encode_to_numpy(piece, allowed_special=set(), disallowed_special=())
                for piece in split_for_tiktoken(text)
            ]
        except UnicodeEncodeError:  # lone surrogates: encode_ordinary's own fix-up, through the list path
            return np.asarray(self.encode(text), dtype=np.uint32)
        if not parts:
            return np.empty(0, dtype=np.uint32)
        return parts[0] if len(parts) == 1 else np.concatenate(parts)

    def decode(self, ids: Sequence[int]) -> str:
        """The text of `ids`; special tokens render as their names.

        Args:
            ids: token ids < `vocab_size`.
        """
        return self._encoding.decode(list(ids))

    def fingerprint(self) -> str:
        """`tiktoken-sha256:` + the sha256 of the ranks file, the split pattern and the special-token count."""
        from titan_core.data.tokenizer import sha256_of_files

        return "tiktoken-sha256:" + sha256_of_files(self.path, extra=f"{self.pattern}\0{self.n_special}")

    def __repr__(self) -> str:
        return f"TiktokenTokenizer({str(self.path)!r}, vocab_size={self.vocab_size})"


def split_for_tiktoken(text: str) -> Iterator[str]:
    """`text` cut into pieces that tiktoken can encode without overflowing.

    Args:
        text: any string.
    """
    for start in range(0, len(text), _MAX_ENCODE_CHARS):
        yield from split_long_runs(text[start : start + _MAX_ENCODE_CHARS], _MAX_RUN_CHARS)


def split_long_runs(text: str, max_run: int) -> Iterator[str]:
    """`text` cut so that no piece holds more than `max_run` consecutive
    whitespace or non-whitespace characters (Meta's llama3 workaround).

    Args:
        text: any string.
        max_run: longest run allowed in one piece.
    """
    if not _may_have_long_run(text, max_run):  # nearly always: skip the regex scan, 40% of encoding's time
        yield text
        return
    start = 0
    # The lookbehinds anchor each try at a run's start, keeping the scan linear.
    for run in re.finditer(rf"(?<!\s)\s{{{max_run + 1},}}|(?<!\S)\S{{{max_run + 1},}}", text):
        for cut in range(run.start() + max_run, run.end(), max_run):
            yield text[start:cut]
            start = cut
    yield text[start:]


def _may_have_long_run(text: str, max_run: int) -> bool:
    """False only if `text` has no run of more than `max_run` whitespace or non-whitespace characters.

    A run of `max_run + 1` or more characters covers a whole window of `max_run // 2` characters
    starting at a multiple of `max_run // 2`; each window is checked with C-speed string methods
    (`isspace`, and `split` stopping at the first whitespace), a few microseconds per window.
    """
    half = max_run // 2
    if half < 1:
        return True
    for start in range(0, len(text) - half + 1, half):
        window = text[start : start + half]
        if window.isspace() or window.split(None, 1) == [window]:
            return True
    return False
