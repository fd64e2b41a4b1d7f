"""Hugging Face checkpoint folders: sharded safetensors, the index, `config.json` and the
tokenizer files that travel with them.

Layout written (what `save_pretrained` writes): one `model.safetensors`, or
`model-00001-of-0000N.safetensors` shards plus `model.safetensors.index.json`
(`{"metadata": {"total_size": bytes}, "weight_map": {name: shard}}`), `config.json`,
and copies of `HF_EXTRA_FILES` found in the source. The writers fill a new folder;
wrap them in `titan_ckpt.atomic_output` for an all-or-nothing result. Transfers of
1 GiB or more show a tqdm progress bar (bytes) on stderr.
"""

from __future__ import annotations

import json
import re
import shutil
import sys
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from tqdm import tqdm

from titan_ckpt.dtypes import cast_floating, dtype_name, state_dict_dtype
from titan_ckpt.errors import CheckpointError, CheckpointNotFoundError
from titan_ckpt.hf_fp8 import dequantize_fp8

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
CONFIG_FILE = "config.json"
HF_EXTRA_FILES = (
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
)
"""Files copied unchanged from a source folder to a converted one when present."""
PROGRESS_FROM_BYTES = 1 << 30
"""Transfers of at least this many bytes (1 GiB) show a progress bar unless told otherwise."""

_SIZE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B)?\s*", re.IGNORECASE)
_UNITS = {
    "": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}


def parse_size(size: int | str) -> int:
    """`"5GB"` -> 5_000_000_000 (KB/MB/GB are powers of 10, KiB/MiB/GiB of 2; a bare number is bytes).

    Args:
        size: bytes, or a number with a unit.

    Raises:
        ValueError: not a size.
    """
    if isinstance(size, int):
        return size
    match = _SIZE.fullmatch(size)
    if match is None:
        raise CheckpointError(f"max shard size '{size}' is not a size; write it like 5GB, 500MB or 2GiB")
    return int(float(match.group(1)) * _UNITS[(match.group(2) or "").upper()])


def progress_bar(label: str, total_bytes: int, enabled: bool | None) -> tqdm:
    """A tqdm bar counting bytes on stderr, shown when `enabled`, or (None) from `PROGRESS_FROM_BYTES` up.

    Args:
        label: what is moving ("reading Llama-3.2-1B").
        total_bytes: size of the whole transfer.
        enabled: force the bar on or off; None decides by size.
    """
    show = total_bytes >= PROGRESS_FROM_BYTES if enabled is None else enabled
    return tqdm(total=total_bytes, desc=label, unit="B", unit_scale=True, file=sys.stderr, disable=not show)


def read_hf_config(folder: str | Path) -> dict[str, Any]:
    """Parse `folder/config.json`.

    Args:
        folder: a Hugging Face checkpoint folder.

    Raises:
        FileNotFoundError: no config.json; ValueError: not valid JSON.
    """
    path = Path(folder) / CONFIG_FILE
    if not path.is_file():
        raise CheckpointNotFoundError(f"{path} not found; a Hugging Face checkpoint folder needs its config.json")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise CheckpointError(
            f"{path} is not valid JSON ({err}); restore the file from the original checkpoint"
        ) from None


def write_hf_config(folder: str | Path, config: dict[str, Any]) -> Path:
    """Write `folder/config.json` (indented, as `save_pretrained` does); returns its path.

    Args:
        folder: an existing folder.
        config: the JSON content.
    """
    path = Path(folder) / CONFIG_FILE
    path.write_text(json.dumps(config, indent=2) + "\n")
    return path


def list_hf_shards(folder: str | Path) -> list[Path]:
    """The safetensors files of a checkpoint: the index's shards, or `model.safetensors`.

    Args:
        folder: a Hugging Face checkpoint folder.

    Raises:
        FileNotFoundError: no weights, or a shard the index names is missing.
    """
    folder = Path(folder)
    index = folder / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as err:
            raise CheckpointError(
                f"{index} is not a safetensors index ({err!r}); restore it from the original checkpoint"
            ) from None
        shards = [folder / name for name in sorted(set(weight_map.values()))]
        for shard in shards:
            if not shard.is_file():
                raise CheckpointNotFoundError(
                    f"{shard} is named in {INDEX_FILE} but missing; download or copy the whole checkpoint again"
                )
        return shards
    if (folder / SINGLE_FILE).is_file():
        return [folder / SINGLE_FILE]
    found = sorted(folder.glob("*.safetensors"))
    if not found:
        raise CheckpointNotFoundError(
            f"{folder} holds no .safetensors weights; point to a Hugging Face checkpoint folder"
        )
    return found


def read_hf_state_dict(folder: str | Path, progress: bool | None = None) -> dict[str, torch.Tensor]:
    """Load every tensor of a safetensors checkpoint into CPU memory; the weights of a block-FP8 checkpoint
    (DeepSeek-V3's, Qwen3-FP8's: `*_scale_inv` tensors) come dequantized to float32, without their scales
    (`titan_ckpt.hf_fp8`).

    Args:
        folder: the checkpoint folder.
        progress: show a progress bar on stderr; None shows one for checkpoints over 1 GiB.

    Raises:
        ValueError: a shard is truncated or corrupt (the message names it), or quantized other than by block FP8.
    """
    shards = list_hf_shards(folder)
    state_dict: dict[str, torch.Tensor] = {}
    with progress_bar(f"reading {Path(folder).name}", sum(s.stat().st_size for s in shards), progress) as bar:
        for shard in shards:
            try:
                with safe_open(str(shard), framework="pt") as f:
                    for name in f.keys():
                        state_dict[name] = f.get_tensor(name)
            except (SafetensorError, OSError, RuntimeError) as err:
                raise CheckpointError(
                    f"{shard} is truncated or corrupt ({err}); download or export this file again"
                ) from None
            bar.update(shard.stat().st_size)
    config = read_hf_config(folder) if (Path(folder) / CONFIG_FILE).is_file() else None
    return dequantize_fp8(state_dict, config, str(folder))


def plan_shards(sizes: dict[str, int], max_shard_bytes: int) -> list[list[str]]:
    """Group tensor names into shards, in order, each at most `max_shard_bytes`
    (a single larger tensor gets a shard of its own).

    Args:
        sizes: bytes of each tensor, in writing order.
        max_shard_bytes: shard size limit.
    """
    shards: list[list[str]] = [[]]
    used = 0
    for name, size in sizes.items():
        if shards[-1] and used + size > max_shard_bytes:
            shards.append([])
            used = 0
        shards[-1].append(name)
        used += size
    return shards


def write_hf_checkpoint(
    folder: str | Path,
    state_dict: dict[str, torch.Tensor],
    config: dict[str, Any],
    max_shard_size: int | str = "5GB",
    dtype: torch.dtype | None = None,
    extra_files_from: str | Path | None = None,
    progress: bool | None = None,
) -> list[Path]:
    """Write a Hugging Face checkpoint folder (weights, index, config, tokenizer files).

    Args:
        folder: the folder to fill (created if missing); use `atomic_output` around
            this for atomicity.
        state_dict: Hugging Face names -> tensors; tensors must not share storage.
        config: the `config.json` content; `torch_dtype` is set to the weights' dtype.
        max_shard_size: shard size limit, bytes or "5GB"-style.
        dtype: cast floating-point tensors to this; None keeps them.
        extra_files_from: a folder whose `HF_EXTRA_FILES` are copied when present.
        progress: progress bar on stderr; None shows one over 1 GiB.

    Returns:
        The safetensors files written.
    """
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    state_dict = cast_floating(state_dict, dtype)
    sizes = {name: t.numel() * t.element_size() for name, t in state_dict.items()}
    groups = plan_shards(sizes, parse_size(max_shard_size))
    names = (
        [SINGLE_FILE]
        if len(groups) == 1
        else [f"model-{i:05d}-of-{len(groups):05d}.safetensors" for i in range(1, len(groups) + 1)]
    )
    with progress_bar(f"writing {folder.name}", sum(sizes.values()), progress) as bar:
        for group, name in zip(groups, names, strict=True):
            save_file({k: state_dict[k].contiguous() for k in group}, str(folder / name), metadata={"format": "pt"})
            bar.update(sum(sizes[k] for k in group))
    if len(groups) > 1:
        weight_map = {k: name for group, name in zip(groups, names, strict=True) for k in group}
        index = {"metadata": {"total_size": sum(sizes.values())}, "weight_map": weight_map}
        (folder / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    write_hf_config(folder, {**config, "torch_dtype": dtype_name(state_dict_dtype(state_dict))})
    if extra_files_from is not None:
        copy_extra_files(extra_files_from, folder)
    return [folder / name for name in names]


def copy_extra_files(src: str | Path, dst: str | Path) -> list[str]:
    """Copy the `HF_EXTRA_FILES` (tokenizer, generation config) present in `src` into `dst`; returns their names.

    Args:
        src: a Hugging Face checkpoint folder.
        dst: an existing folder.
    """
    copied = []
    for name in HF_EXTRA_FILES:
        if (Path(src) / name).is_file():
            shutil.copyfile(Path(src) / name, Path(dst) / name)
            copied.append(name)
    return copied
