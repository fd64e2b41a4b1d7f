"""The mixture loader: several sources at chosen weights, interleaved by the global sample index.

Global sample `g` comes from the source and the source-sample index that `MixSchedule`
gives (a periodic smooth weighted round-robin: every window of a few hundred samples
holds each source at its weight to within about one sample). Within a source, sample
`k` is read by `TokenWindows` (a token-shard folder: in file order or a per-epoch
shuffle of fixed windows) or taken from a text stream tokenized on the fly. A source
that runs out starts its next epoch; `metrics()` reports each source's tokens and epoch.

As for the other loaders, a step consumes the next `dp_world x B` global samples and
data-parallel rank r takes `[r * B, (r + 1) * B)`, so the state is the number of global
samples consumed (plus, for text sources, their document positions, which every rank
advances through the whole step): the same on every rank and independent of the world
size, so a run resumes on another number of ranks with the same batches. Batches of
token-shard sources only are a pure function of their first sample and are prefetched
in a thread (`training.prefetch_batches`); a mix with a text source reads in the step.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from titan_core.config.errors import ConfigError
from titan_core.data.loader import SKIP
from titan_core.data.mix_schedule import PhasedMixSchedule, describe_weights
from titan_core.data.mix_sources import MixSource
from titan_core.data.token_loader import _Prefetcher

__all__ = ["FORMAT", "MixtureLoader", "read_window_batch"]

FORMAT = "titan-mixture"
Batch = tuple[torch.Tensor, torch.Tensor]


def _as_batch(samples: np.ndarray) -> Batch:
    """`(B, L + 1)` tokens -> `(inputs, labels)`, each `(B, L)` int64."""
    inputs = torch.from_numpy(np.ascontiguousarray(samples[:, :-1]))  # (B, seq_len)
    labels = torch.from_numpy(np.ascontiguousarray(samples[:, 1:]))  # (B, seq_len)
    return inputs, labels


def read_window_batch(
    schedule: PhasedMixSchedule, sources: Sequence[MixSource], first: int, local_batch_size: int, width: int
) -> Batch:
    """Global samples `[first, first + B)` of a mixture whose sources are all token-shard folders.

    Args:
        schedule: the mixture's schedule.
        sources: the opened sources (each with `windows`).
        first: the global index of the first sample.
        local_batch_size: samples to read (B).
        width: tokens per sample (seq_len + 1).
    """
    source, index = schedule.locate(np.arange(first, first + local_batch_size))
    out = np.empty((local_batch_size, width), dtype=np.int64)  # (B, seq_len + 1)
    for i in np.unique(source).tolist():
        windows = sources[i].windows
        assert windows is not None  # only token-shard sources here
        mine = source == i
        out[mine] = windows.read(index[mine])
    return _as_batch(out)


class MixtureLoader:
    """Batches for one data-parallel rank from weighted sources.

    Args:
        sources: the opened sources (`open_sources`), in the order of `shares`.
        shares: integer shares of one period (`shares_of(weights)`).
        seq_len: tokens per sample fed to the model.
        local_batch_size: samples per batch on this rank (B).
        dp_rank: this rank's index among the data-parallel ranks.
        dp_world: how many data-parallel ranks share the stream (W).
        prefetch: batches read ahead in a thread (token-shard sources only); 0 reads in `next()`.
        shuffle_seed: `training.shuffle_seed` when the token sources are shuffled, else None
            (recorded in the state, so that a resume reads the same order).
        key: the config key of the sources, for error messages.
        phases: later phases, `(first global sample, shares)` each, increasing (`training.dataset_mix_phases`).
    """

    def __init__(
        self,
        sources: Sequence[MixSource],
        shares: Sequence[int],
        seq_len: int,
        local_batch_size: int,
        dp_rank: int = 0,
        dp_world: int = 1,
        prefetch: int = 2,
        shuffle_seed: int | None = None,
        key: str = "training.dataset_mix",
        phases: Sequence[tuple[int, Sequence[int]]] = (),
    ):
        if seq_len < 1 or local_batch_size < 1:
            raise ConfigError(
                f"training.seq_len and training.local_batch_size must be >= 1, got {seq_len} and {local_batch_size}"
            )
        if not 0 <= dp_rank < dp_world:
            raise ValueError(
                f"dp_rank must be in [0, dp_world={dp_world}), got {dp_rank}; check the data-parallel mesh"
            )
        if prefetch < 0:
            raise ConfigError(f"training.prefetch_batches must be >= 0, got {prefetch}")
        if len(sources) != len(shares):
            raise ValueError(f"{len(sources)} sources but {len(shares)} shares")
        self.phases = [(int(start), [int(x) for x in later]) for start, later in phases]  # JSON-able, saved
        self.sources = [s.fresh() for s in sources]
        self.schedule = PhasedMixSchedule([(0, shares), *self.phases])
        self.seq_len, self.local_batch_size = seq_len, local_batch_size
        self.dp_rank, self.dp_world, self.shuffle_seed, self.key = dp_rank, dp_world, shuffle_seed, key
        self.prefetch = prefetch if all(s.windows is not None for s in self.sources) else 0
        self.samples_consumed = 0  # global samples of all ranks returned by next() so far
        self._prefetcher: _Prefetcher | None = None
        self._stop_prefetcher: weakref.finalize | None = None

    def __iter__(self) -> MixtureLoader:
        return self

    def __next__(self) -> Batch:
        """This rank's next `(inputs, labels)`, each `(local_batch_size, seq_len)` int64."""
        first = self.samples_consumed + self.dp_rank * self.local_batch_size
        if self.prefetch == 0:
            batch = self._read_in_step(first)
        else:
            if self._prefetcher is None:
                read = functools.partial(
                    read_window_batch,
                    self.schedule,
                    self.sources,
                    local_batch_size=self.local_batch_size,
                    width=self.seq_len + 1,
                )
                self._prefetcher = _Prefetcher(read, first, self.dp_world * self.local_batch_size, self.prefetch)
                self._stop_prefetcher = weakref.finalize(self, self._prefetcher.stop)
            batch = self._prefetcher.get()
        self.samples_consumed += self.dp_world * self.local_batch_size
        return batch

    def _read_in_step(self, first: int) -> Batch:
        """This rank's batch; text sources advance by their samples of the whole step (every rank's)."""
        if all(s.windows is not None for s in self.sources):
            return read_window_batch(self.schedule, self.sources, first, self.local_batch_size, self.seq_len + 1)
        width, step_start = self.seq_len + 1, self.samples_consumed
        before = self.schedule.consumed(step_start)
        after = self.schedule.consumed(step_start + self.dp_world * self.local_batch_size)
        source, index = self.schedule.locate(np.arange(first, first + self.local_batch_size))
        out = np.empty((self.local_batch_size, width), dtype=np.int64)  # (B, seq_len + 1)
        for i, mix_source in enumerate(self.sources):
            mine = source == i
            if mix_source.windows is not None:
                if mine.any():
                    out[mine] = mix_source.windows.read(index[mine])
                continue
            n_step = int(after[i] - before[i])  # this source's samples in the step, all ranks
            if n_step == 0:
                continue
            stream = mix_source.stream
            assert stream is not None  # a text source
            rows = stream.take_tokens(n_step * width).reshape(n_step, width)  # (n_step, seq_len + 1)
            stream.samples_consumed += n_step
            out[mine] = rows[index[mine] - before[i]]
        return _as_batch(out)

    def metrics(self) -> dict[str, float]:
        """Each source's tokens trained on so far (seq_len per sample, all ranks) and its epoch, keyed
        `data/<name>/tokens` and `data/<name>/epoch`."""
        consumed = self.schedule.consumed(self.samples_consumed)
        out: dict[str, float] = {}
        for source, n in zip(self.sources, consumed.tolist(), strict=True):
            out[f"data/{source.name}/tokens"] = n * self.seq_len
            out[f"data/{source.name}/epoch"] = source.epoch(n)
        return out

    def describe_samples(self, first: int, count: int) -> str:
        """Which sources global samples `[first, first + count)` came from, e.g. `web 11, code 5 samples`.

        Args:
            first: the first global sample.
            count: how many.
        """
        counts = self.schedule.consumed(first + count) - self.schedule.consumed(first)
        parts = [f"{s.name} {n}" for s, n in zip(self.sources, counts.tolist(), strict=True) if n]
        return f"{', '.join(parts)} samples (global samples {first}-{first + count - 1})"

    def close(self) -> None:
        """Stop the prefetch thread (a later `next()` starts a new one)."""
        if self._stop_prefetcher is not None:
            self._stop_prefetcher()
        self._prefetcher = self._stop_prefetcher = None

    def state_dict(self) -> dict[str, Any]:
        """The position as plain JSON-able data, the same on every rank, independent of the world size."""
        sources = []
        for source, share in zip(self.sources, self.schedule.shares.tolist(), strict=True):
            entry = {**source.identity(), "share": share}
            if source.stream is not None:
                entry["stream"] = source.stream.state_dict()
            sources.append(entry)
        return {
            "format": FORMAT,
            "samples_consumed": self.samples_consumed,
            "seq_len": self.seq_len,
            "shuffle_seed": self.shuffle_seed,
            "sources": sources,
            **({"phases": [[start, shares] for start, shares in self.phases]} if self.phases else {}),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume at a position from `state_dict()`, possibly of another `dp_world` / `local_batch_size`.

        Args:
            state: a dict that `MixtureLoader.state_dict()` returned.
        """
        if state.get("format") != FORMAT:
            read = "in file order (training.shuffle = false)" if state.get("format") else "as text on the fly"
            raise ConfigError(
                f"the checkpoint's data was read {read} from one source, this run reads {self.key} "
                f"{'shuffled' if self.shuffle_seed is not None else 'as a mixture'}; resume with the checkpoint's "
                f"training.shuffle and data keys, {SKIP}"
            )
        if state["seq_len"] != self.seq_len:
            raise ConfigError(
                f"loader state was saved with training.seq_len={state['seq_len']}, this run has {self.seq_len}; "
                f"resume with the same training.seq_len, {SKIP}"
            )
        if state.get("shuffle_seed") != self.shuffle_seed:
            raise ConfigError(
                f"the checkpoint's data was read with {_describe_shuffle(state.get('shuffle_seed'))}, this run "
                f"has {_describe_shuffle(self.shuffle_seed)}; resume with the same, {SKIP}"
            )
        shares = self.schedule.shares.tolist()
        ours = [{**s.identity(), "share": share} for s, share in zip(self.sources, shares, strict=True)]
        theirs = [{k: v for k, v in s.items() if k != "stream"} for s in state["sources"]]
        if ours != theirs:
            raise ConfigError(
                f"the checkpoint read {_describe_sources(theirs)}, this run's {self.key} gives "
                f"{_describe_sources(ours)}; resume with the same sources, weights and data, {SKIP}"
            )
        position = int(state["samples_consumed"])
        theirs_before = [(int(a), list(b)) for a, b in state.get("phases", []) if a < position]
        ours_before = [(a, b) for a, b in self.phases if a < position]
        if ours_before != theirs_before:  # later phases may change: a run can decide on its annealing mix late
            names = [source.name for source in self.sources]
            raise ConfigError(
                f"the checkpoint's data had mixture phases {_describe_phases(theirs_before, names)} before its "
                f"position (global sample {position}), this run's training.dataset_mix_phases give "
                f"{_describe_phases(ours_before, names)}; change only the phases that start after the checkpoint's "
                f"step, {SKIP}"
            )
        self.close()
        for source, saved in zip(self.sources, state["sources"], strict=True):
            if source.stream is not None:
                source.stream.load_state_dict(saved["stream"])
        self.samples_consumed = position

    def __repr__(self) -> str:
        shares = self.schedule.shares.tolist()
        names = ", ".join(f"{s.name}:{share}" for s, share in zip(self.sources, shares, strict=True))
        return (
            f"MixtureLoader([{names}], seq_len={self.seq_len}, local_batch_size={self.local_batch_size}, "
            f"dp_rank={self.dp_rank}, dp_world={self.dp_world}, shuffle_seed={self.shuffle_seed})"
        )


def _describe_shuffle(seed: int | None) -> str:
    return "training.shuffle = false" if seed is None else f"training.shuffle_seed = {seed}"


def _describe_phases(phases: list[tuple[int, list[Any]]], names: list[str]) -> str:
    """'from global sample 8 plays 90% + code 10%, ...', or 'none'."""
    if not phases:
        return "none"
    return ", ".join(f"from global sample {start} {describe_weights(names, shares)}" for start, shares in phases)


def _describe_sources(sources: list[dict[str, Any]]) -> str:
    """`[web: share 7, 1200 tokens; code: share 3, text]`."""
    parts = []
    for s in sources:
        size = "text" if s["tokens"] is None else f"{s['tokens']} tokens"
        parts.append(f"{s['name']}: share {s['share']}, {size}")
    return "[" + "; ".join(parts) + "]"
