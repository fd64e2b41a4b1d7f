"""How titan-parallel may split the Llama 3 `Transformer`, as data. A multi-token-prediction depth (`MTPBlock`)
adds its input projection and head norm (`titan_models.mtp.MTP_TP`)."""

from titan_models.mtp import MTP_TP
from titan_parallel.plan import ModelPlan, TPStyle

llama3_plan = ModelPlan(
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
        ("attention.wk", TPStyle.COLWISE),
        ("attention.wv", TPStyle.COLWISE),
        ("attention.wo", TPStyle.ROWWISE),
        ("ffn_norm", TPStyle.NORM),
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
