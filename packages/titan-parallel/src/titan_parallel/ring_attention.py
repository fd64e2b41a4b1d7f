"""Exact causal attention of a rank's queries against the whole sequence's keys/values.

The sequence is laid out "head-tail" over the `cp` ranks (see `cp_positions`): it
is cut into `2 * cp` chunks and rank r holds chunks r and `2 * cp - 1 - r`, so every
rank does the same causal work. Two ways to exchange K/V:

- "allgather": all-gather K and V (autograd-aware), one masked attention.
- "rotate": a ring. K/V travel rank to rank with send/recv; each step's partial
  attention is merged with the others by its log-sum-exp; the backward is a ring
  too, passing the K/V gradients along until they reach their owner. With the
  head-tail layout every step after the first is one unmasked half-size block.

Written here rather than taken from `torch.distributed.tensor.experimental.context_parallel`
because that one swaps SDPA kernels behind a context manager, rings only the CUDA
kernels (flash, efficient, cuDNN), and shards buffers itself with its own load
balancer; titan-parallel needs a plain module in place of `ModelPlan.attention` that runs
on CPU (gloo) and GPU alike, under TP.
The partial attentions are plain matmuls in float32 (exact, not a fused kernel).
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


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float):
    """Partial attention and its log-sum-exp; every query row must see at least one key.

    Args:
        q: `(bs, n_kv_heads, n_rep, lq, head_dim)` float32.
        k, v: `(bs, n_kv_heads, 1, lk, head_dim)` float32.
        mask: `(lq, lk)` bool, True where a query may see a key; None for all.
        scale: the softmax scale.

    Returns:
        out `(bs, n_kv_heads, n_rep, lq, head_dim)`, lse `(bs, n_kv_heads, n_rep, lq)`.
    """
    scores = q @ k.transpose(-1, -2) * scale  # (bs, n_kv_heads, n_rep, lq, lk)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    lse = scores.logsumexp(dim=-1)
    return torch.exp(scores - lse.unsqueeze(-1)) @ v, lse


def _attend_backward(q, k, v, dout, lse, delta, mask, scale):
    """Gradients of one partial attention, given the final (merged) lse and delta = rowsum(dout * out).

    Shapes as in `_attend`; dout `(bs, n_kv_heads, n_rep, lq, head_dim)`, delta like lse.
    Returns dq like q, dk and dv like k (summed over the query heads sharing them).
    """
    scores = q @ k.transpose(-1, -2) * scale  # (bs, n_kv_heads, n_rep, lq, lk)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.exp(scores - lse.unsqueeze(-1))  # the global softmax restricted to these keys
    dv = (probs.transpose(-1, -2) @ dout).sum(dim=2, keepdim=True)
    dscores = probs * (dout @ v.transpose(-1, -2) - delta.unsqueeze(-1))
    dq = dscores @ k * scale
    dk = (dscores.transpose(-1, -2) @ q).sum(dim=2, keepdim=True) * scale
    return dq, dk, dv


def _merge_(out: torch.Tensor, lse: torch.Tensor, part_out: torch.Tensor, part_lse: torch.Tensor) -> None:
    """Fold a partial attention into the running (out, lse), in place."""
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


class _RingAttention(torch.autograd.Function):
    """Ring attention over head-tail shards; inputs in the `_attend` layout, float32."""

    @staticmethod
    def forward(ctx, q, k, v, group, scale):
        rank, size = dist.get_rank(group), dist.get_world_size(group)
        chunk = q.size(-2) // 2
        positions = cp_positions(q.size(-2), rank, size, device=q.device)
        own_mask = positions.unsqueeze(1) >= positions.unsqueeze(0)  # (seqlen, seqlen)
        kv = torch.stack([k, v])  # (2, bs, n_kv_heads, 1, seqlen, head_dim)
        for step in range(size):
            requests = []
            if step + 1 < size:
                next_kv, requests = _exchange(kv, group)  # overlaps with this step's compute
            source = (rank - step) % size
            if step == 0:  # my own K/V: causal by position
                out, lse = _attend(q, k, v, own_mask, scale)
            elif source < rank:  # all my queries see the source's head chunk, none its tail
                part_out, part_lse = _attend(q, kv[0][..., :chunk, :], kv[1][..., :chunk, :], None, scale)
                _merge_(out, lse, part_out, part_lse)
            else:  # only my tail chunk sees the source, all of it
                part_out, part_lse = _attend(q[..., chunk:, :], kv[0], kv[1], None, scale)
                _merge_(out[..., chunk:, :], lse[..., chunk:], part_out, part_lse)
            _wait(requests)
            if step + 1 < size:
                kv = next_kv
        ctx.save_for_backward(q, k, v, out, lse, own_mask)
        ctx.group, ctx.scale = group, scale
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, own_mask = ctx.saved_tensors
        group, scale = ctx.group, ctx.scale
        rank, size = dist.get_rank(group), dist.get_world_size(group)
        chunk = q.size(-2) // 2
        dout = dout.contiguous()
        delta = (dout * out).sum(dim=-1)  # (bs, n_kv_heads, n_rep, seqlen)
        dq = torch.zeros_like(q)
        kv = torch.stack([k, v])
        dkv = torch.zeros_like(kv)  # gradient of the K/V now held, accumulated over the ranks it visited
        for step in range(size):
            kv_requests = []
            if step + 1 < size:
                next_kv, kv_requests = _exchange(kv, group)  # overlaps with this step's compute
            source = (rank - step) % size
            if step == 0:
                dq_part, dk, dv = _attend_backward(q, k, v, dout, lse, delta, own_mask, scale)
                dq += dq_part
                dkv[0] += dk
                dkv[1] += dv
            elif source < rank:
                kh, vh = kv[0][..., :chunk, :], kv[1][..., :chunk, :]
                dq_part, dk, dv = _attend_backward(q, kh, vh, dout, lse, delta, None, scale)
                dq += dq_part
                dkv[0][..., :chunk, :] += dk
                dkv[1][..., :chunk, :] += dv
            else:
                rows = slice(chunk, None)
                dq_part, dk, dv = _attend_backward(
                    q[..., rows, :], kv[0], kv[1], dout[..., rows, :], lse[..., rows], delta[..., rows], None, scale
                )
                dq[..., rows, :] += dq_part
                dkv[0] += dk
                dkv[1] += dv
            # Pass the K/V gradient on; after `size` hops it is back at its owner, complete.
            next_dkv, dkv_requests = _exchange(dkv, group)
            _wait(kv_requests + dkv_requests)
            dkv = next_dkv
            if step + 1 < size:
                kv = next_kv
        return dq, dkv[0], dkv[1], None, None


def _to_groups(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`(bs, heads, seqlen, head_dim)` q, k, v -> float32 grouped by KV head.

    q becomes `(bs, n_kv_heads, n_rep, seqlen, head_dim)`, k and v `(bs, n_kv_heads, 1, seqlen, head_dim)`.
    """
    bs, n_heads, seqlen, head_dim = q.shape
    n_kv_heads = k.size(1)
    if n_heads % n_kv_heads:
        raise ValueError(f"ring attention: n_kv_heads {n_kv_heads} must divide n_heads {n_heads}")
    # Query head h uses K/V head h // n_rep, as in SDPA's enable_gqa.
    qg = q.float().reshape(bs, n_kv_heads, n_heads // n_kv_heads, seqlen, head_dim)
    return qg, k.float().unsqueeze(2).contiguous(), v.float().unsqueeze(2).contiguous()


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


def _allgather_attention(q, k, v, group: dist.ProcessGroup, scale: float) -> torch.Tensor:
    """All-gather K and V (autograd-aware), then one attention masked by the global positions."""
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    seqlen = q.size(2)
    keys, values = _gather_sequence(k, group), _gather_sequence(v, group)  # (bs, n_kv_heads, seqlen * cp, head_dim)
    q_pos = cp_positions(seqlen, rank, size, device=q.device)
    k_pos = torch.cat([cp_positions(seqlen, r, size, device=q.device) for r in range(size)])
    mask = q_pos.unsqueeze(1) >= k_pos.unsqueeze(0)  # (seqlen, seqlen * cp); K/V stay in gathered order
    return F.scaled_dot_product_attention(
        q, keys, values, attn_mask=mask, scale=scale, enable_gqa=q.size(1) != k.size(1)
    )


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    group: dist.ProcessGroup,
    rotate_method: RotateMethod = "rotate",
    scale: float | None = None,
) -> torch.Tensor:
    """Causal attention of this rank's head-tail shard of queries against the whole sequence.

    Args:
        q: `(bs, n_heads, seqlen/cp, head_dim)` local queries, positions `cp_positions(seqlen/cp, rank, cp)`.
        k: `(bs, n_kv_heads, seqlen/cp, head_dim)` local keys, same positions; `n_kv_heads` divides `n_heads`.
        v: `(bs, n_kv_heads, seqlen/cp, head_dim)` local values.
        group: the context-parallel process group.
        rotate_method: "allgather" (gather K/V, one masked attention) or "rotate" (ring of send/recv).
        scale: softmax scale; None means `1 / sqrt(head_dim)`.

    Returns:
        `(bs, n_heads, seqlen/cp, head_dim)`, dtype of q.
    """
    scale = 1.0 / math.sqrt(q.size(-1)) if scale is None else scale
    if dist.get_world_size(group) == 1:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=q.size(1) != k.size(1))
    check_rotate_method(rotate_method)
    if rotate_method == "allgather":
        return _allgather_attention(q, k, v, group, scale)
    qg, kg, vg = _to_groups(q, k, v)
    out = _RingAttention.apply(qg, kg, vg, group, scale)  # (bs, n_kv_heads, n_rep, seqlen/cp, head_dim)
    return out.reshape(q.shape).to(q.dtype)


class RingAttention(nn.Module):
    """Drop-in for a causal attention core `(q, k, v) -> out` under context parallel (see `ring_attention`).

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
            mask: must be None: the ring computes causal attention only (each rank sees a chunk of the keys at a
                time, not a mask of the whole sequence); `UlyssesAttention` takes one.

        Returns:
            `(bs, n_heads, seqlen/cp, head_dim)`.
        """
        if mask is not None:
            raise ValueError(
                "ring attention computes causal attention only and takes no attention mask (a block-causal one "
                "over packed documents, say); use cp_method='ulysses', whose attention sees whole sequences"
            )
        check_rotate_method(self.rotate_method, k.shape[-1], v.shape[-1])
        return ring_attention(q, k, v, self.group, self.rotate_method, scale=self.scale)

    def extra_repr(self) -> str:
        return f"rotate_method={self.rotate_method!r}, cp={dist.get_world_size(self.group)}"
