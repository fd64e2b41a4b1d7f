"""Qwen3 and Qwen3-MoE (titan-models) against transformers' Qwen3ForCausalLM / Qwen3MoeForCausalLM,
single process on CPU, float32: logits parity both ways, config.json both ways, parameter counts of
the published shapes (from transformers' own models built on meta), and `titan convert` choosing
the family from config.json with its round trip HF -> DCP -> HF."""

import dataclasses
import json
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from typer.testing import CliRunner

from titan_ckpt.hf_safetensors import read_hf_state_dict, write_hf_checkpoint
from titan_cli.main import app
from titan_models import ModelConfigError, get_model_spec
from titan_models.qwen3 import (
    ModelArgs,
    Transformer,
    args_from_hf_config,
    count_active_params,
    count_params,
    flops_per_token,
    hf_config_from_args,
    moe_args_from_hf_config,
    qwen3_flavors,
    qwen3_moe_flavors,
)
from titan_models.qwen3.hf_adapter import from_hf_state_dict, to_hf_state_dict

transformers = pytest.importorskip("transformers")
Qwen3Config, Qwen3ForCausalLM = transformers.Qwen3Config, transformers.Qwen3ForCausalLM
Qwen3MoeConfig, Qwen3MoeForCausalLM = transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")  # convert's DCP writes

TOL = 1e-5  # fp32 logits; O(1)-O(10) with std-0.1 weights
PARITY = re.compile(r"parity: max_abs_diff=(\S+) kl=(\S+) tokens=(\d+) \(ok;")

BASE = dict(
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=24,  # != hidden_size / heads, as in the published models
    vocab_size=97,
    max_position_embeddings=128,
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
    initializer_range=0.1,
)
MOE = dict(moe_intermediate_size=32, num_experts=6, num_experts_per_tok=2, norm_topk_prob=True)
CASES = {
    "gqa": {},
    "tied": dict(tie_word_embeddings=True),
    "mha_theta_1e6": dict(num_key_value_heads=4, rope_theta=1e6, head_dim=16),
    "mqa": dict(num_key_value_heads=1),
}
MOE_CASES = {"norm_topk": {}, "no_norm_tied": dict(norm_topk_prob=False, tie_word_embeddings=True, num_experts_per_tok=3)}

# Qwen3-8B's and Qwen3-30B-A3B's published config.json (transformers 4.51 layout).
QWEN3_8B_CONFIG = {
    "architectures": ["Qwen3ForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 4096,
    "initializer_range": 0.02,
    "intermediate_size": 12288,
    "max_position_embeddings": 40960,
    "max_window_layers": 36,
    "model_type": "qwen3",
    "num_attention_heads": 32,
    "num_hidden_layers": 36,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-06,
    "rope_scaling": None,
    "rope_theta": 1000000,
    "sliding_window": None,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "use_cache": True,
    "use_sliding_window": False,
    "vocab_size": 151936,
}
QWEN3_30B_A3B_CONFIG = {
    **QWEN3_8B_CONFIG,
    "architectures": ["Qwen3MoeForCausalLM"],
    "model_type": "qwen3_moe",
    "decoder_sparse_step": 1,
    "hidden_size": 2048,
    "intermediate_size": 6144,
    "max_window_layers": 48,
    "mlp_only_layers": [],
    "moe_intermediate_size": 768,
    "norm_topk_prob": True,
    "num_attention_heads": 32,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "num_hidden_layers": 48,
    "num_key_value_heads": 4,
    "output_router_logits": False,
    "router_aux_loss_coef": 0.001,
}


def randomize_hf(model):
    """Norm weights around 1 (transformers initialises them to ones), so a QK-norm mix-up shows."""
    torch.manual_seed(1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.copy_(1 + 0.1 * torch.randn_like(param))
    return model.eval()


def build_hf(overrides: dict, moe: bool = False, seed: int = 0):
    torch.manual_seed(seed)
    if moe:
        return randomize_hf(Qwen3MoeForCausalLM(Qwen3MoeConfig(**{**BASE, **MOE, **overrides})))
    return randomize_hf(Qwen3ForCausalLM(Qwen3Config(**{**BASE, **overrides})))


def randomize(model: Transformer, seed: int = 0) -> Transformer:
    """Weights of std 0.1 and norms around 1, so the logits are O(1) and a layout error shows."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(1 + 0.1 * torch.randn_like(param) if "norm" in name else 0.1 * torch.randn_like(param))
    return model.eval()


def tokens(vocab: int, seqlen: int = 64) -> torch.Tensor:
    return torch.randint(0, vocab, (2, seqlen), generator=torch.Generator().manual_seed(2))


def titan_from_hf(hf_model, hf_state_dict=None) -> Transformer:
    config = hf_model.config.to_dict()
    moe = "num_experts" in config or "num_local_experts" in config
    args = (moe_args_from_hf_config if moe else args_from_hf_config)(config)
    model = Transformer(args)
    model.load_state_dict(from_hf_state_dict(hf_state_dict or hf_model.state_dict(), args), strict=True)
    return model.eval()


def run_cli(*args):
    return CliRunner().invoke(app, ["convert", *map(str, args)])


def hf_files(folder: Path) -> dict[str, torch.Tensor]:
    out = {}
    for path in folder.glob("*.safetensors"):
        out.update(load_file(path))
    return out


# ---- logits parity, dense ------------------------------------------------------------------


@pytest.mark.parametrize("case", sorted(CASES))
def test_hf_to_titan_logits_match(case):
    hf_model = build_hf(CASES[case])
    model = titan_from_hf(hf_model)
    x = tokens(hf_model.config.vocab_size)
    with torch.no_grad():
        expected, got = hf_model(x).logits, model(x)
    assert expected.abs().max() > 1.0  # non-trivial logits
    torch.testing.assert_close(got, expected, atol=TOL, rtol=0)
    assert model.args.tie_word_embeddings == (case == "tied")
    assert (model.output.weight is model.tok_embeddings.weight) == (case == "tied")


@pytest.mark.parametrize("case", sorted(CASES))
def test_titan_to_hf_files_load_in_transformers(case, tmp_path):
    args = args_from_hf_config(Qwen3Config(**{**BASE, **CASES[case]}).to_dict())
    model = randomize(Transformer(args))
    write_hf_checkpoint(tmp_path, to_hf_state_dict(model.state_dict(), args), hf_config_from_args(args), "40KB")
    hf_model = Qwen3ForCausalLM.from_pretrained(tmp_path, local_files_only=True).eval()
    assert ("lm_head.weight" in hf_files(tmp_path)) == (case != "tied")
    x = tokens(args.vocab_size)
    with torch.no_grad():
        torch.testing.assert_close(hf_model(x).logits, model(x), atol=TOL, rtol=0)


def test_positions_match_hf_position_ids():
    # The KV cache of `titan generate` and context parallel pass positions; (bs, seqlen) and (seqlen,).
    hf_model = build_hf({})
    model = titan_from_hf(hf_model)
    x = tokens(97, seqlen=8)
    per_row = torch.tensor([[5 + i for i in range(8)], [40 + i for i in range(8)]])
    with torch.no_grad():
        expected = hf_model(x, position_ids=per_row).logits
        torch.testing.assert_close(model(x, positions=per_row), expected, atol=TOL, rtol=0)
        torch.testing.assert_close(model(x, positions=per_row[0]), hf_model(x, position_ids=per_row[:1]).logits, atol=TOL, rtol=0)


def test_parity_is_sensitive_to_qk_norm_and_rope_layout():
    hf_model = build_hf({})
    model = titan_from_hf(hf_model)
    x = tokens(97)
    with torch.no_grad():
        expected = hf_model(x).logits
        model.layers["0"].attention.q_norm.weight.fill_(1.0)  # what dropping q_norm would load
        assert (model(x) - expected).abs().max() > 1e-2
        swapped = titan_from_hf(hf_model)
        wk = swapped.layers["0"].attention.wk.weight  # interleave one head's halves: a RoPE layout slip
        wk.copy_(wk.view(2, 2, 12, 64).transpose(1, 2).reshape(48, 64))
        assert (swapped(x) - expected).abs().max() > 1e-2


# ---- logits parity, Mixture-of-Experts ----------------------------------------------------------


@pytest.mark.parametrize("case", sorted(MOE_CASES))
def test_moe_hf_to_titan_logits_match_fused_and_saved_layouts(case, tmp_path):
    hf_model = build_hf(MOE_CASES[case], moe=True)
    x = tokens(97)
    with torch.no_grad():
        expected = hf_model(x).logits
        # transformers 5 keeps experts fused in memory (`mlp.experts.gate_up_proj`) ...
        assert "model.layers.0.mlp.experts.gate_up_proj" in hf_model.state_dict()
        torch.testing.assert_close(titan_from_hf(hf_model)(x), expected, atol=TOL, rtol=0)
        # ... and save_pretrained writes the Hub's per-expert layout.
        hf_model.save_pretrained(tmp_path)
        saved = read_hf_state_dict(tmp_path)
        assert "model.layers.1.mlp.experts.5.gate_proj.weight" in saved
        model = titan_from_hf(hf_model, saved)
        torch.testing.assert_close(model(x), expected, atol=TOL, rtol=0)
    # The per-expert names are exactly what to_hf writes back.
    back = to_hf_state_dict(model.state_dict(), model.args)
    assert set(back) == set(saved) and all(torch.equal(back[k], saved[k]) for k in saved)
    assert model.args.moe.route_norm == (case == "norm_topk") and model.args.moe.top_k == hf_model.config.num_experts_per_tok


def test_moe_titan_to_hf_files_load_in_transformers(tmp_path):
    args = moe_args_from_hf_config(Qwen3MoeConfig(**{**BASE, **MOE}).to_dict())
    model = randomize(Transformer(args))
    write_hf_checkpoint(tmp_path, to_hf_state_dict(model.state_dict(), args), hf_config_from_args(args), "40KB")
    hf_model = Qwen3MoeForCausalLM.from_pretrained(tmp_path, local_files_only=True).eval()
    x = tokens(args.vocab_size)
    with torch.no_grad():
        expected = model(x)
        torch.testing.assert_close(hf_model(x).logits, expected, atol=TOL, rtol=0)
        # Routing matters: swapping two experts of one layer changes the logits.
        w1 = model.layers["0"].moe.experts.w1
        w1.copy_(w1[[1, 0, 2, 3, 4, 5]])
        assert (model(x) - expected).abs().max() > 1e-3


def test_moe_to_hf_refuses_an_expert_bias():
    args = qwen3_moe_flavors["debugmodel_moe"]
    with torch.device("meta"):
        state = Transformer(dataclasses.replace(args, n_layers=1)).state_dict()
    state = {k: torch.zeros(v.shape) for k, v in state.items()}
    assert not any("expert_bias" in k for k in to_hf_state_dict(state, args))
    state["layers.0.moe.expert_bias"][3] = 0.5
    with pytest.raises(ModelConfigError, match=r"^'layers.0.moe.expert_bias' is non-zero .*load_balance_coeff=None to export to Hugging Face$"):
        to_hf_state_dict(state, args)


def test_moe_from_hf_names_a_missing_expert():
    hf_model = build_hf({}, moe=True)
    args = moe_args_from_hf_config(hf_model.config.to_dict())
    state = to_hf_state_dict(titan_from_hf(hf_model).state_dict(), args)
    del state["model.layers.1.mlp.experts.4.up_proj.weight"]
    with pytest.raises(ModelConfigError, match=r"^layer 1 lacks mlp.experts.4.up_proj.weight;"):
        from_hf_state_dict(state, args)
    with pytest.raises(ModelConfigError, match=r"--model-name qwen3_moe$"):
        from_hf_state_dict(state, dataclasses.replace(args, moe=None))


# ---- config.json ------------------------------------------------------------------------------


def test_published_configs_give_the_flavors_in_both_rope_layouts():
    assert args_from_hf_config(QWEN3_8B_CONFIG) == qwen3_flavors["8B"]
    assert moe_args_from_hf_config(QWEN3_30B_A3B_CONFIG) == qwen3_moe_flavors["30B-A3B"]
    # transformers 5 writes rope_parameters instead of rope_theta / rope_scaling.
    v5 = {k: v for k, v in QWEN3_8B_CONFIG.items() if k not in ("rope_theta", "rope_scaling")}
    v5["rope_parameters"] = {"rope_theta": 1000000.0, "rope_type": "default"}
    assert args_from_hf_config(v5) == qwen3_flavors["8B"]
    saved = Qwen3MoeConfig(**{**BASE, **MOE}).to_dict()  # transformers 5: num_local_experts, rope_parameters
    assert moe_args_from_hf_config(saved).moe.num_experts == 6


@pytest.mark.parametrize("name", ["qwen3", "qwen3_moe"])
def test_hf_config_round_trip_every_flavor(name):
    spec = get_model_spec(name)
    for flavor, args in spec.flavors.items():
        config = hf_config_from_args(args, "bfloat16")
        assert spec.hf_adapter.args_from_hf_config(json.loads(json.dumps(config))) == args, flavor
        assert config["architectures"] == [spec.hf_adapter.hf_architecture]


@pytest.mark.parametrize(
    "change, pattern",
    [
        (dict(attention_bias=True), r"^config.json attention_bias=true is not supported"),
        (dict(use_sliding_window=True, sliding_window=4096), r"^config.json use_sliding_window=true is not supported"),
        (dict(rope_scaling={"rope_type": "yarn", "factor": 4.0}), r"^config.json rope_scaling type 'yarn' is not supported"),
        (dict(hidden_act="gelu"), r"^config.json hidden_act 'gelu' is not supported"),
        (dict(model_type="qwen3_moe"), r"^config.json model_type 'qwen3_moe' is not 'qwen3'; convert it with --model-name qwen3_moe$"),
        (dict(model_type="llama"), r"^config.json model_type 'llama' is not 'qwen3'; only Qwen3 checkpoints convert$"),
    ],
)
def test_unsupported_configs_fail_in_one_line(change, pattern):
    with pytest.raises(ModelConfigError, match=pattern) as err:
        args_from_hf_config({**QWEN3_8B_CONFIG, **change})
    assert "\n" not in str(err.value)


def test_unsupported_moe_configs_fail_in_one_line():
    with pytest.raises(ModelConfigError, match=r"^config.json mlp_only_layers / decoder_sparse_step>1 .* every layer sparse$"):
        moe_args_from_hf_config({**QWEN3_30B_A3B_CONFIG, "mlp_only_layers": [0]})
    with pytest.raises(ModelConfigError, match=r"decoder_sparse_step"):
        moe_args_from_hf_config({**QWEN3_30B_A3B_CONFIG, "decoder_sparse_step": 2})


# ---- parameter and FLOP counts ------------------------------------------------------------------


def hf_param_count(args: ModelArgs) -> int:
    """Parameters of transformers' own model for this shape, built on meta (a tied weight once)."""
    config = hf_config_from_args(args)
    with torch.device("meta"):
        model = (Qwen3MoeForCausalLM(Qwen3MoeConfig(**config)) if args.moe else Qwen3ForCausalLM(Qwen3Config(**config)))
    return sum(p.numel() for p in model.parameters())  # parameters() yields a tied weight once


PUBLISHED_TOTALS = {
    "0.6B": 596_049_920,
    "1.7B": 1_720_574_976,
    "4B": 4_022_468_096,
    "8B": 8_190_735_360,
    "14B": 14_768_307_200,
    "32B": 32_762_123_264,
    "30B-A3B": 30_532_122_624,
    "235B-A22B": 235_093_634_560,
}


@pytest.mark.parametrize("flavor", sorted(PUBLISHED_TOTALS))
def test_published_flavors_match_transformers_parameter_counts(flavor):
    args = {**qwen3_flavors, **qwen3_moe_flavors}[flavor]
    assert count_params(args) == hf_param_count(args) == PUBLISHED_TOTALS[flavor]


def test_active_params_and_flops():
    dense, moe = qwen3_flavors["8B"], qwen3_moe_flavors["30B-A3B"]
    assert count_active_params(dense) == count_params(dense)
    # 30B-A3B: a token skips 120 of 128 experts in each of 48 layers (3 x 2048 x 768 each).
    assert count_active_params(moe) == 30_532_122_624 - 48 * 120 * 3 * 2048 * 768 == 3_353_032_704
    assert get_model_spec("qwen3_moe").active_params(moe) == 3_353_032_704
    embedding = 151936 * 2048
    attention = 12 * 48 * 32 * 128 * 4096
    assert flops_per_token(moe, 4096) == 6 * (3_353_032_704 - embedding) + attention
    tied = qwen3_flavors["0.6B"]  # the tied weight is also the output matmul
    assert flops_per_token(tied, 1024) == 6 * count_params(tied) + 12 * 28 * 16 * 128 * 1024
    with torch.device("meta"):
        for args in (qwen3_flavors["debugmodel"], qwen3_moe_flavors["debugmodel_moe"]):
            assert sum(p.numel() for p in Transformer(args).parameters()) == count_params(args)


# ---- model mechanics -----------------------------------------------------------------------------


def test_meta_init_ties_and_initialises_every_tensor():
    for args in (
        dataclasses.replace(qwen3_flavors["debugmodel"], n_layers=2, tie_word_embeddings=True),
        dataclasses.replace(qwen3_moe_flavors["debugmodel_moe"], n_layers=2),
    ):
        with torch.device("meta"):
            model = Transformer(args)
        model.to_empty(device="cpu")
        torch.manual_seed(0)
        model.init_weights(buffer_device="cpu")
        state = model.state_dict()
        assert all(torch.isfinite(t).all() for t in state.values())
        assert torch.equal(state["layers.1.attention.q_norm.weight"], torch.ones(args.head_dim))
        if args.moe is None:
            assert model.output.weight is model.tok_embeddings.weight
        else:
            assert torch.equal(state["layers.0.moe.expert_bias"], torch.zeros(8))
            assert 0.01 < state["layers.0.moe.experts.w1"].std() < 0.03
        logits = model(torch.randint(0, args.vocab_size, (2, 16)))
        assert logits.shape == (2, 16, args.vocab_size) and torch.isfinite(logits).all()


def test_pipeline_stage_forward_without_embedding_and_output():
    model = titan_from_hf(build_hf({}))
    x = tokens(97, seqlen=16)
    with torch.no_grad():
        full = model(x)
        hidden = model.tok_embeddings(x)
        model.tok_embeddings, norm, output = None, model.norm, model.output
        model.norm = model.output = None
        out = model(hidden)
        assert out.shape == (2, 16, 64)
        torch.testing.assert_close(output(norm(out)), full, atol=TOL, rtol=0)


# ---- titan convert ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def qwen3_source(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("qwen3") / "hf"
    build_hf(dict(tie_word_embeddings=True)).save_pretrained(folder, max_shard_size="40KB")
    (folder / "tokenizer_config.json").write_text('{"eos_token": "<|im_end|>"}')
    return folder


def parity_ok(output: str) -> bool:
    match = PARITY.search(output)
    assert match, output
    return float(match.group(1)) < TOL and float(match.group(2)) < 1e-9


@pytest.mark.parametrize("moe", [False, True])
def test_convert_picks_the_family_and_round_trips(moe, qwen3_source, tmp_path):
    if moe:
        source = tmp_path / "moe_hf"
        build_hf({}, moe=True).save_pretrained(source)
    else:
        source = qwen3_source
    family = "qwen3_moe" if moe else "qwen3"
    # HF -> DCP, no --model-name: the family comes from config.json's architectures.
    result = run_cli(source, tmp_path / "dcp", "--to", "dcp")
    assert result.exit_code == 0, result.output
    assert f"model family {family}" in result.stderr and parity_ok(result.output)
    # DCP -> HF, again without --model-name: the config.json beside the DCP files names it.
    result = run_cli(tmp_path / "dcp", tmp_path / "hf2", "--to", "hf", "--max-shard-size", "40KB")
    assert result.exit_code == 0, result.output
    assert parity_ok(result.output)  # transformers' Qwen3(Moe)ForCausalLM.from_pretrained on the written files
    source_files, back = hf_files(source), hf_files(tmp_path / "hf2")
    assert set(back) == set(source_files) and all(torch.equal(back[k], source_files[k]) for k in source_files)
    config = json.loads((tmp_path / "hf2" / "config.json").read_text())
    assert config["architectures"] == [f"Qwen3{'Moe' if moe else ''}ForCausalLM"]


def test_convert_explicit_model_name_and_unknown_architecture(qwen3_source, tmp_path):
    result = run_cli(qwen3_source, tmp_path / "dcp", "--to", "dcp", "--model-name", "qwen3", "--no-parity-check")
    assert result.exit_code == 0, result.output
    assert (tmp_path / "dcp" / "tokenizer_config.json").is_file()
    wrong = run_cli(qwen3_source, tmp_path / "never", "--to", "dcp", "--model-name", "llama3")
    assert wrong.exit_code == 2 and "model_type 'qwen3' is not 'llama'" in wrong.stderr
    other = tmp_path / "gpt2"
    other.mkdir()
    (other / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}))
    (other / "model.safetensors").write_bytes(b"")
    result = run_cli(other, tmp_path / "never", "--to", "dcp")
    assert result.exit_code == 2
    line = result.stderr.strip()
    assert "\n" not in line and "['GPT2LMHeadModel'] names no Titan model family" in line
    assert all(arch in line for arch in ("LlamaForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM"))
    assert not (tmp_path / "never").exists()
