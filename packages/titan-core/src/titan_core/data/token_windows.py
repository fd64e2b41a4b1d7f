"""One token-shard folder as a sequence of samples, in file order or shuffled: `TokenWindows`.

Sample `k` of the folder is `seq_len + 1` tokens of its looped token stream:

- in order (`shuffle_key=None`): tokens `[k * (L + 1), (k + 1) * (L + 1))` of the looped
  stream, exactly `TokenShardLoader`'s (and `PackedLoader`'s) samples; a sample may wrap
  past the corpus' end into the next epoch.
- shuffled: the corpus is cut into `W = total_tokens // (L + 1)` fixed windows of
  `L + 1` tokens (the last `total_tokens mod (L + 1)` tokens, less than one sample, are
  not read); epoch `e = k // W` reads window `permute(k mod W, W, key(e))`, a keyed
  Feistel permutation (`titan_core.data.permutation`), a new one every epoch. Every
  window is read once per epoch, and sample `k`'s window is computed from `k` alone: O(1)
  to read and to resume, with no buffer.

Windows rather than documents: a window's place in the stream is one multiplication
away, so no per-document index is read, every token is trained on once per epoch, and
every sample is full (no padding). Documents stay packed as they were written
(`[bos] + ids + [eos]`), so a window may start mid-document, as an unshuffled sample does.
"""

from __future__ import annotations

import numpy as np

from titan_core.config.errors import ConfigError
from titan_core.data.permutation import mix_key, permute
from titan_core.data.token_loader import TokenStream
from titan_core.data.token_shards import TokenShardManifest

__all__ = ["TokenWindows"]


class TokenWindows:
    """The samples of one token-shard folder, read by index.

    Args:
        manifest: the folder's checked manifest (`read_manifest`).
        seq_len: tokens per sample fed to the model (each sample reads `seq_len + 1`).
        shuffle_key: None reads in file order; else the key of the per-epoch permutations
            (`mix_key(training.shuffle_seed, source)`).
        key: the config key that names the folder, for error messages.
    """

    def __init__(self, manifest: TokenShardManifest, seq_len: int, shuffle_key: int | None, key: str):
        self.manifest, self.stream = manifest, TokenStream(manifest)
        self.width = seq_len + 1
        self.shuffle_key = shuffle_key
        self.n_windows = self.stream.total // self.width
        if shuffle_key is not None and self.n_windows == 0:
            raise ConfigError(
                f"{key}={manifest.folder} holds {self.stream.total} tokens, less than one sample of "
                f"training.seq_len + 1 = {self.width}; add data, lower training.seq_len, "
                "or set training.shuffle = false"
            )

    def starts(self, samples: np.ndarray) -> np.ndarray:
        """The position in the looped stream where each sample's tokens start (int64).

        Args:
            samples: sample indices within this folder (>= 0).
        """
        samples = np.asarray(samples, dtype=np.int64)
        if self.shuffle_key is None:
            return samples * self.width
        epochs, within = np.divmod(samples, self.n_windows)
        windows = np.empty_like(samples)
        for epoch in np.unique(epochs):  # a batch spans at most a few epochs
            mask = epochs == epoch
            windows[mask] = permute(within[mask], self.n_windows, mix_key(self.shuffle_key, int(epoch)))
        return windows * self.width

    def read(self, samples: np.ndarray) -> np.ndarray:
        """The tokens of each sample, `(len(samples), seq_len + 1)` int64.

        Args:
            samples: sample indices within this folder.
        """
        starts = self.starts(samples)
        out = np.empty((len(starts), self.width), dtype=np.int64)
        for row, start in enumerate(starts.tolist()):
            out[row] = self.stream.read(start, self.width)
        return out

    def epoch(self, samples: int) -> int:
        """The epoch the next sample is in, after `samples` samples of this folder were read.

        Args:
            samples: how many samples of this folder were read.
        """
        if self.shuffle_key is None:
            return samples * self.width // self.stream.total
        return samples // self.n_windows
