"""DeepSeek-V3 (and the DeepSeek-V2-Lite-shaped 16B) as one small file; what it shares with
Llama 3 (SwiGLU `FeedForward`, interleaved RoPE, initialisation) is imported from there.

Differences from `titan_models.llama3.model`:

- Multi-head Latent Attention (MLA): keys and values are expanded per head from a shared
  low-rank latent (`wkv_a` -> `kv_norm` -> `wkv_b`); the query is direct (`wq`) or
  low-rank too (`wq_a` -> `q_norm` -> `wq_b`). Only `qk_rope_head_dim` of each head's
  `qk_nope_head_dim + qk_rope_head_dim` query/key dims are rotated, and the rotated part
  of the key is one head shared by all. Values have their own head dim `v_head_dim`.
- RoPE with YaRN scaling (`YaRN`), as transformers' `rope_type="yarn"` computes it, in
  DeepSeek's interleaved pair layout (pairs `(2i, 2i+1)`, as Llama 3's `apply_rotary_emb`).
- Blocks after the first `n_dense_layers` replace the dense feed-forward with a
  Mixture-of-Experts (`titan_models.moe.MoE`, attribute `moe`).
- Multi-token prediction (DeepSeek-V3's MTP, `ModelArgs.n_mtp_layers`, `titan_models.mtp`): depth `k`
  combines the main model's last hidden state at position `i` with the embedding of token `i + k`, runs
  one more (MoE) block and its own final norm, and predicts token `i + k + 1` through the shared `output`;
  only `forward(..., mtp=True)` runs the depths (training).

Nothing here knows about parallelism (no `torch.distributed` import); titan-parallel
splits the modules from outside, reading `titan_models.deepseek_v3.plan`. Build on the
meta device, shard, `to_empty`, then call `Transformer.init_weights`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from titan_models.decoder import decoder_forward
from titan_models.document_mask import masked_attention
from titan_models.errors import ModelConfigError
from titan_models.llama3.model import FeedForward, apply_rotary_emb, init_trunc_normal_
from titan_models.moe import MoE, MoEArgs
from titan_models.mtp import MTPDepth

if TYPE_CHECKING:
    from torch.nn.attention.flex_attention import BlockMask

LATENT_NORM_EPS = 1e-6
"""Epsilon of `q_norm` and `kv_norm` (fixed, as in DeepSeek's and transformers' code: not `norm_eps`)."""


@dataclass(frozen=True)
class YaRN:
    """YaRN scaling of the RoPE frequencies (transformers' `rope_type="yarn"`).

    Args:
        factor: context extension factor (40 for DeepSeek-V3).
        original_max_position_embeddings: context length the model was pretrained at (4096).
        beta_fast: rotations above which a frequency is kept (extrapolated).
        beta_slow: rotations below which a frequency is divided by `factor` (interpolated).
        mscale: numerator of the cos/sin scale `yarn_mscale(mscale) / yarn_mscale(mscale_all_dim)`.
        mscale_all_dim: denominator of that scale; also multiplies the softmax scale by
            `yarn_mscale(mscale_all_dim) ** 2`. 0 turns both off (then cos/sin use `yarn_mscale(1)`).
    """

    factor: float = 40.0
    original_max_position_embeddings: int = 4096
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 1.0

    def yarn_mscale(self, mscale: float) -> float:
        """`0.1 * mscale * ln(factor) + 1` (1 when `factor <= 1`)."""
        return 1.0 if self.factor <= 1 else 0.1 * mscale * math.log(self.factor) + 1.0

    @property
    def attention_factor(self) -> float:
        """Scale of cos and sin (transformers' `attention_scaling`); 1 for DeepSeek-V3."""
        if self.mscale and self.mscale_all_dim:
            return self.yarn_mscale(self.mscale) / self.yarn_mscale(self.mscale_all_dim)
        return self.yarn_mscale(1.0)

    @property
    def softmax_mscale(self) -> float:
        """Factor on the softmax scale: `yarn_mscale(mscale_all_dim) ** 2`, or 1 when `mscale_all_dim` is 0."""
        return self.yarn_mscale(self.mscale_all_dim) ** 2 if self.mscale_all_dim else 1.0


@dataclass(frozen=True)
class ModelArgs:
    """Shape of a DeepSeek-V3 model. Frozen: derive variants with `dataclasses.replace`."""

    dim: int = 7168
    """Width of the residual stream (Hugging Face `hidden_size`)."""
    n_layers: int = 61
    """Number of transformer blocks (the multi-token-prediction layer is not one of them)."""
    n_dense_layers: int = 3
    """The first this many blocks have a dense feed-forward, the rest a Mixture-of-Experts (`first_k_dense_replace`)."""
    n_heads: int = 128
    """Number of attention heads (queries, keys and values alike)."""
    vocab_size: int = 129280
    """Rows of the token embedding and of the output projection."""
    ffn_hidden_dim: int = 18432
    """Hidden size of the dense layers' SwiGLU (Hugging Face `intermediate_size`)."""
    norm_eps: float = 1e-6
    """Epsilon of the blocks' and the final RMSNorm (`q_norm` and `kv_norm` use `LATENT_NORM_EPS`)."""
    q_lora_rank: int = 1536
    """Rank of the low-rank query (`wq_a` -> `q_norm` -> `wq_b`); 0 = one direct projection `wq`."""
    kv_lora_rank: int = 512
    """Rank of the shared key/value latent (`wkv_a` -> `kv_norm` -> `wkv_b`)."""
    qk_nope_head_dim: int = 128
    """Per-head query/key dims without RoPE."""
    qk_rope_head_dim: int = 64
    """Per-head query/key dims rotated by RoPE (the key's are shared by all heads)."""
    v_head_dim: int = 128
    """Per-head value dims."""
    rope_theta: float = 10000.0
    """RoPE base frequency."""
    rope_scaling: YaRN | None = field(default_factory=YaRN)
    """YaRN frequency scaling; None for plain RoPE."""
    max_seq_len: int = 163840
    """Length of the precomputed RoPE table: the largest position the model can see plus one."""
    moe: MoEArgs = field(default_factory=MoEArgs)
    """The Mixture-of-Experts of blocks `n_dense_layers` .. `n_layers - 1`."""
    tie_word_embeddings: bool = False
    """Share one weight between `tok_embeddings` and `output`."""
    n_mtp_layers: int = 0
    """Multi-token-prediction depths (Hugging Face `num_nextn_predict_layers`; DeepSeek-V3 trains with 1): blocks
    `n_layers .. n_layers + n_mtp_layers - 1` of `layers`, run only by `forward(..., mtp=True)`."""

    def __post_init__(self) -> None:
        if self.n_mtp_layers < 0:
            raise ModelConfigError(f"ModelArgs.n_mtp_layers={self.n_mtp_layers} must be >= 0")
        if not 0 <= self.n_dense_layers <= self.n_layers:
            raise ModelConfigError(
                f"ModelArgs.n_dense_layers={self.n_dense_layers} must be in 0..n_layers={self.n_layers}"
            )
        if self.qk_rope_head_dim <= 0 or self.qk_rope_head_dim % 2:
            raise ModelConfigError(
                f"ModelArgs.qk_rope_head_dim={self.qk_rope_head_dim} must be even and positive for RoPE"
            )
        if self.q_lora_rank < 0 or self.kv_lora_rank <= 0:
            raise ModelConfigError(
                f"ModelArgs q_lora_rank={self.q_lora_rank} must be >= 0 and kv_lora_rank={self.kv_lora_rank} > 0"
            )
        for name in ("dim", "n_heads", "vocab_size", "ffn_hidden_dim", "v_head_dim", "max_seq_len"):
            if getattr(self, name) <= 0:
                raise ModelConfigError(f"ModelArgs.{name}={getattr(self, name)} must be positive")

    @property
    def qk_head_dim(self) -> int:
        """Per-head query/key width: `qk_nope_head_dim + qk_rope_head_dim`."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def kv_heads(self) -> int:
        """Key/value heads after `wkv_b`: `n_heads` (the name titan-parallel's and titan-core's checks read)."""
        return self.n_heads

    @property
    def attention_head_dim(self) -> int:
        """`qk_head_dim` (the name titan-core's cost model reads, as for Llama 3)."""
        return self.qk_head_dim

    @property
    def softmax_scale(self) -> float:
        """`qk_head_dim ** -0.5`, times YaRN's `softmax_mscale` (transformers' `yarn_apply_mscale`)."""
        scale = self.qk_head_dim**-0.5
        return scale * self.rope_scaling.softmax_mscale if self.rope_scaling is not None else scale


def compute_rope_inv_freq(rope_dim: int, theta: float, scaling: YaRN | None = None) -> torch.Tensor:
    """Inverse frequencies of RoPE, YaRN-scaled if given (transformers' `_compute_yarn_parameters`, `truncate=True`).

    Args:
        rope_dim: rotated dims per head (even).
        theta: RoPE base.
        scaling: YaRN, or None.

    Returns:
        `(rope_dim // 2,)` float32.
    """
    pos_freqs = theta ** (
        torch.arange(0, rope_dim, 2, dtype=torch.float32) / rope_dim
    )  # (rope_dim/2,) wavelengths / 2pi
    if scaling is None:
        return 1.0 / pos_freqs

    def correction_dim(rotations: float) -> float:  # the dim index whose wavelength fits `rotations` times
        return (
            rope_dim
            * math.log(scaling.original_max_position_embeddings / (rotations * 2 * math.pi))
            / (2 * math.log(theta))
        )

    low = max(math.floor(correction_dim(scaling.beta_fast)), 0)
    high = min(math.ceil(correction_dim(scaling.beta_slow)), rope_dim - 1)
    ramp = (torch.arange(rope_dim // 2, dtype=torch.float32) - low) / (high - low if high != low else 0.001)
    extrapolate = 1 - ramp.clamp(0, 1)  # 1: keep the frequency, 0: divide it by `factor`
    return 1.0 / (scaling.factor * pos_freqs) * (1 - extrapolate) + 1.0 / pos_freqs * extrapolate


def precompute_rope_cache(rope_dim: int, max_seq_len: int, theta: float, scaling: YaRN | None = None) -> torch.Tensor:
    """The RoPE table in Llama 3's `[cos | sin]` layout (read by `llama3.apply_rotary_emb`).

    Args:
        rope_dim: rotated dims per head (even).
        max_seq_len: number of positions (rows).
        theta: RoPE base.
        scaling: YaRN, or None; its `attention_factor` multiplies cos and sin.

    Returns:
        `(max_seq_len, rope_dim)` float32.
    """
    inv_freq = compute_rope_inv_freq(rope_dim, theta, scaling)  # (rope_dim/2,)
    angles = torch.outer(torch.arange(max_seq_len, dtype=torch.float32), inv_freq)  # (max_seq_len, rope_dim/2)
    factor = scaling.attention_factor if scaling is not None else 1.0
    return torch.cat([angles.cos() * factor, angles.sin() * factor], dim=-1)


class ScaledDotProductAttention(nn.Module):
    """Causal `softmax(q k^T * scale) v` with MLA's own softmax scale; its own module so context
    parallel and `titan generate`'s KV cache can swap it (they read `scale`).

    Args:
        scale: the softmax scale (`ModelArgs.softmax_scale`), kept as the attribute `scale`.
    """

    def __init__(self, scale: float):
        super().__init__()
        self.scale = scale

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | BlockMask | None = None
    ) -> torch.Tensor:
        """Args:
            q: `(bs, n_heads, seqlen, qk_head_dim)` after RoPE.
            k: `(bs, n_heads, seqlen, qk_head_dim)` after RoPE.
            v: `(bs, n_heads, seqlen, v_head_dim)`.
            mask: a block-causal mask (`titan_models.document_mask`); None is causal over the whole sequence.

        Returns:
            `(bs, n_heads, seqlen, v_head_dim)`.
        """
        if mask is not None:
            return masked_attention(q, k, v, mask, scale=self.scale)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale)

    def extra_repr(self) -> str:
        return f"scale={self.scale:.6g}"


class Attention(nn.Module):
    """Multi-head Latent Attention. Head counts come from the weights' shapes (`view(..., -1, ...)`),
    so tensor parallel needs to change no attribute."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.q_lora_rank = args.q_lora_rank
        self.kv_lora_rank = args.kv_lora_rank
        self.qk_nope_head_dim, self.qk_rope_head_dim = args.qk_nope_head_dim, args.qk_rope_head_dim
        self.qk_head_dim, self.v_head_dim = args.qk_head_dim, args.v_head_dim
        q_out = args.n_heads * args.qk_head_dim
        if args.q_lora_rank == 0:
            self.wq = nn.Linear(args.dim, q_out, bias=False)
        else:
            self.wq_a = nn.Linear(args.dim, args.q_lora_rank, bias=False)
            self.q_norm = nn.RMSNorm(args.q_lora_rank, eps=LATENT_NORM_EPS)
            self.wq_b = nn.Linear(args.q_lora_rank, q_out, bias=False)
        self.wkv_a = nn.Linear(args.dim, args.kv_lora_rank + args.qk_rope_head_dim, bias=False)
        self.kv_norm = nn.RMSNorm(args.kv_lora_rank, eps=LATENT_NORM_EPS)
        self.wkv_b = nn.Linear(args.kv_lora_rank, args.n_heads * (args.qk_nope_head_dim + args.v_head_dim), bias=False)
        self.wo = nn.Linear(args.n_heads * args.v_head_dim, args.dim, bias=False)
        # Where the one rotated key head meets every query head. An identity here; tensor parallel
        # (which splits the heads) sums its gradient over the ranks, each of which saw only its heads.
        self.k_rope_to_heads = nn.Identity()
        self.sdpa = ScaledDotProductAttention(args.softmax_scale)

    def _project(
        self, x: torch.Tensor, rope_cache: torch.Tensor, positions: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The queries' two parts (the second rotated), each `(bs, seqlen, n_heads, nope | rope)`, the normalised
        latent `(bs, seqlen, kv_lora_rank)` and the rotated key of one shared head `(bs, seqlen, 1, rope_dim)`."""
        bs, seqlen, _ = x.shape
        q = self.wq(x) if self.q_lora_rank == 0 else self.wq_b(self.q_norm(self.wq_a(x)))
        q = q.view(bs, seqlen, -1, self.qk_head_dim)  # (bs, seqlen, n_heads, qk_head_dim)
        q_nope, q_rope = q.split([self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1)
        latent, k_rope = self.wkv_a(x).split([self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
        k_rope = apply_rotary_emb(k_rope.unsqueeze(2), rope_cache, positions)  # (bs, seqlen, 1, rope_dim)
        return q_nope, apply_rotary_emb(q_rope, rope_cache, positions), self.kv_norm(latent), k_rope

    def _heads(
        self, q_nope: torch.Tensor, q_rope: torch.Tensor, latent: torch.Tensor, k_rope: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Every head's q, k `(bs, n_heads, seqlen, qk_head_dim)` and v `(bs, n_heads, seqlen, v_head_dim)`."""
        bs, seqlen, _ = latent.shape
        kv = self.wkv_b(latent).view(bs, seqlen, -1, self.qk_nope_head_dim + self.v_head_dim)
        k_nope, v = kv.split([self.qk_nope_head_dim, self.v_head_dim], dim=-1)  # (bs, seqlen, n_heads, nope | v)
        k_rope = self.k_rope_to_heads(k_rope).expand(-1, -1, k_nope.shape[2], -1)  # (bs, seqlen, n_heads, rope_dim)
        q = torch.cat([q_nope, q_rope], dim=-1)  # (bs, seqlen, n_heads, qk_head_dim)
        k = torch.cat([k_nope, k_rope], dim=-1)  # (bs, seqlen, n_heads, qk_head_dim)
        return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)

    def forward(
        self,
        x: torch.Tensor,
        rope_cache: torch.Tensor,
        positions: torch.Tensor | None = None,
        mask: torch.Tensor | BlockMask | None = None,
    ) -> torch.Tensor:
        """Args:
            x: `(bs, seqlen, dim)`.
            rope_cache: `(max_seq_len, qk_rope_head_dim)` RoPE table.
            positions: `(seqlen,)` or `(bs, seqlen)` absolute positions; None means `arange(seqlen)`.
            mask: the block-causal mask of packed documents (`titan_models.document_mask`); None: causal.

        Returns:
            `(bs, seqlen, dim)`.
        """
        bs, seqlen, _ = x.shape
        q, k, v = self._heads(*self._project(x, rope_cache, positions))
        # The cores that context parallel and the KV cache put in place take no mask: it goes only when set.
        out = self.sdpa(q, k, v) if mask is None else self.sdpa(q, k, v, mask=mask)  # (bs, n_heads, seqlen, v_head_dim)
        return self.wo(out.transpose(1, 2).reshape(bs, seqlen, -1))  # wo: (bs, seqlen, n_heads * v_head_dim) -> dim

    def latent_forward(
        self,
        x: torch.Tensor,
        rope_cache: torch.Tensor,
        positions: torch.Tensor | None,
        attend: Callable[..., torch.Tensor],
        expand: bool = False,
    ) -> torch.Tensor:
        """`forward` for a cache of the latent: what it keeps per token is the normalised latent and the rotated
        key, one shared key head `kv = [c | k_rope]`, not every head's keys and values.

        Decoding (`expand=False`) absorbs `wkv_b` into the query and the output (DeepSeek's decoding form). Per
        head h, with `W_k`, `W_v` the head's rows of `wkv_b`: `q_nope . (W_k c) = (W_k^T q_nope) . c`, and the
        output `sum_t p_t W_v c_t = W_v sum_t p_t c_t`. So every query head attends over the one key head `kv`,
        whose first `kv_lora_rank` dims are also its value, and `W_v` maps the result back.

        Args:
            x: `(bs, seqlen, dim)`.
            rope_cache: `(max_seq_len, qk_rope_head_dim)` RoPE table.
            positions: as in `forward`.
            attend: called `attend(q, kv)` when absorbed: causal attention of q `(bs, n_heads, seqlen,
                kv_lora_rank + rope_dim)` over `kv` `(bs, 1, seqlen, kv_lora_rank + rope_dim)` and the keys
                cached before them, values `kv[..., :kv_lora_rank]`, scale `sdpa.scale`, returning `(bs, n_heads,
                seqlen, kv_lora_rank)`; called `attend(q, kv, k, v)` when expanded: store `kv`, attend every
                head's q over this forward's own k, v (as `forward` does) and return `(bs, n_heads, seqlen,
                v_head_dim)`.
            expand: compute every head's keys and values (the prompt: all its keys are in this forward).

        Returns:
            `(bs, seqlen, dim)`, equal to `forward`'s up to rounding.
        """
        bs, seqlen, _ = x.shape
        q_nope, q_rope, latent, k_rope = self._project(x, rope_cache, positions)
        kv = torch.cat([latent.unsqueeze(2), k_rope], dim=-1).transpose(1, 2)  # (bs, 1, seqlen, kv_lora_rank + rope)
        if expand:
            q, k, v = self._heads(q_nope, q_rope, latent, k_rope)
            out = attend(q, kv, k, v)  # (bs, n_heads, seqlen, v_head_dim)
            return self.wo(out.transpose(1, 2).reshape(bs, seqlen, -1))
        w = self.wkv_b.weight.view(-1, self.qk_nope_head_dim + self.v_head_dim, self.kv_lora_rank)
        w_k, w_v = w.split([self.qk_nope_head_dim, self.v_head_dim], dim=1)  # (n_heads, nope | v, kv_lora_rank)
        q_latent = torch.einsum("bshd,hdr->bshr", q_nope, w_k)  # (bs, seqlen, n_heads, kv_lora_rank)
        q = torch.cat([q_latent, q_rope], dim=-1)  # (bs, seqlen, n_heads, kv_lora_rank + rope_dim)
        out = attend(q.transpose(1, 2), kv)  # (bs, n_heads, seqlen, kv_lora_rank)
        out = torch.einsum("bhsr,hvr->bshv", out, w_v)  # (bs, seqlen, n_heads, v_head_dim)
        return self.wo(out.reshape(bs, seqlen, -1))

    def init_weights(self, out_std: float) -> None:
        """Args:
        out_std: std of `wo` (depth-scaled by the block); the other projections use 0.02, norms ones."""
        for name in ("wq", "wq_a", "wq_b", "wkv_a", "wkv_b"):
            if hasattr(self, name):
                init_trunc_normal_(getattr(self, name).weight, 0.02)
        for name in ("q_norm", "kv_norm"):
            if hasattr(self, name):
                getattr(self, name).reset_parameters()
        init_trunc_normal_(self.wo.weight, out_std)


class TransformerBlock(nn.Module):
    """Pre-norm block: `h = x + attention(norm(x))`, `out = h + ffn(norm(h))`, where `ffn` is
    `feed_forward` (a dense SwiGLU) in the first `n_dense_layers` blocks and `moe` after;
    the other of the two attributes is None."""

    def __init__(self, layer_id: int, args: ModelArgs):
        super().__init__()
        self.layer_id = layer_id
        self.attention_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.attention = Attention(args)
        self.ffn_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        dense = layer_id < args.n_dense_layers
        self.feed_forward = FeedForward(args.dim, args.ffn_hidden_dim) if dense else None
        self.moe = None if dense else MoE(args.dim, args.moe)

    def forward(
        self,
        x: torch.Tensor,
        rope_cache: torch.Tensor,
        positions: torch.Tensor | None = None,
        mask: torch.Tensor | BlockMask | None = None,
    ) -> torch.Tensor:
        """Args:
        x: `(bs, seqlen, dim)`.
        rope_cache: `(max_seq_len, qk_rope_head_dim)` RoPE table.
        positions: absolute positions for RoPE, or None for `arange(seqlen)`.
        mask: the block-causal mask of packed documents, or None for causal attention.
        """
        # rope_cache and positions go by keyword: tensor parallel prepares only the first positional input.
        h = x + self.attention(self.attention_norm(x), rope_cache=rope_cache, positions=positions, mask=mask)
        ffn = self.feed_forward if self.feed_forward is not None else self.moe
        assert ffn is not None  # a block has one of the two
        return h + ffn(self.ffn_norm(h))

    def init_weights(self, buffer_device: torch.device | None = None) -> None:
        """Norms to ones; output-side weights (`wo`, `w2`, `w3`, experts') use std `0.02 / sqrt(2 * (layer_id + 1))`.

        Args:
            buffer_device: where the MoE's buffers go; None keeps their device.
        """
        out_std = 0.02 / (2 * (self.layer_id + 1)) ** 0.5
        self.attention_norm.reset_parameters()
        self.ffn_norm.reset_parameters()
        self.attention.init_weights(out_std)
        if self.feed_forward is not None:
            self.feed_forward.init_weights(out_std)
        elif self.moe is not None:
            self.moe.init_weights(out_std, buffer_device)


class MTPBlock(MTPDepth, TransformerBlock):  # type: ignore[misc]  # forward: two outputs, a block's input
    """One multi-token-prediction depth (DeepSeek-V3 section 2.2, `titan_models.mtp`): `input_proj` (`MTPInput`), a
    block (a Mixture-of-Experts one, as every block after `n_dense_layers`), and `head_norm` before the shared output.

    Args:
        layer_id: its index in `layers` (`n_layers + depth - 1`); depth-scales its output-side init.
        args: the model's shape.
    """


class Transformer(nn.Module):
    """DeepSeek-V3 decoder. A pipeline stage sets `tok_embeddings`, `norm` or `output` to None
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
        if torch.get_default_device().type == "meta":  # no values on meta; `init_weights` computes them
            return torch.empty(a.max_seq_len, a.qk_rope_head_dim)  # (max_seq_len, rope_dim)
        return precompute_rope_cache(a.qk_rope_head_dim, a.max_seq_len, a.rope_theta, a.rope_scaling)

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
            mtp: also run the multi-token-prediction depths (training; needs the whole sequence of token ids).
                Depth `k`'s row `i` predicts token `i + k + 1`: its targets are the labels shifted left by `k`
                (the last `k` positions have none). Without MTP layers this changes nothing.
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
        """Initialise every parameter in place, recompute the RoPE table and zero the MoE buffers.

        As `llama3.Transformer.init_weights`: works after `to_empty` from the meta device, on
        DTensor parameters and on pipeline stages; embeddings std 0.02, `output` std
        `dim ** -0.5`, output-side weights depth-scaled, norms ones, normals truncated at +-3 std.
        The multi-token-prediction blocks come last, so that adding them leaves the main model's
        initial weights (the same seed's) as they were.

        Args:
            buffer_device: device for the RoPE table and the MoE buffers; None keeps their device.
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
        device = torch.device(buffer_device) if buffer_device is not None else None
        main = {key: int(key) < self.args.n_layers for key in self.layers}
        for key, layer in self.layers.items():
            if main[key]:  # Module.__getattr__ is typed Tensor | Module; a block may be wrapped (AC, compile)
                layer.init_weights(device)  # type: ignore[operator]
        if self.norm is not None:
            self.norm.reset_parameters()
        if self.output is not None and not self.args.tie_word_embeddings:
            init_trunc_normal_(self.output.weight, self.args.dim**-0.5)
        for key, layer in self.layers.items():
            if not main[key]:  # the multi-token-prediction blocks
                layer.init_weights(device)  # type: ignore[operator]
