"""FP8 block-quantized Hugging Face checkpoints, dequantized as they are read.

DeepSeek-V3 / R1 and the Qwen3 `-FP8` checkpoints on the Hub store most linear weights in float8 (e4m3) with
one float32 scale per 128 x 128 block of the weight, beside it as `<name>_scale_inv`, and say so in
`config.json`:

    "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128], ...}

The dequantized weight is each block times its scale,

    W[i, j] = float(Q[i, j]) * S[i // 128, j // 128]          S: (ceil(rows / 128), ceil(cols / 128))

where a weight's last row and column blocks may be partial (DeepSeek-V3's `kv_a_proj_with_mqa`, 576 rows:
5 row blocks), as DeepSeek's own `weight_dequant` kernel reads them. The product is taken in float32,
the scales' dtype, as transformers' `Fp8Dequantize` takes it (tests/test_hf_fp8.py compares the two); a
caller casts afterwards (`titan convert --dtype`). Only the tensors with a scale are touched (the embeddings,
norms, router and output stay as stored).

Why not transformers' `Fp8Dequantize` itself: titan-ckpt does not depend on transformers, and that op derives
the block from the scale grid (`rows // scale_rows`), which refuses the partial blocks above.
"""

from __future__ import annotations

from typing import Any

import torch

from titan_ckpt.errors import CheckpointError

SCALE_SUFFIX = "_scale_inv"
"""A quantized weight `<name>` has its block scales as `<name>_scale_inv`."""
DEFAULT_BLOCK = (128, 128)
"""The block of a checkpoint whose config.json does not give `weight_block_size` (DeepSeek-V3's, Qwen3-FP8's)."""


def fp8_block_size(config: dict[str, Any] | None, source: str) -> tuple[int, int]:
    """The (rows, cols) block of an FP8 checkpoint's scales, from its config.json's `quantization_config`.

    Args:
        config: the parsed config.json (None: none was found).
        source: the checkpoint, named in errors.

    Raises:
        CheckpointError: a quantization method other than block FP8 (weights Titan cannot dequantize).
    """
    quant = (config or {}).get("quantization_config") or {}
    method = quant.get("quant_method", "fp8")
    if method != "fp8":
        raise CheckpointError(
            f"{source}: config.json's quantization_config has quant_method {method!r}; only block FP8 "
            "('fp8', with *_scale_inv tensors) is dequantized on load: use an unquantized checkpoint"
        )
    block = quant.get("weight_block_size") or DEFAULT_BLOCK
    if not isinstance(block, (list, tuple)) or len(block) != 2 or not all(isinstance(b, int) and b > 0 for b in block):
        raise CheckpointError(f"{source}: config.json's weight_block_size {block!r} is not two positive integers")
    return int(block[0]), int(block[1])


def dequantize_block(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int], name: str) -> torch.Tensor:
    """One FP8 weight `(rows, cols)` times its block scales `(ceil(rows / b0), ceil(cols / b1))`, in float32.

    Args:
        weight: the stored float8 weight.
        scale: its `_scale_inv` tensor.
        block: the (rows, cols) of a scale's block.
        name: the weight's name, for errors.

    Raises:
        CheckpointError: the scales' grid does not cover the weight by `block`.
    """
    rows, cols = weight.shape if weight.dim() == 2 else (0, 0)
    grid = (-(-rows // block[0]), -(-cols // block[1]))
    if weight.dim() != 2 or tuple(scale.shape) != grid:
        raise CheckpointError(
            f"'{name}{SCALE_SUFFIX}' has shape {tuple(scale.shape)}, but a {tuple(weight.shape)} weight in "
            f"{block[0]} x {block[1]} blocks needs {grid}; the checkpoint is damaged or its weight_block_size is wrong"
        )
    full = scale.float().repeat_interleave(block[0], dim=0)[:rows].repeat_interleave(block[1], dim=1)[:, :cols]
    return weight.float() * full


def dequantize_fp8(
    state_dict: dict[str, torch.Tensor], config: dict[str, Any] | None, source: str
) -> dict[str, torch.Tensor]:
    """`state_dict` with every weight that has a `<name>_scale_inv` dequantized to float32 and the scales
    dropped, in place (each float8 tensor freed as it is replaced); returns it. A state dict without scales, of a
    checkpoint not quantized otherwise, is returned untouched.

    Args:
        state_dict: the tensors of a Hugging Face checkpoint, as stored.
        config: its config.json (the block size), None where there is none.
        source: the checkpoint, named in errors.

    Raises:
        CheckpointError: a scale without its weight, or a quantization method other than block FP8.
    """
    scales = [name for name in state_dict if name.endswith(SCALE_SUFFIX)]
    block = fp8_block_size(config, source)  # refuses other quantization methods, scales or not
    if not scales:
        return state_dict
    for scale_name in scales:
        name = scale_name.removesuffix(SCALE_SUFFIX)
        if name not in state_dict:
            raise CheckpointError(
                f"{source}: '{scale_name}' has no weight '{name}'; pass every shard of the checkpoint"
            )
        state_dict[name] = dequantize_block(state_dict[name], state_dict.pop(scale_name), block, name)
    return state_dict


def dequantized_config(config: dict[str, Any]) -> dict[str, Any]:
    """`config` without its block-FP8 `quantization_config`: what describes the weights once dequantized."""
    quant = config.get("quantization_config") or {}
    if quant.get("quant_method", "fp8") != "fp8":
        return config
    return {key: value for key, value in config.items() if key != "quantization_config"}
