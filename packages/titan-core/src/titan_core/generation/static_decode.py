"""The static decode loop: a fixed-shape step that `torch.compile` can capture in one CUDA graph.

At batch 1 a small model's eager decode is bound by the host, not the GPU: each
step launches a few hundred small kernels (and the dynamic loop also rebuilds its
mask, slices a cache that grows by one each step and reads `finished` back to the
host). Here every tensor the step touches is allocated before it, and the step
changes them only in place:

- the KV cache (`kv_cache.py`'s decode mode): the new keys/values go to the slot
  `cache.slot` (a device tensor), the attention reads the whole cache under an
  additive mask that `cache.advance()` opens one slot at a time;
- `token`, `positions`, `finished`, `new_tokens`, `count`: the token fed now, its RoPE
  positions, which sequences have ended, the output so far and its length;
- the sampling noise (`sampling.draw_noise`), drawn outside the step from the seeded
  generator, so that compiled and eager draws agree.

A step is then a function of no arguments with no host sync and no branch on data:
`torch.compile(step, mode="reduce-overhead")` records it once as a CUDA graph and
replays it. The loop reads `finished` back every `EOS_CHECK_EVERY` steps only
(finished sequences are fed a filler token meanwhile, and their output is cut at the
EOS). The prompt's forward (prefill) stays eager: its length differs from call to
call, it is one launch-bound pass rather than hundreds, and compiling it for dynamic
shapes would cost more than it saves on a single prompt.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from titan_core.generation.decode_speed import DecodeClock, DecodeTiming
from titan_core.generation.kv_cache import KVCache, left_pad
from titan_core.generation.sampling import SamplingParams, draw_noise, pick_next_token

WARMUP_STEPS = 3
"""Decode steps timed apart from the rate when compiling: Dynamo's trace, CUDA graph warm-up and recording."""

EOS_CHECK_EVERY = 16
"""Decode steps between reads of `finished` on the host (each one waits for the GPU)."""

CACHE_ALIGN = 16
"""Cache slots are rounded up to a multiple of this: the additive mask's rows stay aligned for the fused attention
kernels, which otherwise pad a copy of it at every call."""


def cache_slots(prompts: Sequence[Sequence[int]], max_new_tokens: int) -> int:
    """Slots per sequence of the static cache: longest prompt + new tokens, rounded up to `CACHE_ALIGN`."""
    needed = max(len(p) for p in prompts) + max_new_tokens
    return -(-needed // CACHE_ALIGN) * CACHE_ALIGN


CUDA_TUNING: dict[str, str | int | bool | Callable[..., Any]] = {"coordinate_descent_tuning": True}
"""Inductor options added by `tune=True` on CUDA: coordinate-descent tuning of the generated kernels, as gpt-fast
compiles its decode step. The 1B Llama at batch 1 on an H100 (torch 2.11): 535 tokens/s and ~20 s of first
compile without it, 664 tokens/s and ~60 s with it (Inductor caches both for the next run)."""


def compile_step(
    step: Callable[[], torch.Tensor], device: torch.device, backend: str, tune: bool = False
) -> Callable[[], torch.Tensor]:
    """`step` compiled: with CUDA graphs (as `mode="reduce-overhead"`) for Inductor on CUDA, else plain `backend`.

    Args:
        step: `StaticDecoder.step`.
        device: the model's device.
        backend: "inductor" (the default), or e.g. "aot_eager" to check the capture without code generation.
        tune: on CUDA with Inductor, add `CUDA_TUNING` (faster steps, a longer first compile).
    """
    if backend == "inductor" and device.type == "cuda":
        options: dict[str, str | int | bool | Callable[..., Any]] = {"triton.cudagraphs": True}  # "reduce-overhead"
        if tune:
            options.update(CUDA_TUNING)
        return torch.compile(step, dynamic=False, options=options)
    return torch.compile(step, backend=backend, dynamic=False)


class StaticDecoder:
    """The state of one static generation, its prefill and its decode step.

    Args:
        model: the model, its attention cores swapped by `kv_cache` for `cache`.
        cache: the shared cache state, `cache_slots(...)` slots long.
        prompts: token ids of each prompt.
        max_new_tokens: most tokens to add to each prompt (at least 1).
        sampling: greedy or temperature / top-k / top-p.
        eos_ids: tokens that end a sequence.
        generator: the seeded source of the sampling noise.
    """

    def __init__(
        self,
        model: nn.Module,
        cache: KVCache,
        prompts: Sequence[Sequence[int]],
        max_new_tokens: int,
        sampling: SamplingParams,
        eos_ids: Sequence[int],
        generator: torch.Generator,
    ):
        device = cache.real.device
        self.model, self.cache, self.sampling, self.generator = model, cache, sampling, generator
        self.prompt_tokens, self.prompt_real = left_pad(prompts, device)  # each (bs, longest)
        bs, longest = self.prompt_tokens.shape
        self.eos = torch.tensor(sorted(set(eos_ids)), dtype=torch.long, device=device)  # (n_eos,)
        self.filler = min(eos_ids) if eos_ids else 0  # fed after a sequence ended; its outputs are never read
        self.token = torch.zeros(bs, dtype=torch.long, device=device)  # (bs,): the token fed next
        self.positions = self.prompt_real.sum(-1, keepdim=True) - 1  # (bs, 1): RoPE position of the last one fed
        self.finished = torch.zeros(bs, dtype=torch.bool, device=device)  # (bs,)
        self.new_tokens = torch.full((bs, max_new_tokens), self.filler, dtype=torch.long, device=device)
        self.count = torch.zeros(1, dtype=torch.long, device=device)  # (1,): tokens chosen so far
        self.noise: torch.Tensor | None = None  # (bs, vocab) once the vocabulary is known

    def prefill(self) -> torch.Tensor:
        """The prompts in one forward (eager); chooses the first token. Returns its logits `(bs, vocab)`."""
        positions = (self.prompt_real.long().cumsum(-1) - 1).clamp(min=0)  # (bs, longest): 0.. over the real tokens
        self.cache.prepare(0, self.prompt_real)
        logits = self.model(self.prompt_tokens, positions=positions)[:, -1]  # (bs, vocab)
        if not self.sampling.greedy:
            self.noise = draw_noise(logits, self.generator)
        self.choose(logits)
        self.cache.start_decode(self.prompt_tokens.size(1) - 1)
        state = (self.token, self.positions, self.finished, self.new_tokens, self.count, self.eos)
        for tensor in (*state, *((self.noise,) if self.noise is not None else ())):
            torch._dynamo.mark_static_address(tensor)
        return logits

    def draw(self) -> None:
        """Fill the sampling noise of the next step from the generator (eager; nothing when greedy)."""
        if self.noise is not None:
            self.noise.exponential_(generator=self.generator)

    def choose(self, logits: torch.Tensor) -> None:
        """Record the next token of each sequence from `logits` `(bs, vocab)`; a finished one gets the filler."""
        chosen = pick_next_token(logits, self.sampling, self.noise)  # (bs,)
        chosen = torch.where(self.finished, self.filler, chosen)
        self.new_tokens.index_copy_(1, self.count, chosen[:, None])
        self.count.add_(1)
        self.finished.logical_or_(torch.isin(chosen, self.eos))
        self.token.copy_(chosen)

    def step(self) -> torch.Tensor:
        """Feed `token` at the next slot and position, choose the next one. Returns the logits `(bs, vocab)`.

        Fixed shapes, in-place updates only, no host sync: the function `compile_step` compiles.
        """
        self.cache.advance()
        self.positions.add_(1)
        logits = self.model(self.token[:, None], positions=self.positions)[:, -1]  # input (bs, 1)
        self.choose(logits)
        return logits


def decode_static(
    decoder: StaticDecoder,
    max_new_tokens: int,
    step: Callable[[], torch.Tensor],
    compiled: bool,
    return_logits: bool,
) -> tuple[torch.Tensor, list[torch.Tensor], DecodeTiming]:
    """Run the prefill, then `step` until every sequence ended or `max_new_tokens` were chosen.

    Args:
        decoder: the state, built for this call.
        max_new_tokens: most tokens per sequence (at least 1).
        step: `decoder.step`, or it compiled by `compile_step`.
        compiled: whether `step` is compiled (its first `WARMUP_STEPS` are timed apart; CUDA graph
            steps are marked).
        return_logits: keep each step's logits (float32, on CPU: a host sync per step).

    Returns:
        The new tokens `(bs, n)` (filler after a sequence's EOS), the logits of each step if asked,
        and the timing.
    """
    device = decoder.token.device
    bs, longest = decoder.prompt_tokens.shape
    clock = DecodeClock(device, bs, longest, WARMUP_STEPS if compiled else 0)
    mark_graph_step = compiled and device.type == "cuda"
    check_every = 1 if return_logits else EOS_CHECK_EVERY
    clock.start()
    logits = decoder.prefill()
    clock.prefill_done()
    step_logits = [logits.float().cpu()] if return_logits else []
    chosen = 1
    while chosen < max_new_tokens and not (chosen % check_every == 0 and bool(decoder.finished.all())):
        clock.before_step()
        decoder.draw()
        if mark_graph_step:
            torch.compiler.cudagraph_mark_step_begin()  # the previous replay's outputs may be overwritten
        logits = step()
        chosen += 1
        if return_logits:
            step_logits.append(logits.float().cpu())
    timing = clock.timing()
    return decoder.new_tokens[:, :chosen], step_logits, timing
