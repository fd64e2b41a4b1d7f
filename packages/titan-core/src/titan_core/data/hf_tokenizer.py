"""A Hugging Face `tokenizer.json` as a tokenizer (the `tokenizers` package).

BOS/EOS come from `tokenizer_config.json` next to it (`bos_token`/`eos_token`,
strings or `{"content": ...}` dicts) when present, else from common names.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from titan_core.config.errors import ConfigError, MissingPackageError

__all__ = ["HFTokenizer", "BOS_NAMES", "EOS_NAMES"]

# Tried in order when tokenizer_config.json names no BOS/EOS found in the vocab.
BOS_NAMES = ("<|begin_of_text|>", "<s>", "<bos>", "<|startoftext|>", "<|endoftext|>", "[CLS]")
EOS_NAMES = ("<|end_of_text|>", "</s>", "<eos>", "<|endoftext|>", "<|im_end|>", "[SEP]")


class HFTokenizer:
    """A `tokenizer.json` loaded with the `tokenizers` package.

    Args:
        path: the `tokenizer.json` file.
    """

    def __init__(self, path: str | Path):
        try:
            from tokenizers import Tokenizer as RustTokenizer
        except ImportError as e:
            raise MissingPackageError(
                f"reading the Hugging Face tokenizer {path} needs the tokenizers package: pip install 'titan-core[hf]'"
            ) from e
        self.path = Path(path)
        try:
            self._tokenizer = RustTokenizer.from_file(str(self.path))
        except Exception as e:
            raise ConfigError(
                f"{self.path} is not a readable Hugging Face tokenizer.json ({e}); "
                "point model.hf_assets_path at the model's tokenizer files"
            ) from e
        config = read_tokenizer_config(self.path.parent / "tokenizer_config.json")
        self.bos_id = self._find_special(config.get("bos_token"), BOS_NAMES, "bos_token")
        self.eos_id = self._find_special(config.get("eos_token"), EOS_NAMES, "eos_token")
        vocab = self._tokenizer.get_vocab(with_added_tokens=True)
        self.vocab_size = max(self._tokenizer.get_vocab_size(with_added_tokens=True), max(vocab.values()) + 1)

    def _find_special(self, configured: str | dict | None, fallbacks: tuple[str, ...], key: str) -> int:
        """The id of the configured special token, else of the first known name in the vocab."""
        if isinstance(configured, dict):
            configured = configured.get("content")
        names = ([configured] if configured else []) + list(fallbacks)
        for name in names:
            token_id = self._tokenizer.token_to_id(name)
            if token_id is not None:
                return token_id
        raise ConfigError(
            f"{self.path}: no {key} found (tried {', '.join(names)}); "
            f"set {key} in {self.path.parent / 'tokenizer_config.json'} to a token of the vocabulary"
        )

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`, without BOS/EOS or other added special tokens.

        Args:
            text: any string.
        """
        return self._tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int]) -> str:
        """The text of `ids`; special tokens render as their names.

        Args:
            ids: token ids < `vocab_size`.
        """
        return self._tokenizer.decode(list(ids), skip_special_tokens=False)

    def fingerprint(self) -> str:
        """`hf-sha256:` + the sha256 of `tokenizer.json` and `tokenizer_config.json` (which picks BOS/EOS)."""
        from titan_core.data.tokenizer import sha256_of_files

        return "hf-sha256:" + sha256_of_files(self.path, self.path.parent / "tokenizer_config.json")

    def __repr__(self) -> str:
        return f"HFTokenizer({str(self.path)!r}, vocab_size={self.vocab_size})"


def read_tokenizer_config(path: Path) -> dict:
    """The contents of `tokenizer_config.json`, or {} when there is none.

    Args:
        path: where `tokenizer_config.json` would be.
    """
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path} is not valid JSON ({e}); fix or delete it") from e
