"""DeepSeek-V3: model (Multi-head Latent Attention, Mixture-of-Experts), flavors, parallel plan,
parameter and FLOP counts, Hugging Face adapter."""

from titan_models.deepseek_v3.flavors import deepseek_v3_flavors
from titan_models.deepseek_v3.flops import count_active_params, count_params, flops_per_token
from titan_models.deepseek_v3.hf_adapter import args_from_hf_config, deepseek_v3_hf_adapter, hf_config_from_args
from titan_models.deepseek_v3.model import (
    Attention,
    ModelArgs,
    MTPBlock,
    ScaledDotProductAttention,
    Transformer,
    TransformerBlock,
    YaRN,
    compute_rope_inv_freq,
    precompute_rope_cache,
)
from titan_models.deepseek_v3.plan import deepseek_v3_plan
from titan_models.mtp import MTPInput

__all__ = [
    "Attention",
    "MTPBlock",
    "MTPInput",
    "ModelArgs",
    "ScaledDotProductAttention",
    "Transformer",
    "TransformerBlock",
    "YaRN",
    "args_from_hf_config",
    "compute_rope_inv_freq",
    "count_active_params",
    "count_params",
    "deepseek_v3_flavors",
    "deepseek_v3_hf_adapter",
    "deepseek_v3_plan",
    "flops_per_token",
    "hf_config_from_args",
    "precompute_rope_cache",
]
