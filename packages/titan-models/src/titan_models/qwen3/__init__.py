"""Qwen3 and Qwen3-MoE: model, flavors, parallel plans, parameter and FLOP counts, Hugging Face adapters."""

from titan_models.qwen3.flavors import qwen3_flavors, qwen3_moe_flavors
from titan_models.qwen3.flops import count_active_params, count_params, flops_per_token
from titan_models.qwen3.hf_adapter import (
    args_from_hf_config,
    hf_config_from_args,
    moe_args_from_hf_config,
    qwen3_hf_adapter,
    qwen3_moe_hf_adapter,
)
from titan_models.qwen3.model import Attention, ModelArgs, Transformer, TransformerBlock, apply_rotary_emb
from titan_models.qwen3.plan import qwen3_moe_plan, qwen3_plan

__all__ = [
    "Attention",
    "ModelArgs",
    "Transformer",
    "TransformerBlock",
    "apply_rotary_emb",
    "args_from_hf_config",
    "count_active_params",
    "count_params",
    "flops_per_token",
    "hf_config_from_args",
    "moe_args_from_hf_config",
    "qwen3_flavors",
    "qwen3_hf_adapter",
    "qwen3_moe_flavors",
    "qwen3_moe_hf_adapter",
    "qwen3_moe_plan",
    "qwen3_plan",
]
