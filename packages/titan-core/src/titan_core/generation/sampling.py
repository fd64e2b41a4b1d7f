"""Choosing the next token from logits: greedy, temperature, top-k, top-p (nucleus).

The order is the usual one (transformers' too): divide by the temperature, keep the
top-k logits, keep the smallest nucleus of probability mass `top_p`, then draw one
token from what is left with a seeded `torch.Generator`. Temperature 0 is greedy.

The draw is the exponential race (gpt-fast's `multinomial_sample_one_no_sync`):
`argmax(probs / E)` with `E ~ Exp(1)` drawn per token picks token i with probability
`probs[i]`, as `torch.multinomial` does, but in plain tensor ops that `torch.compile`
traces and a CUDA graph replays. The noise is drawn outside (`draw_noise`), from the
seeded generator, so the compiled decode step and the eager loop draw the same tokens
from the same seed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from titan_core.config.errors import ConfigError


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each next token.

    Args:
        temperature: logits are divided by it; 0 means greedy (argmax, top_k/top_p ignored).
        top_k: keep only the k most likely tokens; None keeps all.
        top_p: keep the smallest set of most likely tokens whose probability reaches top_p; 1 keeps all.
    """

    temperature: float = 1.0
    top_k: int | None = None
    top_p: float = 1.0

    def __post_init__(self) -> None:
        if not self.temperature >= 0:  # also catches NaN
            raise ConfigError(f"--temperature {self.temperature} is negative; pass 0 for greedy or a positive value")
        if self.top_k is not None and self.top_k < 1:
            raise ConfigError(f"--top-k {self.top_k} must be at least 1; leave it unset to keep every token")
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"--top-p {self.top_p} is outside (0, 1]; pass e.g. 0.9, or 1 to keep every token")

    @property
    def greedy(self) -> bool:
        """True when the next token is the argmax (temperature 0)."""
        return self.temperature == 0


def top_k_filter(logits: torch.Tensor, k: int) -> torch.Tensor:
    """Set every logit below the k-th largest of its row to -inf (ties with it are kept).

    Args:
        logits: `(bs, vocab)`.
        k: how many to keep; k >= vocab keeps all.
    """
    if k >= logits.size(-1):
        return logits
    kth = torch.topk(logits, k, dim=-1).values[:, -1:]  # (bs, 1)
    return logits.masked_fill(logits < kth, float("-inf"))


def top_p_filter(logits: torch.Tensor, p: float) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose probabilities sum to at least `p`.

    A token is kept when the mass of the tokens more likely than it is below `p`, so
    the most likely token is always kept.

    Args:
        logits: `(bs, vocab)`.
        p: nucleus mass in (0, 1]; 1 keeps all.
    """
    if p >= 1:
        return logits
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True)  # (bs, vocab)
    sorted_probs = sorted_logits.softmax(-1)
    mass_before = sorted_probs.cumsum(-1) - sorted_probs  # (bs, vocab): mass of the more likely tokens
    drop_sorted = mass_before >= p
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)  # back to vocab order
    return logits.masked_fill(drop, float("-inf"))


def sampling_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution to draw from: temperature, then top-k, then top-p.

    Args:
        logits: `(bs, vocab)` logits of the last position.
        params: temperature (> 0), top-k, top-p.

    Returns:
        `(bs, vocab)` float32 probabilities, zero where filtered.
    """
    logits = logits.float() / params.temperature
    if params.top_k is not None:
        logits = top_k_filter(logits, params.top_k)
    logits = top_p_filter(logits, params.top_p)
    return logits.softmax(-1)


def draw_noise(like: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """`Exp(1)` noise shaped like `like` `(bs, vocab)`, float32, from `generator` (None: torch's global one)."""
    return torch.empty(like.shape, dtype=torch.float32, device=like.device).exponential_(generator=generator)


def pick_next_token(logits: torch.Tensor, params: SamplingParams, noise: torch.Tensor | None) -> torch.Tensor:
    """The next token of each row, given the noise of the draw; no host sync, no data-dependent branch.

    Args:
        logits: `(bs, vocab)` logits of the last position.
        params: greedy, or temperature / top-k / top-p.
        noise: `(bs, vocab)` `Exp(1)` noise from `draw_noise`; unused (may be None) when greedy.

    Returns:
        `(bs,)` int64 token ids.
    """
    if params.greedy:
        return logits.argmax(-1)
    if noise is None:
        raise ValueError("sampling needs noise from draw_noise; pass it, or use greedy SamplingParams")
    # probs / E: a filtered token (prob 0) scores 0; the clamp keeps an E of exactly 0 from giving 0 / 0
    return (sampling_probs(logits, params) / noise.clamp_min(torch.finfo(torch.float32).tiny)).argmax(-1)


def sample_next_token(
    logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None = None
) -> torch.Tensor:
    """The next token of each row.

    Args:
        logits: `(bs, vocab)` logits of the last position.
        params: temperature, top-k, top-p.
        generator: the random source (on the logits' device); None uses torch's global one.

    Returns:
        `(bs,)` int64 token ids.
    """
    noise = None if params.greedy else draw_noise(logits, generator)
    return pick_next_token(logits, params, noise)
