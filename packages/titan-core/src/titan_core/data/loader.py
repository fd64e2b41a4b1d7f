"""The packed loader: documents -> one global token stream -> fixed-length samples.

Each document becomes `[bos] + tokens + [eos]`; the documents are concatenated
into ONE global token stream (looping over the source forever, one epoch after
another), and the stream is cut into consecutive, non-overlapping samples of
`seq_len + 1` tokens: `inputs = sample[:-1]`, `labels = sample[1:]`.

The global sample order does not depend on the world size. Each step consumes
the next `dp_world * local_batch_size` global samples and rank r takes the
contiguous slice `[r * B, (r + 1) * B)`, so the ranks' shares are disjoint and
one process with `local_batch_size = W * B` sees the W ranks' batches, in rank
order, as one batch. Every rank reads the whole stream (and so holds the same
position), which keeps the loader's state identical on all ranks.

The position is training state: `state_dict()` is plain JSON-able data, and
`load_state_dict` resumes at it without re-reading the documents before it,
also into a loader with another `dp_world` or `local_batch_size`.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from titan_core.config.errors import ConfigError
from titan_core.data.corpus import DocumentSource
from titan_core.data.tokenizer import Tokenizer

__all__ = ["PackedLoader"]

SKIP = "or skip the data position with checkpoint.exclude_from_loading=['dataloader']"
"""How every refusal of a checkpoint's data position ends: the run may go on from the data's start instead."""


class PackedLoader:
    """Batches of packed token samples for one data-parallel rank.

    Args:
        source: the documents, in a fixed order, re-iterable (one epoch each).
        tokenizer: turns a document into ids; supplies `bos_id` / `eos_id`.
        seq_len: tokens per sample fed to the model (each sample reads
            `seq_len + 1` tokens of the stream).
        local_batch_size: samples per batch on this rank (B).
        dp_rank: this rank's index among the data-parallel ranks.
        dp_world: how many data-parallel ranks share the stream (W).
        key: the config key that names the data, for the message when it holds no documents.
    """

    def __init__(
        self,
        source: DocumentSource,
        tokenizer: Tokenizer,
        seq_len: int,
        local_batch_size: int,
        dp_rank: int = 0,
        dp_world: int = 1,
        key: str = "training.dataset / training.dataset_path",
    ):
        if seq_len < 1:
            raise ConfigError(f"training.seq_len must be >= 1, got {seq_len}")
        if local_batch_size < 1:
            raise ConfigError(f"training.local_batch_size must be >= 1, got {local_batch_size}")
        if not 0 <= dp_rank < dp_world:
            raise ValueError(
                f"dp_rank must be in [0, dp_world={dp_world}), got {dp_rank}; check the data-parallel mesh"
            )
        self.source = source
        self.tokenizer = tokenizer
        self.seq_len = seq_len
        self.local_batch_size = local_batch_size
        self.dp_rank = dp_rank
        self.dp_world = dp_world
        self.key = key
        # Position of the next unconsumed token: token `doc_offset` of the
        # wrapped document `doc_index` of epoch `epoch`.
        self.epoch = 0
        self.doc_index = 0
        self.doc_offset = 0
        self.samples_consumed = 0
        self._document: np.ndarray | None = None  # wrapped tokens of doc_index, once read
        self._expected_digest: str | None = None  # a loaded state's `doc_digest`, checked at the next read
        self._documents: Iterator[str] | None = None  # the source, at the next doc to read

    def __iter__(self) -> PackedLoader:
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's next `(inputs, labels)`, each `(local_batch_size, seq_len)` int64."""
        n_samples = self.dp_world * self.local_batch_size
        tokens = self.take_tokens(n_samples * (self.seq_len + 1))
        samples = tokens.reshape(n_samples, self.seq_len + 1)  # (W * B, seq_len + 1)
        self.samples_consumed += n_samples
        start = self.dp_rank * self.local_batch_size
        mine = samples[start : start + self.local_batch_size]  # (B, seq_len + 1)
        inputs = torch.from_numpy(np.ascontiguousarray(mine[:, :-1]))  # (B, seq_len)
        labels = torch.from_numpy(np.ascontiguousarray(mine[:, 1:]))  # (B, seq_len)
        return inputs, labels

    def take_tokens(self, n_tokens: int) -> np.ndarray:
        """The next `n_tokens` tokens of the global stream, advancing the position.

        Args:
            n_tokens: how many tokens to consume.
        """
        pieces = []
        while n_tokens > 0:
            if self._document is None:
                self._document = self.read_document()
                if self.doc_offset >= len(self._document):
                    raise ConfigError(
                        f"loader state points at token {self.doc_offset} of document {self.doc_index}, "
                        f"which has {len(self._document)}; the dataset or tokenizer changed since the "
                        f"checkpoint: resume with the same ones, {SKIP}"
                    )
                expected, self._expected_digest = self._expected_digest, None
                if expected is not None and _digest(self._document) != expected:
                    raise ConfigError(
                        f"document {self.doc_index} of {self.source!r} is not the one the checkpoint was reading "
                        f"(its tokens differ); the dataset or tokenizer changed since the checkpoint: resume with "
                        f"the same ones, {SKIP}"
                    )
            piece = self._document[self.doc_offset : self.doc_offset + n_tokens]
            pieces.append(piece)
            n_tokens -= len(piece)
            self.doc_offset += len(piece)
            if self.doc_offset == len(self._document):
                self._document = None
                self.doc_index += 1
                self.doc_offset = 0
        return np.concatenate(pieces)

    def read_document(self) -> np.ndarray:
        """The wrapped tokens `[bos] + ids + [eos]` of document `doc_index`,
        starting a new epoch when the source runs out."""
        if self._documents is None:
            self._documents = iter(self.source.skip(self.doc_index))
        text = next(self._documents, None)
        if text is None:
            if self.doc_index == 0:
                raise ConfigError(f"the dataset {self.source} has no documents; check {self.key}")
            if self.doc_offset:
                raise ConfigError(
                    f"loader state points into document {self.doc_index}, past the dataset's end; "
                    f"the dataset changed since the checkpoint: resume with the same one, {SKIP}"
                )
            self.epoch += 1
            self.doc_index = 0
            self._documents = iter(self.source)
            text = next(self._documents, None)
            if text is None:
                raise ValueError(
                    f"the dataset {self.source!r} yielded no documents in a new epoch; it must be re-iterable"
                )
        ids = self.tokenizer.encode(text)
        document = np.empty(len(ids) + 2, dtype=np.int64)
        document[0] = self.tokenizer.bos_id
        document[1:-1] = ids
        document[-1] = self.tokenizer.eos_id
        return document

    def wrapped(self) -> bool:
        """Whether the batches returned so far read past the data's end, into its next epoch (every rank reads the
        whole stream, so every rank answers alike)."""
        return self.epoch > 0

    def close(self) -> None:
        """Nothing to release: this loader reads in the training step, with no thread."""

    def metrics(self) -> dict[str, float]:
        """The epoch the stream is in, as `data/epoch` (for the metrics of a log step)."""
        return {"data/epoch": self.epoch}

    def describe_samples(self, first: int, count: int) -> str:
        """`global samples 160-175 of <source>` (for a message about a batch).

        Args:
            first: the first global sample.
            count: how many.
        """
        return f"global samples {first}-{first + count - 1} of {self.source!r}"

    def state_dict(self) -> dict[str, Any]:
        """The stream position as plain ints (JSON-able, the same on every rank).

        `doc_offset` counts the tokens of document `doc_index` (BOS included)
        already consumed: samples end mid-document, so the position is a
        document plus an offset; resuming re-tokenizes that one document only.
        `doc_digest` is a hash of that document's tokens (None at a document
        boundary): the resume checks it, so other text or another tokenizer
        under the same path is refused instead of read from a wrong position.
        """
        return {
            "epoch": self.epoch,
            "doc_index": self.doc_index,
            "doc_offset": self.doc_offset,
            # right after a load, before the document was read again: the loaded digest, still unchecked
            "doc_digest": self._expected_digest if self._document is None else _digest(self._document),
            "samples_consumed": self.samples_consumed,
            "seq_len": self.seq_len,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume at a position from `state_dict()`, possibly of another world size.

        Args:
            state: a dict that `state_dict()` returned.
        """
        missing = {"epoch", "doc_index", "doc_offset", "samples_consumed", "seq_len"} - set(state)
        if missing:
            raise ConfigError(
                f"loader state lacks {sorted(missing)}; it does not come from PackedLoader.state_dict() (e.g. it was "
                f"saved reading token shards or a mixture): resume with the checkpoint's data keys, {SKIP}"
            )
        if state["seq_len"] != self.seq_len:
            raise ConfigError(
                f"loader state was saved with training.seq_len={state['seq_len']}, this run has {self.seq_len}; "
                f"resume with the same training.seq_len, {SKIP}"
            )
        self.epoch = int(state["epoch"])
        self.doc_index = int(state["doc_index"])
        self.doc_offset = int(state["doc_offset"])
        self.samples_consumed = int(state["samples_consumed"])
        self._document = None
        self._documents = None
        self._expected_digest = state.get("doc_digest")  # absent from states saved before it was recorded

    def __repr__(self) -> str:
        return (
            f"PackedLoader({self.source!r}, {self.tokenizer!r}, seq_len={self.seq_len}, "
            f"local_batch_size={self.local_batch_size}, dp_rank={self.dp_rank}, dp_world={self.dp_world})"
        )


def _digest(document: np.ndarray) -> str:
    """A short hash of a document's wrapped tokens (`PackedLoader.state_dict`'s `doc_digest`)."""
    return hashlib.blake2b(document.tobytes(), digest_size=8).hexdigest()
