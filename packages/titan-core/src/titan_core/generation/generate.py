"""The generation loop: prefill the prompts, then one token per step until EOS or the limit.

Prompts of different lengths are left-padded to one length, so every sequence's
newest token is the last column; padding gets RoPE position 0 and is never attended
to, and each sequence's real tokens take positions 0, 1, ... as if it were alone
(transformers does the same with an attention mask). Sequences that have emitted an
EOS keep being fed a filler token until the whole batch is done; their output is cut
after the EOS.

With the KV cache (`kv_cache.py`) the prompt is one forward and each new token one
more forward of length 1. Three loops, all giving the same greedy tokens (the tests
check it):

- static (the default, `static_decode.py`): the cache preallocated, a fixed-shape
  decode step with no host sync, optionally compiled (`compile=True`: CUDA graphs on
  CUDA). The fast one.
- dynamic (`static_cache=False`): the cache told where each forward goes by Python
  ints, the mask rebuilt and `finished` read back at every step; the eager reference
  the static step is checked against.
- none (`use_kv_cache=False`): every step recomputes each sequence alone from its
  first token with the model as it was built: slow, but the plainest reference there is.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field

import torch
from torch import nn

from titan_core.config.errors import ConfigError
from titan_core.generation.decode_speed import DecodeClock, DecodeTiming
from titan_core.generation.fused_linears import fuse_shared_input_linears
from titan_core.generation.kv_cache import KVCache, kv_cache, left_pad
from titan_core.generation.sampling import SamplingParams, sample_next_token
from titan_core.generation.static_decode import StaticDecoder, cache_slots, compile_step, decode_static
from titan_parallel.modules import get_submodule_or_none
from titan_parallel.plan import ModelPlan

GREEDY = SamplingParams(temperature=0.0)
"""Argmax decoding, the default."""


@dataclass(frozen=True)
class GenerationResult:
    """What `generate` produced.

    Args:
        tokens: the new tokens of each prompt; a sequence that stopped on an EOS ends with it.
        step_logits: when asked for, the last-position logits of every step, each `(bs, vocab)`
            float32 on CPU (rows of finished sequences included).
        kv_bytes_per_token: bytes the KV cache took per token of one sequence (0 without it).
        timing: prefill and decode times (None when no token was asked for).
    """

    tokens: list[list[int]]
    step_logits: list[torch.Tensor] = field(default_factory=list)
    kv_bytes_per_token: int = 0
    timing: DecodeTiming | None = None


@torch.no_grad()
def generate(
    model: nn.Module,
    plan: ModelPlan,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    sampling: SamplingParams = GREEDY,
    eos_ids: Sequence[int] = (),
    seed: int = 0,
    use_kv_cache: bool = True,
    max_seq_len: int | None = None,
    return_logits: bool = False,
    static_cache: bool = True,
    compile: bool = False,
    compile_backend: str = "inductor",
    compile_tuning: bool = False,
    fuse_linears: bool = True,
) -> GenerationResult:
    """Continue each prompt by up to `max_new_tokens` tokens.

    Args:
        model: a family's model, called as `model(tokens, positions=positions)`; in eval mode.
        plan: the family's plan (`ModelSpec.plan`): names the attention core and the output projection.
        prompts: token ids of each prompt (BOS included where the model expects one); none empty.
        max_new_tokens: most tokens to add to each prompt.
        sampling: temperature / top-k / top-p; the default is greedy.
        eos_ids: tokens that end a sequence (kept as its last token).
        seed: seed of the `torch.Generator` the sampling draws from.
        use_kv_cache: False recomputes every sequence from its start at each step.
        max_seq_len: the model's longest sequence (RoPE table length); None skips the check.
        return_logits: keep every step's logits in the result.
        static_cache: with the cache, the static decode step (`static_decode.py`); False runs the
            dynamic loop, the eager reference.
        compile: compile the static decode step (`torch.compile`, CUDA graphs on CUDA with Inductor).
        compile_backend: the `torch.compile` backend; "aot_eager" captures without generating code.
        compile_tuning: on CUDA, tune Inductor's kernels too (`static_decode.CUDA_TUNING`): faster
            steps for a first compile about three times as long.
        fuse_linears: compute each of the plan's `shared_input_linears` groups (a block's query / key / value
            projections, the feed-forward's `w1` / `w3`) as one matmul (`fused_linears.py`).
    """
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ConfigError("every prompt needs at least one token; pass a non-empty --prompt")
    if max_new_tokens < 0:
        raise ConfigError(f"--max-new-tokens {max_new_tokens} is negative; pass 1 or more")
    longest = max(len(p) for p in prompts)
    if max_seq_len is not None and longest + max_new_tokens > max_seq_len:
        raise ConfigError(
            f"the longest prompt ({longest} token{'s' if longest != 1 else ''}) plus --max-new-tokens {max_new_tokens} "
            f"exceeds the model's max_seq_len {max_seq_len}; shorten the prompt or lower --max-new-tokens"
        )
    if compile and not (use_kv_cache and static_cache):
        raise ConfigError("only the static KV cache's decode step compiles; pass --no-compile with --no-kv-cache")
    if not max_new_tokens:
        return GenerationResult([[] for _ in prompts])
    device = next(model.parameters()).device
    generator = torch.Generator(device=device).manual_seed(seed)
    with ExitStack() as stack:
        stack.enter_context(last_position_logits(model, plan))
        if fuse_linears:
            stack.enter_context(fuse_shared_input_linears(model, plan))
        if use_kv_cache and static_cache:
            cache = stack.enter_context(
                kv_cache(model, plan, len(prompts), cache_slots(prompts, max_new_tokens), device)
            )
            decoder = StaticDecoder(model, cache, prompts, max_new_tokens, sampling, eos_ids, generator)
            step = compile_step(decoder.step, device, compile_backend, compile_tuning) if compile else decoder.step
            new_tokens, step_logits, timing = decode_static(decoder, max_new_tokens, step, compile, return_logits)
            kv_bytes = cache.bytes_per_token()
        else:
            new_tokens, step_logits, timing, kv_bytes = _decode_eager(
                model, plan, prompts, max_new_tokens, sampling, eos_ids, generator, use_kv_cache, return_logits, stack
            )
    rows = _cut_after_eos(new_tokens.tolist(), set(eos_ids))
    return GenerationResult(rows, step_logits, kv_bytes, timing)


def _decode_eager(
    model: nn.Module,
    plan: ModelPlan,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    sampling: SamplingParams,
    eos_ids: Sequence[int],
    generator: torch.Generator,
    use_kv_cache: bool,
    return_logits: bool,
    stack: ExitStack,
) -> tuple[torch.Tensor, list[torch.Tensor], DecodeTiming, int]:
    """The reference loops (dynamic cache, or none): new tokens `(bs, n)`, step logits, timing, KV bytes/token."""
    device = generator.device
    longest = max(len(p) for p in prompts)
    eos = torch.tensor(sorted(set(eos_ids)), dtype=torch.long, device=device)
    filler = int(eos[0]) if eos.numel() else 0  # fed after a sequence ended; its outputs are never read
    new_tokens = torch.full((len(prompts), max_new_tokens), filler, dtype=torch.long, device=device)  # (bs, max_new)
    finished = torch.zeros(len(prompts), dtype=torch.bool, device=device)
    n_steps, step_logits, cache = 0, [], None
    if use_kv_cache:
        cache = stack.enter_context(kv_cache(model, plan, len(prompts), longest + max_new_tokens, device))
        forward: _CachedForward | _UncachedForward = _CachedForward(model, cache, prompts, device)
    else:
        forward = _UncachedForward(model, prompts, device)
    clock = DecodeClock(device, len(prompts), longest, warmup_steps=0)
    clock.start()
    logits: torch.Tensor | None = forward.prefill()  # (bs, vocab)
    while logits is not None:
        if return_logits:
            step_logits.append(logits.float().cpu())
        token = torch.where(finished, filler, sample_next_token(logits, sampling, generator))  # (bs,)
        new_tokens[:, n_steps] = token
        n_steps += 1
        finished |= torch.isin(token, eos)
        if n_steps == 1:
            clock.prefill_done()
        if n_steps == max_new_tokens or bool(finished.all()):
            break
        clock.before_step()
        logits = forward.step(token)
    kv_bytes = cache.bytes_per_token() if cache is not None else 0
    return new_tokens[:, :n_steps], step_logits, clock.timing(), kv_bytes


class _CachedForward:
    """The prompts in one forward, then one forward of length 1 per step, through the KV cache.

    Args:
        model: the model, its attention cores swapped by `kv_cache`.
        cache: the shared cache state.
        prompts: token ids of each prompt.
        device: the model's device.
    """

    def __init__(self, model: nn.Module, cache: KVCache, prompts: Sequence[Sequence[int]], device: torch.device):
        self.model, self.cache = model, cache
        self.tokens, self.real = left_pad(prompts, device)  # each (bs, longest), left-padded
        self.next_slot = self.tokens.size(1)
        self.lengths = self.real.sum(-1, keepdim=True)  # (bs, 1): RoPE position of each sequence's next token

    def prefill(self) -> torch.Tensor:
        """Logits `(bs, vocab)` after each prompt's last token."""
        positions = (self.real.long().cumsum(-1) - 1).clamp(min=0)  # (bs, longest): 0.. over the real tokens
        self.cache.prepare(0, self.real)
        return self.model(self.tokens, positions=positions)[:, -1]

    def step(self, token: torch.Tensor) -> torch.Tensor:
        """Logits `(bs, vocab)` after feeding `token` `(bs,)`."""
        self.cache.prepare(self.next_slot, torch.ones_like(self.lengths, dtype=torch.bool))
        logits = self.model(token[:, None], positions=self.lengths)[:, -1]  # input (bs, 1)
        self.next_slot += 1
        self.lengths = self.lengths + 1
        return logits


class _UncachedForward:
    """Each sequence alone, recomputed from its first token at every step, with the model as built."""

    def __init__(self, model: nn.Module, prompts: Sequence[Sequence[int]], device: torch.device):
        self.model, self.device = model, device
        self.sequences = [list(p) for p in prompts]

    def prefill(self) -> torch.Tensor:
        """Logits `(bs, vocab)` after each sequence's last token."""
        rows = [self.model(torch.tensor([seq], dtype=torch.long, device=self.device))[:, -1] for seq in self.sequences]
        return torch.cat(rows)

    def step(self, token: torch.Tensor) -> torch.Tensor:
        """Append `token` `(bs,)` to each sequence and recompute."""
        for seq, t in zip(self.sequences, token.tolist(), strict=True):
            seq.append(t)
        return self.prefill()


@contextmanager
def last_position_logits(model: nn.Module, plan: ModelPlan) -> Iterator[None]:
    """Inside the `with` block, the output projection sees only the last position.

    The projection is the last module of `plan.pp_last` (e.g. `output`); a pre-hook
    slices its input `(bs, seqlen, dim)` to `(bs, 1, dim)`, so a prompt's forward
    computes one row of logits instead of `seqlen`. Without such a module nothing
    changes (the caller slices the full logits).
    """
    head = get_submodule_or_none(model, plan.pp_last[-1]) if plan.pp_last else None
    if not isinstance(head, nn.Module):
        yield
        return
    handle = head.register_forward_pre_hook(lambda module, args: (args[0][:, -1:], *args[1:]))
    try:
        yield
    finally:
        handle.remove()


def _cut_after_eos(rows: list[list[int]], eos_ids: set[int]) -> list[list[int]]:
    """Each row up to and including its first EOS."""
    cut = []
    for row in rows:
        end = next((i + 1 for i, t in enumerate(row) if t in eos_ids), len(row))
        cut.append(row[:end])
    return cut
