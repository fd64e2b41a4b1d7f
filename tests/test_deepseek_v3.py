"""DeepSeek-V3 (titan-models) against transformers' DeepseekV3ForCausalLM, single process on CPU, fp32:
logits parity both ways (MLA with and without low-rank q, group-limited sigmoid routing with a
nonzero correction bias, shared experts, a dense first layer, YaRN), `titan convert`
HF -> DCP -> HF, parameter counts (671B against transformers on meta) and the active count."""

import dataclasses
import json
import re

import pytest
import torch
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from titan_cli.main import app
from titan_models import get_model_spec
from titan_models.deepseek_v3 import (
    ModelArgs,
    Transformer,
    YaRN,
    args_from_hf_config,
    count_active_params,
    count_params,
    deepseek_v3_flavors,
    flops_per_token,
    hf_config_from_args,
)
from titan_models.deepseek_v3.hf_adapter import from_hf_state_dict, to_hf_state_dict
from titan_models.errors import ModelConfigError

transformers = pytest.importorskip("transformers")
DeepseekV3Config, DeepseekV3ForCausalLM = transformers.DeepseekV3Config, transformers.DeepseekV3ForCausalLM
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")

TOL = 1e-5
BASE = dict(
    vocab_size=97,
    hidden_size=48,
    intermediate_size=80,  # dense layers
    moe_intermediate_size=24,
    num_hidden_layers=3,
    first_k_dense_replace=1,
    num_attention_heads=4,
    num_key_value_heads=4,
    n_routed_experts=8,
    num_experts_per_tok=3,
    n_group=4,
    topk_group=2,
    n_shared_experts=2,
    norm_topk_prob=True,
    routed_scaling_factor=2.5,
    kv_lora_rank=16,
    qk_nope_head_dim=12,
    qk_rope_head_dim=8,
    v_head_dim=10,
    max_position_embeddings=128,
    rms_norm_eps=1e-5,
    initializer_range=0.1,
)
YARN = {  # rope dim 8: wavelengths 6 .. 6300 against 32 original positions, so the ramp is crossed
    "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 32,
    "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 0.8,  # cos/sin scale != 1
}
CASES = {
    "q_direct_yarn": dict(q_lora_rank=None, rope_parameters=YARN),
    "q_lora_plain_rope": dict(q_lora_rank=20, rope_parameters={"rope_type": "default", "rope_theta": 5000.0}, norm_topk_prob=False),
}


def hf_model(case: str, seed: int = 0) -> DeepseekV3ForCausalLM:
    """A random DeepseekV3ForCausalLM with every norm, router weight and correction bias perturbed."""
    torch.manual_seed(seed)
    model = DeepseekV3ForCausalLM(DeepseekV3Config(**{**BASE, **CASES[case]})).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "experts" in name and "shared" not in name:
                param.normal_(0.0, 0.1)  # transformers' own init leaves the fused experts at std 0.02
            if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
                param.copy_(1 + 0.1 * torch.randn_like(param))
        for layer in model.model.layers[BASE["first_k_dense_replace"] :]:
            layer.mlp.gate.e_score_correction_bias.copy_(0.3 * torch.randn(BASE["n_routed_experts"]))
    return model


def tokens(n: int = 40) -> torch.Tensor:
    return torch.randint(0, BASE["vocab_size"], (2, n), generator=torch.Generator().manual_seed(1))  # (2, n)


def test_config_round_trip_and_hf_names():
    config = DeepseekV3Config(**{**BASE, **CASES["q_direct_yarn"]}).to_dict()
    args = args_from_hf_config(config)
    assert (args.q_lora_rank, args.n_dense_layers, args.ffn_hidden_dim, args.moe.n_groups, args.moe.topk_groups) == (0, 1, 80, 4, 2)
    assert args.moe.score_func == "sigmoid" and args.moe.route_scale == 2.5 and args.moe.num_shared_experts == 2
    assert args.rope_scaling == YaRN(factor=4.0, original_max_position_embeddings=32, mscale=1.0, mscale_all_dim=0.8)
    assert args_from_hf_config(hf_config_from_args(args)) == args
    hf = DeepseekV3Config(**hf_config_from_args(args))  # transformers reads the published layout
    assert hf.rope_parameters["rope_type"] == "yarn" and hf.q_lora_rank is None
    # The softmax scale carries YaRN's mscale_all_dim squared, as transformers computes it.
    assert args.softmax_scale == pytest.approx(DeepseekV3ForCausalLM(hf).model.layers[0].self_attn.scaling, rel=1e-12)
    for bad, key in (({"rope_interleave": False}, "rope_interleave"), ({"attention_bias": True}, "attention_bias"),
                     ({"quantization_config": {"quant_method": "gptq"}}, "quant_method 'gptq'")):
        with pytest.raises(ModelConfigError, match=key):
            args_from_hf_config({**config, **bad})


@pytest.mark.parametrize("case", sorted(CASES))
def test_logits_match_transformers_both_ways(case, tmp_path):
    model_hf = hf_model(case)
    args = args_from_hf_config(model_hf.config.to_dict())
    x = tokens()
    with torch.no_grad():
        expected = model_hf(x).logits

    # HF -> Titan, from the Hub layout save_pretrained writes (one tensor per expert) ...
    model_hf.save_pretrained(tmp_path / "hf")
    hub = load_file(tmp_path / "hf" / "model.safetensors")
    assert "model.layers.1.mlp.experts.7.gate_proj.weight" in hub and "model.layers.1.mlp.gate.e_score_correction_bias" in hub
    titan = Transformer(args).eval()
    titan.load_state_dict(from_hf_state_dict(hub, args), strict=True)
    with torch.no_grad():
        torch.testing.assert_close(titan(x), expected, atol=TOL, rtol=0)
        # ... and from transformers' in-memory fused layout (experts.gate_up_proj) to the same weights.
        fused = from_hf_state_dict(model_hf.state_dict(), args)
    assert all(torch.equal(fused[k], v) for k, v in titan.state_dict().items())

    # Titan -> HF: fresh Titan weights written in the Hub layout load into transformers.
    torch.manual_seed(1)
    titan = Transformer(args).eval()
    titan.init_weights()
    with torch.no_grad():
        for layer in list(titan.layers.values())[args.n_dense_layers :]:
            layer.moe.expert_bias.normal_(0.0, 0.3)
        for name, param in titan.named_parameters():  # bigger weights than the 0.02 init, so routing is decisive
            param.mul_(5.0) if not name.endswith("norm.weight") else param.add_(0.1 * torch.randn_like(param))
    out_dir = tmp_path / "from_titan"
    out_dir.mkdir()
    save_file({k: v.contiguous() for k, v in to_hf_state_dict(titan.state_dict(), args).items()}, out_dir / "model.safetensors",
              metadata={"format": "pt"})
    (out_dir / "config.json").write_text(json.dumps(hf_config_from_args(args)))
    loaded = DeepseekV3ForCausalLM.from_pretrained(out_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        torch.testing.assert_close(loaded(x).logits, titan(x), atol=TOL, rtol=0)


def test_positions_and_pipeline_stage_contract():
    args = args_from_hf_config(hf_model("q_lora_plain_rope").config.to_dict())
    torch.manual_seed(0)
    with torch.device("meta"):
        model = Transformer(args)
    model.to_empty(device="cpu")
    model.init_weights(buffer_device="cpu")
    moe = model.layers["1"].moe
    assert moe.expert_bias.device.type == "cpu" and not moe.expert_bias.any() and torch.isfinite(model.rope_cache).all()
    x = tokens(12)
    with torch.no_grad():
        full = model(x)
        shifted = model(x, positions=torch.arange(12))
        torch.testing.assert_close(full, shifted)
        # A last stage: no embeddings, the first layer deleted, hidden states in.
        hidden = model.layers["0"](model.tok_embeddings(x), model.rope_cache)
        model.tok_embeddings = None
        del model.layers["0"]
        torch.testing.assert_close(model(hidden), full, atol=1e-6, rtol=0)
    assert model.layers["1"].feed_forward is None and model.layers["1"].moe is not None


def run_cli(*args: str):
    return CliRunner().invoke(app, ["convert", *map(str, args)])


PARITY = re.compile(r"parity: max_abs_diff=(\S+) kl=(\S+) tokens=(\d+) \(ok;")


def test_titan_convert_hf_dcp_hf_round_trip(tmp_path):
    model = hf_model("q_direct_yarn", seed=3)
    model.save_pretrained(tmp_path / "hf")
    result = run_cli(tmp_path / "hf", tmp_path / "dcp", "--to", "dcp", "--model-name", "deepseek_v3")
    assert result.exit_code == 0, result.output
    diff, kl, n = (float(v) for v in PARITY.search(result.output).groups())
    assert diff < TOL and kl < 1e-9 and n == BASE["max_position_embeddings"]
    result = run_cli(tmp_path / "dcp", tmp_path / "hf2", "--to", "hf", "--model-name", "deepseek_v3")
    assert result.exit_code == 0, result.output
    diff, kl, _ = (float(v) for v in PARITY.search(result.output).groups())
    assert diff < TOL and kl < 1e-9
    source, back = load_file(tmp_path / "hf" / "model.safetensors"), load_file(tmp_path / "hf2" / "model.safetensors")
    assert set(back) == set(source) and all(torch.equal(back[k], source[k]) for k in source)
    config = json.loads((tmp_path / "hf2" / "config.json").read_text())
    assert config["architectures"] == ["DeepseekV3ForCausalLM"] and config["num_nextn_predict_layers"] == 0


def test_mtp_layer_skipped_and_softmax_refused():
    model = hf_model("q_lora_plain_rope")
    args = args_from_hf_config(model.config.to_dict())
    hf = dict(model.state_dict())
    hf["model.layers.3.eh_proj.weight"] = torch.zeros(2, 2)  # the MTP module sits at layer num_hidden_layers
    hf["model.layers.3.mlp.experts.0.gate_proj.weight"] = torch.zeros(2, 2)
    Transformer(args).load_state_dict(from_hf_state_dict(hf, args), strict=True)
    softmax = dataclasses.replace(args, moe=dataclasses.replace(args.moe, score_func="softmax"))
    with pytest.raises(ModelConfigError, match="score_func 'softmax'"):
        to_hf_state_dict(Transformer(softmax).state_dict(), softmax)


def test_671b_param_count_matches_transformers_on_meta():
    args = deepseek_v3_flavors["671B"]
    config = DeepseekV3Config(**hf_config_from_args(args))
    with torch.device("meta"):
        hf = DeepseekV3ForCausalLM(config)
        titan = Transformer(args)
    n_hf = sum(p.numel() for p in hf.parameters())
    assert count_params(args) == n_hf == sum(p.numel() for p in titan.parameters()) == 671_026_404_352
    # Plus the 58 MoE layers' 256-entry correction biases (buffers): the published 671,026,419,200.
    assert sum(t.numel() for t in titan.state_dict().values()) == 671_026_419_200  # rope_cache is not persistent
    assert isinstance(hf.model.layers[2].mlp, type(hf.model.layers[0].mlp)) and hf.model.layers[3].mlp.gate.weight.shape == (256, 7168)
    assert get_model_spec("deepseek_v3").active_params(args) == count_active_params(args)
    for name in ("debugmodel", "16B"):
        a = deepseek_v3_flavors[name]
        with torch.device("meta"):
            assert count_params(a) == sum(p.numel() for p in Transformer(a).parameters())


def test_debugmodel_active_params_by_hand():
    a = deepseek_v3_flavors["debugmodel"]
    assert (a.dim, a.n_layers, a.n_dense_layers, a.n_heads, a.vocab_size, a.ffn_hidden_dim) == (256, 4, 1, 8, 2048, 768)
    assert (a.q_lora_rank, a.kv_lora_rank, a.qk_nope_head_dim, a.qk_rope_head_dim, a.v_head_dim) == (128, 128, 32, 16, 32)
    assert (a.moe.num_experts, a.moe.top_k, a.moe.hidden_dim, a.moe.num_shared_experts) == (8, 2, 256, 1)
    # attention: wq_a 256*128 + q_norm 128 + wq_b 128*(8*48) + wkv_a 256*(128+16) + kv_norm 128
    #            + wkv_b 128*(8*(32+32)) + wo (8*32)*256
    attention = 32768 + 128 + 49152 + 36864 + 128 + 65536 + 65536  # = 250112
    norms = 2 * 256
    dense_ffn = 3 * 256 * 768  # 589824
    router = 256 * 8
    one_expert = 3 * 256 * 256  # 196608; the shared expert has the same shape (1 x 256 hidden)
    active_moe = router + 2 * one_expert + one_expert  # top 2 routed + 1 shared
    embedding = output = 2048 * 256
    active = embedding + output + 256 + 4 * (attention + norms) + 1 * dense_ffn + 3 * active_moe
    assert active == 4_416_768 == count_active_params(a)
    assert count_params(a) == active + 3 * 6 * one_expert  # the 6 unchosen experts of each MoE layer
    # 6 * (active - embedding) + attention's 6 * layers * heads * (qk 48 + v 32) * seq_len
    assert flops_per_token(a, 64) == 6 * (active - embedding) + 6 * 4 * 8 * (48 + 32) * 64


def test_flavors_validate():
    with pytest.raises(ModelConfigError, match="n_dense_layers"):
        dataclasses.replace(deepseek_v3_flavors["debugmodel"], n_dense_layers=5)
    with pytest.raises(ModelConfigError, match="qk_rope_head_dim"):
        ModelArgs(qk_rope_head_dim=7)
