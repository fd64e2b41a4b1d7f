"""`titan convert`: move model weights between Hugging Face safetensors, DCP and single
torch files, then prove the result with a logits parity check against transformers.

Titan-side formats (DCP, torch) hold Titan parameter names (`tok_embeddings.weight`,
`layers.0.attention.wq.weight`, ...) in the family's own layout (Llama 3: Meta's RoPE
layout); the model's `ModelSpec.hf_adapter` renames (and for Llama 3 permutes) to and from
Hugging Face. The family is `--model-name`, or the one whose Hugging Face architecture the
source's `config.json` names (`infer_model_name`). The shape of a Titan-side source comes
from `--flavor`, a `config.json` beside it, or the run's `config.toml` above a trainer
checkpoint (`<run>/checkpoint/step-N`). The tokenizer travels along: the source folder's
tokenizer files, else those of the run's `model.hf_assets_path` (`copy_tokenizer`), so
`transformers` and `titan generate` read an export with the tokenizer it was trained
with. Every output is written to a hidden sibling
folder and renamed into place only once complete and, when Hugging Face is involved,
once the parity check passed.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import tomllib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from titan_ckpt.atomic import atomic_output
from titan_ckpt.dcp_files import read_dcp_state_dict, read_dcp_tensor_shapes, write_dcp_checkpoint
from titan_ckpt.dtypes import cast_floating, dtype_name, parse_dtype, state_dict_dtype
from titan_ckpt.formats import FORMATS, detect_format, torch_file_of
from titan_ckpt.hf_hub import resolve_hf_source
from titan_ckpt.hf_safetensors import (
    CONFIG_FILE,
    copy_extra_files,
    list_hf_shards,
    read_hf_config,
    read_hf_state_dict,
    write_hf_checkpoint,
    write_hf_config,
)
from titan_ckpt.torch_files import TORCH_SUFFIXES, read_torch_state_dict, write_torch_state_dict
from titan_core.config.errors import ConfigError, MissingFileError
from titan_core.data.tokenizer import find_tokenizer_file
from titan_core.hf_parity import ParityError, ParityReport, check_hf_parity
from titan_core.model_shape import run_args
from titan_models import HFAdapter, get_model_args, get_model_spec

DEFAULT_MODEL_NAME = "llama3"
"""Family of a source whose config.json and run config name none."""
TORCH_FILE_NAME = "model.pt"
"""State-dict file written inside a torch-format output folder."""
# config.json keys that describe the weights or the writer rather than the model; recomputed on write.
_STALE_CONFIG_KEYS = ("rope_parameters", "rope_scaling", "rope_theta", "dtype", "torch_dtype", "transformers_version")


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


RUN_CONFIG = "config.toml"
HF_RUN_CONFIG = "hf_config.json"
"""A run started from Hugging Face weights keeps their config.json under this name: the shape it trained."""
"""The config a `titan train` run writes into its folder."""


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
    ema: bool = False,
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
        ema: read each DCP checkpoint's moving average of the weights (`[ema]`, keys `ema.<name>`) instead of its
            weights.

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
    src_path = resolve_hf_source(src)
    src_format = detect_format(src_path)
    if model_name is None:
        model_name = infer_model_name(src_path, src_format)
        log(f"model family {model_name} (pass --model-name to choose another)")
    spec, adapter = get_model_spec(model_name), _hf_adapter(model_name)
    log(f"reading {src_format} checkpoint {src_path}")
    args, base_config, extras_dir = resolve_source_args(src_path, src_format, adapter, model_name, flavor)
    expected = expected_shapes(spec.build, args)
    state_dict = load_titan_state_dict(src_path, src_format, args, adapter, expected, ema=ema)
    check_state_dict(state_dict, expected, src_path)
    if average_with:
        state_dict = _average(
            state_dict, src_path, average_with, weights, args, adapter, model_name, flavor, expected, log, ema
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
    ema: bool = False,
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
        path = resolve_hf_source(other)
        fmt = detect_format(path)
        other_args = resolve_source_args(path, fmt, adapter, model_name, flavor)[0]
        if other_args != args:
            raise ConfigError(
                f"--average-with {other}: another model shape than {first_path} ({_shape_difference(args, other_args)})"
                "; average checkpoints of one model only"
            )
        log(f"reading {fmt} checkpoint {path}")
        state_dict = load_titan_state_dict(path, fmt, args, adapter, expected, ema=ema)
        check_state_dict(state_dict, expected, path)
        for key, tensor in state_dict.items():
            if tensor.is_floating_point():
                total[key] += tensor.float() * share
            elif not torch.equal(tensor, total[key]):
                raise ConfigError(f"--average-with {other}: its {key!r} ({tensor.dtype}) differs from {first_path}'s")
    return {k: v.to(first[k].dtype) for k, v in total.items()}


def _shape_difference(a: Any, b: Any) -> str:
    """The first fields in which two model args differ, e.g. 'n_layers 6 vs 4'."""
    import dataclasses

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
    adapter = _hf_adapter(model_name)
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
    adapter = _hf_adapter(model_name)
    # write_hf_checkpoint records the dtype of the weights it writes as torch_dtype
    write_hf_checkpoint(
        folder, adapter.to_hf(state_dict, args), adapter.hf_config_from_args(args, "float32"), max_shard_size, dtype
    )
    if tokenizer is not None:
        copy_tokenizer(tokenizer, Path(folder))


def infer_model_name(src: Path, src_format: str) -> str:
    """The family (`model.name`) of a checkpoint, for a conversion not given `--model-name`.

    A Hugging Face source, or a DCP/torch source with a config.json beside it: the
    registered family whose `hf_adapter.hf_architecture` is in config.json's
    `architectures`. A trainer checkpoint: its run's `config.toml` `model.name` (up to 3
    levels above). Else `DEFAULT_MODEL_NAME`.

    Args:
        src: source path (local).
        src_format: "hf", "dcp" or "torch".

    Raises:
        ConfigError: a config.json naming no supported architecture; the message lists them.
    """
    folder = src if src.is_dir() else src.parent
    config_folder = src if src_format == "hf" else folder
    if src_format == "hf" or (folder / CONFIG_FILE).is_file():
        architectures = list(read_hf_config(config_folder).get("architectures") or [])
        families = _families_by_hf_architecture()
        for architecture in architectures:
            if architecture in families:
                return families[architecture]
        if src_format == "hf" or architectures:
            raise ConfigError(
                f"{config_folder / CONFIG_FILE} architectures {architectures} names no Titan model family; "
                f"supported: {', '.join(families)} (or pass --model-name)"
            )
    run = find_run_config(folder)
    return str(run[1].get("model", {}).get("name", DEFAULT_MODEL_NAME)) if run is not None else DEFAULT_MODEL_NAME


def copy_tokenizer(assets: str | Path, folder: Path) -> list[str]:
    """Copy the tokenizer that `model.hf_assets_path` names into `folder`: its tokenizer file (the one
    `build_tokenizer` reads) and the `HF_EXTRA_FILES` beside it. Returns the names copied.

    Args:
        assets: a tokenizer folder or file, as `model.hf_assets_path`.
        folder: an existing folder (an export of the weights).
    """
    path = Path(assets).expanduser()
    file = find_tokenizer_file(path) if path.is_dir() else path
    names = copy_extra_files(file.parent, folder)
    if file.name not in names:
        shutil.copyfile(file, folder / file.name)
        names.append(file.name)
    return names


def copy_run_tokenizer(src: Path, folder: Path, log: Callable[[str], None]) -> None:
    """Give an export of a training checkpoint its run's tokenizer (`model.hf_assets_path` of the run's
    config.toml), unless the source folder carried tokenizer files of its own, or the run used the byte
    tokenizer (which has no files). A run whose tokenizer is not on this machine gets a line, not an error.

    Args:
        src: the source checkpoint (a step folder or a file in one).
        folder: the export being written.
    """
    try:
        find_tokenizer_file(folder)
        return  # the source's own tokenizer files came along
    except MissingFileError:
        pass
    if (run := run_tokenizer_assets(src)) is None:
        return
    toml_path, assets = run
    try:
        names = copy_tokenizer(assets, folder)
    except (MissingFileError, FileNotFoundError):
        log(f"the run's tokenizer (model.hf_assets_path {assets} in {toml_path}) is not here; the export carries none")
        return
    log(f"tokenizer: {', '.join(names)} from {assets} (the run's model.hf_assets_path)")


def run_tokenizer_assets(path: Path) -> tuple[Path, str] | None:
    """The `config.toml` of the run `path` belongs to and its `model.hf_assets_path`; None when there is no run
    config or the run used the byte tokenizer (the key unset).

    Args:
        path: a run folder, its checkpoint folder, a step folder, or a file in one.
    """
    run = find_run_config(path)
    assets = None if run is None else run[1].get("model", {}).get("hf_assets_path")
    return None if run is None or assets is None else (run[0], str(assets))


def find_run_config(path: Path) -> tuple[Path, dict[str, Any]] | None:
    """The `config.toml` of the `titan train` run `path` belongs to (in it or up to 3 folders above), parsed.

    Args:
        path: a run folder, its checkpoint folder, a step folder, or a file in one.

    Raises:
        ConfigError: the config.toml is not valid TOML.
    """
    folder = path if path.is_dir() else path.parent
    for run_folder in [folder, *folder.parents][:4]:
        toml_path = run_folder / RUN_CONFIG
        if toml_path.is_file():
            try:
                return toml_path, tomllib.loads(toml_path.read_text())
            except tomllib.TOMLDecodeError as err:
                raise ConfigError(
                    f"{toml_path} is not valid TOML ({err}); fix it, or pass --model-name and --flavor"
                ) from None
    return None


def _families_by_hf_architecture() -> dict[str, str]:
    """Hugging Face architecture (e.g. "Qwen3ForCausalLM") -> registered `model.name`, in registration order."""
    from titan_models import registered_model_specs

    families: dict[str, str] = {}
    for name, spec in registered_model_specs().items():
        if spec.hf_adapter is not None:
            families.setdefault(spec.hf_adapter.hf_architecture, name)
    return families


def _hf_adapter(model_name: str) -> HFAdapter[Any]:
    """The registry's Hugging Face adapter of `model_name`, or a one-line error."""
    adapter = get_model_spec(model_name).hf_adapter
    if adapter is None:
        raise ConfigError(
            f"model.name '{model_name}' has no Hugging Face adapter; conversion needs ModelSpec.hf_adapter"
        )
    return adapter


def _needs_adapter(adapter: HFAdapter[Any] | None, path: Path) -> HFAdapter[Any]:
    """`adapter`, or a one-line error: `path` holds Hugging Face names or a config.json to read."""
    if adapter is None:
        raise ConfigError(
            f"{path} is in Hugging Face form and this model has no Hugging Face adapter (ModelSpec.hf_adapter); "
            "pass --flavor, or a checkpoint in Titan's names"
        )
    return adapter


def resolve_source_args(
    src: Path, src_format: str, adapter: HFAdapter[Any] | None, model_name: str, flavor: str | None
) -> tuple[Any, dict[str, Any], Path]:
    """The model's args for a source checkpoint, the config.json to build on, and the
    folder whose tokenizer files travel along.

    Order: a Hugging Face source's own config.json; `flavor`; a config.json beside a
    DCP/torch source; the `config.toml` of the trainer run above it (up to 3 levels).

    Args:
        src: source path (local).
        src_format: "hf", "dcp" or "torch".
        adapter: the model's Hugging Face adapter (None: it has none; a config.json cannot be read).
        model_name: registry name.
        flavor: named shape, or None.

    Raises:
        ValueError: no way to tell the shape; the message says how to give it.
    """
    folder = src if src.is_dir() else src.parent
    if src_format == "hf":
        config = read_hf_config(src)
        return hf_mtp_layers(src, _needs_adapter(adapter, src).args_from_hf_config(config), config), config, src
    if flavor is not None:
        return get_model_args(model_name, flavor), {}, folder
    if (folder / CONFIG_FILE).is_file():
        config = read_hf_config(folder)
        return _needs_adapter(adapter, folder).args_from_hf_config(config), config, folder
    run = find_run_config(folder)
    if run is not None:
        toml_path, model = run[0], run[1].get("model", {})
        if model.get("name", model_name) != model_name:
            raise ConfigError(f"{toml_path} trains model.name '{model['name']}'; pass --model-name {model['name']}")
        hf_config = _run_hf_config(toml_path, run[1])
        if hf_config is not None or "flavor" in model:
            if hf_config is not None:  # started from Hugging Face weights: their shape, not model.flavor
                args = _needs_adapter(adapter, toml_path.parent).args_from_hf_config(hf_config)
            else:
                args = get_model_args(model_name, model["flavor"])
            args = run_args(args, run[1])  # model.shape, [mup]
            if mtp_layers := run[1].get("mtp", {}).get("layers"):  # the run's prediction depths are in its weights
                args = dataclasses.replace(args, n_mtp_layers=int(mtp_layers))
            return args, hf_config or {}, folder
    raise ConfigError(
        f"cannot tell the model shape of {src}; pass --flavor NAME or put the model's config.json beside it"
    )


def _run_hf_config(toml_path: Path, run: dict[str, Any]) -> dict[str, Any] | None:
    """The config.json of the Hugging Face weights a run started from (its `hf_config.json`, else the source's
    own), or None for a run that did not start from Hugging Face weights."""
    ckpt = run.get("checkpoint", {})
    source = ckpt.get("initial_load_path")
    if not (ckpt.get("initial_load_in_hf") and source):
        return None
    kept = toml_path.parent / HF_RUN_CONFIG
    if kept.is_file():
        return json.loads(kept.read_text())
    try:  # a run from before hf_config.json was kept
        return read_hf_config(resolve_hf_source(source))
    except (OSError, ValueError) as err:
        raise ConfigError(
            f"{toml_path} started from the Hugging Face weights in {source}, whose config.json cannot be read "
            f"({err}); put it in the run folder as {HF_RUN_CONFIG}, or pass --flavor NAME"
        ) from None


def hf_mtp_layers(src: Path, args: Any, config: dict[str, Any]) -> Any:
    """`args` with as many multi-token-prediction depths as the Hugging Face weights in `src` hold (layers
    `n_layers ..` with an `eh_proj`; their config's `num_nextn_predict_layers` is not evidence, see
    `titan_models.deepseek_v3.hf_adapter`); `args` unchanged for an architecture whose config has no such key
    (Llama, Qwen3: their files hold no depths). Reads shard headers only."""
    if not hasattr(args, "n_mtp_layers") or "num_nextn_predict_layers" not in config:
        return args
    from safetensors import safe_open

    names: set[str] = set()
    for shard in list_hf_shards(src):
        with safe_open(str(shard), framework="pt") as f:
            names.update(f.keys())
    depths = 0
    while f"model.layers.{args.n_layers + depths}.eh_proj.weight" in names:
        depths += 1
    return dataclasses.replace(args, n_mtp_layers=depths)


def expected_shapes(build: Callable[[Any], torch.nn.Module], args: Any) -> dict[str, torch.Size]:
    """Name -> shape of every entry of `build(args).state_dict()`, built on meta (no memory)."""
    with torch.device("meta"):
        return {k: v.shape for k, v in build(args).state_dict().items()}


def load_titan_state_dict(
    path: Path,
    fmt: str,
    args: Any,
    adapter: HFAdapter[Any] | None,
    expected: dict[str, torch.Size],
    *,
    ema: bool = False,
) -> dict[str, torch.Tensor]:
    """Read a checkpoint of any format as a Titan-named full state dict on CPU.

    Args:
        path: the checkpoint (local).
        fmt: "hf", "dcp" or "torch".
        args: the model's args (for the RoPE permutation and tied embeddings).
        adapter: the model's Hugging Face adapter (None: it has none; Hugging Face weights cannot be read).
        expected: the model's names and shapes (`expected_shapes`); a DCP folder is read for these only.
        ema: read a trainer checkpoint's moving average of the weights (DCP only) instead of its weights.
    """
    if ema and fmt != "dcp":
        raise ConfigError(
            f"--ema: {path} is a {fmt} checkpoint; the moving average of the weights is in a trainer's DCP "
            "checkpoints (ema.enable = true): point to a step-N folder"
        )
    if fmt == "hf":
        return _needs_adapter(adapter, path).from_hf(read_hf_state_dict(path), args)
    if fmt == "dcp":
        return read_dcp_model(path, args, expected, prefixes=("ema.",) if ema else ("", "model."))
    raw = read_torch_state_dict(torch_file_of(path))
    if "model.embed_tokens.weight" in raw or "lm_head.weight" in raw:  # a Hugging Face pytorch_model.bin
        return _needs_adapter(adapter, path).from_hf(raw, args)
    return _with_tied_output(_strip_prefix(raw, "model."), args)


def read_dcp_model(
    folder: Path, args: Any, expected: dict[str, torch.Size], prefixes: Sequence[str] = ("", "model.")
) -> dict[str, torch.Tensor]:
    """The model's tensors from a DCP folder whose keys have one of `prefixes` (no prefix or `model.`; `ema.` for
    the moving average of the weights): the prefix that holds the most expected names wins. Optimizer, data
    loader and train state entries are not read."""
    stored = read_dcp_tensor_shapes(folder)
    prefix = max(prefixes, key=lambda p: sum(p + k in stored for k in expected))
    names = [prefix + k for k in expected if prefix + k in stored]
    if not names and prefix == "ema.":
        raise ConfigError(
            f"--ema: {folder} holds no moving average of the weights (no 'ema.*' tensors); it is saved by runs with "
            "ema.enable = true"
        )
    if not names:
        raise ConfigError(
            f"{folder} holds none of the model's weights (e.g. 'tok_embeddings.weight'); "
            "point to a Titan DCP checkpoint"
        )
    loaded = read_dcp_state_dict(folder, names)
    return _with_tied_output({k[len(prefix) :]: v for k, v in loaded.items()}, args)


def _strip_prefix(state_dict: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    """Drop `prefix` from every key when every key has it."""
    if state_dict and all(k.startswith(prefix) for k in state_dict):
        return {k[len(prefix) :]: v for k, v in state_dict.items()}
    return state_dict


def _with_tied_output(state_dict: dict[str, torch.Tensor], args: Any) -> dict[str, torch.Tensor]:
    """With tied embeddings, make `output.weight` the embedding tensor (some writers drop it)."""
    if getattr(args, "tie_word_embeddings", False) and "tok_embeddings.weight" in state_dict:
        state_dict = {**state_dict, "output.weight": state_dict["tok_embeddings.weight"]}
    return state_dict


def check_state_dict(state_dict: dict[str, torch.Tensor], expected: dict[str, torch.Size], src: Path) -> None:
    """Compare names and shapes with what the model expects.

    Raises:
        ValueError: a missing, unexpected or mis-shaped tensor; one line naming it and the fix.
    """
    hint = "pass the right --flavor (or config.json) for this checkpoint"
    for name, shape in expected.items():
        if name not in state_dict:
            raise ConfigError(f"{src} lacks '{name}'; {hint}")
        if state_dict[name].shape != shape:
            raise ConfigError(
                f"{src}: '{name}' has shape {tuple(state_dict[name].shape)}, the model expects {tuple(shape)}; {hint}"
            )
    for name in state_dict:
        if name not in expected:
            raise ConfigError(f"{src} has '{name}', which the model does not; {hint}")
