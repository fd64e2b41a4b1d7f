"""Block-causal attention over packed documents: each token attends only to earlier tokens of its own document.

Pretraining packs documents back to back into fixed-length sequences (`[bos] doc [eos] [bos] doc ...`).
Plain causal attention lets a document's tokens attend to the unrelated documents before it in the
sequence; Llama 3 trains with a mask that stops at document boundaries (torchtitan's `block_causal`).

- `document_ids(tokens, bos_id, eos_id)`: which document each position belongs to, from the tokens
  alone: a document starts where a `bos` follows an `eos` (so a tokenizer whose `bos` and `eos` are one
  token, as Qwen's `<|endoftext|>`, still starts one document per boundary, not two).
- `block_causal_mask(document_ids)`: the mask, built once per forward and shared by every block.
- `masked_attention(q, k, v, mask)`: attention under it.

Two kernels, by device:

- CUDA: torch's FlexAttention (`torch.nn.attention.flex_attention`), compiled, with a `BlockMask` whose
  fully masked tiles are skipped, so many short documents cost less than one long one.
- Elsewhere: `F.scaled_dot_product_attention` with a dense boolean mask of `(bs, 1, seqlen, seqlen)`.
  FlexAttention has no backward on CPU ("FlexAttention does not support backward on CPU", torch 2.15),
  and the dense mask is exact: rows always keep their diagonal, so no row is empty.

RoPE positions run on across documents (as in torchtitan): attention scores depend only on the distance
between two positions, so a document's outputs are the same wherever it sits in the sequence.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from torch.nn.attention.flex_attention import BlockMask

_compiled_flex: Any = None  # torch.compile(flex_attention), built on first use on a GPU
_compiled_create_block_mask: Any = None  # torch.compile(create_block_mask), likewise


def uses_flex(device: torch.device) -> bool:
    """Whether `block_causal_mask` builds a FlexAttention `BlockMask` on `device` (CUDA) or a dense mask.

    Args:
        device: where the model computes.
    """
    return device.type == "cuda"


def document_ids(tokens: torch.Tensor, bos_id: int, eos_id: int) -> torch.Tensor:
    """The document of each position: 0 for the first (possibly partial) one, +1 at each boundary.

    Args:
        tokens: `(bs, seqlen)` int64 input ids, documents packed as `[bos] ids [eos]`.
        bos_id: the token that opens a document.
        eos_id: the token that closes one.

    Returns:
        `(bs, seqlen)` int64, non-decreasing along each row.
    """
    starts = (tokens[:, 1:] == bos_id) & (tokens[:, :-1] == eos_id)  # (bs, seqlen - 1): position i + 1 opens one
    ids = torch.zeros_like(tokens)
    ids[:, 1:] = starts.cumsum(dim=1)
    return ids


def block_causal_mask(ids: torch.Tensor, *, flex: bool | None = None) -> torch.Tensor | BlockMask:
    """The block-causal mask of `ids`: query `i` sees key `j` when `j <= i` and both are in one document.

    Args:
        ids: `(bs, seqlen)` document ids (`document_ids`).
        flex: True for a FlexAttention `BlockMask`, False for a dense boolean tensor; None picks
            FlexAttention on CUDA and the dense mask elsewhere.

    Returns:
        `(bs, 1, seqlen, seqlen)` bool, or a `BlockMask` for `(bs, any head, seqlen, seqlen)`.
    """
    if flex is None:
        flex = uses_flex(ids.device)
    bs, seqlen = ids.shape
    if not flex:
        causal = torch.ones(seqlen, seqlen, dtype=torch.bool, device=ids.device).tril()  # (seqlen, seqlen)
        same = ids.unsqueeze(2) == ids.unsqueeze(1)  # (bs, seqlen, seqlen)
        return (same & causal).unsqueeze(1)  # (bs, 1, seqlen, seqlen)
    global _compiled_create_block_mask
    from torch.nn.attention.flex_attention import create_block_mask

    def same_document_causal(b: torch.Tensor, h: torch.Tensor, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        return (kv <= q) & (ids[b, q] == ids[b, kv])

    create: Any = create_block_mask
    if ids.device.type == "cuda":
        # Eager, the mask is evaluated over all (bs, seqlen, seqlen) pairs with int64 gathers: GiBs at seq_len 8192.
        # Compiled (as torchtitan does), it is one fused pass; a new batch's ids reuse the graph (no recompile).
        if _compiled_create_block_mask is None:
            _compiled_create_block_mask = torch.compile(create_block_mask)
        create = _compiled_create_block_mask
    return create(same_document_causal, bs, None, seqlen, seqlen, device=ids.device)


def masked_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | BlockMask, *, scale: float | None = None
) -> torch.Tensor:
    """`softmax(q k^T * scale + mask) v`, keys and values shared by groups of query heads (GQA).

    Args:
        q: `(bs, n_heads, seqlen, qk_head_dim)`.
        k: `(bs, n_kv_heads, seqlen, qk_head_dim)`; `n_kv_heads` divides `n_heads`.
        v: `(bs, n_kv_heads, seqlen, v_head_dim)`.
        mask: from `block_causal_mask`.
        scale: the softmax scale; None is `qk_head_dim ** -0.5`.

    Returns:
        `(bs, n_heads, seqlen, v_head_dim)`.
    """
    gqa = q.size(1) != k.size(1)
    if isinstance(mask, torch.Tensor):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=gqa)
    global _compiled_flex
    from torch.nn.attention.flex_attention import flex_attention

    kernel: Any = flex_attention
    if q.device.type == "cuda":
        # Eager FlexAttention is its reference implementation (the full score matrix); only the compiled one
        # is the fused kernel. Inside a compiled block Dynamo inlines this call into the block's graph.
        if _compiled_flex is None:
            _compiled_flex = torch.compile(flex_attention, dynamic=False)
        kernel = _compiled_flex
    return kernel(q, k, v, block_mask=mask, scale=scale, enable_gqa=gqa)
