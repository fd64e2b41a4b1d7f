"""A keyed permutation of `[0, n)` computed one index at a time: the data shuffle's order.

`permute(j, n, key)` is the position that index `j` moves to in a pseudo-random
permutation of `[0, n)` chosen by `key`. It costs O(1) per index and holds nothing of
size `n`: a balanced Feistel network over the smallest even number of bits that covers
`n`, with cycle walking (apply it again while the result is `>= n`) to stay in
`[0, n)`. A Feistel network is a bijection whatever its round function, and cycle
walking keeps it one on the smaller domain; since the bit domain is under `4 n`, an
index walks fewer than 4 times on average.

Written here rather than taken from a library: numpy and torch have no keyed
permutation that can be evaluated at one index (`np.random.permutation` materialises
all `n`), and a shuffle buffer only mixes within its own size. The round function is
splitmix64's finaliser, in numpy `uint64` arithmetic (which wraps), so the order is
the same on every platform.
"""

from __future__ import annotations

import numpy as np

__all__ = ["mix_key", "permute"]

_ROUNDS = 6
_MASK64 = (1 << 64) - 1


def _splitmix64(value: int) -> int:
    """splitmix64 of a Python int (mod 2**64): a well-mixed 64-bit word."""
    z = (value + 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def mix_key(*parts: int) -> int:
    """One 64-bit key from several ints (e.g. seed, source, epoch), order-sensitive.

    Args:
        parts: non-negative ints.
    """
    key = 0
    for part in parts:
        key = _splitmix64(key ^ (part & _MASK64))
    return key


def _round_function(half: np.ndarray, round_key: int, mask: int) -> np.ndarray:
    """splitmix64's finaliser of `half ^ round_key`, cut to the half's bits; `half` is uint64."""
    z = half ^ np.uint64(round_key)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return (z ^ (z >> np.uint64(31))) & np.uint64(mask)


def _feistel(x: np.ndarray, half_bits: int, round_keys: list[int]) -> np.ndarray:
    """One pass of the balanced Feistel network over `2 * half_bits` bits; `x` is uint64."""
    mask = (1 << half_bits) - 1
    shift = np.uint64(half_bits)
    left, right = x >> shift, x & np.uint64(mask)
    for round_key in round_keys:
        left, right = right, left ^ _round_function(right, round_key, mask)
    return (left << shift) | right


def permute(index: np.ndarray | int, n: int, key: int) -> np.ndarray:
    """Where each `index` goes in the permutation of `[0, n)` that `key` picks.

    Args:
        index: ints in `[0, n)` (any shape).
        n: the size of the permuted range (>= 1).
        key: the permutation's key (`mix_key(seed, source, epoch)`); another key, another order.

    Returns:
        int64 array of `index`'s shape, each in `[0, n)`; distinct indices give distinct results.
    """
    x = np.asarray(index, dtype=np.int64)
    if n < 1:
        raise ValueError(f"permute needs n >= 1, got {n}")
    if x.size and (x.min() < 0 or x.max() >= n):
        raise ValueError(f"permute: indices must lie in [0, {n}), got {x.min()}..{x.max()}")
    if n == 1:
        return np.zeros_like(x)
    half_bits = ((n - 1).bit_length() + 1) // 2
    round_keys = [mix_key(key, r) for r in range(_ROUNDS)]
    out = x.astype(np.uint64).ravel()
    pending = np.arange(out.size)
    while pending.size:  # cycle walking: re-apply until every result lies in [0, n)
        out[pending] = _feistel(out[pending], half_bits, round_keys)
        pending = pending[out[pending] >= np.uint64(n)]
    return out.astype(np.int64).reshape(x.shape)
