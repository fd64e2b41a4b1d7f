"""The sources of a data mixture (`training.dataset_mix`), opened and checked once.

A source is read one of two ways, picked by its `path`:

- a token-shard folder (`titan tokenize`): `TokenWindows`, random access, shuffled when
  `training.shuffle` is on;
- anything else (`"stdlib"`, local `.txt` / `.jsonl` / `.parquet` files, a folder or glob of
  them, a Hugging Face dataset name): tokenized on the fly by a one-rank `PackedLoader`
  that every rank advances through the whole step, in document order.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from titan_core.config.errors import ConfigError
from titan_core.data.corpus import build_source, looks_like_path
from titan_core.data.loader import PackedLoader
from titan_core.data.permutation import mix_key
from titan_core.data.token_loader import check_tokenizer
from titan_core.data.token_shards import is_token_shard_folder, read_manifest
from titan_core.data.token_windows import TokenWindows
from titan_core.data.tokenizer import Tokenizer

__all__ = ["MixEntry", "MixSource", "default_name", "open_source", "open_sources"]


class MixEntry(Protocol):
    """One `training.dataset_mix` entry (the config's `DatasetSource`)."""

    path: str
    weight: float
    name: str | None
    text_field: str | None


@dataclass
class MixSource:
    """One opened source of a mixture.

    Args:
        name: its label in metrics and messages (`data/<name>/tokens`).
        key: the config key of its path, for error messages.
        windows: a token-shard folder's samples, or None.
        stream: text tokenized on the fly (a one-rank `PackedLoader`), or None.
    """

    name: str
    key: str
    windows: TokenWindows | None = None
    stream: PackedLoader | None = None

    def fresh(self) -> MixSource:
        """This source at its start: a text source gets a new stream (a token folder is stateless)."""
        if self.stream is None:
            return self
        stream = self.stream
        return MixSource(
            self.name, self.key, stream=PackedLoader(stream.source, stream.tokenizer, stream.seq_len, 1, key=self.key)
        )

    def epoch(self, samples: int) -> int:
        """The epoch the source reads in after `samples` of its samples.

        Args:
            samples: how many samples of this source the run consumed.
        """
        if self.windows is not None:
            return self.windows.epoch(samples)
        assert self.stream is not None  # one of the two is set
        return self.stream.epoch

    def identity(self) -> dict[str, Any]:
        """What a checkpoint records to recognise the source: its name and its size or kind."""
        if self.windows is not None:
            return {"name": self.name, "tokens": self.windows.stream.total}
        return {"name": self.name, "tokens": None}


def default_name(path: str) -> str:
    """A source's label from its path: the folder or file name, a hub name's last part.

    Args:
        path: the entry's `path`.
    """
    base = os.path.basename(path.rstrip("/\\*")) or path
    return Path(base).stem if Path(base).suffix in (".txt", ".jsonl", ".parquet") else base


def open_source(
    path: str,
    name: str,
    key: str,
    tokenizer: Tokenizer,
    *,
    seq_len: int,
    text_field: str,
    shuffle_key: int | None,
) -> MixSource:
    """Open one source: a token-shard folder as `TokenWindows`, anything else as a text stream.

    Args:
        path: a token-shard folder, `"stdlib"`, local files (file, folder, glob) or a hub dataset name.
        name: its label.
        key: the config key of `path`, for error messages.
        tokenizer: the run's tokenizer (checked against a token folder's, used for text).
        seq_len: tokens per sample fed to the model.
        text_field: the JSON field / parquet column of the text (text sources).
        shuffle_key: the key of a token folder's per-epoch permutations; None: file order.
    """
    if looks_like_path(path) and is_token_shard_folder(path):
        manifest = read_manifest(path, key)
        check_tokenizer(manifest, tokenizer, key)
        return MixSource(name, key, windows=TokenWindows(manifest, seq_len, shuffle_key, key))
    field_key = key.removesuffix(".path") + ".text_field"  # the entry's own text_field wins
    documents = build_source(path, None, text_field, dataset_key=key, field_key=field_key)
    return MixSource(name, key, stream=PackedLoader(documents, tokenizer, seq_len, 1, 0, 1, key=key))


def open_sources(
    entries: Sequence[MixEntry],
    tokenizer: Tokenizer,
    *,
    seq_len: int,
    text_field: str,
    shuffle_seed: int | None,
    section: str = "training",
) -> list[MixSource]:
    """Open every entry of `<section>.dataset_mix`, checking paths, tokenizers and names once.

    Args:
        entries: the mixture's entries, in order.
        tokenizer: the run's tokenizer.
        seq_len: tokens per sample fed to the model.
        text_field: the default text field (`training.dataset_text_field`); an entry's own wins.
        shuffle_seed: `training.shuffle_seed` when `training.shuffle` is on, else None.
        section: the config section, for error messages.
    """
    if not entries:
        raise ConfigError(f"{section}.dataset_mix is empty; give at least one {{path = ..., weight = ...}}")
    names: dict[str, int] = {}
    sources = []
    for i, entry in enumerate(entries):
        name = entry.name or default_name(entry.path)
        if name in names:
            raise ConfigError(
                f"{section}.dataset_mix[{names[name]}] and [{i}] are both named {name!r}; "
                f"set a distinct name = '...' in one of them"
            )
        names[name] = i
        shuffle_key = None if shuffle_seed is None else mix_key(shuffle_seed, i)
        sources.append(
            open_source(
                entry.path,
                name,
                f"{section}.dataset_mix[{i}].path",
                tokenizer,
                seq_len=seq_len,
                text_field=entry.text_field or text_field,
                shuffle_key=shuffle_key,
            )
        )
    return sources
