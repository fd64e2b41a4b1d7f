"""The token-shard loader: batches read straight from pre-tokenized shards (`titan tokenize`).

Sample semantics are `PackedLoader`'s, bit for bit: the global token stream is the
concatenation of the folder's shards (which hold `[bos] + ids + [eos]` per document, in
order), looping forever; global sample i is the tokens `[i * (L + 1), (i + 1) * (L + 1))`
of the looped stream (L = seq_len); each step consumes the next `dp_world * B` global
samples and data-parallel rank r takes `[r * B, (r + 1) * B)`.

Why it scales: rank r's B samples are one contiguous run of `B * (L + 1)` tokens, so a
step reads exactly that run from `np.memmap`s of the shards: O(B) per rank whatever
`dp_world` is (`PackedLoader` tokenizes and reads all `dp_world * B` samples on every
rank). The position is one number, `samples_consumed`, so the state is the same on every
rank and independent of the world size: a state saved at one `dp_world` or
`local_batch_size` resumes at another.

Tensor-, context- and pipeline-parallel ranks of one data-parallel group share a
`dp_rank`, so each of them reads the same B samples from the memmap rather than
receiving them from a peer. That costs O(B) per rank and no collective: the reads
never wait on another rank, and the OS page cache holds each page of a shard once per
node however many processes map it, so the disk is read once. A broadcast from one
reader would add a synchronisation point to every step to save a memory copy of a few
hundred kilobytes. (CP splits the sequence after loading; PP's first and last stages
use the inputs and the labels.)

Prefetch runs in one daemon thread per loader with a bounded queue of `prefetch`
batches, rather than worker processes (torchdata's `StatefulDataLoader` is not a
dependency): a batch is a memmap read plus numpy copies, which release the GIL, so a
thread overlaps them with the training step without pickling batches between
processes. The thread reads ahead, but `state_dict()` counts only the batches `next()`
has returned, so a checkpoint never skips prefetched, unused data. The thread never
holds the loader itself, so a dropped loader (e.g. each validation pass's) stops its
thread when it is collected; `close()` stops it at once, and a daemon thread never
keeps the process from exiting.
"""

from __future__ import annotations

import functools
import queue
import threading
import weakref
from pathlib import Path
from typing import Any

import numpy as np
import torch

from titan_core.config.errors import ConfigError
from titan_core.data.loader import SKIP
from titan_core.data.token_shards import FORMAT, TokenShardManifest, read_manifest
from titan_core.data.tokenizer import Tokenizer, tokenizer_fingerprint

__all__ = ["TokenShardLoader", "TokenStream"]

Batch = tuple[torch.Tensor, torch.Tensor]
_STATE_KEYS = ("format", "samples_consumed", "seq_len", "total_tokens")


class TokenStream:
    """The looped concatenation of a token-shard folder's shards, read by position.

    Args:
        manifest: the folder's checked manifest (`read_manifest`).
    """

    def __init__(self, manifest: TokenShardManifest):
        self.shards = [
            np.memmap(manifest.folder / s.tokens, dtype=manifest.dtype, mode="r", shape=(s.n_tokens,))
            for s in manifest.shards
        ]
        self.starts = np.cumsum([0] + [s.n_tokens for s in manifest.shards])  # (n_shards + 1,)
        self.total = int(self.starts[-1])

    def read(self, start: int, n_tokens: int) -> np.ndarray:
        """Tokens `[start, start + n_tokens)` of the looped stream, as int64.

        Args:
            start: a position in the looped stream (any size: it wraps).
            n_tokens: how many tokens.
        """
        out = np.empty(n_tokens, dtype=np.int64)
        position, filled = start % self.total, 0
        while filled < n_tokens:
            shard = int(np.searchsorted(self.starts, position, side="right")) - 1
            offset = position - int(self.starts[shard])
            take = min(n_tokens - filled, len(self.shards[shard]) - offset)
            out[filled : filled + take] = self.shards[shard][offset : offset + take]
            filled += take
            position = (position + take) % self.total
        return out


def read_batch(stream: TokenStream, first_sample: int, local_batch_size: int, seq_len: int) -> Batch:
    """Global samples `[first_sample, first_sample + local_batch_size)` as `(inputs, labels)`.

    Args:
        stream: the token stream.
        first_sample: the global index of the first sample.
        local_batch_size: samples to read (B).
        seq_len: tokens per sample fed to the model (each reads `seq_len + 1`).
    """
    tokens = stream.read(first_sample * (seq_len + 1), local_batch_size * (seq_len + 1))
    samples = tokens.reshape(local_batch_size, seq_len + 1)  # (B, seq_len + 1)
    inputs = torch.from_numpy(np.ascontiguousarray(samples[:, :-1]))  # (B, seq_len)
    labels = torch.from_numpy(np.ascontiguousarray(samples[:, 1:]))  # (B, seq_len)
    return inputs, labels


class _Prefetcher:
    """A daemon thread that reads batch k = 0, 1, ... as `read(first + k * stride)` into a bounded queue.

    Holds the stream, never the loader, so the loader can be collected while it runs.
    """

    def __init__(self, read: functools.partial, first: int, stride: int, depth: int):
        self.queue: queue.Queue = queue.Queue(depth)
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._run, args=(read, first, stride), daemon=True, name="titan-prefetch")
        self.thread.start()

    def _run(self, read: functools.partial, sample: int, stride: int) -> None:
        while not self.stopping.is_set():
            try:
                item: Batch | BaseException = read(sample)
            except BaseException as e:  # handed to the consumer, raised in its next()
                item = e
            while not self.stopping.is_set():
                try:
                    self.queue.put(item, timeout=0.1)
                    break
                except queue.Full:
                    continue
            if isinstance(item, BaseException):
                return
            sample += stride

    def get(self) -> Batch:
        while True:
            try:
                item = self.queue.get(timeout=1.0)
                break
            except queue.Empty:
                if not self.thread.is_alive():
                    raise RuntimeError(
                        "the data prefetch thread stopped; set training.prefetch_batches=0 to read in the step"
                    ) from None
        if isinstance(item, BaseException):
            raise item
        return item

    def stop(self) -> None:
        self.stopping.set()
        while not self.queue.empty():
            self.queue.get_nowait()
        if threading.current_thread() is not self.thread:
            self.thread.join(timeout=5)


class TokenShardLoader:
    """Batches of packed token samples for one data-parallel rank, from a token-shard folder.

    Args:
        folder: a folder written by `titan tokenize`, or its manifest already read (`read_manifest`).
        seq_len: tokens per sample fed to the model (each sample reads `seq_len + 1`).
        local_batch_size: samples per batch on this rank (B).
        dp_rank: this rank's index among the data-parallel ranks.
        dp_world: how many data-parallel ranks share the stream (W).
        prefetch: batches read ahead in a background thread; 0 reads in `next()`.
        tokenizer: the run's tokenizer; when given, its fingerprint must match the
            one the folder was tokenized with.
        key: the config key that names `folder`, for error messages.
    """

    def __init__(
        self,
        folder: str | Path | TokenShardManifest,
        seq_len: int,
        local_batch_size: int,
        dp_rank: int = 0,
        dp_world: int = 1,
        prefetch: int = 2,
        tokenizer: Tokenizer | None = None,
        key: str = "training.dataset_path",
    ):
        if seq_len < 1:
            raise ConfigError(f"training.seq_len must be >= 1, got {seq_len}")
        if local_batch_size < 1:
            raise ConfigError(f"training.local_batch_size must be >= 1, got {local_batch_size}")
        if not 0 <= dp_rank < dp_world:
            raise ValueError(
                f"dp_rank must be in [0, dp_world={dp_world}), got {dp_rank}; check the data-parallel mesh"
            )
        if prefetch < 0:
            raise ConfigError(f"training.prefetch_batches must be >= 0, got {prefetch}")
        self.manifest = folder if isinstance(folder, TokenShardManifest) else read_manifest(folder, key)
        self.key = key
        if tokenizer is not None:
            check_tokenizer(self.manifest, tokenizer, key)
        self.stream = TokenStream(self.manifest)
        self.seq_len, self.local_batch_size = seq_len, local_batch_size
        self.dp_rank, self.dp_world, self.prefetch = dp_rank, dp_world, prefetch
        self.samples_consumed = 0  # global samples of all ranks returned by next() so far
        self._prefetcher: _Prefetcher | None = None
        self._stop_prefetcher: weakref.finalize | None = None

    def __iter__(self) -> TokenShardLoader:
        return self

    def __next__(self) -> Batch:
        """This rank's next `(inputs, labels)`, each `(local_batch_size, seq_len)` int64."""
        first = self.samples_consumed + self.dp_rank * self.local_batch_size
        if self.prefetch == 0:
            batch = read_batch(self.stream, first, self.local_batch_size, self.seq_len)
        else:
            if self._prefetcher is None:
                read = functools.partial(
                    read_batch, self.stream, local_batch_size=self.local_batch_size, seq_len=self.seq_len
                )
                self._prefetcher = _Prefetcher(read, first, self.dp_world * self.local_batch_size, self.prefetch)
                self._stop_prefetcher = weakref.finalize(self, self._prefetcher.stop)
            batch = self._prefetcher.get()
        self.samples_consumed += self.dp_world * self.local_batch_size
        return batch

    def close(self) -> None:
        """Stop the prefetch thread (a later `next()` starts a new one)."""
        if self._stop_prefetcher is not None:
            self._stop_prefetcher()  # runs `stop` once, and not again at collection
        self._prefetcher = self._stop_prefetcher = None

    def wrapped(self) -> bool:
        """Whether the batches returned so far read past the data's end, into its next epoch (the position is
        global, so every rank answers alike)."""
        return self.samples_consumed * (self.seq_len + 1) > self.stream.total

    def metrics(self) -> dict[str, float]:
        """The epoch of the next sample, as `data/epoch` (for the metrics of a log step)."""
        return {"data/epoch": self.samples_consumed * (self.seq_len + 1) // self.stream.total}

    def describe_samples(self, first: int, count: int) -> str:
        """`global samples 160-175 of <folder>` (for a message about a batch).

        Args:
            first: the first global sample.
            count: how many.
        """
        return f"global samples {first}-{first + count - 1} of {self.manifest.folder}"

    def state_dict(self) -> dict[str, Any]:
        """The stream position, as plain JSON-able data, the same on every rank.

        Counts the batches `next()` returned, not those prefetched. `total_tokens`
        lets a resume notice that the folder changed under it.
        """
        return {
            "format": FORMAT,
            "samples_consumed": self.samples_consumed,
            "seq_len": self.seq_len,
            "total_tokens": self.stream.total,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume at a position from `state_dict()`, possibly of another `dp_world` / `local_batch_size`.

        Args:
            state: a dict that `TokenShardLoader.state_dict()` returned.

        Raises:
            ValueError: the state comes from `PackedLoader` (on-the-fly data), another
                `seq_len`, or a folder with another number of tokens.
        """
        if state.get("format") == "titan-mixture":
            raise ConfigError(
                f"the checkpoint's data was read shuffled or as a mixture (training.shuffle / "
                f"training.dataset_mix), this run reads {self.key} in file order; resume with the checkpoint's "
                f"training.shuffle and data keys, {SKIP}"
            )
        if state.get("format") != FORMAT or any(k not in state for k in _STATE_KEYS):
            raise ConfigError(
                f"the checkpoint's dataloader state ({sorted(state)}) is not a token-shard loader's (it has "
                f"{list(_STATE_KEYS)}), e.g. it was saved reading text on the fly; resume with the checkpoint's "
                f"{self.key}, {SKIP}"
            )
        if state["seq_len"] != self.seq_len:
            raise ConfigError(
                f"loader state was saved with training.seq_len={state['seq_len']}, this run has {self.seq_len}; "
                f"resume with the same training.seq_len, {SKIP}"
            )
        if state["total_tokens"] != self.stream.total:
            raise ConfigError(
                f"loader state was saved on {state['total_tokens']} tokens, {self.key}={self.manifest.folder} "
                f"holds {self.stream.total}; resume with the same data, {SKIP}"
            )
        self.close()
        self.samples_consumed = int(state["samples_consumed"])

    def __repr__(self) -> str:
        return (
            f"TokenShardLoader({str(self.manifest.folder)!r}, seq_len={self.seq_len}, "
            f"local_batch_size={self.local_batch_size}, dp_rank={self.dp_rank}, dp_world={self.dp_world}, "
            f"prefetch={self.prefetch})"
        )


def check_tokenizer(manifest: TokenShardManifest, tokenizer: Tokenizer, key: str) -> None:
    """Raise one line naming the keys when `tokenizer` is not the one `manifest`'s folder was made with.

    Args:
        manifest: the folder's manifest.
        tokenizer: the run's tokenizer (from model.hf_assets_path).
        key: the config key that names the folder.
    """
    ours = (tokenizer_fingerprint(tokenizer), tokenizer.bos_id, tokenizer.eos_id, tokenizer.vocab_size)
    theirs = (manifest.tokenizer, manifest.bos_id, manifest.eos_id, manifest.vocab_size)
    if ours != theirs:
        raise ConfigError(
            f"{key}={manifest.folder} was tokenized with {manifest.tokenizer_description} "
            f"(fingerprint {manifest.tokenizer[:28]}), but model.hf_assets_path gives {tokenizer!r} "
            f"(fingerprint {ours[0][:28]}); set model.hf_assets_path to the tokenizer the data was made with, "
            f"or re-run `titan tokenize --hf-assets-path <model.hf_assets_path> --force` into {key}"
        )
