"""How titan-parallel may split the Qwen3 `Transformer`, as data.

The entries are Llama 3's plus the QK-norms. `attention.q_norm` / `attention.k_norm`
normalise each head over `head_dim`, and the colwise `wq` / `wk` return plain local
tensors holding whole heads (`n_heads / tp` of them), so the forward needs nothing; but
each rank's weight gradient covers only its own heads. `TPStyle.HEAD_NORM` makes the
weight a replicated DTensor whose gradient is summed over the TP ranks (without it the
gradients are partial and grad clipping meets plain tensors among DTensors).
"""

import dataclasses

from titan_models.mtp import MTP_TP
from titan_parallel.plan import ModelPlan, TPStyle

_ATTENTION_TP = (
    ("attention_norm", TPStyle.NORM),
    ("attention", TPStyle.BLOCK_INPUT),
    ("attention.wq", TPStyle.COLWISE),
    ("attention.wk", TPStyle.COLWISE),
    ("attention.q_norm", TPStyle.HEAD_NORM),
    ("attention.k_norm", TPStyle.HEAD_NORM),
    ("attention.wv", TPStyle.COLWISE),
    ("attention.wo", TPStyle.ROWWISE),
    ("ffn_norm", TPStyle.NORM),
)

qwen3_plan = ModelPlan(
    blocks="layers",
    tp=(
        ("tok_embeddings", TPStyle.EMBEDDING),
        ("norm", TPStyle.NORM),
        ("output", TPStyle.OUTPUT),
    ),
    block_tp=(
        *_ATTENTION_TP,
        ("feed_forward", TPStyle.BLOCK_INPUT),
        ("feed_forward.w1", TPStyle.COLWISE),
        ("feed_forward.w3", TPStyle.COLWISE),
        ("feed_forward.w2", TPStyle.ROWWISE),
        *MTP_TP,
    ),
    pp_first=("tok_embeddings",),
    pp_last=("norm", "output"),
    attention="attention.sdpa",
    head_counts=(),  # Attention reshapes with view(..., -1, head_dim): no attribute to divide
    fsdp_root_units=("tok_embeddings", "output"),
    shared_input_linears=(("attention.wq", "attention.wk", "attention.wv"), ("feed_forward.w1", "feed_forward.w3")),
)
"""Dense Qwen3."""

qwen3_moe_plan = dataclasses.replace(
    qwen3_plan, block_tp=(*_ATTENTION_TP, ("moe", TPStyle.MOE_INPUT), *MTP_TP), moe="moe"
)
"""Qwen3-MoE: attention as in `qwen3_plan`; tensor parallel splits the `moe` module's experts on their
hidden dim (`MOE_INPUT`) and expert parallel splits them by expert (`ModelPlan.moe`)."""
