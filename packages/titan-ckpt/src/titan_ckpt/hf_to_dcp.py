"""Hugging Face safetensors -> a DCP checkpoint folder that `CheckpointManager` starts from.

For any model: the caller says how Hugging Face's names map to the model's own (and
any layout change, e.g. a RoPE permutation); the rest (Hub download or cache, shard
reading, dtype cast, the all-or-nothing DCP folder with `config.json` and the tokenizer
files beside it) is here.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from titan_ckpt.atomic import atomic_output
from titan_ckpt.dcp_files import write_dcp_checkpoint
from titan_ckpt.dtypes import cast_floating
from titan_ckpt.hf_fp8 import dequantized_config
from titan_ckpt.hf_hub import resolve_hf_source
from titan_ckpt.hf_safetensors import read_hf_config, read_hf_state_dict

StateDictFn = Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]]
"""Hugging Face state dict -> the model's own (names, and layout where it differs)."""


def convert_hf_to_dcp(
    source: str | Path,
    dst: str | Path,
    from_hf: StateDictFn | None = None,
    *,
    dtype: torch.dtype | None = None,
    revision: str | None = None,
    progress: bool | None = None,
) -> dict[str, torch.Tensor]:
    """Convert a Hugging Face checkpoint into a single-process DCP folder with the model's names.

    The result loads with `read_dcp_state_dict`, or as `CheckpointManager(initial_load_path=dst)`
    into any layout (FSDP, TP, pipeline stages). A key-renaming function is enough for most models:

        convert_hf_to_dcp("org/model", "model-dcp", lambda sd: {rename(k): v for k, v in sd.items()})

    Args:
        source: a Hugging Face folder (`config.json` + `*.safetensors`) or a Hub repo id.
        dst: the DCP folder to create; it must not exist. It appears only once complete.
        from_hf: maps the Hugging Face state dict to the model's own; None keeps it as it is.
        dtype: cast floating-point tensors to this; None keeps their dtype.
        revision: branch, tag or commit of a Hub repo; None for the default branch.
        progress: progress bar while reading; None shows one from 1 GiB.

    Returns:
        The state dict written (after `from_hf` and the cast).

    Raises:
        FileNotFoundError: no such folder or reachable repo; FileExistsError: `dst` exists;
        ValueError: a damaged shard or config.json.
    """
    src = resolve_hf_source(source, revision)
    config = dequantized_config(read_hf_config(src))  # the weights below are read dequantized
    state_dict = read_hf_state_dict(src, progress)
    if from_hf is not None:
        state_dict = from_hf(state_dict)
    state_dict = cast_floating(state_dict, dtype)
    with atomic_output(dst) as tmp:
        write_dcp_checkpoint(tmp, state_dict, config, extra_files_from=src)
    return state_dict
