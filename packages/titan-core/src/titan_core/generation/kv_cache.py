"""A key/value cache for generation, added to any model family from outside.

Every family's `ModelPlan.attention` names, inside each block, the module that turns
`(q, k, v)` (after RoPE) into causal attention; context parallel swaps it for ring
attention. `kv_cache` swaps it, for the length of a `with` block, for a
`CachedAttention` that writes the new keys/values into a preallocated cache and
attends the new queries over every cached slot. The model's code is untouched.

A family whose attention module has a `latent_forward` (DeepSeek-V3's Multi-head Latent
Attention) gets that whole module swapped for a `LatentCachedAttention` instead: the cache
then keeps, per token and layer, MLA's normalised latent and its rotated key (one shared
key head, whose leading dims are also the value) rather than every head's expanded keys
and values, 71x fewer bytes at DeepSeek-V3's shape; the model's `latent_forward` holds the
absorbed math.

Slots vs positions: slot i of the cache holds the i-th token fed to the model
(prompts are left-padded to one length, so slot != RoPE position for a short
prompt). The caller passes RoPE positions to the model and tells the cache, per
forward, where the new tokens go and which of them are real (`KVCache.prepare`);
padding slots are never attended to.

Two ways to feed it:

- `prepare(start, real)` before each forward (the prompt, and the dynamic decode loop):
  Python ints say where the tokens go, the mask is built for this forward, and the
  attention reads only slots `0 .. start + n - 1`. Any length, any start.
- `start_decode(slot)` once after the prompt (the static decode step): from then on
  each forward feeds one token per sequence, written at the device tensor `slot`;
  the attention reads every slot of the cache, those not yet written masked by an
  additive bias the step updates in place. Every shape is fixed and nothing is
  allocated or read back to the host, so the step can be compiled and captured in
  one CUDA graph.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from titan_core.config.errors import ConfigError
from titan_parallel.modules import get_submodule_or_none, iter_blocks
from titan_parallel.plan import ModelPlan


def left_pad(prompts: Sequence[Sequence[int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The prompts left-padded to the longest: tokens `(bs, longest)` int64 (padding 0), and `real` `(bs, longest)`
    bool, False on padding."""
    longest = max(len(p) for p in prompts)
    tokens = torch.zeros(len(prompts), longest, dtype=torch.long)  # (bs, longest)
    real = torch.zeros(len(prompts), longest, dtype=torch.bool)  # (bs, longest)
    for row, prompt in enumerate(prompts):
        tokens[row, longest - len(prompt) :] = torch.tensor(list(prompt), dtype=torch.long)
        real[row, longest - len(prompt) :] = True
    return tokens.to(device), real.to(device)


class KVCache:
    """What every layer's `CachedAttention` shares: the slots of this forward, and which slots hold real tokens.

    Args:
        batch_size: sequences generated together.
        max_len: slots per sequence (longest prompt + new tokens).
        device: where the masks live (the model's device).
    """

    def __init__(self, batch_size: int, max_len: int, device: torch.device | str):
        self.max_len = max_len
        self.real = torch.zeros(batch_size, max_len, dtype=torch.bool, device=device)  # (bs, max_len)
        self.start = 0
        self.attn_mask = torch.ones(batch_size, 1, 0, 0, dtype=torch.bool, device=device)
        self.layers: list[CachedAttention] = []
        self.decoding = False  # set once by start_decode; a mode, not a per-step branch
        self.slot = torch.zeros(1, dtype=torch.long, device=device)  # (1,): slot of the token being decoded
        self.bias = torch.zeros(0, device=device)  # (bs, 1, 1, max_len) from start_decode: 0 or -inf per slot

    def prepare(self, start: int, real: torch.Tensor) -> None:
        """Get ready for a forward whose tokens go into slots `start .. start + n - 1`.

        Args:
            start: first slot of the new tokens (0 for the prompt).
            real: `(bs, n)` bool, False for padding tokens (never attended to as keys).
        """
        n = real.size(1)
        if start + n > self.max_len:
            raise ValueError(f"the KV cache holds {self.max_len} tokens; {start + n} were fed; raise max_len")
        self.decoding = False
        self.start = start
        self.real[:, start : start + n] = real
        slots = torch.arange(start + n, device=real.device)  # (end,)
        query_slots = slots[start:, None]  # (n, 1)
        causal = slots[None, :] <= query_slots  # (n, end)
        # A padding query sees only itself, so its row stays finite (an all-masked softmax is NaN,
        # which would reach real tokens through 0 * NaN in the next layer's values).
        allowed = (causal & self.real[:, None, None, : start + n]) | (slots[None, :] == query_slots)  # (bs, 1, n, end)
        self.attn_mask = allowed

    def start_decode(self, last_slot: int) -> None:
        """Switch to the static decode step: from now on `slot` says where each forward's one token goes.

        Every layer's cache must exist (a prompt forward allocates them). Marks the cache
        tensors as static addresses, so CUDA graphs read and write them in place.

        Args:
            last_slot: the last slot written so far; `advance` moves to the next one.
        """
        per_layer = [layer.cache_tensors() for layer in self.layers]
        if not per_layer or not all(per_layer):
            raise ValueError("start_decode needs every layer's cache; run the prompt through the model first")
        caches = [t for tensors in per_layer for t in tensors]
        self.decoding = True
        self.slot.fill_(last_slot)
        bs, max_len = self.real.shape
        dtype = caches[0].dtype
        # additive mask in the attention's dtype: 0 where a slot holds a real token, -inf elsewhere
        self.bias = torch.zeros(bs, 1, 1, max_len, dtype=dtype, device=self.real.device)  # (bs, 1, 1, max_len)
        self.bias.masked_fill_(~self.real[:, None, None, :], float("-inf"))
        for tensor in (self.slot, self.bias, *caches):
            torch._dynamo.mark_static_address(tensor)

    def advance(self) -> None:
        """Move to the next slot and let every query attend to it (in place: no allocation, no host sync)."""
        self.slot.add_(1)
        self.bias.index_fill_(-1, self.slot, 0.0)

    def bytes_per_token(self) -> int:
        """Bytes the caches of all layers take per token of one sequence (0 before the first forward)."""
        return sum(layer.bytes_per_token() for layer in self.layers)


class CachedAttention(nn.Module):
    """Drop-in for a causal attention core `(q, k, v) -> out` that reads and extends a KV cache.

    The cache of this layer is allocated on the first forward, `(bs, n_kv_heads, max_len, head_dim)`
    for keys and the same with v's head dim for values, in k's dtype and device. With `value_dim`,
    the values are the first `value_dim` dims of each key (MLA's latent, `LatentCachedAttention`):
    only the keys are stored, and `values` is a view of them.

    Args:
        cache: the state shared by all layers.
        scale: softmax scale; None means `1 / sqrt(q head_dim)`. Taken from the swapped
            module's `scale` attribute when it has one.
        value_dim: None, or the leading key dims that are also the values (`v` is then not read).
    """

    def __init__(self, cache: KVCache, scale: float | None = None, value_dim: int | None = None):
        super().__init__()
        self.cache = cache
        self.scale = scale
        self.value_dim = value_dim
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None = None) -> torch.Tensor:
        """Args:
            q: `(bs, n_heads, n, head_dim)` queries of the new tokens.
            k: `(bs, n_kv_heads, n, head_dim)` their keys; `n_kv_heads` divides `n_heads`.
            v: `(bs, n_kv_heads, n, v_head_dim)` their values; None with `value_dim`.

        Returns:
            `(bs, n_heads, n, v_head_dim)`.
        """
        state = self.cache
        if state.decoding:
            keys, values = self._allocated(k, v)
            return self._decode(q, k, v, keys, values)
        keys, values = self.write(k, v)
        end = state.start + q.size(2)
        return F.scaled_dot_product_attention(
            q,
            keys[:, :, :end],
            values[:, :, :end],
            attn_mask=state.attn_mask,
            scale=self.scale,
            enable_gqa=q.size(1) != k.size(1),
        )

    def write(self, k: torch.Tensor, v: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Store the keys (and values) of this forward's tokens at the slots `KVCache.prepare` set.

        Args:
            k: `(bs, n_kv_heads, n, head_dim)`.
            v: `(bs, n_kv_heads, n, v_head_dim)`; None with `value_dim`.

        Returns:
            The whole cache: keys and values, `(bs, n_kv_heads, max_len, ...)`.
        """
        keys, values = self._allocated(k, v)
        start = self.cache.start
        keys[:, :, start : start + k.size(2)] = k
        if self.value_dim is None:
            assert v is not None  # checked when the cache was allocated
            values[:, :, start : start + k.size(2)] = v
        return keys, values

    def _allocated(self, k: torch.Tensor, v: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """The cache tensors, allocated on first use in k's (and v's) dtype, device and head dims."""
        if self.keys is None or self.values is None:
            bs, kv_heads = k.shape[:2]
            # (bs, n_kv_heads, max_len, head_dim) and (bs, n_kv_heads, max_len, v_head_dim)
            self.keys = k.new_zeros(bs, kv_heads, self.cache.max_len, k.size(-1))
            if self.value_dim is not None:
                self.values = self.keys[..., : self.value_dim]
            else:
                assert v is not None, "CachedAttention needs v unless its values are part of the keys (value_dim)"
                self.values = v.new_zeros(bs, kv_heads, self.cache.max_len, v.size(-1))
        return self.keys, self.values

    def _decode(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None, keys: torch.Tensor, values: torch.Tensor
    ) -> torch.Tensor:
        """One new token per sequence at `cache.slot`, attending over the whole cache (fixed shapes)."""
        bs, n_heads, n, _ = q.shape
        if n != 1:
            raise ValueError(f"the static decode step feeds one token per sequence, not {n}; use prepare() for more")
        keys.index_copy_(2, self.cache.slot, k)
        if self.value_dim is None:
            assert v is not None  # checked when the cache was allocated
            values.index_copy_(2, self.cache.slot, v)
        kv_heads = keys.size(1)
        # Grouped-query attention without repeating the cache: the `n_heads / n_kv_heads` query heads
        # that share a KV head (heads h with h // group equal, as enable_gqa pairs them) become that
        # head's rows of queries, so each KV head is read once.
        grouped = q.reshape(bs, kv_heads, n_heads // kv_heads, q.size(-1))  # (bs, n_kv_heads, group, head_dim)
        out = F.scaled_dot_product_attention(grouped, keys, values, attn_mask=self.cache.bias, scale=self.scale)
        return out.reshape(bs, n_heads, 1, values.size(-1))  # (bs, n_heads, 1, v_head_dim)

    def bytes_per_token(self) -> int:
        """Bytes of this layer's cache per token of one sequence (keys + values, all heads)."""
        if self.keys is None or self.values is None:
            return 0
        per_slot = self.keys[0, :, 0].nbytes + (self.values[0, :, 0].nbytes if self.value_dim is None else 0)
        return int(per_slot)

    def cache_tensors(self) -> list[torch.Tensor]:
        """The tensors this layer stores (not the values' view of the keys); empty before the first forward."""
        if self.keys is None or self.values is None:
            return []
        return [self.keys] if self.value_dim is not None else [self.keys, self.values]


class LatentCachedAttention(nn.Module):
    """Drop-in for a whole attention module that has a `latent_forward` (DeepSeek-V3's MLA): caches its
    latent and rotated key per token instead of every head's keys and values.

    `latent_forward(x, rope_cache, positions, attend, expand)` hands `attend` the queries and the key of one
    shared head, `[latent | k_rope]`, whose leading `kv_lora_rank` dims are also the value. The prompt's
    forward (nothing cached before it) gets each head's keys and values too (`expand=True`) and attends over
    those: cheaper than the absorbed form when many queries meet many keys (each query head's dot products
    and outputs are 192 and 128 wide at DeepSeek-V3's shape rather than 576 and 512). Every later forward
    (decoding) runs absorbed over the cache, reading each cached latent once for all heads.

    Args:
        original: the attention module swapped (its weights are used as they are).
        cache: the state shared by all layers.
        scale: the softmax scale of its core (MLA's own).
        value_dim: the key dims that are also the value (MLA's `kv_lora_rank`).
    """

    def __init__(self, original: nn.Module, cache: KVCache, scale: float | None, value_dim: int):
        super().__init__()
        self.original = original
        self.core = CachedAttention(cache, scale, value_dim=value_dim)

    def forward(
        self,
        x: torch.Tensor,
        rope_cache: torch.Tensor,
        positions: torch.Tensor | None = None,
        mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The original module's arguments; `mask` must be None (the cache builds the causal mask itself)."""
        if mask is not None:
            raise ValueError("the KV cache attends causally over its slots; it takes no document mask")
        state = self.core.cache
        expand = not state.decoding and state.start == 0  # the prompt: its keys are all in this forward
        return self.original.latent_forward(x, rope_cache, positions, self._attend, expand)  # type: ignore[operator]

    def _attend(
        self, q: torch.Tensor, kv: torch.Tensor, k: torch.Tensor | None = None, v: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Store `kv`; attend `q` over the cache (absorbed), or over this forward's own `k`, `v` (expanded)."""
        if k is None or v is None:
            return self.core(q, kv)
        self.core.write(kv)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=self.core.cache.attn_mask, scale=self.core.scale)


@contextmanager
def kv_cache(
    model: nn.Module,
    plan: ModelPlan,
    batch_size: int,
    max_len: int,
    device: torch.device | str,
    *,
    latent: bool = True,
) -> Iterator[KVCache]:
    """Swap every block's attention core for a `CachedAttention` inside the `with` block.

    Where the module holding the core has a `latent_forward` (DeepSeek-V3's MLA), that module is swapped
    instead, for a `LatentCachedAttention`: the cache keeps its latent and rotated key per token.
    The original modules come back on exit, so the model can run without the cache again.

    Args:
        model: a built model whose blocks `plan` names.
        plan: the family's plan; `plan.attention` names the attention core of each block.
        batch_size: sequences generated together.
        max_len: slots per sequence.
        device: the model's device.
        latent: False caches every head's keys and values even where a latent cache is possible.

    Yields:
        The shared `KVCache`; call `prepare` before each forward.
    """
    if plan.attention is None:
        raise ConfigError(
            f"model {type(model).__name__} names no attention core (ModelPlan.attention); "
            "give its plan one, or pass --no-kv-cache"
        )
    parent_path, _, name = plan.attention.rpartition(".")
    cache = KVCache(batch_size, max_len, device)
    swapped: list[tuple[nn.Module, str, nn.Module]] = []  # (holder, attribute, original module)
    try:
        for block in iter_blocks(model, plan):
            parent = get_submodule_or_none(block, parent_path) if parent_path else block
            original = getattr(parent, name, None) if parent is not None else None
            if parent is None or not isinstance(original, nn.Module):
                raise ConfigError(
                    f"block {type(block).__name__} has no module at ModelPlan.attention '{plan.attention}'; "
                    "fix the model's plan"
                )
            scale = getattr(original, "scale", None)  # a family with its own softmax scale (e.g. MLA) keeps it
            scale = float(scale) if isinstance(scale, (int, float)) else None
            if latent and parent_path and hasattr(parent, "latent_forward"):
                grand_path, _, parent_name = parent_path.rpartition(".")
                grand = get_submodule_or_none(block, grand_path) if grand_path else block
                assert grand is not None  # it holds `parent`
                latent_layer = LatentCachedAttention(parent, cache, scale, cast(int, parent.kv_lora_rank))
                setattr(grand, parent_name, latent_layer)
                swapped.append((grand, parent_name, parent))
                cache.layers.append(latent_layer.core)
                continue
            layer = CachedAttention(cache, scale)
            setattr(parent, name, layer)
            swapped.append((parent, name, original))
            cache.layers.append(layer)
        yield cache
    finally:
        for holder, attribute, module in swapped:
            setattr(holder, attribute, module)
