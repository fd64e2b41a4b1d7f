"""`titan convert`: move model weights between Hugging Face safetensors, DCP and single
torch files, then prove the result with a logits parity check against transformers.

Titan-side formats (DCP, torch) hold Titan parameter names (`tok_embeddings.weight`,
`layers.0.attention.wq.weight`, ...) in the family's own layout (Llama 3: Meta's RoPE
layout); the model's `ModelSpec.hf_adapter` renames (and for Llama 3 permutes) to and from
Hugging Face. What the source is comes from `titan_core.model_source`: its family
(`--model-name`, or the one whose Hugging Face architecture its `config.json` names), its
shape (`--flavor`, a `config.json` beside it, or the run's `config.toml` above a trainer
checkpoint, `<run>/checkpoint/step-N`) and its tokenizer (the source folder's tokenizer
files, else those of the run's `model.hf_assets_path`), which travels along, so
`transformers` and `titan generate` read an export with the tokenizer it was trained
with. Every output is written to a hidden sibling folder and renamed into place only
once complete and, when Hugging Face is involved, once the parity check passed.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from titan_ckpt.atomic import atomic_output
from titan_ckpt.dcp_files import write_dcp_checkpoint
from titan_ckpt.dtypes import cast_floating, dtype_name, parse_dtype, state_dict_dtype
from titan_ckpt.formats import FORMATS, detect_format
from titan_ckpt.hf_hub import resolve_hf_source
from titan_ckpt.hf_safetensors import (
    copy_extra_files,
    read_hf_state_dict,
    write_hf_checkpoint,
    write_hf_config,
)
from titan_ckpt.torch_files import TORCH_SUFFIXES, write_torch_state_dict
from titan_core.config.errors import ConfigError
from titan_core.hf_parity import ParityError, ParityReport, check_hf_parity
from titan_core.model_source import (
    check_state_dict,
    copy_run_tokenizer,
    copy_tokenizer,
    expected_shapes,
    hf_adapter,
    infer_model_name,
    load_titan_state_dict,
    resolve_checkpoint,
    resolve_source_args,
)
from titan_models import HFAdapter, get_model_spec

TORCH_FILE_NAME = "model.pt"
"""State-dict file written inside a torch-format output folder."""
# config.json keys that describe the weights or the writer rather than the model; recomputed on write.
_STALE_CONFIG_KEYS = (
    "rope_parameters",
    "rope_scaling",
    "rope_theta",
    "dtype",
    "torch_dtype",
    "transformers_version",
    "quantization_config",  # block-FP8 weights are read dequantized (titan_ckpt.hf_fp8)
)


@dataclass(frozen=True)
class ConversionResult:
    """What `convert_checkpoint` did.

    Args:
        src_format: detected source format.
        dst: the written file or folder.
        dst_format: written format.
        n_params: parameters written.
        dtype: dtype name of the written weights.
        parity: the parity report; None when Hugging Face was on neither side.
    """

    src_format: str
    dst: Path
    dst_format: str
    n_params: int
    dtype: str
    parity: ParityReport | None


def convert_checkpoint(
    src: str,
    dst: str | Path,
    to: str,
    dtype: str | None = None,
    parity_check: bool = True,
    model_name: str | None = None,
    flavor: str | None = None,
    max_shard_size: str = "5GB",
    log: Callable[[str], None] = lambda message: None,
    average_with: Sequence[str] = (),
    weights: Sequence[float] | None = None,
    weight_set: str = "model",
) -> ConversionResult:
    """Convert model weights between "hf", "dcp" and "torch" (source format detected), or write the average of
    several checkpoints of one model (`average_with`).

    Args:
        src: source folder or file, or a Hugging Face Hub repo id.
        dst: output path; must not exist. For `to="torch"` a `.pt`/`.bin` path writes
            that one file, any other path a folder with `model.pt` and `config.json`.
        to: output format, one of "hf", "dcp", "torch".
        dtype: cast floating-point weights to "float32", "bfloat16" or "float16"; None keeps them.
        parity_check: compare logits with transformers when either side is "hf".
        model_name: model family in the registry (`model.name`); None = `infer_model_name`.
        flavor: named shape for a DCP/torch source without a config.json beside it.
        max_shard_size: Hugging Face shard size limit ("5GB").
        log: receives progress lines.
        average_with: more checkpoints of the same model (any format): the output holds the weighted mean of
            `src` and these, each floating-point tensor averaged in fp32 (checkpoint averaging, "model soups").
        weights: one weight per checkpoint (`src` first), normalised to sum 1; None = equal weights.
        weight_set: which weights of each DCP checkpoint (`titan_core.model_source.WEIGHT_SETS`): "model", "ema"
            (the moving average, `[ema]`, keys `ema.<name>`) or "anchors" (DiLoCo's, `diloco.anchor.<name>`).

    Raises:
        ValueError / FileNotFoundError / FileExistsError: bad input, one line naming the path and the fix.
        ParityError: the parity check failed; nothing was written.
    """
    if to not in FORMATS:
        raise ConfigError(f"--to '{to}' is not a format; choose one of: {', '.join(FORMATS)}")
    out_dtype = parse_dtype(dtype) if dtype is not None else None
    dst = Path(dst)
    if dst.exists():
        raise FileExistsError(f"{dst} already exists; choose a new destination or delete it first")
    src_path = resolve_checkpoint(src)  # a run folder: its newest complete step
    src_format = detect_format(src_path)
    if model_name is None:
        model_name = infer_model_name(src_path, src_format)
        log(f"model family {model_name} (pass --model-name to choose another)")
    spec, adapter = get_model_spec(model_name), hf_adapter(model_name)
    log(f"reading {src_format} checkpoint {src_path}")
    args, base_config, extras_dir = resolve_source_args(src_path, src_format, adapter, model_name, flavor)
    expected = expected_shapes(spec.build, args)
    state_dict = load_titan_state_dict(src_path, src_format, args, adapter, expected, weight_set=weight_set)
    check_state_dict(state_dict, expected, src_path)
    if average_with:
        state_dict = _average(
            state_dict, src_path, average_with, weights, args, adapter, model_name, flavor, expected, log, weight_set
        )
    elif weights is not None:
        raise ConfigError("--weights weigh the checkpoints of an average; add them with --average-with")
    written = cast_floating(state_dict, out_dtype)
    stable_config = {k: v for k, v in base_config.items() if k not in _STALE_CONFIG_KEYS}
    hf_config = {**stable_config, **adapter.hf_config_from_args(args, dtype_name(state_dict_dtype(written)))}
    parity = None
    with atomic_output(dst) as tmp:
        log(f"writing {to} checkpoint {dst}")
        if to == "hf":
            write_hf_checkpoint(
                tmp, adapter.to_hf(written, args), hf_config, max_shard_size, extra_files_from=extras_dir
            )
        elif to == "dcp":
            write_dcp_checkpoint(tmp, written, hf_config, extra_files_from=extras_dir)
        elif dst.suffix in TORCH_SUFFIXES:
            write_torch_state_dict(tmp, written)
        else:
            tmp.mkdir()
            write_torch_state_dict(tmp / TORCH_FILE_NAME, written)
            write_hf_config(tmp, hf_config)
            copy_extra_files(extras_dir, tmp)
        if tmp.is_dir() and src_format != "hf":
            copy_run_tokenizer(src_path, tmp, log)
        # An average is none of its sources: it is checked where it is written as Hugging Face files.
        if parity_check and (to == "hf" or (src_format == "hf" and not average_with)):
            log("checking parity with transformers")
            if to == "hf":  # HF side: the files just written; Titan side: the source weights
                parity = check_hf_parity(tmp, state_dict, args, spec.build, adapter.hf_architecture, out_dtype)
            else:  # HF side: the source files; Titan side: the weights read back from disk
                written_back = load_titan_state_dict(tmp, to, args, adapter, expected)
                parity = check_hf_parity(src_path, written_back, args, spec.build, adapter.hf_architecture, out_dtype)
            if not parity.passed:
                raise ParityError(
                    f"{parity.describe()}; the converted weights do not reproduce {src_path}, so {dst} was not written"
                )
    n_params = sum(t.numel() for k, t in written.items() if not (k == "output.weight" and args.tie_word_embeddings))
    return ConversionResult(src_format, dst, to, n_params, dtype_name(state_dict_dtype(written)), parity)


def _average(
    first: dict[str, torch.Tensor],
    first_path: Path,
    others: Sequence[str],
    weights: Sequence[float] | None,
    args: Any,
    adapter: HFAdapter[Any] | None,
    model_name: str,
    flavor: str | None,
    expected: dict[str, torch.Size],
    log: Callable[[str], None],
    weight_set: str = "model",
) -> dict[str, torch.Tensor]:
    """The weighted mean of `first` and the checkpoints at `others` (read one at a time): floating-point tensors
    accumulated in fp32 and returned in `first`'s dtypes; any other tensor must be equal in all of them."""
    count = 1 + len(others)
    if weights is None:
        weights = [1.0] * count
    if len(weights) != count or not all(w > 0 for w in weights):
        raise ConfigError(
            f"--weights: {len(weights)} weight(s) for {count} checkpoints (the source and {len(others)} "
            "--average-with); give one positive weight per checkpoint, the source's first"
        )
    shares = [w / sum(weights) for w in weights]
    log(f"averaging {count} checkpoints, weights {', '.join(f'{w:.4g}' for w in shares)}")
    total = {k: v.float() * shares[0] if v.is_floating_point() else v for k, v in first.items()}
    for other, share in zip(others, shares[1:], strict=True):
        path = resolve_checkpoint(other)
        fmt = detect_format(path)
        other_args = resolve_source_args(path, fmt, adapter, model_name, flavor)[0]
        if other_args != args:
            raise ConfigError(
                f"--average-with {other}: another model shape than {first_path} ({_shape_difference(args, other_args)})"
                "; average checkpoints of one model only"
            )
        log(f"reading {fmt} checkpoint {path}")
        state_dict = load_titan_state_dict(path, fmt, args, adapter, expected, weight_set=weight_set)
        check_state_dict(state_dict, expected, path)
        for key, tensor in state_dict.items():
            if tensor.is_floating_point():
                total[key] += tensor.float() * share
            elif not torch.equal(tensor, total[key]):
                raise ConfigError(f"--average-with {other}: its {key!r} ({tensor.dtype}) differs from {first_path}'s")
    return {k: v.to(first[k].dtype) for k, v in total.items()}


def _shape_difference(a: Any, b: Any) -> str:
    """The first fields in which two model args differ, e.g. 'n_layers 6 vs 4'."""

    if type(a) is not type(b):
        return f"{type(a).__module__} vs {type(b).__module__}"
    diffs = [
        f"{f.name} {getattr(a, f.name)} vs {getattr(b, f.name)}"
        for f in dataclasses.fields(a)
        if getattr(a, f.name) != getattr(b, f.name)
    ]
    return ", ".join(diffs[:3]) or "another args class"


def read_hf_weights(source: str | Path, model_name: str, args: Any) -> dict[str, torch.Tensor]:
    """Titan-named full weights of a Hugging Face checkpoint (a `checkpoint.initial_load_in_hf` reader).

    Args:
        source: Hugging Face folder or Hub repo id.
        model_name: registry name; its adapter converts the names.
        args: the model's args.
    """
    adapter = hf_adapter(model_name)
    return adapter.from_hf(read_hf_state_dict(resolve_hf_source(str(source))), args)


def write_hf_weights(
    folder: str | Path,
    state_dict: dict[str, torch.Tensor],
    model_name: str,
    args: Any,
    dtype: torch.dtype | None = None,
    max_shard_size: str = "5GB",
    tokenizer: str | Path | None = None,
) -> None:
    """Write Titan-named full weights as a Hugging Face checkpoint into `folder` (a
    `checkpoint.last_save_in_hf` writer; call it on one rank).

    Args:
        folder: destination folder (created if missing).
        state_dict: Titan names -> full tensors.
        model_name: registry name; its adapter converts the names.
        args: the model's args.
        dtype: cast floating-point weights to this; None keeps them.
        max_shard_size: shard size limit.
        tokenizer: the run's `model.hf_assets_path`, whose tokenizer files are copied along; None: the byte
            tokenizer, which has no files.
    """
    adapter = hf_adapter(model_name)
    # write_hf_checkpoint records the dtype of the weights it writes as torch_dtype
    write_hf_checkpoint(
        folder, adapter.to_hf(state_dict, args), adapter.hf_config_from_args(args, "float32"), max_shard_size, dtype
    )
    if tokenizer is not None:
        copy_tokenizer(tokenizer, Path(folder))
