"""How titan-parallel may split the DeepSeek-V3 `Transformer`, as data.

Attention: the query and the key/value up-projections (`wq` or `wq_b`, `wkv_b`) are split
by heads (colwise), `wo` rowwise; the low-rank down-projections `wq_a`, `wkv_a` and the
latent norms `q_norm`, `kv_norm` are small and run whole on every TP rank (`REPLICATED`:
weights replicated, plain tensors in and out; the colwise projection after them sums their
gradient over the TP ranks). The rotated key is one head shared by all heads, so each rank's
gradient of it covers only that rank's heads: `attention.k_rope_to_heads` (an identity) sums
it over the TP ranks (`SUM_GRAD`). A Mixture-of-Experts block's routed and shared experts are
split on their hidden dim (`MOE_INPUT`); expert parallel splits the routed ones by expert. Only
the entries a block has apply (a model has `wq` or `wq_a`/`wq_b`; a block `feed_forward` or `moe`).
A multi-token-prediction block (`MTPBlock`) adds its input projection, run token by token on each rank's sequence
shard with its weights replicated (`TOKENWISE`), and its head norm (sequence parallel).
"""

from titan_models.mtp import MTP_TP
from titan_parallel.plan import ModelPlan, TPStyle

_MLA_SHARED = (
    ("attention.wq_a", TPStyle.REPLICATED),
    ("attention.q_norm", TPStyle.REPLICATED),
    ("attention.wkv_a", TPStyle.REPLICATED),
    ("attention.kv_norm", TPStyle.REPLICATED),
    ("attention.k_rope_to_heads", TPStyle.SUM_GRAD),
)

deepseek_v3_plan = ModelPlan(
    blocks="layers",
    tp=(
        ("tok_embeddings", TPStyle.EMBEDDING),
        ("norm", TPStyle.NORM),
        ("output", TPStyle.OUTPUT),
    ),
    block_tp=(
        ("attention_norm", TPStyle.NORM),
        ("attention", TPStyle.BLOCK_INPUT),
        ("attention.wq", TPStyle.COLWISE),
        *_MLA_SHARED,
        ("attention.wq_b", TPStyle.COLWISE),
        ("attention.wkv_b", TPStyle.COLWISE),
        ("attention.wo", TPStyle.ROWWISE),
        ("ffn_norm", TPStyle.NORM),
        ("feed_forward", TPStyle.BLOCK_INPUT),
        ("feed_forward.w1", TPStyle.COLWISE),
        ("feed_forward.w3", TPStyle.COLWISE),
        ("feed_forward.w2", TPStyle.ROWWISE),
        ("moe", TPStyle.MOE_INPUT),
        *MTP_TP,
    ),
    pp_first=("tok_embeddings",),
    pp_last=("norm", "output"),
    attention="attention.sdpa",
    head_counts=(),  # Attention reshapes with view(..., -1, head_dim): no attribute to divide
    fsdp_root_units=("tok_embeddings", "output"),
    moe="moe",
)
