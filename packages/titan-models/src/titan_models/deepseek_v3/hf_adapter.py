"""DeepSeek-V3 <-> Hugging Face `DeepseekV3ForCausalLM`: parameter names, the experts'
layout, and `config.json`, bundled as `deepseek_v3_hf_adapter`.

RoPE needs no permutation: Titan rotates DeepSeek's interleaved pairs `(2i, 2i+1)`, which is
what transformers does with `rope_interleave=True` (its default, and what DeepSeek's
checkpoints hold); a `config.json` with `rope_interleave: false` is refused.

Experts: the Hub layout (and what transformers 5's `save_pretrained` writes) has one
`mlp.experts.{j}.{gate,up,down}_proj.weight` per expert; Titan stacks them into
`moe.experts.w1` / `w3` / `w2` `(experts, ...)`. `from_hf` also reads transformers' in-memory
layout (`mlp.experts.gate_up_proj` `(experts, 2 * hidden, dim)`, `mlp.experts.down_proj`).
The router's `mlp.gate.e_score_correction_bias` is `moe.expert_bias`.

Multi-token prediction: DeepSeek-V3's checkpoints carry an MTP module as layer
`num_hidden_layers` (layer 61 of the 671B): a block plus `enorm`, `hnorm`, `eh_proj`,
`shared_head.norm`, and copies of the embedding (`embed_tokens`) and output (`shared_head.head`).
Titan's `MTPBlock`s are the same layers of `layers` (`input_proj.{enorm,hnorm,eh_proj}`,
`head_norm`), sharing the model's embedding and output: `from_hf` reads the first
`args.n_mtp_layers` of them (and skips the copies, and any further layers), `to_hf` writes them with
the copies, as the Hub checkpoints and vLLM's and SGLang's MTP loaders have them. The written `config.json`
says `num_nextn_predict_layers: n_mtp_layers`; `args_from_hf_config` does not read it (n_mtp_layers 0), since
transformers writes 1 into every DeepSeek-V3 config whether or not the weights hold the layer (it drops
them on load): a training job asks for the depths with `mtp.layers`, `titan convert` counts the layers the
weights hold.
FP8 checkpoints (DeepSeek's own: `*.weight_scale_inv`, `quantization_config.quant_method = "fp8"`) are read
dequantized by `titan_ckpt.read_hf_state_dict` (`titan_ckpt.hf_fp8`); `from_hf` itself takes unquantized weights.
"""

from __future__ import annotations

import re
from typing import Any

import torch

from titan_models.deepseek_v3.model import ModelArgs, YaRN
from titan_models.errors import ModelConfigError
from titan_models.moe import MoEArgs
from titan_models.spec import HFAdapter

# Titan name inside a block -> Hugging Face name inside `model.layers.{i}`.
_LAYER_NAMES: dict[str, str] = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wq_a.weight": "self_attn.q_a_proj.weight",
    "attention.q_norm.weight": "self_attn.q_a_layernorm.weight",
    "attention.wq_b.weight": "self_attn.q_b_proj.weight",
    "attention.wkv_a.weight": "self_attn.kv_a_proj_with_mqa.weight",
    "attention.kv_norm.weight": "self_attn.kv_a_layernorm.weight",
    "attention.wkv_b.weight": "self_attn.kv_b_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "moe.router.gate.weight": "mlp.gate.weight",
    "moe.expert_bias": "mlp.gate.e_score_correction_bias",
    "moe.shared_experts.w1.weight": "mlp.shared_experts.gate_proj.weight",
    "moe.shared_experts.w2.weight": "mlp.shared_experts.down_proj.weight",
    "moe.shared_experts.w3.weight": "mlp.shared_experts.up_proj.weight",
}
_MTP_NAMES: dict[str, str] = {  # an MTPBlock's own parameters (the rest is a block's)
    "input_proj.enorm.weight": "enorm.weight",
    "input_proj.hnorm.weight": "hnorm.weight",
    "input_proj.eh_proj.weight": "eh_proj.weight",
    "head_norm.weight": "shared_head.norm.weight",
}
_MTP_SHARED = {"embed_tokens.weight": "tok_embeddings.weight", "shared_head.head.weight": "output.weight"}
"""An MTP layer's copies of the shared weights in the Hub layout -> the Titan weight they copy."""
_TOP_NAMES: dict[str, str] = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_EXPERT_PROJ = {"w1": "gate_proj", "w2": "down_proj", "w3": "up_proj"}  # Titan stacked weight -> HF per-expert name
_HF_LAYER_NAMES = {hf: titan for titan, hf in _LAYER_NAMES.items()}
_HF_MTP_NAMES = {hf: titan for titan, hf in _MTP_NAMES.items()}
_HF_TOP_NAMES = {hf: titan for titan, hf in _TOP_NAMES.items()}
_TITAN_LAYER = re.compile(r"layers\.(\d+)\.(.+)")
_HF_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")
_HF_EXPERT = re.compile(r"mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight")
_HF_PROJ = {hf: titan for titan, hf in _EXPERT_PROJ.items()}


def _check_sigmoid(args: ModelArgs) -> None:
    if args.moe.score_func != "sigmoid":
        raise ModelConfigError(
            f"model moe.score_func '{args.moe.score_func}' has no DeepseekV3ForCausalLM equivalent (it scores experts "
            "with sigmoid); keep this model in Titan's formats (dcp, torch)"
        )


def to_hf_state_dict(state_dict: dict[str, torch.Tensor], args: ModelArgs) -> dict[str, torch.Tensor]:
    """Titan's full DeepSeek-V3 state dict -> `DeepseekV3ForCausalLM` names, experts one by one.

    Args:
        state_dict: Titan names (`tok_embeddings.weight`, `layers.3.moe.experts.w1`, ...).
        args: the model's shape.

    Returns:
        Hugging Face names in the Hub layout; `lm_head.weight` left out when embeddings are tied.

    Raises:
        ValueError: a name that is not a DeepSeek-V3 parameter.
        ModelConfigError: softmax expert scores (no Hugging Face equivalent).
    """
    _check_sigmoid(args)
    hf: dict[str, torch.Tensor] = {}
    for name, tensor in state_dict.items():
        if name == "output.weight" and args.tie_word_embeddings:
            continue
        if name in _TOP_NAMES:
            hf[_TOP_NAMES[name]] = tensor
            continue
        match = _TITAN_LAYER.fullmatch(name)
        leaf = match.group(2) if match else None
        prefix = f"model.layers.{match.group(1)}." if match else ""
        if leaf in _LAYER_NAMES:
            hf[prefix + _LAYER_NAMES[leaf]] = tensor
        elif leaf in _MTP_NAMES and match is not None and int(match.group(1)) >= args.n_layers:
            hf[prefix + _MTP_NAMES[leaf]] = tensor
        elif leaf is not None and leaf.startswith("moe.experts.") and leaf[len("moe.experts.") :] in _EXPERT_PROJ:
            proj = _EXPERT_PROJ[leaf[len("moe.experts.") :]]
            for j, weight in enumerate(tensor.unbind(0)):  # (experts, out, in) -> experts x (out, in)
                hf[f"{prefix}mlp.experts.{j}.{proj}.weight"] = weight
        else:
            raise ValueError(
                f"'{name}' is not a DeepSeek-V3 parameter; pass the model's own state dict (Titan names, no prefix)"
            )
    embedding = state_dict.get("tok_embeddings.weight")
    head = embedding if args.tie_word_embeddings else state_dict.get("output.weight")
    copies: dict[str, torch.Tensor | None] = {"embed_tokens.weight": embedding, "shared_head.head.weight": head}
    for layer in range(args.n_layers, args.n_layers + args.n_mtp_layers):  # the Hub layout's copies
        for hf_leaf, shared in copies.items():
            if shared is not None:  # a clone: safetensors refuses two names for one storage
                hf[f"model.layers.{layer}.{hf_leaf}"] = shared.clone()
    return hf


def from_hf_state_dict(hf_state_dict: dict[str, torch.Tensor], args: ModelArgs) -> dict[str, torch.Tensor]:
    """`DeepseekV3ForCausalLM` state dict (Hub per-expert layout or transformers' fused one) -> Titan names.

    Layers `n_layers .. n_layers + n_mtp_layers - 1` are multi-token-prediction blocks (their copies of the
    embedding and output skipped); later layers (depths the run does not train) are skipped.

    Args:
        hf_state_dict: Hugging Face names (`model.embed_tokens.weight`, ...).
        args: the model's shape.

    Returns:
        Titan names, loadable into `Transformer(args)` with `strict=True`.

    Raises:
        ModelConfigError: a name that is not a `DeepseekV3ForCausalLM` parameter, FP8 weights still quantized,
            a missing expert, or softmax expert scores in `args`.
    """
    _check_sigmoid(args)
    titan: dict[str, torch.Tensor] = {}
    experts: dict[tuple[str, str], dict[int, torch.Tensor]] = {}  # (layer, w1|w2|w3) -> {expert: weight}
    for name, tensor in hf_state_dict.items():
        if name.endswith("weight_scale_inv"):
            raise ModelConfigError(
                f"'{name}': FP8 weights with their scales; read the checkpoint with titan_ckpt.read_hf_state_dict, "
                "which dequantizes them"
            )
        if name in _HF_TOP_NAMES:
            titan[_HF_TOP_NAMES[name]] = tensor
            continue
        match = _HF_LAYER.fullmatch(name)
        if match is None:
            raise ModelConfigError(
                f"'{name}' is not a DeepseekV3ForCausalLM parameter; only DeepSeek-V3-architecture checkpoints convert"
            )
        layer, leaf = match.groups()
        mtp_layer = int(layer) >= args.n_layers
        if int(layer) >= args.n_layers + args.n_mtp_layers or (mtp_layer and leaf in _MTP_SHARED):
            continue  # a prediction depth this model has not, or an MTP layer's copy of a shared weight
        expert = _HF_EXPERT.fullmatch(leaf)
        if mtp_layer and leaf in _HF_MTP_NAMES:
            titan[f"layers.{layer}.{_HF_MTP_NAMES[leaf]}"] = tensor
        elif leaf in _HF_LAYER_NAMES:
            titan[f"layers.{layer}.{_HF_LAYER_NAMES[leaf]}"] = tensor
        elif expert is not None:
            experts.setdefault((layer, _HF_PROJ[expert.group(2)]), {})[int(expert.group(1))] = tensor
        elif leaf == "mlp.experts.gate_up_proj":  # transformers' fused (experts, 2 * hidden, dim)
            titan[f"layers.{layer}.moe.experts.w1"], titan[f"layers.{layer}.moe.experts.w3"] = tensor.chunk(2, dim=1)
        elif leaf == "mlp.experts.down_proj":  # (experts, dim, hidden)
            titan[f"layers.{layer}.moe.experts.w2"] = tensor
        else:
            raise ModelConfigError(
                f"'{name}' is not a DeepseekV3ForCausalLM parameter; only DeepSeek-V3-architecture checkpoints convert"
            )
    for (layer, weight), by_expert in experts.items():
        if sorted(by_expert) != list(range(args.moe.num_experts)):
            missing = sorted(set(range(args.moe.num_experts)) - set(by_expert))
            raise ModelConfigError(
                f"layer {layer} lacks experts {missing[:8]} of {args.moe.num_experts}; "
                "pass every shard of the checkpoint"
            )
        titan[f"layers.{layer}.moe.experts.{weight}"] = torch.stack([by_expert[j] for j in range(args.moe.num_experts)])
    if args.tie_word_embeddings and "tok_embeddings.weight" in titan:
        titan["output.weight"] = titan["tok_embeddings.weight"]
    return titan


def args_from_hf_config(config: dict[str, Any]) -> ModelArgs:
    """A Hugging Face DeepSeek-V3 `config.json` (as a dict) -> `ModelArgs`, no flavor needed.

    Reads the published layout (`rope_theta`, `rope_scaling`) and transformers 5's
    (`rope_parameters`); `num_nextn_predict_layers` is ignored (see the module docstring).

    Args:
        config: the parsed `config.json`.

    Raises:
        ModelConfigError: not DeepSeek-V3, or a feature Titan's DeepSeek-V3 lacks; one line with the key.
    """
    model_type = config.get("model_type", "deepseek_v3")
    if model_type != "deepseek_v3":
        raise ModelConfigError(
            f"config.json model_type '{model_type}' is not 'deepseek_v3'; "
            "only DeepSeek-V3-architecture checkpoints convert"
        )
    method = (config.get("quantization_config") or {}).get("quant_method", "fp8")
    if method != "fp8":  # block FP8 (DeepSeek's own checkpoints) is dequantized as it is read: titan_ckpt.hf_fp8
        raise ModelConfigError(
            f"config.json's quantization_config has quant_method {method!r}; use an unquantized or block-FP8 checkpoint"
        )
    if config.get("attention_bias", False):
        raise ModelConfigError(
            "config.json attention_bias=true is not supported by Titan's DeepSeek-V3; use a checkpoint without biases"
        )
    if config.get("hidden_act", "silu") != "silu":
        raise ModelConfigError(
            f"config.json hidden_act '{config['hidden_act']}' is not supported; "
            "Titan's DeepSeek-V3 uses 'silu' (SwiGLU)"
        )
    if config.get("rope_interleave", True) is False:
        raise ModelConfigError(
            "config.json rope_interleave=false is not supported; Titan's DeepSeek-V3 rotates interleaved pairs"
        )
    n_heads = int(config["num_attention_heads"])
    if int(config.get("num_key_value_heads") or n_heads) != n_heads:
        raise ModelConfigError(
            f"config.json num_key_value_heads must equal num_attention_heads={n_heads} for MLA; fix config.json"
        )
    rope: dict[str, Any] = dict(config.get("rope_parameters") or {})
    scaling = config.get("rope_scaling") or rope
    moe = MoEArgs(
        num_experts=int(config["n_routed_experts"]),
        top_k=int(config["num_experts_per_tok"]),
        hidden_dim=int(config["moe_intermediate_size"]),
        num_shared_experts=int(config.get("n_shared_experts") or 0),
        score_func=config.get("scoring_func", "sigmoid"),
        route_norm=bool(config.get("norm_topk_prob", True)),
        route_scale=float(config.get("routed_scaling_factor", 1.0)),
        n_groups=int(config.get("n_group") or 1),
        topk_groups=int(config.get("topk_group") or 1),
    )
    return ModelArgs(
        dim=int(config["hidden_size"]),
        n_layers=int(config["num_hidden_layers"]),
        n_dense_layers=min(int(config.get("first_k_dense_replace") or 0), int(config["num_hidden_layers"])),
        n_heads=n_heads,
        vocab_size=int(config["vocab_size"]),
        ffn_hidden_dim=int(config["intermediate_size"]),
        norm_eps=float(config.get("rms_norm_eps", 1e-6)),
        q_lora_rank=int(config.get("q_lora_rank") or 0),
        kv_lora_rank=int(config["kv_lora_rank"]),
        qk_nope_head_dim=int(config["qk_nope_head_dim"]),
        qk_rope_head_dim=int(config["qk_rope_head_dim"]),
        v_head_dim=int(config["v_head_dim"]),
        rope_theta=float(config.get("rope_theta", rope.get("rope_theta", 10000.0))),
        rope_scaling=_yarn_from_hf(scaling),
        max_seq_len=int(config.get("max_position_embeddings", 4096)),
        moe=moe,
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
    )


def _yarn_from_hf(scaling: dict[str, Any]) -> YaRN | None:
    """`rope_scaling` / `rope_parameters` -> `YaRN` for type "yarn", None for plain RoPE."""
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type == "default":
        return None
    if rope_type != "yarn":
        raise ModelConfigError(
            f"config.json rope_scaling type '{rope_type}' is not supported; Titan's DeepSeek-V3 knows 'yarn' or none"
        )
    if (
        scaling.get("truncate", True) is False
        or scaling.get("attention_factor") is not None
        or scaling.get("factor") is None
    ):
        raise ModelConfigError(
            "config.json rope_scaling sets truncate=false, attention_factor or no factor; Titan's YaRN needs "
            "factor and computes the attention factor from mscale / mscale_all_dim"
        )
    return YaRN(
        factor=float(scaling["factor"]),
        original_max_position_embeddings=int(scaling["original_max_position_embeddings"]),
        beta_fast=float(scaling.get("beta_fast") or 32.0),
        beta_slow=float(scaling.get("beta_slow") or 1.0),
        mscale=float(scaling.get("mscale") or 0.0),
        mscale_all_dim=float(scaling.get("mscale_all_dim") or 0.0),
    )


def hf_config_from_args(args: ModelArgs, dtype: str = "float32") -> dict[str, Any]:
    """`ModelArgs` -> a `DeepseekV3Config`-compatible `config.json` dict (the published layout,
    which transformers 5 reads too).

    Args:
        args: the model's shape.
        dtype: the weights' dtype name, recorded as `torch_dtype`.
    """
    m, yarn = args.moe, args.rope_scaling
    return {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "hidden_size": args.dim,
        "intermediate_size": args.ffn_hidden_dim,
        "moe_intermediate_size": m.hidden_dim,
        "num_hidden_layers": args.n_layers,
        "first_k_dense_replace": args.n_dense_layers,
        "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.n_heads,
        "q_lora_rank": args.q_lora_rank or None,
        "kv_lora_rank": args.kv_lora_rank,
        "qk_nope_head_dim": args.qk_nope_head_dim,
        "qk_rope_head_dim": args.qk_rope_head_dim,
        "v_head_dim": args.v_head_dim,
        "n_routed_experts": m.num_experts,
        "num_experts_per_tok": m.top_k,
        "n_shared_experts": m.num_shared_experts,
        "n_group": m.n_groups,
        "topk_group": m.topk_groups,
        "norm_topk_prob": m.route_norm,
        "routed_scaling_factor": m.route_scale,
        "scoring_func": m.score_func,
        "topk_method": "noaux_tc",
        "num_nextn_predict_layers": args.n_mtp_layers,
        "vocab_size": args.vocab_size,
        "rms_norm_eps": args.norm_eps,
        "rope_theta": args.rope_theta,
        "rope_scaling": None
        if yarn is None
        else {
            "type": "yarn",
            "rope_type": "yarn",
            "factor": yarn.factor,
            "original_max_position_embeddings": yarn.original_max_position_embeddings,
            "beta_fast": yarn.beta_fast,
            "beta_slow": yarn.beta_slow,
            "mscale": yarn.mscale,
            "mscale_all_dim": yarn.mscale_all_dim,
        },
        "rope_interleave": True,
        "max_position_embeddings": args.max_seq_len,
        "tie_word_embeddings": args.tie_word_embeddings,
        "hidden_act": "silu",
        "attention_bias": False,
        "torch_dtype": dtype,
    }


deepseek_v3_hf_adapter: HFAdapter[ModelArgs] = HFAdapter(
    hf_architecture="DeepseekV3ForCausalLM",
    to_hf=to_hf_state_dict,
    from_hf=from_hf_state_dict,
    args_from_hf_config=args_from_hf_config,
    hf_config_from_args=hf_config_from_args,
)
"""The DeepSeek-V3 family's `ModelSpec.hf_adapter`."""
