"""`build_loader` / `loader_factory`: the training (or validation) loader that a dataset setting names.

A folder written by `titan tokenize` (it holds a token-shard `manifest.json`) is read
by `TokenShardLoader`: O(B) per rank, prefetched. Anything else (`"stdlib"`, local
text files, a hub dataset) is tokenized on the fly by `PackedLoader`, which is fine
for small corpora and few data-parallel ranks (see docs/data.md).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

from titan_core.data.corpus import build_source, looks_like_path
from titan_core.data.loader import PackedLoader
from titan_core.data.token_loader import TokenShardLoader, check_tokenizer
from titan_core.data.token_shards import is_token_shard_folder, read_manifest
from titan_core.data.tokenizer import Tokenizer

__all__ = ["build_loader", "loader_factory"]


def build_loader(*args, **kwargs) -> PackedLoader | TokenShardLoader:
    """A `TokenShardLoader` when the dataset is a token-shard folder, else a `PackedLoader`; takes
    `loader_factory`'s arguments."""
    return loader_factory(*args, **kwargs)()


def loader_factory(
    dataset: str,
    dataset_path: str | None,
    text_field: str,
    tokenizer: Tokenizer,
    *,
    seq_len: int,
    local_batch_size: int,
    dp_rank: int = 0,
    dp_world: int = 1,
    prefetch: int = 2,
    section: str = "training",
) -> Callable[[], PackedLoader | TokenShardLoader]:
    """A function that returns a fresh loader at the data's start (e.g. for each validation pass):
    a `TokenShardLoader` when the dataset is a token-shard folder, else a `PackedLoader`.

    The dataset is opened and checked once, here (a hub dataset is not reopened per
    loader; a token-shard folder's tokenizer is checked now, not at the first pass).

    Args:
        dataset: `<section>.dataset`: `"stdlib"`, a local path/glob or a hub name.
        dataset_path: `<section>.dataset_path`: local files or a token-shard folder;
            when set, it wins over `dataset`.
        text_field: the JSON field / parquet column of the text (on-the-fly only).
        tokenizer: the run's tokenizer (checked against a token-shard folder's).
        seq_len: tokens per sample fed to the model.
        local_batch_size: samples per batch on this rank.
        dp_rank: this rank's index among the data-parallel ranks.
        dp_world: how many data-parallel ranks share the stream.
        prefetch: batches a `TokenShardLoader` reads ahead in a thread (0: none);
            `PackedLoader` tokenizes in the step and ignores it.
        section: the config section the settings come from, for error messages.
    """
    if dataset_path:
        folder, key = dataset_path, f"{section}.dataset_path"
    else:
        folder, key = dataset, f"{section}.dataset"
    if (dataset_path or looks_like_path(dataset)) and is_token_shard_folder(folder):
        manifest = read_manifest(folder, key)  # read and checked once, for every loader the factory makes
        check_tokenizer(manifest, tokenizer, key)
        return functools.partial(
            TokenShardLoader, manifest, seq_len, local_batch_size, dp_rank, dp_world, prefetch=prefetch, key=key
        )
    source = build_source(dataset, dataset_path, text_field)
    return functools.partial(PackedLoader, source, tokenizer, seq_len, local_batch_size, dp_rank, dp_world)
