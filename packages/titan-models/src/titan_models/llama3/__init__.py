"""Llama 3 / 3.1: model, flavors, parallel plan, parameter and FLOP counts, Hugging Face adapter."""

from titan_models.llama3.flavors import llama3_flavors
from titan_models.llama3.flops import count_params, flops_per_token
from titan_models.llama3.hf_adapter import args_from_hf_config, hf_config_from_args, llama3_hf_adapter
from titan_models.llama3.model import (
    Attention,
    FeedForward,
    ModelArgs,
    RopeScaling,
    ScaledDotProductAttention,
    Transformer,
    TransformerBlock,
    apply_rotary_emb,
    compute_rope_inv_freq,
    precompute_rope_cache,
)
from titan_models.llama3.plan import llama3_plan

__all__ = [
    "Attention",
    "FeedForward",
    "ModelArgs",
    "RopeScaling",
    "ScaledDotProductAttention",
    "Transformer",
    "TransformerBlock",
    "apply_rotary_emb",
    "args_from_hf_config",
    "compute_rope_inv_freq",
    "count_params",
    "flops_per_token",
    "hf_config_from_args",
    "llama3_flavors",
    "llama3_plan",
    "llama3_hf_adapter",
    "precompute_rope_cache",
]
