"""Llama 3 <-> Hugging Face adapter (titan-models) against transformers' LlamaForCausalLM,
single process on CPU: RoPE permutation, name map, config.json, logits parity both ways."""

import dataclasses
import json

import pytest
import torch

from titan_ckpt.hf_safetensors import INDEX_FILE, read_hf_state_dict, write_hf_checkpoint
from titan_models import get_model_spec
from titan_models.llama3 import (
    ModelArgs,
    RopeScaling,
    Transformer,
    args_from_hf_config,
    count_params,
    hf_config_from_args,
    llama3_flavors,
    llama3_hf_adapter,
)
from titan_models.llama3.hf_adapter import from_hf_state_dict, permute_from_hf, permute_to_hf, to_hf_state_dict

transformers = pytest.importorskip("transformers")
LlamaConfig, LlamaForCausalLM = transformers.LlamaConfig, transformers.LlamaForCausalLM

TOL = 1e-5  # fp32 logits; the models' logits are O(1)-O(10) with std-0.1 weights

# Meta-Llama-3.1-8B's published config.json.
LLAMA31_8B_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 128000,
    "eos_token_id": 128001,
    "hidden_act": "silu",
    "hidden_size": 4096,
    "initializer_range": 0.02,
    "intermediate_size": 14336,
    "max_position_embeddings": 131072,
    "mlp_bias": False,
    "model_type": "llama",
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "pretraining_tp": 1,
    "rms_norm_eps": 1e-05,
    "rope_scaling": {
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    },
    "rope_theta": 500000.0,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "vocab_size": 128256,
}

BASE = dict(
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=97,
    max_position_embeddings=128,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    initializer_range=0.1,
)
SMALL_SCALING = {
    "rope_type": "llama3",
    "factor": 4.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,  # head_dim 16: wavelengths 6 .. 20000, so most frequencies are scaled
}
CASES = {
    "gqa": {},
    "mha_wide_ffn": dict(num_key_value_heads=4, intermediate_size=200),
    "mqa": dict(num_key_value_heads=1),
    "tied": dict(tie_word_embeddings=True),
    "rope_scaling_llama3": dict(rope_scaling=SMALL_SCALING),
    "rope_theta": dict(rope_theta=1234.5),
    "head_dim": dict(head_dim=24, num_attention_heads=8, num_key_value_heads=4),
}


def build_hf(overrides: dict, seed: int = 0):
    torch.manual_seed(seed)
    config = LlamaConfig(**{**BASE, **overrides})
    return LlamaForCausalLM(config).eval(), config


def tokens(vocab: int, seqlen: int = 96) -> torch.Tensor:
    return torch.randint(0, vocab, (2, seqlen), generator=torch.Generator().manual_seed(1))


def randomize(model: Transformer, seed: int = 0) -> Transformer:
    """Weights of std 0.1 and norms around 1, so the logits are O(1) and a layout error shows."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1 + 0.1 * torch.randn_like(param))
            else:
                param.normal_(0, 0.1)
    return model.eval()


# ---- the RoPE permutation ------------------------------------------------------------


def test_permute_to_hf_puts_even_rows_then_odd_rows_of_each_head():
    # Meta pairs rows (0,1), (2,3), (4,5) of a head; HF rotates row i with row i + head_dim/2,
    # so head rows must come out as 0, 2, 4 (first members) then 1, 3, 5 (second members).
    w = torch.arange(12, dtype=torch.float32)[:, None].repeat(1, 3)  # 2 heads of head_dim 6, dim 3
    out = permute_to_hf(w, n_heads=2)
    assert out[:, 0].tolist() == [0, 2, 4, 1, 3, 5, 6, 8, 10, 7, 9, 11]
    assert permute_from_hf(out, n_heads=2)[:, 0].tolist() == list(range(12))


@pytest.mark.parametrize("n_heads,head_dim,dim", [(4, 16, 64), (1, 8, 64), (8, 64, 32)])
def test_permutation_round_trip_is_identity(n_heads, head_dim, dim):
    w = torch.randn(n_heads * head_dim, dim)
    assert torch.equal(permute_from_hf(permute_to_hf(w, n_heads), n_heads), w)
    assert torch.equal(permute_to_hf(permute_from_hf(w, n_heads), n_heads), w)
    if n_heads > 1:  # a real reordering, not the identity
        assert not torch.equal(permute_to_hf(w, n_heads), w)


def test_permutation_turns_meta_rope_into_hf_rotate_half():
    """Rotating permuted q by HF's rotate-half equals permuting Meta's interleaved rotation."""
    from titan_models.llama3 import apply_rotary_emb, precompute_rope_cache

    head_dim, n_heads, seqlen = 8, 2, 5
    x = torch.randn(1, seqlen, n_heads, head_dim)
    meta = apply_rotary_emb(x, precompute_rope_cache(head_dim, 16, 10000.0))
    # HF: inv_freq = theta^(-2i/d), emb = cat(freqs, freqs); x*cos + rotate_half(x)*sin
    inv = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    freqs = torch.outer(torch.arange(seqlen).float(), inv)
    cos, sin = torch.cat([freqs, freqs], -1).cos()[None, :, None], torch.cat([freqs, freqs], -1).sin()[None, :, None]

    def to_hf(t):  # per-head row order of permute_to_hf, applied to the feature axis
        return permute_to_hf(t.reshape(-1, n_heads * head_dim).T, n_heads).T.reshape(t.shape)

    xh = to_hf(x)
    rotate_half = torch.cat([-xh[..., head_dim // 2 :], xh[..., : head_dim // 2]], -1)
    torch.testing.assert_close(xh * cos + rotate_half * sin, to_hf(meta), atol=1e-6, rtol=1e-6)


# ---- names and config.json -----------------------------------------------------------


def test_name_map_both_ways():
    args = ModelArgs(dim=32, n_layers=1, n_heads=4, n_kv_heads=2, vocab_size=11, multiple_of=16)
    titan = Transformer(args).state_dict()
    hf = to_hf_state_dict(titan, args)
    assert set(hf) == {
        "model.embed_tokens.weight",
        "model.norm.weight",
        "lm_head.weight",
        *(
            f"model.layers.0.{n}.weight"
            for n in (
                "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj", "input_layernorm", "post_attention_layernorm",
            )
        ),
    }
    assert torch.equal(hf["model.layers.0.mlp.gate_proj.weight"], titan["layers.0.feed_forward.w1.weight"])
    assert torch.equal(hf["model.layers.0.mlp.down_proj.weight"], titan["layers.0.feed_forward.w2.weight"])
    assert torch.equal(hf["model.layers.0.mlp.up_proj.weight"], titan["layers.0.feed_forward.w3.weight"])
    back = from_hf_state_dict(hf, args)
    assert set(back) == set(titan) and all(torch.equal(back[k], titan[k]) for k in titan)
    with pytest.raises(ValueError, match="model.layers.0.self_attn.q_norm.weight"):
        from_hf_state_dict({"model.layers.0.self_attn.q_norm.weight": torch.ones(8)}, args)

    tied = dataclasses.replace(args, tie_word_embeddings=True)
    hf_tied = to_hf_state_dict(Transformer(tied).state_dict(), tied)
    assert "lm_head.weight" not in hf_tied  # as save_pretrained writes tied models
    back = from_hf_state_dict(hf_tied, tied)
    assert back["output.weight"] is back["tok_embeddings.weight"]


def test_args_from_llama31_8b_config_is_the_8b_flavor():
    args = args_from_hf_config(LLAMA31_8B_CONFIG)
    assert count_params(args) == 8_030_261_248  # Meta's published count
    flavor = llama3_flavors["8B"]
    assert args.ffn_hidden_dim == 14336 == flavor.ffn_hidden_dim
    for field in ("dim", "n_layers", "n_heads", "kv_heads", "vocab_size", "norm_eps", "rope_theta", "rope_scaling", "max_seq_len"):
        assert getattr(args, field) == getattr(flavor, field), field
    assert args.rope_scaling == RopeScaling(8.0, 1.0, 4.0, 8192)
    # transformers 5 writes RoPE as rope_parameters; same model.
    v5 = {k: v for k, v in LLAMA31_8B_CONFIG.items() if k not in ("rope_scaling", "rope_theta")}
    v5["rope_parameters"] = {**LLAMA31_8B_CONFIG["rope_scaling"], "rope_theta": 500000.0}
    assert args_from_hf_config(v5) == args


def test_args_from_llama32_1b_config_ties_embeddings():
    config = {
        **LLAMA31_8B_CONFIG,
        "hidden_size": 2048,
        "intermediate_size": 8192,
        "num_hidden_layers": 16,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 64,
        "tie_word_embeddings": True,
        "rope_scaling": {**LLAMA31_8B_CONFIG["rope_scaling"], "factor": 32.0},
    }
    args = args_from_hf_config(config)
    assert count_params(args) == 1_235_814_400  # Llama 3.2 1B: 128256*2048 + 16 * 60,821,504 + 2048
    assert args.tie_word_embeddings and args.rope_scaling.factor == 32.0 and args.ffn_hidden_dim == 8192


@pytest.mark.parametrize("flavor", ["debugmodel", "1B", "8B", "70B", "405B"])
def test_hf_config_round_trip(flavor):
    args = llama3_flavors[flavor]
    config = hf_config_from_args(args)
    back = args_from_hf_config(json.loads(json.dumps(config)))
    for field in ("dim", "n_layers", "n_heads", "kv_heads", "vocab_size", "ffn_hidden_dim", "attention_head_dim",
                  "norm_eps", "rope_theta", "rope_scaling", "max_seq_len", "tie_word_embeddings"):
        assert getattr(back, field) == getattr(args, field), field
    hf_config = LlamaConfig(**config)  # transformers accepts it
    assert hf_config.intermediate_size == args.ffn_hidden_dim and hf_config.num_key_value_heads == args.kv_heads


@pytest.mark.parametrize(
    "change,key",
    [
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_scaling"),
        ({"attention_bias": True}, "attention_bias"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"model_type": "mistral"}, "model_type"),
    ],
)
def test_unsupported_configs_fail_naming_the_key(change, key):
    with pytest.raises(ValueError, match=key):
        args_from_hf_config({**LLAMA31_8B_CONFIG, **change})


def test_registry_exposes_the_adapter():
    spec = get_model_spec("llama3")
    assert spec.hf_adapter is llama3_hf_adapter and spec.hf_adapter.hf_architecture == "LlamaForCausalLM"
    assert spec.hf_adapter.args_from_hf_config(LLAMA31_8B_CONFIG) == args_from_hf_config(LLAMA31_8B_CONFIG)
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.hf_adapter.hf_architecture = "MistralForCausalLM"


# ---- logits parity with transformers -------------------------------------------------


@pytest.mark.parametrize("case", list(CASES))
def test_hf_to_titan_logits_match(case):
    hf_model, config = build_hf(CASES[case])
    args = args_from_hf_config(config.to_dict())
    assert args.ffn_hidden_dim == config.intermediate_size
    titan = Transformer(args).eval()
    titan.load_state_dict(from_hf_state_dict(hf_model.state_dict(), args), strict=True)
    x = tokens(config.vocab_size)
    with torch.no_grad():
        expected, got = hf_model(x).logits, titan(x)
    assert expected.abs().max() > 1.0  # the comparison is not between near-zero logits
    assert (expected - got).abs().max().item() < TOL


def test_parity_check_is_sensitive_to_the_permutation_and_the_scaling():
    hf_model, config = build_hf(CASES["rope_scaling_llama3"])
    args = args_from_hf_config(config.to_dict())
    x = tokens(config.vocab_size)
    with torch.no_grad():
        expected = hf_model(x).logits
        state = from_hf_state_dict(hf_model.state_dict(), args)
        unpermuted = {**state, "layers.0.attention.wq.weight": hf_model.state_dict()["model.layers.0.self_attn.q_proj.weight"]}
        for variant_args, variant_state in ((args, unpermuted), (dataclasses.replace(args, rope_scaling=None), state)):
            model = Transformer(variant_args).eval()
            model.load_state_dict(variant_state)
            assert (expected - model(x)).abs().max().item() > 1e-2


@pytest.mark.parametrize("case", ["gqa", "tied", "rope_scaling_llama3", "head_dim"])
def test_titan_to_hf_files_load_in_transformers(case, tmp_path):
    args = args_from_hf_config(build_hf(CASES[case])[1].to_dict())
    titan = randomize(Transformer(args))
    write_hf_checkpoint(
        tmp_path / "hf",
        to_hf_state_dict(titan.state_dict(), args),
        hf_config_from_args(args),
        max_shard_size="40KB",
    )
    assert (tmp_path / "hf" / INDEX_FILE).is_file()  # sharded
    hf_model = LlamaForCausalLM.from_pretrained(tmp_path / "hf", local_files_only=True).eval()
    x = tokens(args.vocab_size)
    with torch.no_grad():
        expected, got = titan(x), hf_model(x).logits
    assert expected.abs().max() > 1.0
    assert (expected - got).abs().max().item() < TOL
    # and back: the files give Titan its own weights bit for bit
    back = from_hf_state_dict(read_hf_state_dict(tmp_path / "hf"), args)
    assert all(torch.equal(back[k], v) for k, v in titan.state_dict().items())
