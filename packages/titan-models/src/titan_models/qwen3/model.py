"""Qwen3 and Qwen3-MoE as one small file; what it shares with Llama 3 is imported from there.

Differences from `titan_models.llama3.model`: an explicit `head_dim` (128 in the published
models, independent of `dim / n_heads`), QK-norm (an RMSNorm over `head_dim` on every
query and key head, before RoPE), RoPE in Hugging Face's rotate-half layout (so the
Hugging Face adapter is a pure rename), and, when `ModelArgs.moe` is set, a
Mixture-of-Experts feed-forward (`titan_models.moe.MoE`) in every block.

Nothing here knows about parallelism (no `torch.distributed` import); titan-parallel
splits the modules from outside, reading `titan_models.qwen3.plan`. Build on the meta
device, shard, `to_empty`, then call `Transformer.init_weights`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from titan_models.decoder import decoder_forward
from titan_models.errors import ModelConfigError
from titan_models.llama3.model import FeedForward, ScaledDotProductAttention, init_trunc_normal_, precompute_rope_cache
from titan_models.moe import MoE, MoEArgs
from titan_models.mtp import MTPDepth
from titan_models.mup import MuP, check_mup

if TYPE_CHECKING:
    from torch.nn.attention.flex_attention import BlockMask


@dataclass(frozen=True)
class ModelArgs:
    """Shape of a Qwen3 (or, with `moe`, Qwen3-MoE) model. Frozen: derive variants with `dataclasses.replace`."""

    dim: int = 4096
    """Width of the residual stream (Hugging Face `hidden_size`)."""
    n_layers: int = 36
    """Number of transformer blocks."""
    n_heads: int = 32
    """Number of query heads."""
    n_kv_heads: int = 8
    """Number of key/value heads (grouped-query attention); divides `n_heads`."""
    head_dim: int = 128
    """Width of one attention head, independent of `dim / n_heads` (Hugging Face `head_dim`)."""
    hidden_dim: int = 12288
    """Hidden size of the dense SwiGLU feed-forward (Hugging Face `intermediate_size`); unused when `moe` is set."""
    vocab_size: int = 151936
    """Rows of the token embedding and of the output projection."""
    norm_eps: float = 1e-6
    """Epsilon of every RMSNorm, QK-norm included."""
    rope_theta: float = 1000000.0
    """RoPE base frequency."""
    max_seq_len: int = 40960
    """Length of the precomputed RoPE table: the largest position the model can see plus one."""
    tie_word_embeddings: bool = False
    """Share one weight between `tok_embeddings` and `output` (Qwen3 0.6B / 1.7B / 4B)."""
    moe: MoEArgs | None = None
    """Mixture-of-Experts feed-forward in every block (Qwen3-MoE); None = dense SwiGLU of `hidden_dim`."""
    mup: MuP | None = None
    """The maximal update parametrization's base shape and multipliers (`titan_models.mup`); None: standard."""
    n_mtp_layers: int = 0
    """Multi-token-prediction depths (`titan_models.mtp`, as Qwen3-Next's): entries `n_layers ..` of `layers`, run
    only by `forward(..., mtp=True)`."""

    def __post_init__(self) -> None:
        if self.n_mtp_layers < 0:
            raise ModelConfigError(f"ModelArgs.n_mtp_layers={self.n_mtp_layers} must be >= 0")
        if self.n_heads % self.n_kv_heads != 0:
            raise ModelConfigError(
                f"ModelArgs.n_kv_heads={self.n_kv_heads} must divide n_heads={self.n_heads}; pick a divisor of n_heads"
            )
        if self.head_dim % 2 != 0:
            raise ModelConfigError(f"ModelArgs.head_dim={self.head_dim} must be even for RoPE; change head_dim")
        if self.mup is not None:
            check_mup(self.mup, tied=self.tie_word_embeddings, moe=self.moe is not None)

    @property
    def kv_heads(self) -> int:
        """`n_kv_heads` (the name titan-parallel's and titan-core's checks read)."""
        return self.n_kv_heads

    @property
    def attention_head_dim(self) -> int:
        """`head_dim` (the name titan-core's memory model reads, as for Llama 3)."""
        return self.head_dim

    @property
    def ffn_hidden_dim(self) -> int:
        """Hidden size tensor parallel splits in a feed-forward: each expert's with `moe`, else `hidden_dim`."""
        return self.moe.hidden_dim if self.moe is not None else self.hidden_dim


def apply_rotary_emb(x: torch.Tensor, rope_cache: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
    """Rotate queries or keys by RoPE in Hugging Face's rotate-half layout: `i` pairs with `i + head_dim/2`.

    Args:
        x: `(bs, seqlen, n_heads, head_dim)` queries or keys.
        rope_cache: `(max_seq_len, head_dim)` `[cos | sin]` table from `llama3.precompute_rope_cache`.
        positions: absolute positions, `(seqlen,)` or `(bs, seqlen)` int64; None means `arange(seqlen)`.

    Returns:
        Tensor shaped and typed like `x`; the rotation is computed in float32.
    """
    bs, seqlen, _, head_dim = x.shape
    rope = rope_cache[:seqlen] if positions is None else rope_cache[positions]  # (seqlen | bs, seqlen, head_dim)
    rope = rope.view(-1, seqlen, 1, head_dim)  # (1 | bs, seqlen, 1, head_dim)
    cos, sin = (half.float() for half in rope.chunk(2, dim=-1))  # each (1 | bs, seqlen, 1, head_dim/2)
    x1, x2 = x.float().chunk(2, dim=-1)  # each (bs, seqlen, n_heads, head_dim/2)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).type_as(x)


class Attention(nn.Module):
    """Grouped-query attention with QK-norm and RoPE. Head counts come from the weights' shapes
    (`view(..., -1, head_dim)`), so tensor parallel needs to change no attribute; `q_norm` and
    `k_norm` act on each head alone, so they run unchanged on a rank's share of the heads."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.head_dim = args.head_dim
        self.wq = nn.Linear(args.dim, args.n_heads * args.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * args.head_dim, args.dim, bias=False)
        self.q_norm = nn.RMSNorm(args.head_dim, eps=args.norm_eps)
        self.k_norm = nn.RMSNorm(args.head_dim, eps=args.norm_eps)
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
        xq = self.q_norm(self.wq(x).view(bs, seqlen, -1, self.head_dim))  # (bs, seqlen, n_heads, head_dim)
        xk = self.k_norm(self.wk(x).view(bs, seqlen, -1, self.head_dim))  # (bs, seqlen, n_kv_heads, head_dim)
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
        in_std: std of `wq`, `wk`, `wv` (0.02; muP scales it with width); the QK-norms get ones."""
        for linear in (self.wq, self.wk, self.wv):
            init_trunc_normal_(linear.weight, in_std)
        init_trunc_normal_(self.wo.weight, out_std)
        self.q_norm.reset_parameters()
        self.k_norm.reset_parameters()


class TransformerBlock(nn.Module):
    """Pre-norm block: `h = x + attention(norm(x))`, `out = h + ffn(norm(h))`, where `ffn` is
    `feed_forward` (dense SwiGLU) or, with `args.moe`, `moe` (Mixture-of-Experts)."""

    def __init__(self, layer_id: int, args: ModelArgs):
        super().__init__()
        self.layer_id = layer_id
        self.attention_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.attention = Attention(args)
        self.ffn_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.is_moe = args.moe is not None
        if args.moe is not None:
            self.moe = MoE(args.dim, args.moe)
        else:
            self.feed_forward = FeedForward(args.dim, args.hidden_dim)
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
        ffn = self.moe if self.is_moe else self.feed_forward
        return h + ffn(self.ffn_norm(h))

    def init_weights(self, buffer_device: torch.device | str | None = None) -> None:
        """Norms to ones; output-side weights (`wo`, `w2`, `w3`) use std `0.02 / sqrt(2 * (layer_id + 1))`, the
        others 0.02, each times `init_scale` (muP's; a model with MoE has none).

        Args:
            buffer_device: device for the MoE's buffers; None keeps their device.
        """
        out_std = 0.02 / (2 * (self.layer_id + 1)) ** 0.5 * self.init_scale
        self.attention_norm.reset_parameters()
        self.ffn_norm.reset_parameters()
        self.attention.init_weights(out_std, 0.02 * self.init_scale)
        if self.is_moe:
            self.moe.init_weights(out_std, None if buffer_device is None else torch.device(buffer_device))
        else:
            self.feed_forward.init_weights(out_std, 0.02 * self.init_scale)


class MTPBlock(MTPDepth, TransformerBlock):  # type: ignore[misc]  # forward: two outputs, a block's input
    """One multi-token-prediction depth (`titan_models.mtp`): `input_proj`, a Qwen3 (or Qwen3-MoE) block, `head_norm`.

    Args:
        layer_id: its index in `layers` (`n_layers + depth - 1`); depth-scales its output-side init.
        args: the model's shape.
    """


class Transformer(nn.Module):
    """Qwen3 decoder. A pipeline stage sets `tok_embeddings`, `norm` or `output` to None
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
            # A meta model holds no values (`init_weights` computes them once materialised).
            return torch.empty(a.max_seq_len, a.head_dim)  # (max_seq_len, head_dim)
        return precompute_rope_cache(a.head_dim, a.max_seq_len, a.rope_theta)

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
        """Initialise every parameter and buffer in place and recompute the RoPE table.

        As `llama3.Transformer.init_weights`: works after `to_empty` from the meta device, on
        DTensor parameters and on pipeline stages; embeddings and `wq`/`wk`/`wv`/`w1` (and the
        MoE router) std 0.02, `wo`/`w2`/`w3` std `0.02 / sqrt(2 * (layer_id + 1))`, `output`
        std `dim ** -0.5`, norms (QK-norms included) ones, MoE buffers zeros; normals truncated
        at +-3 std; a tied weight is re-tied and initialised once, as an embedding. Under muP the blocks'
        stds are scaled by `1 / sqrt(dim / base_dim)` and `output`'s is `base_dim ** -0.5`.

        Args:
            buffer_device: device for the RoPE table and MoE buffers; None keeps their device.
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
                layer.init_weights(buffer_device)  # type: ignore[operator]
        if self.norm is not None:
            self.norm.reset_parameters()
        if self.output is not None and not self.args.tie_word_embeddings:
            mup = self.args.mup
            init_trunc_normal_(self.output.weight, self.args.dim**-0.5 if mup is None else mup.output_init_std())
        for key, layer in self.layers.items():
            if not main[key]:  # the multi-token-prediction depths last: a seed's main weights do not change
                layer.init_weights(buffer_device)  # type: ignore[operator]
