"""`build_loader` / `loader_factory`: the training (or validation) loader that a dataset setting names.

A folder written by `titan tokenize` (it holds a token-shard `manifest.json`) is read
by `TokenShardLoader` in file order, or with `shuffle` by a one-source `MixtureLoader`
(a seeded permutation of fixed windows per epoch): O(B) per rank, prefetched. Anything
else (`"stdlib"`, local text files, a hub dataset) is tokenized on the fly, in order, by
`PackedLoader`, which is fine for small corpora and few data-parallel ranks. A
`dataset_mix` (several weighted sources of either kind) is read by `MixtureLoader`
(see docs/data.md).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence

from titan_core.data.corpus import Split, build_source, looks_like_path
from titan_core.data.loader import PackedLoader
from titan_core.data.mix_schedule import phase_shares, shares_of
from titan_core.data.mix_sources import MixEntry, MixSource, default_name, open_sources
from titan_core.data.mixture import MixtureLoader
from titan_core.data.permutation import mix_key
from titan_core.data.token_loader import TokenShardLoader, check_tokenizer
from titan_core.data.token_shards import is_token_shard_folder, read_manifest
from titan_core.data.token_windows import TokenWindows
from titan_core.data.tokenizer import Tokenizer

Loader = PackedLoader | TokenShardLoader | MixtureLoader

__all__ = ["build_loader", "loader_factory"]


def build_loader(*args, **kwargs) -> Loader:
    """The loader `loader_factory` makes (its arguments), at the data's start."""
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
    shuffle: bool = False,
    shuffle_seed: int = 0,
    mix: Sequence[MixEntry] = (),
    dataset_key: str | None = None,
    field_key: str = "training.dataset_text_field",
    mix_phases: Sequence[tuple[int, Mapping[str, float]]] = (),
) -> Callable[[], Loader]:
    """A function that returns a fresh loader at the data's start (e.g. for each validation pass):
    a `MixtureLoader` for a mix or a shuffled token-shard folder, a `TokenShardLoader` for a
    token-shard folder in file order, else a `PackedLoader`.

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
        shuffle: `<section>.shuffle`: token-shard data in a seeded order per epoch (text stays in order).
        shuffle_seed: `<section>.shuffle_seed`: picks that order.
        mix: `<section>.dataset_mix`: weighted sources; when given, `dataset` and `dataset_path` are unused.
        dataset_key: the config key `dataset` comes from, for messages; None = `<section>.dataset`.
        field_key: the config key `text_field` comes from, for messages.
        mix_phases: the mix's later weights, `(first global sample, {source name: weight})` each, increasing
            (`training.dataset_mix_phases`, its steps turned into samples).
    """
    seed = shuffle_seed if shuffle else None
    if mix:
        shares = shares_of([entry.weight for entry in mix], f"{section}.dataset_mix")
        sources = open_sources(
            mix, tokenizer, seq_len=seq_len, text_field=text_field, shuffle_seed=seed, section=section
        )
        names = [source.name for source in sources]
        phases = [
            (start, phase_shares([weights.get(n, 0.0) for n in names], f"{section}.dataset_mix_phases[{i}].weights"))
            for i, (start, weights) in enumerate(mix_phases)
        ]
        return functools.partial(
            MixtureLoader,
            sources,
            shares,
            seq_len,
            local_batch_size,
            dp_rank,
            dp_world,
            prefetch=prefetch,
            shuffle_seed=seed,
            key=f"{section}.dataset_mix",
            phases=phases,
        )
    if dataset_path:
        folder, key = dataset_path, f"{section}.dataset_path"
    else:
        folder, key = dataset, dataset_key or f"{section}.dataset"
    if (dataset_path or looks_like_path(dataset)) and is_token_shard_folder(folder):
        manifest = read_manifest(folder, key)  # read and checked once, for every loader the factory makes
        check_tokenizer(manifest, tokenizer, key)
        if seed is not None:  # the same as a one-source mix (its source 0)
            windows = TokenWindows(manifest, seq_len, mix_key(seed, 0), key)
            only = MixSource(default_name(str(manifest.folder)), key, windows=windows)
            return functools.partial(
                MixtureLoader, [only], [1], seq_len, local_batch_size, dp_rank, dp_world,
                prefetch=prefetch, shuffle_seed=seed, key=key,
            )  # fmt: skip
        return functools.partial(
            TokenShardLoader, manifest, seq_len, local_batch_size, dp_rank, dp_world, prefetch=prefetch, key=key
        )
    split: Split = "validation" if section == "validation" else "train"
    source = build_source(
        dataset, dataset_path, text_field, split=split, section=section, dataset_key=dataset_key, field_key=field_key
    )
    return functools.partial(PackedLoader, source, tokenizer, seq_len, local_batch_size, dp_rank, dp_world, key=key)
