"""Tell a checkpoint's format from its files: Hugging Face, DCP or a single torch file."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from titan_ckpt.dcp_files import METADATA_FILE
from titan_ckpt.errors import CheckpointError, CheckpointNotFoundError
from titan_ckpt.hf_safetensors import CONFIG_FILE
from titan_ckpt.torch_files import TORCH_SUFFIXES

CheckpointFormat = Literal["hf", "dcp", "torch"]
FORMATS: tuple[CheckpointFormat, ...] = ("hf", "dcp", "torch")


def detect_format(path: str | Path) -> CheckpointFormat:
    """Which format a checkpoint is in.

    "dcp": a folder with `.metadata`. "hf": a folder with `config.json` and
    `.safetensors` files. "torch": a `.pt`/`.pth`/`.bin` file, or a folder holding
    exactly one such file.

    Args:
        path: file or folder.

    Raises:
        FileNotFoundError: `path` does not exist; ValueError: no format matches.
    """
    path = Path(path)
    if not path.exists():
        raise CheckpointNotFoundError(f"{path} does not exist; pass an existing checkpoint file or folder")
    if path.is_file():
        if path.suffix in TORCH_SUFFIXES:
            return "torch"
        raise CheckpointError(
            f"{path}: unknown checkpoint format; expected a .pt/.bin file or a Hugging Face / DCP folder"
        )
    if (path / METADATA_FILE).is_file():
        return "dcp"
    if any(path.glob("*.safetensors")):
        if not (path / CONFIG_FILE).is_file():
            raise CheckpointError(
                f"{path} has .safetensors weights but no config.json; add the model's config.json beside them"
            )
        return "hf"
    if len(find_torch_files(path)) == 1:
        return "torch"
    raise CheckpointError(
        f"{path}: unknown checkpoint format; expected a Hugging Face folder (config.json + *.safetensors), "
        "a DCP folder (.metadata) or a single .pt/.bin state dict"
    )


def find_torch_files(folder: str | Path) -> list[Path]:
    """The `.pt`/`.pth`/`.bin` files directly inside `folder`.

    Args:
        folder: an existing folder.
    """
    return sorted(p for p in Path(folder).iterdir() if p.is_file() and p.suffix in TORCH_SUFFIXES)


def torch_file_of(path: str | Path) -> Path:
    """The state-dict file of a "torch" checkpoint: `path` itself, or the one file in the folder.

    Args:
        path: a file, or a folder holding one `.pt`/`.bin` file.

    Raises:
        ValueError: a folder without exactly one `.pt`/`.bin` file.
    """
    path = Path(path)
    if path.is_file():
        return path
    files = find_torch_files(path)
    if len(files) != 1:
        raise CheckpointError(
            f"{path} holds {len(files)} .pt/.bin files; pass the path of the one state-dict file to convert"
        )
    return files[0]
