"""Named Qwen3 shapes: debug models and the published Qwen3 / Qwen3-MoE models.

The published shapes are those of the Hub's `config.json` files (vocab 151936, head_dim
128, RoPE theta 1e6, RMSNorm eps 1e-6, 40960 positions); `count_params` gives exactly
the parameter count of transformers' model built from that config:

| flavor | dim | layers | heads / kv | FFN | tied | parameters |
|---|---|---|---|---|---|---|
| 0.6B | 1024 | 28 | 16 / 8 | 3072 | yes | 596,049,920 |
| 1.7B | 2048 | 28 | 16 / 8 | 6144 | yes | 1,720,574,976 |
| 4B | 2560 | 36 | 32 / 8 | 9728 | yes | 4,022,468,096 |
| 8B | 4096 | 36 | 32 / 8 | 12288 | no | 8,190,735,360 |
| 14B | 5120 | 40 | 40 / 8 | 17408 | no | 14,768,307,200 |
| 32B | 5120 | 64 | 64 / 8 | 25600 | no | 32,762,123,264 |

Qwen3-MoE (`qwen3_moe_flavors`): every block's feed-forward is 128 routed experts, top 8,
softmax scores renormalised over the chosen 8 (`norm_topk_prob`), no shared experts;
`count_active_params` is what one token uses:

| flavor | dim | layers | heads / kv | expert FFN | parameters | active |
|---|---|---|---|---|---|---|
| 30B-A3B | 2048 | 48 | 32 / 4 | 768 | 30,532,122,624 | 3,353,032,704 |
| 235B-A22B | 4096 | 94 | 64 / 4 | 1536 | 235,093,634,560 | 22,190,763,520 |

The MoE flavors balance their experts as Qwen3-MoE does, with the auxiliary loss (weight 1e-3)
and no expert bias, which Hugging Face's Qwen3-MoE has no place for: a trained model converts back.
`debugmodel` / `debugmodel_moe` are tiny (vocab 2048) with `head_dim` 32 != dim / n_heads
16, as in the published shapes. Derive variants with `dataclasses.replace`.
"""

import dataclasses

from titan_models.moe import MoEArgs
from titan_models.qwen3.model import ModelArgs

# Qwen3-MoE balances its experts with an auxiliary loss (HF `router_aux_loss_coef` 0.001), not an
# expert bias, which its Hugging Face checkpoints have no place for: a trained model converts back.
_QWEN3_ROUTING = MoEArgs(score_func="softmax", route_norm=True, load_balance_coeff=None, aux_loss_coeff=1e-3)
_VOCAB = 151936
_POSITIONS = 40960


def _qwen3(dim: int, n_layers: int, n_heads: int, hidden_dim: int, tied: bool) -> ModelArgs:
    """A published Qwen3 shape: 8 KV heads, head_dim 128, the shared vocab, theta and context."""
    return ModelArgs(
        dim=dim,
        n_layers=n_layers,
        n_heads=n_heads,
        n_kv_heads=8,
        head_dim=128,
        hidden_dim=hidden_dim,
        vocab_size=_VOCAB,
        max_seq_len=_POSITIONS,
        tie_word_embeddings=tied,
    )


def _qwen3_moe(dim: int, n_layers: int, n_heads: int, hidden_dim: int, expert_dim: int) -> ModelArgs:
    """A published Qwen3-MoE shape: 4 KV heads, 128 experts, top 8, renormalised softmax routing."""
    moe = dataclasses.replace(_QWEN3_ROUTING, num_experts=128, top_k=8, hidden_dim=expert_dim)
    return ModelArgs(
        dim=dim,
        n_layers=n_layers,
        n_heads=n_heads,
        n_kv_heads=4,
        head_dim=128,
        hidden_dim=hidden_dim,
        vocab_size=_VOCAB,
        max_seq_len=_POSITIONS,
        moe=moe,
    )


qwen3_flavors: dict[str, ModelArgs] = {
    "debugmodel": ModelArgs(
        dim=256, n_layers=6, n_heads=16, n_kv_heads=8, head_dim=32, hidden_dim=768, vocab_size=2048, max_seq_len=2048
    ),
    "0.6B": _qwen3(1024, 28, 16, 3072, tied=True),
    "1.7B": _qwen3(2048, 28, 16, 6144, tied=True),
    "4B": _qwen3(2560, 36, 32, 9728, tied=True),
    "8B": _qwen3(4096, 36, 32, 12288, tied=False),
    "14B": _qwen3(5120, 40, 40, 17408, tied=False),
    "32B": _qwen3(5120, 64, 64, 25600, tied=False),
}
"""Dense Qwen3 (`model.name = "qwen3"`)."""

qwen3_moe_flavors: dict[str, ModelArgs] = {
    "debugmodel_moe": ModelArgs(
        dim=256,
        n_layers=6,
        n_heads=16,
        n_kv_heads=8,
        head_dim=32,
        hidden_dim=768,
        vocab_size=2048,
        max_seq_len=2048,
        moe=dataclasses.replace(_QWEN3_ROUTING, num_experts=8, top_k=2, hidden_dim=128),
    ),
    "30B-A3B": _qwen3_moe(2048, 48, 32, 6144, expert_dim=768),
    "235B-A22B": _qwen3_moe(4096, 94, 64, 12288, expert_dim=1536),
}
"""Qwen3-MoE (`model.name = "qwen3_moe"`)."""
