"""Load a model to generate with: from a Titan run or DCP step, or a Hugging Face folder.

The readers are `titan_core.convert`'s (format detection, shape resolution, DCP /
safetensors reading with the family's `HFAdapter`); this file only decides which
checkpoint and family to read, and builds the model the Titan way: on meta, cast,
`to_empty`, `init_weights(buffer_device=...)` for the buffers (the RoPE table), then
`load_state_dict(strict=True)`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from titan_ckpt.dtypes import DTYPES, parse_dtype
from titan_ckpt.formats import detect_format
from titan_core.config.errors import ConfigError
from titan_core.model_source import (
    check_state_dict,
    expected_shapes,
    infer_model_name,
    load_titan_state_dict,
    resolve_checkpoint,
    resolve_source_args,
)
from titan_models import ModelSpec, get_model_spec


@dataclass(frozen=True)
class LoadedModel:
    """A model ready to generate, and where it came from.

    Args:
        model: the model in eval mode, no gradients, on `device` in `dtype`.
        spec: its family (the plan names the attention core the KV cache replaces).
        args: its shape.
        checkpoint: the checkpoint folder or file read (a run folder resolves to its newest step).
        checkpoint_format: "dcp", "hf" or "torch".
        device: where it runs.
        dtype: its parameters' dtype.
        dtype_reason: why that dtype ("asked for", or the rule `--dtype auto` applied).
    """

    model: nn.Module
    spec: ModelSpec[Any]
    args: Any
    checkpoint: Path
    checkpoint_format: str
    device: torch.device
    dtype: torch.dtype
    dtype_reason: str = "asked for"


def load_model(
    source: str,
    model_name: str | None = None,
    flavor: str | None = None,
    device: str | None = None,
    dtype: str = "auto",
    keep_mtp: bool = False,
) -> LoadedModel:
    """Build a family's model and load a checkpoint's weights into it.

    Args:
        source: a run folder (its newest complete step is read), its checkpoint folder, a
            `step-N` DCP folder, a Hugging Face folder or Hub repo id, or a torch state-dict file.
        model_name: the family; None infers it (`titan_core.model_source.infer_model_name`): from
            config.json's `architectures`, else the run's config.toml, else Llama 3.
        flavor: named shape of a DCP/torch source (else from config.json beside it or the run's config.toml).
        device: "cpu", "cuda", "cuda:1", ...; None picks cuda when available.
        dtype: "auto" (`resolve_dtype`), "float32" or "bfloat16" (or "float16") for the parameters.
        keep_mtp: also load the multi-token-prediction depths the checkpoint has (speculative decoding); by
            default they are left out, as plain decoding never runs them.

    Raises:
        ConfigError / CheckpointError / ModelConfigError: bad input, one line naming it and the fix.
    """
    target = resolve_device(device)
    param_dtype, dtype_reason = resolve_dtype(dtype, target)
    checkpoint = resolve_checkpoint(source)
    fmt = detect_format(checkpoint)
    name = model_name or infer_model_name(checkpoint, fmt)
    spec = get_model_spec(name)
    if fmt == "hf" and spec.hf_adapter is None:
        raise ConfigError(
            f"model.name '{name}' has no Hugging Face adapter, so {checkpoint} cannot be read; pass --model-name"
        )
    args, _, _ = resolve_source_args(checkpoint, fmt, spec.hf_adapter, name, flavor)
    if getattr(args, "n_mtp_layers", 0) and not keep_mtp:  # plain decoding never runs the depths: not loaded
        args = dataclasses.replace(args, n_mtp_layers=0)
    expected = expected_shapes(spec.build, args)
    state_dict = load_titan_state_dict(checkpoint, fmt, args, spec.hf_adapter, expected)
    check_state_dict(state_dict, expected, checkpoint)
    model = build_empty(spec, args, target, param_dtype)
    model.load_state_dict(state_dict, strict=True)  # copies, casting to each parameter's dtype
    model.eval().requires_grad_(False)
    return LoadedModel(model, spec, args, checkpoint, fmt, target, param_dtype, dtype_reason)


def build_empty(spec: ModelSpec[Any], args: Any, device: torch.device, dtype: torch.dtype) -> nn.Module:
    """The family's model on `device`: built on meta, parameters cast to `dtype`, materialised,
    buffers computed by `init_weights` (which also fills the parameters, soon overwritten).

    Buffers keep the dtype the model gives them (the RoPE table stays float32).
    """
    with torch.device("meta"):
        model = spec.build(args)
    for param in model.parameters():  # unique parameters: a tied weight stays one tensor
        param.data = param.data.to(dtype)
    model.to_empty(device=device)
    # every family's model has `init_weights`; nn.Module.__getattr__ is typed Tensor | Module
    model.init_weights(buffer_device=device)  # type: ignore[operator]
    return model


def resolve_device(device: str | None) -> torch.device:
    """`device`, or cuda when available else cpu.

    Raises:
        ConfigError: an unknown device name, or cuda without a GPU.
    """
    if device is None or device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        target = torch.device(device)
    except RuntimeError:
        raise ConfigError(f"--device '{device}' is not a device; pass cpu, cuda or cuda:N") from None
    if target.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"--device {device}: no CUDA GPU is available here; pass --device cpu")
    return target


def resolve_dtype(dtype: str, device: torch.device) -> tuple[torch.dtype, str]:
    """The parameter dtype for `--dtype`, and why.

    "auto" is bfloat16 on a CUDA GPU with native bf16 (`torch.cuda.is_bf16_supported`, emulation
    not counted: Ampere and newer), else float32 (CPU, older GPUs); a named dtype is kept.

    Args:
        dtype: "auto", or a name `titan_ckpt.dtypes.parse_dtype` knows ("float32", "bfloat16", "float16").
        device: where the model runs.

    Raises:
        ConfigError: an unknown name.
    """
    if dtype != "auto":
        if dtype not in DTYPES:
            raise ConfigError(f"--dtype {dtype} is not a dtype; pass auto, float32 or bfloat16")
        return parse_dtype(dtype), "asked for"
    if device.type != "cuda":
        return torch.float32, f"auto: float32 on {device.type}"
    if torch.cuda.is_bf16_supported(including_emulation=False):  # asks the current GPU
        return torch.bfloat16, "auto: bfloat16 on CUDA"
    return torch.float32, "auto: this GPU has no native bfloat16"


def resolve_compile(compile: bool | None, device: torch.device) -> tuple[bool, str]:
    """Whether to compile the decode step (`--compile/--no-compile`), and why.

    The default compiles on CUDA (CUDA graphs take the kernel launches off a step that is
    otherwise bound by them) and not on CPU, where Inductor's C++ build takes longer than a
    short generation saves.

    Args:
        compile: the option; None for the default.
        device: where the model runs.
    """
    if compile is not None:
        return compile, "asked for"
    if device.type == "cuda":
        return True, "default on CUDA"
    return False, f"default off on {device.type}"


def resolve_tuning(tune: bool | None, device: torch.device, compiled: bool) -> tuple[bool, str]:
    """Whether to tune the compiled decode step's kernels (`--tune/--no-tune`), and why.

    The default tunes on CUDA (Inductor's coordinate-descent tuning, `static_decode.CUDA_TUNING`): the
    1B decodes ~25% faster on an H100 for a first compile of ~60 s instead of ~20 s, and Inductor caches the
    tuned kernels for the next run. Nothing to tune without compiling, or on CPU.

    Args:
        tune: the option; None for the default.
        device: where the model runs.
        compiled: whether the decode step is compiled.
    """
    if not compiled:
        return False, "not compiled"
    if tune is not None:
        return tune, "asked for"
    if device.type == "cuda":
        return True, "default on CUDA"
    return False, f"default off on {device.type}"
