"""Llama 3 / 3.1 as one small file, in the spirit of nanoGPT and gpt-fast.

Nothing here knows about parallelism (no `torch.distributed` import); titan-parallel
splits the modules from outside, reading `titan_models.llama3.plan.llama3_plan`.
Build on the meta device, shard, `to_empty`, then call `Transformer.init_weights`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from titan_models.decoder import decoder_forward
from titan_models.document_mask import masked_attention
from titan_models.errors import ModelConfigError
from titan_models.mtp import MTPDepth
from titan_models.mup import MuP, check_mup

if TYPE_CHECKING:
    from torch.nn.attention.flex_attention import BlockMask


@dataclass(frozen=True)
class RopeScaling:
    """Llama 3.1 long-context scaling of the RoPE frequencies (Meta's `apply_scaling`).

    Args:
        factor: divisor applied to the low frequencies (8 for Llama 3.1).
        low_freq_factor: wavelengths above `original_max_position_embeddings / low_freq_factor` are divided by `factor`.
        high_freq_factor: wavelengths below `original_max_position_embeddings / high_freq_factor` are kept.
        original_max_position_embeddings: context length the model was pretrained at (8192).
    """

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True)
class ModelArgs:
    """Shape of a Llama 3 model. Frozen: derive variants with `dataclasses.replace`."""

    dim: int = 4096
    """Width of the residual stream."""
    n_layers: int = 32
    """Number of transformer blocks."""
    n_heads: int = 32
    """Number of query heads."""
    n_kv_heads: int | None = None
    """Number of key/value heads (grouped-query attention); None means `n_heads`."""
    vocab_size: int = 128256
    """Rows of the token embedding and of the output projection."""
    multiple_of: int = 256
    """The feed-forward hidden size is rounded up to a multiple of this."""
    ffn_dim_multiplier: float | None = None
    """Scales the feed-forward hidden size `int(2 * 4 * dim / 3)` before rounding; None means 1."""
    norm_eps: float = 1e-5
    """Epsilon of every RMSNorm."""
    rope_theta: float = 500000.0
    """RoPE base frequency."""
    rope_scaling: RopeScaling | None = None
    """Llama 3.1 frequency scaling; None for plain RoPE (Llama 3)."""
    max_seq_len: int = 8192
    """Length of the precomputed RoPE table: the largest position the model can see plus one."""
    tie_word_embeddings: bool = False
    """Share one weight between `tok_embeddings` and `output` (Llama 3.2 1B/3B)."""
    head_dim: int | None = None
    """Width of one attention head; None means `dim // n_heads`."""
    mup: MuP | None = None
    """The maximal update parametrization's base shape and multipliers (`titan_models.mup`); None: standard."""
    n_mtp_layers: int = 0
    """Multi-token-prediction depths (`titan_models.mtp`): entries `n_layers ..` of `layers`, run only by
    `forward(..., mtp=True)`."""

    def __post_init__(self) -> None:
        if self.n_mtp_layers < 0:
            raise ModelConfigError(f"ModelArgs.n_mtp_layers={self.n_mtp_layers} must be >= 0")
        if self.n_heads % self.kv_heads != 0:
            raise ModelConfigError(
                f"ModelArgs.n_kv_heads={self.kv_heads} must divide n_heads={self.n_heads}; pick a divisor of n_heads"
            )
        if self.head_dim is None and self.dim % self.n_heads != 0:
            raise ModelConfigError(
                f"ModelArgs.dim={self.dim} is not divisible by n_heads={self.n_heads}; change one or set head_dim"
            )
        if self.attention_head_dim % 2 != 0:
            raise ModelConfigError(
                f"ModelArgs head_dim={self.attention_head_dim} must be even for RoPE; "
                "change head_dim (or dim / n_heads)"
            )
        if self.mup is not None:
            check_mup(self.mup, tied=self.tie_word_embeddings, moe=False)

    @property
    def kv_heads(self) -> int:
        """`n_kv_heads` with None resolved to `n_heads`."""
        return self.n_kv_heads if self.n_kv_heads is not None else self.n_heads

    @property
    def attention_head_dim(self) -> int:
        """`head_dim` with None resolved to `dim // n_heads`."""
        return self.head_dim if self.head_dim is not None else self.dim // self.n_heads

    @property
    def ffn_hidden_dim(self) -> int:
        """SwiGLU hidden size: `int(2 * 4 * dim / 3)`, times `ffn_dim_multiplier`, rounded up to `multiple_of`."""
        hidden = int(2 * (4 * self.dim) / 3)
        if self.ffn_dim_multiplier is not None:
            hidden = int(self.ffn_dim_multiplier * hidden)
        return self.multiple_of * ((hidden + self.multiple_of - 1) // self.multiple_of)


def compute_rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None = None) -> torch.Tensor:
    """Inverse frequencies of RoPE, with Llama 3.1 scaling if given.

    Args:
        head_dim: width of one attention head (even).
        theta: RoPE base.
        scaling: Llama 3.1 scaling, or None.

    Returns:
        `(head_dim // 2,)` float32: `theta ** (-2i / head_dim)`, then scaled.
    """
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    if scaling is None:
        return inv_freq
    old_len = scaling.original_max_position_embeddings
    low_freq_wavelen = old_len / scaling.low_freq_factor
    high_freq_wavelen = old_len / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    smooth = (old_len / wavelen - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
    smoothed = (1 - smooth) * inv_freq / scaling.factor + smooth * inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / scaling.factor, smoothed)
    return torch.where(wavelen < high_freq_wavelen, inv_freq, scaled)


def precompute_rope_cache(
    head_dim: int, max_seq_len: int, theta: float, scaling: RopeScaling | None = None
) -> torch.Tensor:
    """The RoPE table: cos and sin of every (position, frequency) pair.

    Args:
        head_dim: width of one attention head (even).
        max_seq_len: number of positions (rows).
        theta: RoPE base.
        scaling: Llama 3.1 scaling, or None.

    Returns:
        `(max_seq_len, head_dim)` float32: `[cos | sin]`, each `(max_seq_len, head_dim // 2)`.
    """
    inv_freq = compute_rope_inv_freq(head_dim, theta, scaling)  # (head_dim/2,)
    angles = torch.outer(torch.arange(max_seq_len, dtype=torch.float32), inv_freq)  # (max_seq_len, head_dim/2)
    return torch.cat([angles.cos(), angles.sin()], dim=-1)


def apply_rotary_emb(x: torch.Tensor, rope_cache: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
    """Rotate queries or keys by RoPE in Meta's interleaved layout: pairs (2i, 2i+1).

    Args:
        x: `(bs, seqlen, n_heads, head_dim)` queries or keys.
        rope_cache: `(max_seq_len, head_dim)` from `precompute_rope_cache`.
        positions: absolute positions, `(seqlen,)` or `(bs, seqlen)` int64; None means `arange(seqlen)`.

    Returns:
        Tensor shaped and typed like `x`; the rotation is computed in float32.
    """
    bs, seqlen, _, head_dim = x.shape
    rope = rope_cache[:seqlen] if positions is None else rope_cache[positions]  # (seqlen | bs, seqlen, head_dim)
    rope = rope.view(-1, seqlen, 1, head_dim)  # (1 | bs, seqlen, 1, head_dim)
    cos, sin = (half.float() for half in rope.chunk(2, dim=-1))  # each (1 | bs, seqlen, 1, head_dim/2)
    if torch.compiler.is_compiling():
        # Inductor generates no complex kernels: it would call the eager ones, unfused, through fp32 copies of
        # x. The same products in real form fuse into one kernel with the casts around them.
        x0, x1 = x.float().reshape(bs, seqlen, -1, head_dim // 2, 2).unbind(-1)  # each (bs, seqlen, n_heads, hd/2)
        return torch.stack([x0 * cos - x1 * sin, x0 * sin + x1 * cos], dim=-1).flatten(3).type_as(x)
    # .float(): FSDP's mixed precision casts the cache (a forward input of each block) to bf16,
    # and torch.complex takes no bf16.
    # Pair (2i, 2i+1) as the complex number x_2i + j x_2i+1; rotating it is one complex product
    # (one kernel forward and backward, where the real form took a stack and six element-wise ops).
    pairs = torch.view_as_complex(
        x.float().reshape(bs, seqlen, -1, head_dim // 2, 2)
    )  # (bs, seqlen, n_heads, head_dim/2)
    rotated = torch.view_as_real(pairs * torch.complex(cos, sin))  # (bs, seqlen, n_heads, head_dim/2, 2)
    return rotated.flatten(3).type_as(x)


class ScaledDotProductAttention(nn.Module):
    """Causal `softmax(q k^T / sqrt(head_dim)) v`, its own module so context parallel can swap it."""

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | BlockMask | None = None
    ) -> torch.Tensor:
        """Args:
            q: `(bs, n_heads, seqlen, head_dim)`.
            k: `(bs, n_kv_heads, seqlen, head_dim)`; `n_kv_heads` divides `n_heads` (grouped-query).
            v: `(bs, n_kv_heads, seqlen, head_dim)`.
            mask: a block-causal mask (`titan_models.document_mask`); None is causal over the whole sequence.

        Returns:
            `(bs, n_heads, seqlen, head_dim)`.
        """
        if mask is not None:
            return masked_attention(q, k, v, mask)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=q.size(1) != k.size(1))


class Attention(nn.Module):
    """Grouped-query attention with RoPE. Head counts come from the weights' shapes
    (`view(..., -1, head_dim)`), so tensor parallel needs to change no attribute."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.head_dim = args.attention_head_dim
        self.wq = nn.Linear(args.dim, args.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, args.kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, args.kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * self.head_dim, args.dim, bias=False)
        self.sdpa = ScaledDotProductAttention()
        self.query_scale = args.mup.query_scale(self.head_dim) if args.mup is not None else 1.0
        """muP's factor on the queries (scores as 1 / head_dim); 1 under the standard parametrization."""

    def forward(
        self,
        x: torch.Tensor,
        rope_cache: torch.Tensor,
        positions: torch.Tensor | None = None,
        mask: torch.Tensor | BlockMask | None = None,
    ) -> torch.Tensor:
        """Args:
            x: `(bs, seqlen, dim)`.
            rope_cache: `(max_seq_len, head_dim)` RoPE table.
            positions: `(seqlen,)` or `(bs, seqlen)` absolute positions; None means `arange(seqlen)`.
            mask: the block-causal mask of packed documents (`titan_models.document_mask`); None: causal.

        Returns:
            `(bs, seqlen, dim)`.
        """
        bs, seqlen, _ = x.shape
        xq = self.wq(x).view(bs, seqlen, -1, self.head_dim)  # (bs, seqlen, n_heads, head_dim)
        xk = self.wk(x).view(bs, seqlen, -1, self.head_dim)  # (bs, seqlen, n_kv_heads, head_dim)
        xv = self.wv(x).view(bs, seqlen, -1, self.head_dim)  # (bs, seqlen, n_kv_heads, head_dim)
        xq = apply_rotary_emb(xq, rope_cache, positions)
        xk = apply_rotary_emb(xk, rope_cache, positions)
        if self.query_scale != 1.0:
            xq = xq * self.query_scale
        q, k, v = xq.transpose(1, 2), xk.transpose(1, 2), xv.transpose(1, 2)
        # The cores that context parallel and the KV cache put in place take no mask: it goes only when set.
        out = self.sdpa(q, k, v) if mask is None else self.sdpa(q, k, v, mask=mask)  # (bs, n_heads, seqlen, head_dim)
        out = out.transpose(1, 2).reshape(bs, seqlen, -1)  # (bs, seqlen, n_heads * head_dim)
        return self.wo(out)

    def init_weights(self, out_std: float, in_std: float = 0.02) -> None:
        """Args:
        out_std: std of `wo` (depth-scaled by the block).
        in_std: std of `wq`, `wk`, `wv` (0.02; muP scales it with width)."""
        for linear in (self.wq, self.wk, self.wv):
            init_trunc_normal_(linear.weight, in_std)
        init_trunc_normal_(self.wo.weight, out_std)


class FeedForward(nn.Module):
    """SwiGLU: `w2(silu(w1 x) * w3 x)`."""

    def __init__(self, dim: int, hidden_dim: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Args:
        x: `(bs, seqlen, dim)`; returns the same shape."""
        return self.w2(F.silu(self.w1(x)) * self.w3(x))  # hidden: (bs, seqlen, hidden_dim)

    def init_weights(self, out_std: float, in_std: float = 0.02) -> None:
        """Args:
        out_std: std of `w2` and `w3` (depth-scaled by the block).
        in_std: std of `w1` (0.02; muP scales it with width)."""
        init_trunc_normal_(self.w1.weight, in_std)
        for linear in (self.w2, self.w3):
            init_trunc_normal_(linear.weight, out_std)


class TransformerBlock(nn.Module):
    """Pre-norm block: `h = x + attention(norm(x))`, `out = h + feed_forward(norm(h))`."""

    def __init__(self, layer_id: int, args: ModelArgs):
        super().__init__()
        self.layer_id = layer_id
        self.attention_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.attention = Attention(args)
        self.ffn_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.feed_forward = FeedForward(args.dim, args.ffn_hidden_dim)
        self.init_scale = args.mup.hidden_init_scale(args.dim) if args.mup is not None else 1.0
        """Factor on every init std of the block's matrices: muP's 1 / sqrt(width multiplier), else 1."""

    def forward(
        self,
        x: torch.Tensor,
        rope_cache: torch.Tensor,
        positions: torch.Tensor | None = None,
        mask: torch.Tensor | BlockMask | None = None,
    ) -> torch.Tensor:
        """Args:
        x: `(bs, seqlen, dim)`.
        rope_cache: `(max_seq_len, head_dim)` RoPE table.
        positions: absolute positions for RoPE, or None for `arange(seqlen)`.
        mask: the block-causal mask of packed documents, or None for causal attention.
        """
        # rope_cache and positions go by keyword: tensor parallel prepares only the first positional input.
        h = x + self.attention(self.attention_norm(x), rope_cache=rope_cache, positions=positions, mask=mask)
        return h + self.feed_forward(self.ffn_norm(h))

    def init_weights(self) -> None:
        """Norms to ones; output projections (`wo`, `w2`, `w3`) use std `0.02 / sqrt(2 * (layer_id + 1))`, the
        others 0.02, each times `init_scale`."""
        out_std = 0.02 / (2 * (self.layer_id + 1)) ** 0.5 * self.init_scale
        self.attention_norm.reset_parameters()
        self.ffn_norm.reset_parameters()
        self.attention.init_weights(out_std, 0.02 * self.init_scale)
        self.feed_forward.init_weights(out_std, 0.02 * self.init_scale)


class MTPBlock(MTPDepth, TransformerBlock):  # type: ignore[misc]  # forward: two outputs, a block's input
    """One multi-token-prediction depth (`titan_models.mtp`): `input_proj`, a Llama 3 block, `head_norm`.

    Args:
        layer_id: its index in `layers` (`n_layers + depth - 1`); depth-scales its output-side init.
        args: the model's shape.
    """


class Transformer(nn.Module):
    """Llama 3 decoder. A pipeline stage sets `tok_embeddings`, `norm` or `output` to None
    and deletes entries of `layers`; the forward then skips them."""

    skip_output = False
    """True: forward returns the final hidden states and the caller applies `output`, fused with the loss
    (`titan_parallel.fuse_output_loss`), so the full logits never exist."""

    rope_cache: torch.Tensor  # a non-persistent buffer, registered in __init__

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.tok_embeddings: nn.Embedding | None = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(i, args) for i in range(args.n_layers)})
        for i in range(args.n_layers, args.n_layers + args.n_mtp_layers):
            self.layers[str(i)] = MTPBlock(i, args)
        self.norm: nn.RMSNorm | None = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.output: nn.Linear | None = nn.Linear(args.dim, args.vocab_size, bias=False)
        if args.tie_word_embeddings:
            self.output.weight = self.tok_embeddings.weight
        self.register_buffer("rope_cache", self._compute_rope_cache(), persistent=False)

    def _compute_rope_cache(self) -> torch.Tensor:
        a = self.args
        if torch.get_default_device().type == "meta":
            # A meta model holds no values (`init_weights` computes them once materialised);
            # computing on meta would only cost the first use of torch's meta kernels.
            return torch.empty(a.max_seq_len, a.attention_head_dim)  # (max_seq_len, head_dim)
        return precompute_rope_cache(a.attention_head_dim, a.max_seq_len, a.rope_theta, a.rope_scaling)

    def forward(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor | None = None,
        document_ids: torch.Tensor | None = None,
        mtp: bool = False,
        mtp_tokens: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Args:
            tokens: `(bs, seqlen)` int64 token ids, or `(bs, seqlen, dim)` hidden states
                on a pipeline stage without `tok_embeddings`.
            positions: `(seqlen,)` or `(bs, seqlen)` int64 absolute positions for RoPE
                (context parallel passes its shard's positions); None means `arange(seqlen)`.
            document_ids: `(bs, seqlen)` int64 document of each position (`titan_models.document_mask.document_ids`):
                attention stays within each document (block-causal); None: causal over the whole sequence.
            mtp: also run the multi-token-prediction depths (training; `titan_models.mtp`).
            mtp_tokens: `(bs, n_mtp_layers, seqlen)` each depth's input tokens, taken on the whole sequences
                (`titan_models.mtp.tokens_ahead`): on a pipeline stage after the first or a context-parallel shard.

        Returns:
            `(bs, seqlen, vocab_size)` logits, or `(bs, seqlen, dim)` hidden states on a
            stage without `output`. With `mtp` and `n_mtp_layers = D`: `(bs * (1 + D), seqlen, ...)`,
            the main rows first, then each depth's.
        """
        return decoder_forward(self, tokens, positions, document_ids, mtp, mtp_tokens)

    @torch.no_grad()
    def init_weights(self, buffer_device: torch.device | str | None = None) -> None:
        """Initialise every parameter in place and recompute the RoPE table.

        Works after `to_empty` from the meta device, on DTensor parameters, and on
        pipeline stages whose modules are partly None. Deterministic given the seed.
        Embeddings and `wq`/`wk`/`wv`/`w1`: std 0.02; `wo`/`w2`/`w3`: std
        `0.02 / sqrt(2 * (layer_id + 1))`; `output`: std `dim ** -0.5`; norms: ones. Under muP
        (`args.mup`) the blocks' stds are scaled by `1 / sqrt(dim / base_dim)` and `output`'s is
        `base_dim ** -0.5`.
        A tied weight is re-tied (moving off the meta device unties it) and initialised
        once, as an embedding. Every normal is truncated at +-3 std (torchtitan passes
        nn.init's absolute default of +-2, which truncates nothing at std 0.02).

        Args:
            buffer_device: device for the RoPE table; None keeps its current device.
        """
        with torch.device(buffer_device if buffer_device is not None else self.rope_cache.device):
            self.rope_cache = self._compute_rope_cache()
        if self.args.tie_word_embeddings:
            if self.tok_embeddings is not None and self.output is not None:
                self.output.weight = self.tok_embeddings.weight  # `to_empty` from meta unties them
            shared = self.tok_embeddings if self.tok_embeddings is not None else self.output
            if shared is not None:
                init_trunc_normal_(shared.weight, 0.02)
        elif self.tok_embeddings is not None:
            init_trunc_normal_(self.tok_embeddings.weight, 0.02)
        main = {key: int(key) < self.args.n_layers for key in self.layers}
        for key, layer in self.layers.items():
            if main[key]:  # Module.__getattr__ is typed Tensor | Module; a block may be wrapped (AC, compile)
                layer.init_weights()  # type: ignore[operator]
        if self.norm is not None:
            self.norm.reset_parameters()
        if self.output is not None and not self.args.tie_word_embeddings:
            mup = self.args.mup
            init_trunc_normal_(self.output.weight, self.args.dim**-0.5 if mup is None else mup.output_init_std())
        for key, layer in self.layers.items():
            if not main[key]:  # the multi-token-prediction depths last: a seed's main weights do not change
                layer.init_weights()  # type: ignore[operator]


def init_trunc_normal_(weight: torch.Tensor, std: float, cutoff: float = 3.0) -> None:
    """Fill `weight` in place from N(0, std) truncated at +-`cutoff` std (DTensor-safe).

    Args:
        weight: parameter to fill.
        std: standard deviation.
        cutoff: truncation bound, in stds.
    """
    nn.init.trunc_normal_(weight, mean=0.0, std=std, a=-cutoff * std, b=cutoff * std)
