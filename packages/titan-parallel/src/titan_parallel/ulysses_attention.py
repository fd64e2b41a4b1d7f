"""Ulysses context parallel (DeepSpeed-Ulysses): trade the sequence shard for a head shard around attention.

Between attention cores the activations stay sequence-sharded in the head-tail layout of
`titan_parallel.context_parallel` (rank r holds chunks r and `2cp-1-r` of `2cp`), as under
ring attention, so the batch's sharding, the RoPE positions and the loss are the same for
both methods. Around each core:

1. one all-to-all turns q, k, v `(bs, heads, seqlen/cp, head_dim)` into `(bs, heads/cp, seqlen, head_dim)`:
   rank r receives heads `[r heads/cp, (r+1) heads/cp)` of every position. Unpacking the received
   buffer is a copy anyway; it also puts the `2cp` head-tail chunks back in sequence order;
2. the model's own core runs on the whole sequence: ordinary causal SDPA, with whichever kernel
   `titan_parallel.attention_backend` picks (flash, cuDNN, or the CPU kernel); it knows nothing of CP.
   A mask the model gives (block-causal attention over packed documents) is the whole sequence's, in
   sequence order, and goes to the core as it is: after the exchange the core sees whole sequences;
3. one all-to-all sends every rank its own positions of every head back.

q, k and v travel in one buffer (keys and values in a second one when their head dims
differ, as in MLA), so a forward is two all-to-alls (three for MLA) and so is its backward.

Grouped-query attention: the key/value heads are split like the query heads. Where cp does
not divide a rank's KV heads (after tensor parallel), each KV head is repeated
`cp / gcd(kv_heads, cp)` times before the exchange (DeepSpeed-Ulysses' scheme; torchtitan
refuses instead): query heads are grouped by KV head, so the block of query heads a rank gets
reads exactly the KV copies it gets; the repeat's backward sums the copies' gradients. It costs
that factor in K/V traffic and memory. The query heads must split: `n_heads % (tp x cp) == 0`
(`titan_parallel.layout.check_cp_method`).

Written here because torch has no Ulysses: `torch.distributed.tensor.experimental.context_parallel`
is ring attention only. The exchanges are torch's functional `all_to_all_single_autograd`,
which Dynamo traces, so a compiled block keeps Ulysses inside its graph (no graph break, unlike
ring attention), and which gloo runs on CPU.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed._functional_collectives import all_to_all_single_autograd

from titan_parallel.layout import ParallelConfigError, ulysses_kv_repeats

__all__ = ["UlyssesAttention", "ulysses_attention"]


def _orders(cp: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(slot of each of the `2cp` sequence chunks, chunk in each slot) of an exchanged buffer, int64 on `device`.

    A buffer's slots run (rank, half): rank r's head chunk r is slot `2r`, its tail chunk `2cp-1-r` slot `2r+1`.
    Built by device arithmetic: no host-to-device copy per call.
    """
    i = torch.arange(2 * cp, device=device)
    slot_of_chunk = torch.where(i < cp, 2 * i, 4 * cp - 1 - 2 * i)
    chunk_of_slot = torch.where(i % 2 == 0, i // 2, 2 * cp - 1 - i // 2)
    return slot_of_chunk, chunk_of_slot


class _Reorder(torch.autograd.Function):
    """Swap dims 0 and 1 while permuting the `n` (chunk or slot) dim: one copy each way, deterministic.

    `to_batch_major`: x `(n, bs, ...)` -> `(bs, n, ...)`, out[:, i] = x[index[i]]; else x `(bs, n, ...)` ->
    `(n, bs, ...)`, out[i] = x[:, index[i]]. The backward is the other direction with the inverse permutation
    (autograd's own index_select backward would be a scatter-add, nondeterministic on CUDA).
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, index: torch.Tensor, inverse: torch.Tensor, to_batch_major: bool):
        ctx.save_for_backward(inverse)
        ctx.to_batch_major = to_batch_major
        return x.transpose(0, 1).index_select(1 if to_batch_major else 0, index)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (inverse,) = ctx.saved_tensors
        return grad.transpose(0, 1).index_select(0 if ctx.to_batch_major else 1, inverse), None, None, None


def _sequence_to_heads(parts: list[torch.Tensor], group: dist.ProcessGroup) -> list[torch.Tensor]:
    """All-to-all head-tail sequence shards of same-head-dim tensors into head shards of the whole sequence.

    Args:
        parts: `(bs, heads_i, seqlen/cp, head_dim)` each, positions `cp_positions(seqlen/cp, rank, cp)`;
            cp divides every `heads_i`.
        group: the context-parallel group.

    Returns:
        `(bs, heads_i/cp, seqlen, head_dim)` each, in sequence order: rank r's heads `[r heads_i/cp, ...)`.
    """
    cp = dist.get_world_size(group)
    bs, _, local, head_dim = parts[0].shape
    chunk = local // 2

    def to_send(x: torch.Tensor) -> torch.Tensor:  # (bs, heads, seqlen/cp, hd) -> (cp_dst, 2, bs, chunk, heads/cp, hd)
        return x.transpose(1, 2).reshape(bs, 2, chunk, cp, -1, head_dim).permute(3, 1, 0, 2, 4, 5)

    send = torch.cat([to_send(x) for x in parts], dim=4)  # (cp_dst, 2, bs, chunk, sum heads/cp, hd)
    recv = all_to_all_single_autograd(send, None, None, group)  # (cp_src, 2, bs, chunk, sum heads/cp, hd)
    slot_of_chunk, chunk_of_slot = _orders(cp, recv.device)
    recv = recv.reshape(2 * cp, bs, chunk, -1, head_dim)  # (slot, bs, chunk, heads, hd)
    whole = _Reorder.apply(recv, slot_of_chunk, chunk_of_slot, True)  # (bs, 2cp chunks in order, chunk, heads, hd)
    whole = whole.reshape(bs, 2 * cp * chunk, -1, head_dim)  # (bs, seqlen, sum heads/cp, hd)
    sizes = [x.size(1) // cp for x in parts]
    return [x.transpose(1, 2) for x in whole.split(sizes, dim=2)]  # (bs, heads_i/cp, seqlen, hd) views


def _heads_to_sequence(out: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Inverse of `_sequence_to_heads` for one tensor: `(bs, heads/cp, seqlen, hd)` -> `(bs, heads, seqlen/cp, hd)`."""
    cp = dist.get_world_size(group)
    bs, heads, seqlen, head_dim = out.shape
    chunk = seqlen // (2 * cp)
    slot_of_chunk, chunk_of_slot = _orders(cp, out.device)
    chunks = out.transpose(1, 2).reshape(bs, 2 * cp, chunk, heads, head_dim)  # (bs, chunk index, chunk, heads, hd)
    send = _Reorder.apply(chunks, chunk_of_slot, slot_of_chunk, False)  # (slot = (cp_dst, half), bs, chunk, heads, hd)
    recv = all_to_all_single_autograd(send, None, None, group)  # (slot = (cp_src, half), bs, chunk, heads, hd)
    recv = recv.reshape(cp, 2, bs, chunk, heads, head_dim).permute(2, 1, 3, 0, 4, 5)  # (bs, 2, chunk, cp_src, ...)
    return recv.reshape(bs, 2 * chunk, cp * heads, head_dim).transpose(1, 2)  # (bs, heads * cp, seqlen/cp, hd)


def ulysses_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    group: dist.ProcessGroup,
    core: nn.Module,
    mask: Any = None,
) -> torch.Tensor:
    """Causal attention of head-tail sequence shards by head-sharded attention over the whole sequence.

    Args:
        q: `(bs, n_heads, seqlen/cp, head_dim)` local queries, positions `cp_positions(seqlen/cp, rank, cp)`;
            cp divides n_heads.
        k: `(bs, n_kv_heads, seqlen/cp, head_dim)` local keys, same positions; n_kv_heads divides n_heads.
        v: `(bs, n_kv_heads, seqlen/cp, v_head_dim)` local values.
        group: the context-parallel process group.
        core: the model's causal attention `(q, k, v) -> out` on whole sequences (its own softmax scale).
        mask: None for causal attention; else the whole sequence's attention mask (the model's, e.g. a
            block-causal `(bs, 1, seqlen, seqlen)` boolean tensor or FlexAttention `BlockMask`), which the core
            takes as `core(q, k, v, mask=mask)`.

    Returns:
        `(bs, n_heads, seqlen/cp, v_head_dim)`, dtype of q.
    """
    cp = dist.get_world_size(group)

    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return core(q, k, v) if mask is None else core(q, k, v, mask=mask)

    if cp == 1:
        return attend(q, k, v)
    n_heads, n_kv_heads = q.size(1), k.size(1)
    if n_heads % cp:  # `check_cp_method` refuses this before launch; here for direct callers
        raise ParallelConfigError(
            f"cp_method='ulysses' splits each rank's {n_heads} query heads (n_heads / tp) over cp={cp} ranks, "
            "which does not divide them; change cp or tp, or use cp_method='ring'",
            arguments=("cp_method", "cp"),
        )
    repeats = ulysses_kv_repeats(n_kv_heads, cp)
    if repeats > 1:  # (bs, n_kv_heads * repeats, seqlen/cp, hd): query head h still reads a copy of KV head h // n_rep
        k, v = k.repeat_interleave(repeats, dim=1), v.repeat_interleave(repeats, dim=1)
    if v.size(-1) == q.size(-1):
        q, k, v = _sequence_to_heads([q, k, v], group)  # (bs, heads/cp, seqlen, hd)
    else:  # MLA: keys and values differ in head dim
        q, k = _sequence_to_heads([q, k], group)
        (v,) = _sequence_to_heads([v], group)
    out = attend(q, k, v)  # (bs, n_heads/cp, seqlen, v_head_dim)
    return _heads_to_sequence(out, group)  # (bs, n_heads, seqlen/cp, v_head_dim)


class UlyssesAttention(nn.Module):
    """Drop-in for a causal attention core under context parallel: wraps it in Ulysses' all-to-alls.

    Args:
        core: the model's attention core (`ModelPlan.attention`), run on head shards of whole sequences;
            it must hold no parameters or buffers (they would be renamed under `core.`).
        group: the context-parallel process group.
    """

    def __init__(self, core: nn.Module, group: dist.ProcessGroup):
        super().__init__()
        self.core = core
        self.group = group

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Any = None) -> torch.Tensor:
        """Args:
            q: `(bs, n_heads, seqlen/cp, head_dim)`; k, v: `(bs, n_kv_heads, seqlen/cp, head_dim)`.
            mask: None (causal), or the whole sequence's mask for the core (see `ulysses_attention`).

        Returns:
            `(bs, n_heads, seqlen/cp, head_dim)`.
        """
        return ulysses_attention(q, k, v, self.group, self.core, mask)

    def extra_repr(self) -> str:
        return f"cp={dist.get_world_size(self.group)}"
