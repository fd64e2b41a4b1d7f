"""Text in, text out: which tokenizer a checkpoint goes with, BOS, EOS, and decoding.

The tokenizer is, in order: tokenizer files in the checkpoint's folder (a Hugging Face
folder, or a DCP folder `titan convert` wrote them into); the run's
`model.hf_assets_path` (from its config.toml); else Titan's byte tokenizer, the
training default. A prompt of a Titan run starts with BOS, as every document did in
training (`[bos] + text + [eos]`); a checkpoint that carries its own tokenizer files
follows them: no BOS when `tokenizer_config.json` says `add_bos_token: false` (e.g.
Qwen). The tokenizer's EOS ends a sequence, and so do the `eos_token_id`s of the
checkpoint's `generation_config.json` (else `config.json`) when it has one.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from titan_core.config.errors import ConfigError, MissingFileError
from titan_core.data.hf_tokenizer import read_tokenizer_config
from titan_core.data.tokenizer import Tokenizer, build_tokenizer, find_tokenizer_file
from titan_core.model_source import run_tokenizer_assets

GENERATION_CONFIG = "generation_config.json"
"""Hugging Face file whose `eos_token_id` (an id or a list) lists the tokens that end generation."""


@dataclass(frozen=True)
class PromptCodec:
    """A tokenizer with the rules of generation: BOS first, which tokens end a sequence.

    Args:
        tokenizer: encodes and decodes.
        add_bos: start every prompt with `tokenizer.bos_id`.
        eos_ids: tokens that end a sequence.
        source: where the tokenizer came from, for messages ("byte tokenizer" or a path).
    """

    tokenizer: Tokenizer
    add_bos: bool
    eos_ids: tuple[int, ...]
    source: str

    def encode(self, text: str) -> list[int]:
        """Token ids of a prompt, BOS first where the model expects it."""
        ids = self.tokenizer.encode(text)
        return [self.tokenizer.bos_id, *ids] if self.add_bos else ids

    def decode(self, ids: Sequence[int]) -> str:
        """The text of generated ids; a final EOS is dropped."""
        if ids and ids[-1] in self.eos_ids:
            ids = ids[:-1]
        return self.tokenizer.decode(ids)


def load_prompt_codec(checkpoint: Path, vocab_size: int) -> PromptCodec:
    """The tokenizer and BOS/EOS rules that go with a checkpoint.

    Args:
        checkpoint: the checkpoint folder or file (see `load_model`).
        vocab_size: the model's vocabulary; every id the tokenizer makes must be below it.

    Raises:
        ConfigError: no usable tokenizer; the message says where to put one.
    """
    folder = checkpoint if checkpoint.is_dir() else checkpoint.parent
    path, source, own = _tokenizer_path(folder)
    tokenizer = build_tokenizer(path)
    if tokenizer.vocab_size > vocab_size:
        hint = (
            "put the model's tokenizer.json beside its weights"
            if path is None
            else f"use the model's own tokenizer instead of {path}"
        )
        raise ConfigError(f"the {source} has {tokenizer.vocab_size} tokens, the model {vocab_size}; {hint}")
    add_bos = True
    if own and path is not None:  # the checkpoint's own tokenizer has a folder
        add_bos = read_tokenizer_config(path / "tokenizer_config.json").get("add_bos_token", True) is not False
    eos_ids = {tokenizer.eos_id, *_generation_eos_ids(folder)}
    return PromptCodec(tokenizer, add_bos, tuple(sorted(i for i in eos_ids if 0 <= i < vocab_size)), source)


def _tokenizer_path(folder: Path) -> tuple[Path | None, str, bool]:
    """The tokenizer folder for a checkpoint folder (None: the byte tokenizer), how to name it,
    and whether it is the checkpoint's own (in its folder) rather than the training run's."""
    try:
        return find_tokenizer_file(folder).parent, f"tokenizer in {folder}", True
    except MissingFileError:
        pass
    if (run := run_tokenizer_assets(folder)) is None:
        return None, "byte tokenizer", False
    toml_path, assets = run
    path = Path(assets).expanduser()
    if not path.exists():
        raise ConfigError(
            f"{toml_path}: model.hf_assets_path {assets} does not exist here; copy the tokenizer files into {folder}"
        )
    return path, f"tokenizer of {path}", False


def _generation_eos_ids(folder: Path) -> set[int]:
    """`eos_token_id` of generation_config.json, else of config.json (an id or a list), as a set."""
    for name in (GENERATION_CONFIG, "config.json"):
        file = folder / name
        if file.is_file():
            try:
                value = json.loads(file.read_text()).get("eos_token_id")
            except json.JSONDecodeError as err:
                raise ConfigError(f"{file} is not valid JSON ({err}); fix or delete it") from None
            if value is not None:
                return {int(v) for v in (value if isinstance(value, list) else [value])}
    return set()
