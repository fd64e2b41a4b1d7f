"""Speculative decoding with a model's own multi-token-prediction depth (DeepSeek-V3 section 5.4.3): the trained
depth drafts the token after next, the main model checks it in the same forward that produces the next one.

Greedy, one prompt. Each step feeds two tokens through the main model (through the KV cache): the last token it
chose and the depth's draft of the one after. Its prediction after the first is the true next token; when it
equals the draft, the draft is accepted and the prediction after the draft comes for free: two tokens from one
forward of the large model. Either way the output is exactly what greedy decoding one token at a time gives
(the main model decides every token; the tests check it). The depth then runs over the positions just confirmed,
with its own slots in the same cache (its attention sees the hidden states of every earlier position, as in
training), and drafts again from the last one.

DeepSeek-V3 reports 85-90% of its drafts accepted, 1.8x the tokens per second; what a model accepts depends
on how long its depth trained. Only depth 1 drafts (one token ahead), as DeepSeek-V3 decodes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from titan_core.config.errors import ConfigError
from titan_core.generation.kv_cache import kv_cache
from titan_parallel.plan import ModelPlan


@dataclass(frozen=True)
class SpeculativeResult:
    """What `generate_speculative` produced.

    Args:
        tokens: the new tokens (ending with an EOS if one was emitted).
        drafts: drafts the depth proposed (each checked by one main-model forward).
        accepted: drafts the main model agreed with.
        seconds: wall time of the whole generation, prompt included.
    """

    tokens: list[int]
    drafts: int
    accepted: int
    seconds: float

    @property
    def acceptance(self) -> float:
        """Share of the drafts accepted."""
        return self.accepted / self.drafts if self.drafts else 0.0

    @property
    def tokens_per_forward(self) -> float:
        """New tokens per main-model forward (the prompt's included): 1 without speculation, 2 at best."""
        return len(self.tokens) / (1 + self.drafts)


class _Depth:
    """The model's first multi-token-prediction depth as a drafter: `draft(h, next_tokens)` runs the depth over the
    positions whose next token is known and returns its prediction of the token after the last one."""

    def __init__(self, model: nn.Module):
        args: Any = model.args
        if not getattr(args, "n_mtp_layers", 0):
            raise ConfigError(
                "--speculative drafts with the model's multi-token-prediction depth, and this checkpoint has none; "
                "train with mtp.layers = 1 or drop --speculative"
            )
        self.model, self.args = model, args
        self.block: Any = model.get_submodule(f"layers.{args.n_layers}")
        mup = getattr(args, "mup", None)
        self.embedding_multiplier = mup.embedding_multiplier if mup is not None else 1.0
        self.readout = mup.readout_scale(args.dim) if mup is not None else 1.0

    def draft(self, hidden: torch.Tensor, next_tokens: torch.Tensor, positions: torch.Tensor) -> int:
        """Args:
        hidden: `(1, n, dim)` the main model's last hidden states (before the final norm) at `positions`.
        next_tokens: `(1, n)` the token after each of those positions.
        positions: `(n,)` their positions.
        """
        model = self.model
        emb = model.tok_embeddings(next_tokens) * self.embedding_multiplier  # type: ignore[operator]
        _, head_in = self.block(torch.cat([emb, hidden], dim=-1), model.rope_cache, positions)
        logits = model.output(head_in[:, -1:] * self.readout)  # type: ignore[operator]  # (1, 1, vocab)
        return int(logits[0, -1].argmax())


@torch.no_grad()
def generate_speculative(
    model: nn.Module,
    plan: ModelPlan,
    prompt: Sequence[int],
    max_new_tokens: int,
    eos_ids: Sequence[int] = (),
    max_seq_len: int | None = None,
) -> SpeculativeResult:
    """Greedy decoding of one prompt, the model's first multi-token-prediction depth drafting each token after next.

    Args:
        model: a family's model built with its depths (`n_mtp_layers` >= 1), in eval mode.
        plan: its plan (the attention cores the KV cache replaces).
        prompt: token ids (not empty).
        max_new_tokens: most tokens to add.
        eos_ids: tokens that end the sequence (kept as its last token).
        max_seq_len: the model's longest sequence; None skips the check.

    Raises:
        ConfigError: an empty prompt, too long a request, or a model without depths.
    """
    import time

    if not prompt:
        raise ConfigError("every prompt needs at least one token; pass a non-empty --prompt")
    if max_seq_len is not None and len(prompt) + max_new_tokens + 1 > max_seq_len:
        raise ConfigError(
            f"the prompt ({len(prompt)} tokens) plus --max-new-tokens {max_new_tokens} and a draft exceeds the "
            f"model's max_seq_len {max_seq_len}; shorten the prompt or lower --max-new-tokens"
        )
    depth = _Depth(model)
    started = time.perf_counter()
    if max_new_tokens <= 0:
        return SpeculativeResult([], 0, 0, 0.0)
    device = next(model.parameters()).device
    eos = set(eos_ids)
    captured: list[torch.Tensor] = []
    hook = model.norm.register_forward_pre_hook(lambda module, args: captured.append(args[0]))  # type: ignore[union-attr]
    out: list[int] = []
    drafts = accepted = 0
    try:
        with kv_cache(model, plan, 1, len(prompt) + max_new_tokens + 1, device) as cache:

            def main(tokens: list[int], start: int) -> tuple[torch.Tensor, torch.Tensor]:
                """The main model over `tokens` at slots (= positions) `start ..`: logits and hidden states."""
                fed = torch.tensor([tokens], dtype=torch.long, device=device)  # (1, n)
                positions = torch.arange(start, start + len(tokens), device=device)
                cache.prepare(start, torch.ones_like(fed, dtype=torch.bool))
                captured.clear()
                logits = model(fed, positions=positions)  # (1, n, vocab)
                return logits[0], captured[-1]

            def draft_after(hidden: torch.Tensor, next_tokens: list[int], start: int) -> int:
                """The depth over positions `start ..` (their next tokens now known) fills its slots; its draft."""
                fed = torch.tensor([next_tokens], dtype=torch.long, device=device)
                cache.prepare(start, torch.ones_like(fed, dtype=torch.bool))
                return depth.draft(hidden, fed, torch.arange(start, start + len(next_tokens), device=device))

            logits, hidden = main(list(prompt), 0)
            out.append(int(logits[-1].argmax()))
            draft = draft_after(hidden, [*prompt[1:], out[-1]], 0)
            position = len(prompt)  # where out[-1] goes: fed with the draft after it at the next step
            while len(out) < max_new_tokens and out[-1] not in eos:
                logits, hidden = main([out[-1], draft], position)
                drafts += 1
                predicted = int(logits[0].argmax())
                new = [predicted]
                if predicted == draft:  # accepted: the prediction after the draft is the next token too
                    accepted += 1
                    new.append(int(logits[1].argmax()))
                new = new[: max_new_tokens - len(out)]
                if new[0] in eos:
                    new = new[:1]
                out.extend(new)
                if len(out) >= max_new_tokens or out[-1] in eos:
                    break
                draft = draft_after(hidden[:, : len(new)], new, position)
                position += len(new)
    finally:
        hook.remove()
    return SpeculativeResult(out, drafts, accepted, time.perf_counter() - started)
