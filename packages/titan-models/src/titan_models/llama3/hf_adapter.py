"""Llama 3 <-> Hugging Face `LlamaForCausalLM`: parameter names, the RoPE layout of
`wq`/`wk`, and `config.json`, bundled as `llama3_hf_adapter`.

Titan keeps Meta's interleaved RoPE layout (pairs `(2i, 2i+1)` of a head rotate
together); Hugging Face rotates halves (`i` with `i + head_dim/2`). The query and key
projections therefore differ by a row permutation inside each head, the one
transformers' `convert_llama_weights_to_hf.py` applies (`permute_to_hf`) and its
inverse (`permute_from_hf`). Everything else is a rename.
"""

from __future__ import annotations

import re
from typing import Any

import torch

from titan_models.errors import ModelConfigError
from titan_models.llama3.model import ModelArgs, RopeScaling
from titan_models.mup import fold_into_weights
from titan_models.spec import HFAdapter

# Titan name template -> Hugging Face name template; `{i}` is the layer index.
_LAYER_NAMES: dict[str, str] = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
_TOP_NAMES: dict[str, str] = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_HF_LAYER_NAMES = {hf: titan for titan, hf in _LAYER_NAMES.items()}
_HF_TOP_NAMES = {hf: titan for titan, hf in _TOP_NAMES.items()}
_TITAN_LAYER = re.compile(r"layers\.(\d+)\.(.+)")
_HF_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")
# Buffers some older Hugging Face checkpoints carry; they hold no learned weights.
_HF_IGNORED = re.compile(r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq")


def permute_to_hf(weight: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Reorder the rows of a query or key projection from Meta's interleaved RoPE layout
    to Hugging Face's rotate-half layout (transformers' `permute`).

    Args:
        weight: `(n_heads * head_dim, dim)` projection in Meta's layout.
        n_heads: heads of this projection (`n_kv_heads` for `wk`).

    Returns:
        `(n_heads * head_dim, dim)`: within each head, rows `0, 2, 4, ...` then `1, 3, 5, ...`.
    """
    out_dim, in_dim = weight.shape
    head_dim = out_dim // n_heads
    # (n_heads, head_dim/2, 2, dim) -> (n_heads, 2, head_dim/2, dim)
    return weight.view(n_heads, head_dim // 2, 2, in_dim).transpose(1, 2).reshape(out_dim, in_dim)


def permute_from_hf(weight: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Inverse of `permute_to_hf`: Hugging Face's rotate-half rows back to Meta's interleaved layout.

    Args:
        weight: `(n_heads * head_dim, dim)` projection in Hugging Face's layout.
        n_heads: heads of this projection (`num_key_value_heads` for `k_proj`).

    Returns:
        `(n_heads * head_dim, dim)` in Meta's layout.
    """
    out_dim, in_dim = weight.shape
    head_dim = out_dim // n_heads
    # (n_heads, 2, head_dim/2, dim) -> (n_heads, head_dim/2, 2, dim)
    return weight.view(n_heads, 2, head_dim // 2, in_dim).transpose(1, 2).reshape(out_dim, in_dim)


def to_hf_state_dict(state_dict: dict[str, torch.Tensor], args: ModelArgs) -> dict[str, torch.Tensor]:
    """Titan's full Llama 3 state dict -> `LlamaForCausalLM` names and RoPE layout.

    Args:
        state_dict: Titan names (`tok_embeddings.weight`, `layers.0.attention.wq.weight`, ...).
        args: the model's shape (head counts for the permutation, tied embeddings).

    Returns:
        Hugging Face names; `lm_head.weight` is left out when embeddings are tied, as
        `save_pretrained` does. A muP model's multipliers are folded into the weights
        (`titan_models.mup.fold_into_weights`): `LlamaForCausalLM` has none. Multi-token-prediction depths
        (layers `n_layers ..`) are left out: the architecture has none.

    Raises:
        ValueError: a name that is not a Llama 3 parameter.
    """
    if args.mup is not None:
        state_dict = fold_into_weights(
            state_dict, args.mup, dim=args.dim, head_dim=args.attention_head_dim, query_key="attention.wq.weight"
        )
    hf: dict[str, torch.Tensor] = {}
    for name, tensor in state_dict.items():
        if name == "output.weight" and args.tie_word_embeddings:
            continue
        if name in _TOP_NAMES:
            hf[_TOP_NAMES[name]] = tensor
            continue
        match = _TITAN_LAYER.fullmatch(name)
        if match is not None and int(match.group(1)) >= args.n_layers:
            continue  # a multi-token-prediction depth: LlamaForCausalLM has no place for it
        if match is None or match.group(2) not in _LAYER_NAMES:
            raise ValueError(
                f"'{name}' is not a Llama 3 parameter; pass the model's own state dict (Titan names, no prefix)"
            )
        layer, leaf = match.groups()
        if leaf == "attention.wq.weight":
            tensor = permute_to_hf(tensor, args.n_heads)
        elif leaf == "attention.wk.weight":
            tensor = permute_to_hf(tensor, args.kv_heads)
        hf[f"model.layers.{layer}.{_LAYER_NAMES[leaf]}"] = tensor
    return hf


def from_hf_state_dict(hf_state_dict: dict[str, torch.Tensor], args: ModelArgs) -> dict[str, torch.Tensor]:
    """`LlamaForCausalLM` state dict -> Titan names and Meta's RoPE layout.

    Args:
        hf_state_dict: Hugging Face names (`model.embed_tokens.weight`, ...).
        args: the model's shape (head counts for the permutation, tied embeddings).

    Returns:
        Titan names, loadable into `Transformer(args)` with `strict=True`; with tied
        embeddings `output.weight` is the embedding tensor itself. Into a muP model
        (`args.mup`) the multipliers are divided out of the weights, so it computes what the
        checkpoint does.

    Raises:
        ModelConfigError: a name that is not a `LlamaForCausalLM` parameter.
    """
    titan: dict[str, torch.Tensor] = {}
    for name, tensor in hf_state_dict.items():
        if _HF_IGNORED.fullmatch(name):
            continue
        if name in _HF_TOP_NAMES:
            titan[_HF_TOP_NAMES[name]] = tensor
            continue
        match = _HF_LAYER.fullmatch(name)
        if match is None or match.group(2) not in _HF_LAYER_NAMES:
            raise ModelConfigError(
                f"'{name}' is not a LlamaForCausalLM parameter; only Llama-architecture checkpoints convert"
            )
        layer, leaf = match.groups()
        if leaf == "self_attn.q_proj.weight":
            tensor = permute_from_hf(tensor, args.n_heads)
        elif leaf == "self_attn.k_proj.weight":
            tensor = permute_from_hf(tensor, args.kv_heads)
        titan[f"layers.{layer}.{_HF_LAYER_NAMES[leaf]}"] = tensor
    if args.tie_word_embeddings and "tok_embeddings.weight" in titan:
        titan["output.weight"] = titan["tok_embeddings.weight"]
    if args.mup is not None:
        titan = fold_into_weights(
            titan,
            args.mup,
            dim=args.dim,
            head_dim=args.attention_head_dim,
            query_key="attention.wq.weight",
            unfold=True,
        )
    return titan


def args_from_hf_config(config: dict[str, Any]) -> ModelArgs:
    """A Hugging Face Llama `config.json` (as a dict) -> `ModelArgs`, no flavor needed.

    Reads both the transformers 4 layout (`rope_theta`, `rope_scaling`) and the 5
    layout (`rope_parameters`). ModelArgs has no hidden-size field, so
    `ffn_dim_multiplier` and `multiple_of` are chosen to make `ffn_hidden_dim` equal
    `intermediate_size` exactly: `multiple_of = intermediate_size`, with a multiplier
    below 1 only when `int(8 * dim / 3)` exceeds it.

    Args:
        config: the parsed `config.json`.

    Raises:
        ModelConfigError: not a Llama architecture, or a feature Titan's Llama lacks (biases,
            another activation, a RoPE scaling other than "llama3"); one line with the key.
    """
    model_type = config.get("model_type", "llama")
    if model_type != "llama":
        raise ModelConfigError(
            f"config.json model_type '{model_type}' is not 'llama'; only Llama-architecture checkpoints convert"
        )
    for key in ("attention_bias", "mlp_bias"):
        if config.get(key, False):
            raise ModelConfigError(
                f"config.json {key}=true is not supported by Titan's Llama (no biases); use a checkpoint without biases"
            )
    if config.get("hidden_act", "silu") != "silu":
        raise ModelConfigError(
            f"config.json hidden_act '{config['hidden_act']}' is not supported; Titan's Llama uses 'silu' (SwiGLU)"
        )
    dim, n_heads = int(config["hidden_size"]), int(config["num_attention_heads"])
    head_dim = config.get("head_dim")
    hidden = int(config["intermediate_size"])
    base_hidden = int(2 * (4 * dim) / 3)
    rope: dict[str, Any] = dict(config.get("rope_parameters") or {})
    rope_theta = float(config.get("rope_theta", rope.get("rope_theta", 10000.0)))
    scaling = config.get("rope_scaling") or rope
    args = ModelArgs(
        dim=dim,
        n_layers=int(config["num_hidden_layers"]),
        n_heads=n_heads,
        n_kv_heads=int(config.get("num_key_value_heads") or n_heads),
        vocab_size=int(config["vocab_size"]),
        multiple_of=hidden,
        ffn_dim_multiplier=None if base_hidden <= hidden else hidden / base_hidden,
        norm_eps=float(config.get("rms_norm_eps", 1e-6)),
        rope_theta=rope_theta,
        rope_scaling=_rope_scaling_from_hf(scaling),
        max_seq_len=int(config.get("max_position_embeddings", 2048)),
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        head_dim=None if head_dim is None or int(head_dim) * n_heads == dim else int(head_dim),
    )
    if args.ffn_hidden_dim != hidden:  # guards the float multiplier; holds for every hidden >= 2
        raise ValueError(
            f"config.json intermediate_size={hidden} cannot be expressed by ModelArgs; report this shape as a bug"
        )
    return args


def _rope_scaling_from_hf(scaling: dict[str, Any]) -> RopeScaling | None:
    """`rope_scaling` / `rope_parameters` -> `RopeScaling` for type "llama3", None for plain RoPE."""
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type == "default":
        return None
    if rope_type != "llama3":
        raise ModelConfigError(
            f"config.json rope_scaling type '{rope_type}' is not supported; "
            "Titan's Llama knows 'llama3' scaling or none"
        )
    return RopeScaling(
        factor=float(scaling["factor"]),
        low_freq_factor=float(scaling["low_freq_factor"]),
        high_freq_factor=float(scaling["high_freq_factor"]),
        original_max_position_embeddings=int(scaling["original_max_position_embeddings"]),
    )


def hf_config_from_args(args: ModelArgs, dtype: str = "float32") -> dict[str, Any]:
    """`ModelArgs` -> a `LlamaConfig`-compatible `config.json` dict (transformers 4 layout,
    which transformers 5 reads too).

    Args:
        args: the model's shape.
        dtype: the weights' dtype name, recorded as `torch_dtype`.
    """
    scaling = args.rope_scaling
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": args.dim,
        "intermediate_size": args.ffn_hidden_dim,
        "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.kv_heads,
        "head_dim": args.attention_head_dim,
        "vocab_size": args.vocab_size,
        "rms_norm_eps": args.norm_eps,
        "rope_theta": args.rope_theta,
        "rope_scaling": None
        if scaling is None
        else {
            "rope_type": "llama3",
            "factor": scaling.factor,
            "low_freq_factor": scaling.low_freq_factor,
            "high_freq_factor": scaling.high_freq_factor,
            "original_max_position_embeddings": scaling.original_max_position_embeddings,
        },
        "max_position_embeddings": args.max_seq_len,
        "tie_word_embeddings": args.tie_word_embeddings,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": dtype,
    }


llama3_hf_adapter: HFAdapter[ModelArgs] = HFAdapter(
    hf_architecture="LlamaForCausalLM",
    to_hf=to_hf_state_dict,
    from_hf=from_hf_state_dict,
    args_from_hf_config=args_from_hf_config,
    hf_config_from_args=hf_config_from_args,
)
"""The Llama 3 family's `ModelSpec.hf_adapter`."""
