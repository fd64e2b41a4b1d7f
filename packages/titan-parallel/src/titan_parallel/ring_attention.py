"""Exact causal attention of a rank's queries against the whole sequence's keys/values.

The sequence is laid out "head-tail" over the `cp` ranks (see `cp_positions`): it
is cut into `2 * cp` chunks and rank r holds chunks r and `2 * cp - 1 - r`, so every
rank does the same causal work. Two ways to exchange K/V:

- "allgather": all-gather K and V (autograd-aware), one masked attention.
- "rotate": a ring. K/V travel rank to rank with send/recv, in the compute dtype;
  each step's partial attention is merged with the others by its log-sum-exp, in
  float32; the backward is a ring too, passing the K/V gradients (float32) along
  until they reach their owner. With the head-tail layout the first step is two
  causal squares and one full block, and every step after it one unmasked
  half-size block. The backward of each block takes the
  merged output and log-sum-exp, so it is the exact gradient of the whole attention.

  The partial attentions: on CPU, torch's fused kernel that returns the log-sum-exp
  (`_scaled_dot_product_flash_attention_for_cpu`, and its backward; `FUSED_DEVICES`),
  fed the compute dtype (bf16 stays bf16); elsewhere plain float32 matmuls, which
  hold a block's whole score matrix. CUDA's kernels that return it (flash, efficient,
  cuDNN) are not wired here: they have not run on a GPU in this project.

A mask restricts the causal attention further: block-causal attention over packed documents, as the
model builds it once per forward for the whole sequence (a dense boolean `(bs, 1, seqlen, seqlen)`, or a
FlexAttention `BlockMask`). Each partial attention reads the mask at its own queries' and keys'
global positions: the dense one by indexing, a `BlockMask` by evaluating its `mask_mod` on those
positions (broadcast index tensors, so no `(seqlen, seqlen)` tensor is built). A query may then see
none of a ring step's keys (they belong to earlier documents); its partial attention is zero with a
log-sum-exp of -inf, which the merge weighs as nothing. Every query sees itself, so the merged
attention is never empty. The blocks are computed whole, masked or not: skipping a block no query
sees would need a host sync per step.

Written here rather than taken from `torch.distributed.tensor.experimental.context_parallel`
because that one swaps SDPA kernels behind a context manager, rings only the CUDA
kernels (flash, efficient, cuDNN), and shards buffers itself with its own load
balancer; titan-parallel needs a plain module in place of `ModelPlan.attention` that runs
on CPU (gloo) and GPU alike, under TP.
"""

from __future__ import annotations

import math
from typing import Literal

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn as nn
import torch.nn.functional as F

from titan_parallel.layout import check_cp, check_rotate_method

RotateMethod = Literal["allgather", "rotate"]

FUSED_DEVICES = ("cpu",)
"""Where "rotate" runs each partial attention with torch's fused kernel that returns its log-sum-exp (on CPU,
`_scaled_dot_product_flash_attention_for_cpu` and its backward); elsewhere plain float32 matmuls."""

# `all_gather_single_autograd` in newer torch, `all_gather_tensor_autograd` (now deprecated) before.
_all_gather_autograd = getattr(funcol, "all_gather_single_autograd", None) or funcol.all_gather_tensor_autograd


def cp_positions(seqlen: int, cp_rank: int, cp_size: int, device: torch.device | str | None = None) -> torch.Tensor:
    """Global positions of the `seqlen` tokens a context-parallel rank holds (head-tail layout).

    The global sequence of `seqlen * cp_size` tokens is cut into `2 * cp_size` chunks of
    `seqlen // 2`; rank r holds chunk r then chunk `2 * cp_size - 1 - r`.
    E.g. seqlen 4, cp_size 2: rank 0 -> [0, 1, 6, 7], rank 1 -> [2, 3, 4, 5].

    Args:
        seqlen: the local (per-rank) sequence length; even when `cp_size > 1` (see `check_cp`).
        cp_rank: this rank's index in the context-parallel group.
        cp_size: the context-parallel degree.
        device: where to put the result.

    Returns:
        `(seqlen,)` int64.
    """
    if cp_size == 1:
        return torch.arange(seqlen, device=device)
    check_cp(seqlen * cp_size, cp_size)
    chunk = seqlen // 2
    head = torch.arange(cp_rank * chunk, (cp_rank + 1) * chunk, device=device)
    tail_start = (2 * cp_size - 1 - cp_rank) * chunk
    tail = torch.arange(tail_start, tail_start + chunk, device=device)
    return torch.cat([head, tail])


def _repeat_kv(t: torch.Tensor, heads: int) -> torch.Tensor:
    """`(bs, kv_heads, l, d)` -> `(bs, heads, l, d)`: query head h reads KV head `h // (heads / kv_heads)`, as SDPA."""
    return t if t.size(1) == heads else t.repeat_interleave(heads // t.size(1), dim=1)


def _sum_kv(grad: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """`(bs, heads, l, d)` gradients of repeated K/V -> `(bs, kv_heads, l, d)`, each KV head's copies summed."""
    bs, heads, length, dim = grad.shape
    return grad if heads == kv_heads else grad.view(bs, kv_heads, heads // kv_heads, length, dim).sum(dim=2)


def _bias(visible: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """A boolean mask as the fused kernel takes it: 0 where a query sees a key, -inf elsewhere, in `dtype`."""
    if visible is None:
        return None
    return torch.zeros(visible.shape, dtype=dtype, device=visible.device).masked_fill_(~visible, float("-inf"))


def _scores(q: torch.Tensor, k: torch.Tensor, visible: torch.Tensor | None, causal: bool, scale: float) -> torch.Tensor:
    """The float32 scores `(bs, heads, lq, lk)` of q against the (repeated) k, -inf where a query may not see a key."""
    if causal:
        visible = torch.ones(q.size(-2), k.size(-2), dtype=torch.bool, device=q.device).tril()
    scores = q.float() @ k.float().transpose(-1, -2) * scale
    return scores if visible is None else scores.masked_fill(~visible, float("-inf"))


def _attend(q, k, v, visible: torch.Tensor | None, causal: bool, scale: float, fused: bool):
    """Partial attention of queries against one block of keys, and its log-sum-exp.

    Args:
        q: `(bs, heads, lq, head_dim)`, in the compute dtype.
        k, v: `(bs, kv_heads, lk, head_dim)`; `kv_heads` divides `heads`.
        visible: `(lq, lk)` or `(bs, 1, lq, lk)` bool, True where a query may see a key; None for all.
        causal: query i sees key j <= i (a square block of aligned positions; `visible` None), which the
            fused kernel computes without the masked half.
        scale: the softmax scale.
        fused: torch's fused CPU kernel (`_scaled_dot_product_flash_attention_for_cpu`), which returns the
            log-sum-exp; else plain matmuls in float32.

    Returns:
        out `(bs, heads, lq, head_dim)` float32 and lse `(bs, heads, lq)` float32; a query that sees no key gets
        zeros and an lse of -inf.
    """
    heads = q.size(1)
    k, v = _repeat_kv(k, heads), _repeat_kv(v, heads)
    if fused:
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, causal, attn_mask=_bias(visible, q.dtype), scale=scale
        )
        out, lse = out.float(), lse.contiguous()
        if visible is not None:  # the kernel gives a row with no key an lse of 0, which would weigh in the merge
            lse = lse.masked_fill(~visible.any(dim=-1), float("-inf"))
        return out, lse
    scores = _scores(q, k, visible, causal, scale)
    lse = scores.logsumexp(dim=-1)
    finite = lse.masked_fill(lse == float("-inf"), 0.0)  # a row with no key: exp(-inf - 0) = 0, not nan
    return torch.exp(scores - finite.unsqueeze(-1)) @ v.float(), lse


def _attend_backward(q, k, v, dout, out, lse, visible, causal: bool, scale: float, fused: bool):
    """Gradients of one partial attention, given the merged output and lse of the whole attention.

    The merged lse is finite (every query sees itself), so masked keys get exact zeros. Shapes and dtypes as in
    `_attend`; dout like q, out and lse the merged float32 ones. Returns float32 dq like q, and dk, dv like k
    (summed over the query heads sharing each KV head).
    """
    heads, kv_heads = q.size(1), k.size(1)
    kr, vr = _repeat_kv(k, heads), _repeat_kv(v, heads)
    if fused:
        lse_layout = lse.transpose(1, 2).contiguous().transpose(1, 2)  # the layout the forward kernel returns
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout, q, kr, vr, out.to(q.dtype), lse_layout, 0.0, causal, attn_mask=_bias(visible, q.dtype), scale=scale
        )
        return dq.float(), _sum_kv(dk.float(), kv_heads), _sum_kv(dv.float(), kv_heads)
    qf, kf, vf, doutf = q.float(), kr.float(), vr.float(), dout.float()
    scores = _scores(qf, kf, visible, causal, scale)
    probs = torch.exp(scores - lse.unsqueeze(-1))  # the global softmax restricted to these keys
    delta = (doutf * out).sum(dim=-1, keepdim=True)  # (bs, heads, lq, 1)
    dscores = probs * (doutf @ vf.transpose(-1, -2) - delta)
    dq = dscores @ kf * scale
    dk = dscores.transpose(-1, -2) @ qf * scale
    dv = probs.transpose(-1, -2) @ doutf
    return dq, _sum_kv(dk, kv_heads), _sum_kv(dv, kv_heads)


def _merge_(out: torch.Tensor, lse: torch.Tensor, part_out: torch.Tensor, part_lse: torch.Tensor) -> None:
    """Fold a partial attention into the running (out, lse), in place; the running lse is finite."""
    new_lse = torch.logaddexp(lse, part_lse)
    out.mul_(torch.exp(lse - new_lse).unsqueeze(-1)).add_(part_out * torch.exp(part_lse - new_lse).unsqueeze(-1))
    lse.copy_(new_lse)


def _exchange(send: torch.Tensor, group: dist.ProcessGroup) -> tuple[torch.Tensor, list]:
    """Start sending `send` to the next rank of the ring and receiving the previous rank's.

    Returns (buffer, requests).
    """
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    recv = torch.empty_like(send)
    ops = [
        dist.P2POp(dist.isend, send, group=group, group_peer=(rank + 1) % size),
        dist.P2POp(dist.irecv, recv, group=group, group_peer=(rank - 1) % size),
    ]
    return recv, dist.batch_isend_irecv(ops)


def _wait(requests: list) -> None:
    for request in requests:
        request.wait()


def _visible(mask: object, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
    """Where the queries at global positions `q_pos` may see the keys at `k_pos` under the whole sequence's `mask`.

    Args:
        mask: a dense boolean `(bs, 1, seqlen, seqlen)` tensor, or a FlexAttention `BlockMask` over
            `(bs, 1, seqlen, seqlen)` (its `mask_mod` is evaluated at these positions only).
        q_pos: `(lq,)` int64 global query positions.
        k_pos: `(lk,)` int64 global key positions.

    Returns:
        `(bs, 1, lq, lk)` bool.
    """
    if isinstance(mask, torch.Tensor):
        return mask[:, :, q_pos.unsqueeze(1), k_pos.unsqueeze(0)]  # one gather of (bs, 1, lq, lk)
    mask_mod = getattr(mask, "mask_mod", None)
    if mask_mod is None:
        raise TypeError(f"ring attention: mask must be a boolean tensor or a FlexAttention BlockMask, not {type(mask)}")
    bs = mask.shape[0]  # type: ignore[attr-defined]
    batch = torch.arange(bs, device=q_pos.device).view(bs, 1, 1)
    head = torch.zeros(1, 1, 1, dtype=torch.long, device=q_pos.device)  # one mask for every head (checked)
    return mask_mod(batch, head, q_pos.view(1, -1, 1), k_pos.view(1, 1, -1)).unsqueeze(1)


def _causal_within(mask: object, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
    """Where the queries at global positions `q_pos` may see the keys at `k_pos`: causally, and within `mask` when
    one is given. `(lq, lk)` bool, or `(bs, 1, lq, lk)` under a mask."""
    causal = q_pos.unsqueeze(1) >= k_pos.unsqueeze(0)
    return causal if mask is None else causal & _visible(mask, q_pos, k_pos)


def _check_mask(mask: object, bs: int, seqlen: int) -> None:
    """The mask is the whole sequence's, one for every head: `(bs, 1, seqlen, seqlen)`."""
    shape = tuple(mask.shape) if isinstance(mask, torch.Tensor) else tuple(getattr(mask, "shape", ()))
    if len(shape) != 4 or shape[0] != bs or shape[1] != 1 or shape[2:] != (seqlen, seqlen):
        raise ValueError(
            f"ring attention: the mask must be the whole sequence's, one for every head, of shape "
            f"(bs={bs}, 1, {seqlen}, {seqlen}); got {shape}"
        )


Block = tuple[slice, slice, torch.Tensor | None, bool, bool]
"""One partial attention of a ring step: (query rows, columns of the K/V held, mask or None, causal, fresh)."""


def _ring_blocks(step: int, rank: int, size: int, positions: torch.Tensor, mask: object) -> list[Block]:
    """The partial attentions of ring step `step` on `rank` (the head-tail layout, `cp_positions`).

    Step 0 is my own K/V, causal by position: my head chunk sees its own keys causally, my tail chunk sees all
    of my head chunk and its own keys causally. From a source before me all my queries see its head chunk and
    none of its tail; from a source after me only my tail chunk sees it, all of it. Under a `mask` (block-causal)
    each block is read from it at the block's global positions, step 0 as one block causal by position and
    within the mask; causal attention splits step 0 into its two causal squares and one full block, so a kernel that
    skips a causal square's masked half does. Under a mask the other steps' blocks are cut to where some query sees
    some key (`_trimmed`), and left out where none does. "fresh" blocks are the first to write their rows.
    """
    seqlen = positions.numel()
    chunk = seqlen // 2
    head, tail, whole = slice(None, chunk), slice(chunk, None), slice(None)
    source = (rank - step) % size
    if step == 0 and mask is None:
        return [(head, head, None, True, True), (tail, tail, None, True, True), (tail, head, None, False, False)]
    if step == 0:
        return [(whole, whole, _causal_within(mask, positions, positions), False, True)]
    rows, cols = (whole, head) if source < rank else (tail, whole)
    if mask is None:
        return [(rows, cols, None, False, False)]
    source_positions = cp_positions(seqlen, source, size, device=positions.device)
    return _trimmed(rows, cols, _visible(mask, positions[rows], source_positions[cols]), seqlen)


def _trimmed(rows: slice, cols: slice, visible: torch.Tensor, seqlen: int) -> list[Block]:
    """The block cut to the rows and columns where some query sees some key (in any sequence of the batch), or no
    block when none does: under a document mask most keys of another rank's chunk lie in documents a query is not
    in. One host read of the four bounds."""
    rows_seen = visible.any(dim=-1).any(dim=0)[0]  # (lq,)
    cols_seen = visible.any(dim=-2).any(dim=0)[0]  # (lk,)
    bounds = []
    for seen in (rows_seen, cols_seen):
        index = torch.arange(seen.numel(), device=seen.device)
        bounds += [torch.where(seen, index, seen.numel()).min(), torch.where(seen, index, -1).max() + 1]
    r0, r1, c0, c1 = torch.stack(bounds).tolist()
    if r0 >= r1:
        return []
    row0, col0 = rows.indices(seqlen)[0], cols.indices(seqlen)[0]
    cut = (slice(row0 + r0, row0 + r1), slice(col0 + c0, col0 + c1), visible[..., r0:r1, c0:c1], False, False)
    return [cut]


class _RingAttention(torch.autograd.Function):
    """Ring attention over head-tail shards: q `(bs, heads, seqlen, d)`, k and v `(bs, kv_heads, seqlen, d)` in the
    compute dtype, which is also what travels; outputs and log-sum-exps merge in float32, the K/V gradients travel
    in float32. `mask` as `_visible`'s; `fused` as `_attend`'s."""

    @staticmethod
    def forward(ctx, q, k, v, group, scale, mask, fused):
        rank, size = dist.get_rank(group), dist.get_world_size(group)
        positions = cp_positions(q.size(-2), rank, size, device=q.device)
        kv = torch.stack([k, v])  # (2, bs, kv_heads, seqlen, head_dim)
        out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
        lse = torch.empty(q.shape[:-1], dtype=torch.float32, device=q.device)
        for step in range(size):
            requests = []
            if step + 1 < size:
                next_kv, requests = _exchange(kv, group)  # overlaps with this step's compute
            for rows, cols, visible, causal, fresh in _ring_blocks(step, rank, size, positions, mask):
                part_out, part_lse = _attend(
                    q[..., rows, :], kv[0][..., cols, :], kv[1][..., cols, :], visible, causal, scale, fused
                )
                if fresh:  # step 0's first blocks: every query sees itself, so the running lse is finite after
                    out[..., rows, :], lse[..., rows] = part_out, part_lse
                else:
                    _merge_(out[..., rows, :], lse[..., rows], part_out, part_lse)
            _wait(requests)
            if step + 1 < size:
                kv = next_kv
        ctx.save_for_backward(q, k, v, out, lse, positions)
        ctx.group, ctx.scale, ctx.mask, ctx.fused = group, scale, mask, fused
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, positions = ctx.saved_tensors
        group, scale, mask, fused = ctx.group, ctx.scale, ctx.mask, ctx.fused
        rank, size = dist.get_rank(group), dist.get_world_size(group)
        dout = dout.contiguous()
        dq = torch.zeros_like(q, dtype=torch.float32)
        kv = torch.stack([k, v])
        dkv = torch.zeros_like(kv, dtype=torch.float32)  # the held K/V's gradient, summed over the ranks it visited
        for step in range(size):
            kv_requests = []
            if step + 1 < size:
                next_kv, kv_requests = _exchange(kv, group)  # overlaps with this step's compute
            for rows, cols, visible, causal, _ in _ring_blocks(step, rank, size, positions, mask):
                dq_part, dk, dv = _attend_backward(
                    q[..., rows, :],
                    kv[0][..., cols, :],
                    kv[1][..., cols, :],
                    dout[..., rows, :],
                    out[..., rows, :],
                    lse[..., rows],
                    visible,
                    causal,
                    scale,
                    fused,
                )
                dq[..., rows, :] += dq_part
                dkv[0][..., cols, :] += dk
                dkv[1][..., cols, :] += dv
            # Pass the K/V gradient on; after `size` hops it is back at its owner, complete.
            next_dkv, dkv_requests = _exchange(dkv, group)
            _wait(kv_requests + dkv_requests)
            dkv = next_dkv
            if step + 1 < size:
                kv = next_kv
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None, None, None


class _ContiguousGrad(torch.autograd.Function):
    """The identity, whose backward hands on its gradient contiguous.

    torch 2.11's all-gather backward reduce-scatters the incoming gradient as it comes, and the
    reduce-scatter refuses a non-contiguous one ("Expected input.is_contiguous()"): the backward of
    `_gather_sequence`'s permute gives one when a micro-batch holds one sequence (pipeline parallel,
    micro-batch size 1). Later torch makes it contiguous itself; `contiguous()` copies nothing then.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad.contiguous()


def _gather_sequence(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """All-gather `(bs, heads, seqlen, head_dim)` over the group into `(bs, heads, seqlen * cp, head_dim)`, rank-major.

    Differentiable: the backward reduce-scatters the gradient back to its owner.
    """
    size = dist.get_world_size(group)
    gathered = _all_gather_autograd(x.contiguous(), 0, group)  # (cp * bs, heads, seqlen, head_dim)
    gathered = _ContiguousGrad.apply(gathered)
    bs, heads, seqlen, head_dim = x.shape
    return (
        gathered.view(size, bs, heads, seqlen, head_dim)
        .permute(1, 2, 0, 3, 4)
        .reshape(bs, heads, size * seqlen, head_dim)
    )


def _allgather_attention(q, k, v, group: dist.ProcessGroup, scale: float, mask: object) -> torch.Tensor:
    """All-gather K and V (autograd-aware), then one attention masked by the global positions (and `mask`)."""
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    seqlen = q.size(2)
    keys, values = _gather_sequence(k, group), _gather_sequence(v, group)  # (bs, n_kv_heads, seqlen * cp, head_dim)
    q_pos = cp_positions(seqlen, rank, size, device=q.device)
    k_pos = torch.cat([cp_positions(seqlen, r, size, device=q.device) for r in range(size)])
    visible = _causal_within(mask, q_pos, k_pos)  # (.., seqlen, seqlen * cp); K/V stay in gathered order
    return F.scaled_dot_product_attention(
        q, keys, values, attn_mask=visible, scale=scale, enable_gqa=q.size(1) != k.size(1)
    )


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    group: dist.ProcessGroup,
    rotate_method: RotateMethod = "rotate",
    scale: float | None = None,
    mask: object = None,
) -> torch.Tensor:
    """Causal attention of this rank's head-tail shard of queries against the whole sequence.

    Args:
        q: `(bs, n_heads, seqlen/cp, head_dim)` local queries, positions `cp_positions(seqlen/cp, rank, cp)`.
        k: `(bs, n_kv_heads, seqlen/cp, head_dim)` local keys, same positions; `n_kv_heads` divides `n_heads`.
        v: `(bs, n_kv_heads, seqlen/cp, head_dim)` local values.
        group: the context-parallel process group.
        rotate_method: "allgather" (gather K/V, one masked attention) or "rotate" (ring of send/recv).
        scale: softmax scale; None means `1 / sqrt(head_dim)`.
        mask: None for causal attention; or the whole sequence's block-causal mask, in sequence order and one
            for every head: a boolean `(bs, 1, seqlen, seqlen)` tensor, True where a query may see a key, or a
            FlexAttention `BlockMask` of that shape (`titan_models.document_mask.block_causal_mask`). The
            attention is causal and within the mask.

    Returns:
        `(bs, n_heads, seqlen/cp, head_dim)`, dtype of q.
    """
    scale = 1.0 / math.sqrt(q.size(-1)) if scale is None else scale
    size = dist.get_world_size(group)
    gqa = q.size(1) != k.size(1)
    if mask is not None:
        _check_mask(mask, q.size(0), q.size(2) * size)
    if size == 1:
        if mask is None:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=gqa)
        positions = torch.arange(q.size(2), device=q.device)
        visible = _causal_within(mask, positions, positions)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=visible, scale=scale, enable_gqa=gqa)
    check_rotate_method(rotate_method)
    if rotate_method == "allgather":
        return _allgather_attention(q, k, v, group, scale, mask)
    if q.size(1) % k.size(1):
        raise ValueError(f"ring attention: n_kv_heads {k.size(1)} must divide n_heads {q.size(1)}")
    return _RingAttention.apply(q, k, v, group, scale, mask, q.device.type in FUSED_DEVICES)


class RingAttention(nn.Module):
    """Drop-in for an attention core `(q, k, v[, mask]) -> out` under context parallel (see `ring_attention`).

    Args:
        group: the context-parallel process group.
        rotate_method: "allgather" or "rotate".
        scale: the softmax scale of the core it replaces (its `scale` attribute, e.g. MLA's YaRN-corrected
            one); None means `1 / sqrt(head_dim)`.
    """

    def __init__(self, group: dist.ProcessGroup, rotate_method: RotateMethod = "allgather", scale: float | None = None):
        super().__init__()
        check_rotate_method(rotate_method)
        self.group = group
        self.rotate_method = rotate_method
        self.scale = scale

    @torch.compiler.disable  # point-to-point collectives inside an autograd.Function: run eagerly
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: object = None) -> torch.Tensor:
        """Args:
            q: `(bs, n_heads, seqlen/cp, head_dim)`; k, v: `(bs, n_kv_heads, seqlen/cp, head_dim)`.
            mask: None (causal), or the whole sequence's block-causal mask the model built for its blocks
                (a boolean `(bs, 1, seqlen, seqlen)` tensor or a FlexAttention `BlockMask`; `ring_attention`).

        Returns:
            `(bs, n_heads, seqlen/cp, head_dim)`.
        """
        check_rotate_method(self.rotate_method, k.shape[-1], v.shape[-1])
        return ring_attention(q, k, v, self.group, self.rotate_method, scale=self.scale, mask=mask)

    def extra_repr(self) -> str:
        return f"rotate_method={self.rotate_method!r}, cp={dist.get_world_size(self.group)}"
