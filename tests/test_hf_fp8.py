"""Block-FP8 Hugging Face checkpoints (DeepSeek-V3's, Qwen3-FP8's) read dequantized (`titan_ckpt.hf_fp8`):
against transformers' own `Fp8Dequantize`, against the block formula by hand where the last blocks are partial,
and end to end: a DeepSeek-V3 checkpoint quantized as DeepSeek's are converts with `titan convert`, whose parity
check loads the same files in transformers (which dequantizes them itself)."""

from __future__ import annotations

import json
import re

import pytest
import torch
from safetensors.torch import load_file, save_file
from titan_ckpt import CheckpointError, read_hf_state_dict
from titan_ckpt.hf_fp8 import dequantize_block, dequantize_fp8

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")  # transformers reads FP8 checkpoints with it
from transformers.integrations.finegrained_fp8 import Fp8Dequantize  # noqa: E402

FP8_MAX = 448.0  # float8_e4m3fn's largest finite value


def quantize(weight: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """As DeepSeek's checkpoints are made: each block scaled so its largest magnitude is FP8_MAX, then cast to e4m3;
    the scale kept (`weight_scale_inv`, float32) is what the block is multiplied by to read it back."""
    rows, cols = weight.shape
    grid = (-(-rows // block[0]), -(-cols // block[1]))
    q = torch.empty(rows, cols, dtype=torch.float8_e4m3fn)
    scale = torch.empty(grid)
    for i in range(grid[0]):
        for j in range(grid[1]):
            part = weight[i * block[0]:(i + 1) * block[0], j * block[1]:(j + 1) * block[1]].float()
            scale[i, j] = part.abs().max().clamp(min=1e-12) / FP8_MAX
            q[i * block[0]:(i + 1) * block[0], j * block[1]:(j + 1) * block[1]] = (part / scale[i, j]).to(q.dtype)
    return q, scale


def test_dequantize_equals_transformers_fp8_dequantize():
    torch.manual_seed(0)
    weight = torch.randn(256, 384) * 0.05
    q, scale = quantize(weight, (128, 128))
    ours = dequantize_block(q, scale, (128, 128), "w")
    theirs = Fp8Dequantize(None)._dequantize_one(q, scale, output_dtype=torch.float32)
    assert ours.dtype == torch.float32
    torch.testing.assert_close(ours, theirs, atol=0, rtol=0)
    assert (ours - weight).abs().max() < 0.07 * weight.abs().max()  # e4m3: 3 mantissa bits, within a block's scale


def test_partial_blocks_by_hand():
    """DeepSeek-V3's kv_a_proj_with_mqa has 576 rows: 4.5 blocks of 128, so 5 rows of scales, the last block half
    full (transformers' op, which derives the block from the grid, refuses this shape)."""
    torch.manual_seed(1)
    q = (torch.randn(576, 200) * 100).to(torch.float8_e4m3fn)
    scale = torch.rand(5, 2) + 0.5
    ours = dequantize_block(q, scale, (128, 128), "kv_a")
    for i in range(576):
        for j in (0, 127, 128, 199):
            exact = q[i, j].float().item() * scale[i // 128, j // 128].item()
            assert ours[i, j].item() == pytest.approx(exact, rel=6e-8)  # one float32 product, rounded once
    with pytest.raises(ValueError):
        Fp8Dequantize(None)._dequantize_one(q, scale, output_dtype=torch.float32)


def test_bad_checkpoints_are_one_line_naming_the_tensor_or_key():
    q = torch.zeros(256, 128, dtype=torch.float8_e4m3fn)
    grid = r"'w_scale_inv' has shape \(3, 1\), but a \(256, 128\) weight in 128 x 128 blocks needs \(2, 1\)"
    with pytest.raises(CheckpointError, match=grid):
        dequantize_fp8({"w": q, "w_scale_inv": torch.ones(3, 1)}, None, "ckpt")
    with pytest.raises(CheckpointError, match="'v_scale_inv' has no weight 'v'; pass every shard"):
        dequantize_fp8({"v_scale_inv": torch.ones(1, 1)}, None, "ckpt")
    with pytest.raises(CheckpointError, match="quant_method 'gptq'; only block FP8"):
        dequantize_fp8({"w": torch.ones(2, 2)}, {"quantization_config": {"quant_method": "gptq"}}, "ckpt")
    with pytest.raises(CheckpointError, match="weight_block_size 128 is not two positive integers"):
        bad_block = {"quantization_config": {"weight_block_size": 128}}
        dequantize_fp8({"w": q, "w_scale_inv": torch.ones(2, 1)}, bad_block, "ckpt")
    plain = {"w": torch.ones(2, 2)}
    assert dequantize_fp8(plain, {}, "ckpt") is plain  # nothing quantized: untouched


BLOCK = [8, 8]  # the tiny model's widths (48, 24, 80, 88, ...) are multiples of 8: many blocks, all whole
QUANTIZED = re.compile(r"model\.layers\.\d+\.(self_attn\.\w+|mlp\.(experts\.\d+\.|shared_experts\.)?\w+)_proj\.weight")


def fp8_deepseek_v3(folder, block: list[int]) -> dict[str, torch.Tensor]:
    """A tiny DeepSeek-V3 written to `folder` as DeepSeek's checkpoints are: its attention and MLP / expert
    projections in float8 with `block` scales, `quantization_config` in config.json; returns the tensors stored."""
    from test_deepseek_v3 import hf_model

    hf_model("q_direct_yarn", seed=5).save_pretrained(folder)
    stored = load_file(folder / "model.safetensors")
    quantized = {}
    for name in sorted(stored):
        if QUANTIZED.fullmatch(name):  # the linears DeepSeek quantizes: not the router, norms, embedding, output
            quantized[name], quantized[f"{name}_scale_inv"] = quantize(stored[name], tuple(block))
        else:
            quantized[name] = stored[name]
    assert sum(t.dtype == torch.float8_e4m3fn for t in quantized.values()) > 40
    save_file(quantized, folder / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                     "weight_block_size": block}  # fmt: skip
    (folder / "config.json").write_text(json.dumps(config))
    return quantized


def test_a_deepseek_v3_fp8_checkpoint_converts_with_transformers_parity(tmp_path):
    from test_deepseek_v3 import BASE, PARITY, TOL, run_cli

    fp8 = tmp_path / "fp8"
    quantized = fp8_deepseek_v3(fp8, BLOCK)
    read = read_hf_state_dict(fp8)
    assert not any(name.endswith("_scale_inv") for name in read)
    op = Fp8Dequantize(None)
    for name, tensor in quantized.items():
        if tensor.dtype == torch.float8_e4m3fn:
            expected = op._dequantize_one(tensor, quantized[f"{name}_scale_inv"], output_dtype=torch.float32)
            assert torch.equal(read[name], expected), name
        elif not name.endswith("_scale_inv"):
            assert torch.equal(read[name], tensor), name

    # titan convert's parity check loads the FP8 files in transformers, which dequantizes them its own way
    result = run_cli(fp8, tmp_path / "dcp", "--to", "dcp", "--model-name", "deepseek_v3")
    assert result.exit_code == 0, result.output
    diff, kl, n = (float(v) for v in PARITY.search(result.output).groups())
    assert diff < TOL and kl < 1e-9 and n == BASE["max_position_embeddings"]
    written = json.loads((tmp_path / "dcp" / "config.json").read_text())
    assert "quantization_config" not in written and written["architectures"] == ["DeepseekV3ForCausalLM"]
    # and back out as an unquantized Hugging Face checkpoint that transformers reads as it is
    result = run_cli(tmp_path / "dcp", tmp_path / "hf", "--to", "hf", "--model-name", "deepseek_v3")
    assert result.exit_code == 0 and PARITY.search(result.output), result.output
    back = load_file(tmp_path / "hf" / "model.safetensors")
    assert set(back) == {name for name in quantized if not name.endswith("_scale_inv")}
    assert all(torch.equal(back[name], read[name]) for name in back)


def test_partial_blocks_convert_and_the_parity_check_says_why_it_was_skipped(tmp_path):
    """16 x 16 blocks leave partial ones (24- and 88-wide weights), which transformers' FP8 op refuses: the
    conversion is written from Titan's reading (checked by hand above) and the parity line says why it did not run."""
    from test_deepseek_v3 import run_cli

    fp8 = tmp_path / "fp8"
    fp8_deepseek_v3(fp8, [16, 16])
    result = run_cli(fp8, tmp_path / "dcp", "--to", "dcp", "--model-name", "deepseek_v3")
    assert result.exit_code == 0, result.output
    assert "parity: skipped (transformers could not dequantize these FP8 weights: " in result.output
    from titan_ckpt.dcp_files import read_dcp_state_dict, read_dcp_tensor_shapes
    from titan_models import get_model_spec
    from titan_models.deepseek_v3.hf_adapter import args_from_hf_config

    args = args_from_hf_config(json.loads((fp8 / "config.json").read_text()))
    expected = get_model_spec("deepseek_v3").hf_adapter.from_hf(read_hf_state_dict(fp8), args)
    assert set(read_dcp_tensor_shapes(tmp_path / "dcp")) == set(expected)
    written = read_dcp_state_dict(tmp_path / "dcp", list(expected))
    assert all(torch.equal(written[k], expected[k]) for k in expected)
