"""FLOPs of an FX graph's matmuls and attention, read off its nodes: what a compiled block's backward recomputes.

`torch.utils.flop_counter` counts FLOPs as ops run (`FlopCounterMode`); the memory estimate and `titan plan` need
them for graphs AOTAutograd's partitioner cut on fake tensors, which nothing runs. `graph_flops` applies torch's
own per-op formulas (`flop_registry`) to the fake values AOTAutograd records on each node, so the count is the
counter's (tests/test_memory_budget.py: equal to `FlopCounterMode` over an eager backward of the block). CPU's
flash attention, which the blocks are traced with, has its own formula here (`attention_flops`, torch 2.15's):
torch 2.11's counter skips that op, and its formula for CUDA's refuses grouped-query heads. So has
`wide_attention`'s op, which stands in for CUDA's kernel where q / v head widths differ.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def graph_flops(gm: torch.fx.GraphModule) -> float:
    """FLOPs of an FX graph's matmuls and attention, as `torch.utils.flop_counter` counts each op, from the fake
    values recorded on its nodes (nothing runs; CPU's flash attention by `attention_flops`).

    Args:
        gm: an ATen-level graph whose nodes carry `meta["val"]` (AOTAutograd's forward or backward).
    """
    from torch.utils._pytree import tree_map_only
    from torch.utils.flop_counter import flop_registry

    import titan_core.memory.wide_attention  # noqa: F401  (registers its ops in torch.ops.titan_memory)

    aten = torch.ops.aten
    cpu_flash = {
        aten._scaled_dot_product_flash_attention_for_cpu: 0,  # (query, key, value, ...)
        aten._scaled_dot_product_flash_attention_for_cpu_backward: 1,  # (grad_out, query, key, value, ...)
        torch.ops.titan_memory.causal_attention: 0,  # `wide_attention`'s stand-in for CUDA's kernel
        torch.ops.titan_memory.causal_attention_backward: 1,
    }
    total = 0
    for node in (n for n in gm.graph.nodes if n.op == "call_function"):
        packet = getattr(node.target, "_overloadpacket", node.target)
        count = flop_registry.get(packet)
        if packet not in cpu_flash and count is None:
            continue
        args, kwargs = tree_map_only(torch.fx.Node, lambda n: n.meta["val"], (node.args, node.kwargs))
        if packet in cpu_flash:
            first = cpu_flash[packet]
            query, key, value = args[first : first + 3]
            total += attention_flops(query.shape, key.shape, value.shape, backward=first == 1)
        elif count is not None:
            total += count(*args, **kwargs, out_val=node.meta["val"])
    return float(total)


def attention_flops(query: Sequence[int], key: Sequence[int], value: Sequence[int], backward: bool) -> int:
    """FLOPs of scaled dot-product attention as torch's counter counts them (the causal mask ignored; grouped-query
    key / value heads broadcast to the query's): forward `q k^T` and `p v`; backward those recomputed scores, then
    the gradients of the scores, v, q and k.

    Args:
        query: `(batch, heads, seq_q, head_dim)`.
        key: `(batch, kv_heads, seq_k, head_dim)`.
        value: `(batch, kv_heads, seq_k, v_head_dim)`.
        backward: count the backward rather than the forward.
    """
    b, h, s_q, d_q = query
    s_k, d_v = key[-2], value[-1]
    pairs = 2 * b * h * s_q * s_k
    return pairs * (3 * d_q + 2 * d_v) if backward else pairs * (d_q + d_v)
