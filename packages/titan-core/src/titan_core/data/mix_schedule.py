"""Which source each global sample comes from: a periodic smooth weighted round-robin.

The weights become integer shares `c_i` of a period `P = sum(c_i)`: exactly when the
weights are decimals whose normalised shares have a common denominator up to
`MAX_PERIOD` (0.7 / 0.3 gives 7 / 3, P = 10; 2 / 1 gives P = 3), else rounded to
`MAX_PERIOD` slots by largest remainder. One period is laid out by smooth weighted
round-robin (nginx's): each slot, every source adds its share to a counter, the
largest counter takes the slot and gives back P. After P slots every counter is 0
again, so the layout repeats, and within it the sources are spread as evenly as
integer slots allow (`max_window_error` measures how far any window strays).

Global sample `g` is slot `g mod P` of cycle `g // P`, so its source and its index
within that source are table look-ups: O(1) to compute and to resume, for any `g`.

`PhasedMixSchedule` runs several such schedules one after another (`training.dataset_mix_phases`:
other weights from a step on, e.g. more of the best data while the learning rate decays): phase `p`
covers global samples `[start_p, start_p+1)` and a source's index goes on from where the earlier
phases left it, so each source is still read in one order, and any `g` is still O(1) to place.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from fractions import Fraction

import numpy as np

from titan_core.config.errors import ConfigError

__all__ = ["MAX_PERIOD", "MixSchedule", "PhasedMixSchedule", "phase_shares", "shares_of"]

MAX_PERIOD = 10_000


def describe_weights(names: Sequence[str], weights: Sequence[float]) -> str:
    """`web 70% + code 30%`: each source with a weight above 0, as its share of their sum.

    Args:
        names: the sources' names.
        weights: their weights (or integer shares), in the same order.
    """
    total = sum(weights)
    return " + ".join(f"{n} {100 * w / total:.0f}%" for n, w in zip(names, weights, strict=True) if w > 0)


def shares_of(weights: Sequence[float], key: str = "training.dataset_mix") -> list[int]:
    """Integer shares of one period, proportional to `weights`, divided by their gcd.

    Args:
        weights: one positive weight per source (any scale).
        key: the config key of the weights, for error messages.
    """
    for i, weight in enumerate(weights):
        if not (isinstance(weight, (int, float)) and math.isfinite(weight) and weight > 0):
            raise ConfigError(
                f"{key}[{i}].weight must be a positive number, got {weight!r}; give every source a weight > 0"
            )
    exact = [Fraction(repr(float(w))) for w in weights]  # the decimal the user wrote: 0.7 -> 7/10
    total = sum(exact)
    fractions = [w / total for w in exact]
    period = math.lcm(*(f.denominator for f in fractions))
    if period <= MAX_PERIOD:
        shares = [int(f * period) for f in fractions]
    else:  # largest remainder over MAX_PERIOD slots, ties to the earlier source
        raw = [f * MAX_PERIOD for f in fractions]
        shares = [math.floor(r) for r in raw]
        by_remainder = sorted(range(len(raw)), key=lambda i: (-(raw[i] - shares[i]), i))
        for i in by_remainder[: MAX_PERIOD - sum(shares)]:
            shares[i] += 1
    for i, share in enumerate(shares):
        if share == 0:
            raise ConfigError(
                f"{key}[{i}].weight={weights[i]} is below 1/{MAX_PERIOD} of the total weight; "
                "raise it or drop the source"
            )
    divisor = math.gcd(*shares)
    return [share // divisor for share in shares]


def phase_shares(weights: Sequence[float], key: str) -> list[int]:
    """`shares_of` where a weight may be 0 (the source sits the phase out); at least one must be positive.

    Args:
        weights: one weight >= 0 per source.
        key: the config key of the weights, for error messages.
    """
    bad = [w for w in weights if not (isinstance(w, (int, float)) and math.isfinite(w) and w >= 0)]
    if bad or not any(w > 0 for w in weights):
        raise ConfigError(f"{key}: weights must be numbers >= 0, one of them > 0, got {list(weights)}")
    positive = [i for i, w in enumerate(weights) if w > 0]
    shares = dict(zip(positive, shares_of([weights[i] for i in positive], key), strict=True))
    return [shares.get(i, 0) for i in range(len(weights))]


class MixSchedule:
    """Global sample index -> (source, index within the source), periodic and O(1).

    Args:
        shares: integer shares of one period (`shares_of`), one per source.
    """

    def __init__(self, shares: Sequence[int]):
        self.shares = np.asarray(shares, dtype=np.int64)  # (S,)
        self.period = int(self.shares.sum())
        current = np.zeros(len(shares), dtype=np.int64)
        pattern = np.empty(self.period, dtype=np.int64)  # (P,) the source of each slot
        for slot in range(self.period):
            current += self.shares
            pattern[slot] = int(np.argmax(current))  # the first of equal counters
            current[pattern[slot]] -= self.period
        self.pattern = pattern
        one_hot = pattern[:, None] == np.arange(len(shares))[None, :]  # (P, S)
        self.before = np.zeros((self.period + 1, len(shares)), dtype=np.int64)  # (P + 1, S) slots of each before
        np.cumsum(one_hot, axis=0, out=self.before[1:])
        self.rank = self.before[np.arange(self.period), pattern]  # (P,) index of each slot within its source

    def locate(self, samples: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The source of each global sample and its index within that source.

        Args:
            samples: global sample indices (int64, any shape).

        Returns:
            (source, index): int64 arrays of `samples`' shape.
        """
        cycle, slot = np.divmod(np.asarray(samples, dtype=np.int64), self.period)
        source = self.pattern[slot]
        return source, cycle * self.shares[source] + self.rank[slot]

    def consumed(self, samples: int) -> np.ndarray:
        """How many of the first `samples` global samples each source gave, `(S,)` int64.

        Args:
            samples: a count of global samples.
        """
        cycle, slot = divmod(int(samples), self.period)
        return cycle * self.shares + self.before[slot]

    def max_window_error(self, window: int) -> float:
        """The largest |samples of a source - window x its weight| over every window of `window`
        consecutive samples (the schedule is periodic, so one period of starts covers them all).

        Args:
            window: the window length in samples.
        """
        start = np.arange(self.period)
        counts = self.consumed_many(start + window) - self.consumed_many(start)  # (P, S)
        expected = window * self.shares / self.period
        return float(np.abs(counts - expected[None, :]).max())

    def consumed_many(self, samples: np.ndarray) -> np.ndarray:
        """`consumed` for an array of counts: `(len(samples), S)` int64."""
        cycle, slot = np.divmod(np.asarray(samples, dtype=np.int64), self.period)
        return cycle[:, None] * self.shares[None, :] + self.before[slot]


class PhasedMixSchedule:
    """`MixSchedule`s one after another: global sample -> (source, index within the source), O(1).

    Args:
        phases: `(first global sample, shares)` of each phase, starting at 0, increasing; the shares of every
            phase list the same sources (0 for one that sits a phase out).
    """

    def __init__(self, phases: Sequence[tuple[int, Sequence[int]]]):
        if not phases or phases[0][0] != 0 or any(a[0] >= b[0] for a, b in zip(phases, phases[1:], strict=False)):
            raise ValueError(f"phases must start at sample 0 and increase, got starts {[p[0] for p in phases]}")
        self.starts = np.asarray([start for start, _ in phases], dtype=np.int64)  # (F,)
        self.phases = [MixSchedule(shares) for _, shares in phases]
        self.shares = self.phases[0].shares  # the first phase's (the sources' identity in a saved position)
        offsets = [np.zeros(len(self.shares), dtype=np.int64)]  # each source's samples before each phase
        for p in range(len(phases) - 1):
            offsets.append(offsets[-1] + self.phases[p].consumed(int(self.starts[p + 1] - self.starts[p])))
        self.offsets = np.stack(offsets)  # (F, S)

    def phase_of(self, samples: np.ndarray | int) -> np.ndarray:
        """The phase each global sample (or count of samples) falls in."""
        return np.searchsorted(self.starts, samples, side="right") - 1

    def locate(self, samples: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """As `MixSchedule.locate`, over the phases.

        Args:
            samples: global sample indices (int64, any shape).
        """
        samples = np.asarray(samples, dtype=np.int64)
        phase = self.phase_of(samples)
        source, index = np.empty_like(samples), np.empty_like(samples)
        for p in np.unique(phase).tolist():
            mine = phase == p
            s, i = self.phases[p].locate(samples[mine] - self.starts[p])
            source[mine], index[mine] = s, i + self.offsets[p][s]
        return source, index

    def consumed(self, samples: int) -> np.ndarray:
        """How many of the first `samples` global samples each source gave, `(S,)` int64.

        Args:
            samples: a count of global samples.
        """
        p = int(self.phase_of(int(samples)))
        return self.offsets[p] + self.phases[p].consumed(int(samples) - int(self.starts[p]))
