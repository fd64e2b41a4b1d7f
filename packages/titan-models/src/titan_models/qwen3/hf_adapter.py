"""Qwen3 <-> Hugging Face `Qwen3ForCausalLM` and Qwen3-MoE <-> `Qwen3MoeForCausalLM`:
parameter names and `config.json`, bundled as `qwen3_hf_adapter` and `qwen3_moe_hf_adapter`.

Titan's Qwen3 uses Hugging Face's rotate-half RoPE layout, so the dense weights are a pure
rename. Qwen3-MoE's experts are stacked: Titan's `moe.experts.w1` `(experts, hidden, dim)`
is the Hub's `mlp.experts.{j}.gate_proj.weight` for j = 0.., `w3` the `up_proj`s, `w2`
`(experts, dim, hidden)` the `down_proj`s. `from_hf` also reads the fused layout of a
transformers 5 model's own `state_dict()` (`mlp.experts.gate_up_proj` `(experts, 2 * hidden,
dim)`, gate rows first, and `mlp.experts.down_proj`); `to_hf` writes the per-expert layout,
which is what the Hub holds and what transformers 5's `save_pretrained` writes.
Hugging Face's Qwen3-MoE routes without an expert bias: `from_hf` gives `moe.expert_bias`
zeros, and `to_hf` refuses a non-zero one (that model would route differently).
"""

from __future__ import annotations

import re
from typing import Any

import torch

from titan_models.errors import ModelConfigError
from titan_models.moe import MoEArgs
from titan_models.mup import fold_into_weights
from titan_models.qwen3.model import ModelArgs
from titan_models.spec import HFAdapter

StateDict = dict[str, torch.Tensor]

# Titan name inside a block -> Hugging Face name inside `model.layers.{i}`.
_ATTENTION_NAMES: dict[str, str] = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "attention.q_norm.weight": "self_attn.q_norm.weight",
    "attention.k_norm.weight": "self_attn.k_norm.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
_DENSE_NAMES: dict[str, str] = {
    **_ATTENTION_NAMES,
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
}
_MOE_NAMES: dict[str, str] = {**_ATTENTION_NAMES, "moe.router.gate.weight": "mlp.gate.weight"}
# Stacked expert weight -> the per-expert projection it stacks.
_EXPERT_PROJ: dict[str, str] = {
    "moe.experts.w1": "gate_proj",
    "moe.experts.w2": "down_proj",
    "moe.experts.w3": "up_proj",
}
_HF_EXPERT_PROJ = {proj: titan for titan, proj in _EXPERT_PROJ.items()}
_EXPERT_BIAS = "moe.expert_bias"

_TOP_NAMES: dict[str, str] = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_HF_TOP_NAMES = {hf: titan for titan, hf in _TOP_NAMES.items()}
_TITAN_LAYER = re.compile(r"layers\.(\d+)\.(.+)")
_HF_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")
_HF_EXPERT = re.compile(r"mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight")
_HF_FUSED = {"mlp.experts.gate_up_proj", "mlp.experts.down_proj"}
# Buffers some older Hugging Face checkpoints carry; they hold no learned weights.
_HF_IGNORED = re.compile(r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq")


def to_hf_state_dict(state_dict: StateDict, args: ModelArgs) -> StateDict:
    """Titan's full Qwen3 / Qwen3-MoE state dict -> Hugging Face names (per-expert Hub layout).

    Args:
        state_dict: Titan names (`tok_embeddings.weight`, `layers.0.attention.wq.weight`, ...).
        args: the model's shape (tied embeddings; `moe` picks the MoE names).

    Returns:
        Hugging Face names; `lm_head.weight` is left out when embeddings are tied, as
        `save_pretrained` does. A muP model's multipliers are folded into the weights
        (`titan_models.mup.fold_into_weights`; the query's into `q_norm`): Qwen3 has none. Multi-token-prediction
        depths (layers `n_layers ..`) are left out: the architectures have none.

    Raises:
        ValueError: a name that is not a parameter of this family.
        ModelConfigError: a non-zero `moe.expert_bias`, which Hugging Face's Qwen3-MoE cannot hold.
    """
    if args.mup is not None:
        state_dict = fold_into_weights(
            state_dict, args.mup, dim=args.dim, head_dim=args.head_dim, query_key="attention.q_norm.weight"
        )
    names = _MOE_NAMES if args.moe is not None else _DENSE_NAMES
    hf: StateDict = {}
    for name, tensor in state_dict.items():
        if name == "output.weight" and args.tie_word_embeddings:
            continue
        if name in _TOP_NAMES:
            hf[_TOP_NAMES[name]] = tensor
            continue
        match = _TITAN_LAYER.fullmatch(name)
        layer, leaf = match.groups() if match is not None else ("", "")
        if layer and int(layer) >= args.n_layers:
            continue  # a multi-token-prediction depth: Qwen3ForCausalLM has no place for it
        if leaf in names:
            hf[f"model.layers.{layer}.{names[leaf]}"] = tensor
        elif args.moe is not None and leaf in _EXPERT_PROJ:
            for j, expert in enumerate(tensor.unbind(0)):
                hf[f"model.layers.{layer}.mlp.experts.{j}.{_EXPERT_PROJ[leaf]}.weight"] = expert
        elif args.moe is not None and leaf == _EXPERT_BIAS:
            if bool(tensor.any()):
                raise ModelConfigError(
                    f"'{name}' is non-zero (aux-loss-free load balancing) and Qwen3MoeForCausalLM routes without an "
                    "expert bias; train with MoEArgs.load_balance_coeff=None to export to Hugging Face"
                )
        else:
            family = "Qwen3-MoE" if args.moe is not None else "Qwen3"
            raise ValueError(
                f"'{name}' is not a {family} parameter; pass the model's own state dict (Titan names, no prefix)"
            )
    return hf


def from_hf_state_dict(hf_state_dict: StateDict, args: ModelArgs) -> StateDict:
    """`Qwen3ForCausalLM` / `Qwen3MoeForCausalLM` state dict -> Titan names.

    Args:
        hf_state_dict: Hugging Face names (`model.embed_tokens.weight`, ...); MoE experts
            per expert (Hub files) or fused (a transformers 5 model's `state_dict()`).
        args: the model's shape (tied embeddings; `moe` for the experts).

    Returns:
        Titan names, loadable into `Transformer(args)` with `strict=True`; with tied
        embeddings `output.weight` is the embedding tensor itself; with `moe`,
        `moe.expert_bias` zeros. Into a muP model the multipliers are divided out of the weights.

    Raises:
        ModelConfigError: a name that is not a parameter of the family, or a missing expert.
    """
    arch = "Qwen3MoeForCausalLM" if args.moe is not None else "Qwen3ForCausalLM"
    names = _MOE_NAMES if args.moe is not None else _DENSE_NAMES
    hf_names = {hf: titan for titan, hf in names.items()}
    titan: StateDict = {}
    experts: dict[tuple[str, str], dict[int, torch.Tensor]] = {}  # (layer, Titan leaf) -> expert -> weight
    for name, tensor in hf_state_dict.items():
        if _HF_IGNORED.fullmatch(name):
            continue
        if name in _HF_TOP_NAMES:
            titan[_HF_TOP_NAMES[name]] = tensor
            continue
        match = _HF_LAYER.fullmatch(name)
        layer, leaf = match.groups() if match is not None else ("", "")
        expert = _HF_EXPERT.fullmatch(leaf) if args.moe is not None else None
        if leaf in hf_names:
            titan[f"layers.{layer}.{hf_names[leaf]}"] = tensor
        elif expert is not None:
            experts.setdefault((layer, _HF_EXPERT_PROJ[expert.group(2)]), {})[int(expert.group(1))] = tensor
        elif args.moe is not None and leaf in _HF_FUSED:
            if leaf == "mlp.experts.down_proj":
                titan[f"layers.{layer}.moe.experts.w2"] = tensor  # (experts, dim, hidden)
            else:
                gate, up = tensor.chunk(2, dim=1)  # (experts, 2 * hidden, dim) -> 2 x (experts, hidden, dim)
                titan[f"layers.{layer}.moe.experts.w1"], titan[f"layers.{layer}.moe.experts.w3"] = gate, up
        else:
            moe_weight = leaf == "mlp.gate.weight" or leaf.startswith("mlp.experts.")
            hint = (
                "; a Qwen3-MoE checkpoint converts with --model-name qwen3_moe"
                if moe_weight and args.moe is None
                else ""
            )
            raise ModelConfigError(f"'{name}' is not a {arch} parameter{hint}")
    num_experts = args.moe.num_experts if args.moe is not None else 0  # `experts` is empty without `moe`
    for (layer, leaf), by_index in experts.items():
        missing = sorted(set(range(num_experts)) - set(by_index))
        if missing:
            raise ModelConfigError(
                f"layer {layer} lacks mlp.experts.{missing[0]}.{_EXPERT_PROJ[leaf]}.weight; "
                f"the checkpoint is incomplete or config.json num_experts={num_experts} is wrong"
            )
        titan[f"layers.{layer}.{leaf}"] = torch.stack([by_index[j] for j in range(num_experts)])
    if args.moe is not None:
        layers = {m.group(1) for k in titan if (m := _TITAN_LAYER.fullmatch(k))}
        for layer in layers:
            titan[f"layers.{layer}.{_EXPERT_BIAS}"] = torch.zeros(args.moe.num_experts)
    if args.tie_word_embeddings and "tok_embeddings.weight" in titan:
        titan["output.weight"] = titan["tok_embeddings.weight"]
    if args.mup is not None:
        titan = fold_into_weights(
            titan, args.mup, dim=args.dim, head_dim=args.head_dim, query_key="attention.q_norm.weight", unfold=True
        )
    return titan


def _check_supported(config: dict[str, Any], model_type: str) -> None:
    """Raise `ModelConfigError` for a config.json Titan's Qwen3 cannot build."""
    found = config.get("model_type", model_type)
    if found != model_type:
        fix = (
            f"convert it with --model-name {found}"
            if found in ("qwen3", "qwen3_moe")
            else "only Qwen3 checkpoints convert"
        )
        raise ModelConfigError(f"config.json model_type '{found}' is not '{model_type}'; {fix}")
    if config.get("attention_bias", False):
        raise ModelConfigError(
            "config.json attention_bias=true is not supported by Titan's Qwen3 (no biases); "
            "use a checkpoint without biases"
        )
    if config.get("hidden_act", "silu") != "silu":
        raise ModelConfigError(
            f"config.json hidden_act '{config['hidden_act']}' is not supported; Titan's Qwen3 uses 'silu' (SwiGLU)"
        )
    layer_types = config.get("layer_types") or []
    if config.get("use_sliding_window", False) or "sliding_attention" in layer_types:
        raise ModelConfigError(
            "config.json use_sliding_window=true is not supported; Titan's Qwen3 attends to the full causal context"
        )


def _rope_theta(config: dict[str, Any]) -> float:
    """RoPE base from the transformers 4 (`rope_theta`, `rope_scaling`) or 5 (`rope_parameters`) layout."""
    rope: dict[str, Any] = dict(config.get("rope_parameters") or {})
    scaling = config.get("rope_scaling") or rope
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type != "default":
        raise ModelConfigError(
            f"config.json rope_scaling type '{rope_type}' is not supported; Titan's Qwen3 uses plain RoPE (no YaRN)"
        )
    return float(config.get("rope_theta", rope.get("rope_theta", 10000.0)))


def _base_args(config: dict[str, Any], moe: MoEArgs | None) -> ModelArgs:
    n_heads = int(config["num_attention_heads"])
    return ModelArgs(
        dim=int(config["hidden_size"]),
        n_layers=int(config["num_hidden_layers"]),
        n_heads=n_heads,
        n_kv_heads=int(config.get("num_key_value_heads") or n_heads),
        head_dim=int(config.get("head_dim") or int(config["hidden_size"]) // n_heads),
        hidden_dim=int(config["intermediate_size"]),
        vocab_size=int(config["vocab_size"]),
        norm_eps=float(config.get("rms_norm_eps", 1e-6)),
        rope_theta=_rope_theta(config),
        max_seq_len=int(config.get("max_position_embeddings", 32768)),
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        moe=moe,
    )


def args_from_hf_config(config: dict[str, Any]) -> ModelArgs:
    """A Hugging Face Qwen3 `config.json` (as a dict) -> `ModelArgs`, no flavor needed.

    Reads both the transformers 4 layout (`rope_theta`, `rope_scaling`) and the 5 layout
    (`rope_parameters`).

    Args:
        config: the parsed `config.json`.

    Raises:
        ModelConfigError: not a Qwen3 config, or a feature Titan's Qwen3 lacks (attention
            biases, sliding-window attention, RoPE scaling, another activation); one line with the key.
    """
    _check_supported(config, "qwen3")
    return _base_args(config, None)


def moe_args_from_hf_config(config: dict[str, Any]) -> ModelArgs:
    """A Hugging Face Qwen3-MoE `config.json` (as a dict) -> `ModelArgs` with `moe` set.

    Routing is Qwen3-MoE's (softmax over all experts, top `num_experts_per_tok`, renormalised
    when `norm_topk_prob`), balanced as the registered flavors are: no expert bias (Hugging Face's
    Qwen3-MoE has none), the auxiliary loss weighted by `router_aux_loss_coef` (0.001 by default).

    Args:
        config: the parsed `config.json`.

    Raises:
        ModelConfigError: as `args_from_hf_config`, and for dense layers among the sparse ones
            (`mlp_only_layers`, `decoder_sparse_step` > 1).
    """
    _check_supported(config, "qwen3_moe")
    if config.get("mlp_only_layers") or int(config.get("decoder_sparse_step", 1)) != 1:
        raise ModelConfigError(
            "config.json mlp_only_layers / decoder_sparse_step>1 (dense layers among the MoE ones) is not supported; "
            "Titan's Qwen3-MoE makes every layer sparse"
        )
    moe = MoEArgs(
        num_experts=int(config.get("num_experts", config.get("num_local_experts", 128))),
        top_k=int(config.get("num_experts_per_tok", 8)),
        hidden_dim=int(config["moe_intermediate_size"]),
        score_func="softmax",
        route_norm=bool(config.get("norm_topk_prob", False)),
        load_balance_coeff=None,
        aux_loss_coeff=float(config.get("router_aux_loss_coef", 1e-3)),
    )
    return _base_args(config, moe)


def hf_config_from_args(args: ModelArgs, dtype: str = "float32") -> dict[str, Any]:
    """`ModelArgs` -> a `Qwen3Config` / `Qwen3MoeConfig`-compatible `config.json` dict
    (transformers 4 layout, as on the Hub, which transformers 5 reads too).

    Args:
        args: the model's shape.
        dtype: the weights' dtype name, recorded as `torch_dtype`.
    """
    config: dict[str, Any] = {
        "architectures": ["Qwen3MoeForCausalLM" if args.moe is not None else "Qwen3ForCausalLM"],
        "model_type": "qwen3_moe" if args.moe is not None else "qwen3",
        "hidden_size": args.dim,
        "intermediate_size": args.hidden_dim,
        "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.n_kv_heads,
        "head_dim": args.head_dim,
        "vocab_size": args.vocab_size,
        "rms_norm_eps": args.norm_eps,
        "rope_theta": args.rope_theta,
        "rope_scaling": None,
        "max_position_embeddings": args.max_seq_len,
        "tie_word_embeddings": args.tie_word_embeddings,
        "hidden_act": "silu",
        "attention_bias": False,
        "use_sliding_window": False,
        "sliding_window": None,
        "torch_dtype": dtype,
    }
    if args.moe is not None:
        config.update(
            num_experts=args.moe.num_experts,
            num_experts_per_tok=args.moe.top_k,
            moe_intermediate_size=args.moe.hidden_dim,
            norm_topk_prob=args.moe.route_norm,
            router_aux_loss_coef=args.moe.aux_loss_coeff,
            decoder_sparse_step=1,
            mlp_only_layers=[],
        )
    return config


qwen3_hf_adapter: HFAdapter[ModelArgs] = HFAdapter(
    hf_architecture="Qwen3ForCausalLM",
    to_hf=to_hf_state_dict,
    from_hf=from_hf_state_dict,
    args_from_hf_config=args_from_hf_config,
    hf_config_from_args=hf_config_from_args,
)
"""The `qwen3` family's `ModelSpec.hf_adapter`."""

qwen3_moe_hf_adapter: HFAdapter[ModelArgs] = HFAdapter(
    hf_architecture="Qwen3MoeForCausalLM",
    to_hf=to_hf_state_dict,
    from_hf=from_hf_state_dict,
    args_from_hf_config=moe_args_from_hf_config,
    hf_config_from_args=hf_config_from_args,
)
"""The `qwen3_moe` family's `ModelSpec.hf_adapter`."""
