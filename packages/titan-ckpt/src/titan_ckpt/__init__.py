"""titan-ckpt: checkpoints for any PyTorch model, with torch.distributed.checkpoint (DCP).

- `CheckpointManager`: periodic, atomic (`step-N.tmp` renamed to `step-N`), verified
  (a manifest of sizes and CRC-32), optionally async saves of the model, optimizer, RNG
  and JSON states; resume into any layout (FSDP, TP, pipeline stages, another world size).
  Its settings are keywords, or one frozen `CheckpointOptions` (`options=`).
- Hugging Face safetensors: read (block-FP8 weights dequantized), write (sharded, with index and config.json), and
  `convert_hf_to_dcp` for a model whose names you map.
- Single-process DCP and torch files, format detection, `atomic_output` for
  all-or-nothing files, dtype names, Hub download (`resolve_hf_source`).

Errors about a checkpoint or an argument are `CheckpointError`s naming the parameter
to change (`.arguments`); a missing one is a `CheckpointNotFoundError` (also a
`FileNotFoundError`). `import titan_ckpt` is cheap: each name is imported from
its module on first use.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS: dict[str, str] = {
    # checkpointing a training run
    "CheckpointManager": "manager",
    "CheckpointOptions": "options",
    "LoadModelFn": "manager",
    "SaveModelFn": "manager",
    "JsonStateful": "json_states",
    "TensorStateful": "json_states",
    "ASYNC_MODES": "argument_checks",
    "AsyncMode": "argument_checks",
    "CheckpointError": "errors",
    "CheckpointNotFoundError": "errors",
    # Hugging Face safetensors
    "read_hf_config": "hf_safetensors",
    "read_hf_state_dict": "hf_safetensors",
    "write_hf_checkpoint": "hf_safetensors",
    "write_hf_config": "hf_safetensors",
    "copy_extra_files": "hf_safetensors",
    "resolve_hf_source": "hf_hub",
    "convert_hf_to_dcp": "hf_to_dcp",
    # single-process DCP and torch files
    "read_dcp_tensor_shapes": "dcp_files",
    "read_dcp_state_dict": "dcp_files",
    "write_dcp_state_dict": "dcp_files",
    "write_dcp_checkpoint": "dcp_files",
    "read_torch_state_dict": "torch_files",
    "write_torch_state_dict": "torch_files",
    "detect_format": "formats",
    # helpers
    "atomic_output": "atomic",
    "parse_dtype": "dtypes",
    "cast_floating": "dtypes",
}

__all__ = [
    "ASYNC_MODES",
    "AsyncMode",
    "CheckpointError",
    "CheckpointManager",
    "CheckpointNotFoundError",
    "CheckpointOptions",
    "JsonStateful",
    "TensorStateful",
    "LoadModelFn",
    "SaveModelFn",
    "atomic_output",
    "cast_floating",
    "convert_hf_to_dcp",
    "copy_extra_files",
    "detect_format",
    "parse_dtype",
    "read_dcp_state_dict",
    "read_dcp_tensor_shapes",
    "read_hf_config",
    "read_hf_state_dict",
    "read_torch_state_dict",
    "resolve_hf_source",
    "write_dcp_checkpoint",
    "write_dcp_state_dict",
    "write_hf_checkpoint",
    "write_hf_config",
    "write_torch_state_dict",
]

if TYPE_CHECKING:
    from titan_ckpt.argument_checks import ASYNC_MODES, AsyncMode
    from titan_ckpt.atomic import atomic_output
    from titan_ckpt.dcp_files import (
        read_dcp_state_dict,
        read_dcp_tensor_shapes,
        write_dcp_checkpoint,
        write_dcp_state_dict,
    )
    from titan_ckpt.dtypes import cast_floating, parse_dtype
    from titan_ckpt.errors import CheckpointError, CheckpointNotFoundError
    from titan_ckpt.formats import detect_format
    from titan_ckpt.hf_hub import resolve_hf_source
    from titan_ckpt.hf_safetensors import (
        copy_extra_files,
        read_hf_config,
        read_hf_state_dict,
        write_hf_checkpoint,
        write_hf_config,
    )
    from titan_ckpt.hf_to_dcp import convert_hf_to_dcp
    from titan_ckpt.json_states import JsonStateful, TensorStateful
    from titan_ckpt.manager import CheckpointManager, LoadModelFn, SaveModelFn
    from titan_ckpt.options import CheckpointOptions
    from titan_ckpt.torch_files import read_torch_state_dict, write_torch_state_dict


def __getattr__(name: str) -> Any:
    """Import a public name from its module on first use (`import titan_ckpt` stays cheap)."""
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'titan_ckpt' has no attribute '{name}'")
    value = getattr(importlib.import_module(f"titan_ckpt.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
