"""What a saved model is, for `titan convert` and `titan generate`: its family (from a `config.json`'s
architecture or the run's `config.toml`), its shape (`resolve_source_args`: the Hugging Face config, `--flavor`, or
the run's `model.flavor` with `model.shape`, `[mup]` and its MTP depths), its tokenizer, and its weights in Titan's
names, checked against the shapes the family builds (`load_titan_state_dict`).
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import tomllib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from titan_ckpt.dcp_files import read_dcp_state_dict, read_dcp_tensor_shapes
from titan_ckpt.formats import torch_file_of
from titan_ckpt.hf_hub import resolve_hf_source
from titan_ckpt.hf_safetensors import (
    CONFIG_FILE,
    copy_extra_files,
    list_hf_shards,
    read_hf_config,
    read_hf_state_dict,
)
from titan_ckpt.step_folders import list_complete_steps, step_folder
from titan_ckpt.torch_files import read_torch_state_dict
from titan_core.config.errors import ConfigError, MissingFileError
from titan_core.data.tokenizer import find_tokenizer_file
from titan_core.model_shape import run_args
from titan_models import HFAdapter, get_model_args, get_model_spec

WEIGHT_SETS: dict[str, tuple[str, str, tuple[str, ...], str]] = {
    "model": ("", "model's weights", ("", "model."), "every run"),
    "ema": ("--ema", "moving average of the weights", ("ema.",), "runs with ema.enable = true"),
    "anchors": (
        "--anchors",
        "DiLoCo anchors, the weights the replica groups last synced",
        ("diloco.anchor.",),
        "runs with fault_tolerance.semi_sync_method = 'diloco' or 'local_sgd'",
    ),
}
"""A trainer checkpoint's sets of model weights: name -> (the `titan convert` flag, what it is, DCP key prefixes,
which runs save it)."""
RUN_CONFIG = "config.toml"
"""The config a `titan train` run writes into its folder."""
HF_RUN_CONFIG = "hf_config.json"
"""A run started from Hugging Face weights keeps their config.json under this name: the shape it trained."""


DEFAULT_MODEL_NAME = "llama3"
"""Family of a source whose config.json and run config name none."""


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


def resolve_checkpoint(source: str) -> Path:
    """The checkpoint to read: `source` itself, or the newest complete `step-N` of a run or checkpoint folder (as
    `titan generate`, `titan eval` and `titan convert` read a run folder).

    Args:
        source: a local path or a Hugging Face Hub repo id (downloaded).

    Raises:
        ConfigError: a run folder without a complete checkpoint.
    """
    path = resolve_hf_source(source)
    if not path.is_dir() or any(path.glob("*.safetensors")) or (path / ".metadata").is_file():
        return path
    run = find_run_config(path)
    roots = [path]
    if run is not None and run[0].parent == path:  # a run folder: its checkpoint.folder
        roots.insert(0, path / str(run[1].get("checkpoint", {}).get("folder", "checkpoint")))
    for root in roots:
        steps = list_complete_steps(root)
        if steps:
            return step_folder(root, steps[-1])
    if run is not None and run[0].parent == path:
        raise ConfigError(
            f"{path} is a run folder with no complete checkpoint in {roots[0]}; "
            "train with --checkpoint.enable true, or point to a checkpoint folder"
        )
    return path


def _families_by_hf_architecture() -> dict[str, str]:
    """Hugging Face architecture (e.g. "Qwen3ForCausalLM") -> registered `model.name`, in registration order."""
    from titan_models import registered_model_specs

    families: dict[str, str] = {}
    for name, spec in registered_model_specs().items():
        if spec.hf_adapter is not None:
            families.setdefault(spec.hf_adapter.hf_architecture, name)
    return families


def hf_adapter(model_name: str) -> HFAdapter[Any]:
    """The registry's Hugging Face adapter of `model_name`, or a one-line error."""
    adapter = get_model_spec(model_name).hf_adapter
    if adapter is None:
        raise ConfigError(
            f"model.name '{model_name}' has no Hugging Face adapter; conversion needs ModelSpec.hf_adapter"
        )
    return adapter


def needs_adapter(adapter: HFAdapter[Any] | None, path: Path) -> HFAdapter[Any]:
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
        return hf_mtp_layers(src, needs_adapter(adapter, src).args_from_hf_config(config), config), config, src
    if flavor is not None:
        return get_model_args(model_name, flavor), {}, folder
    if (folder / CONFIG_FILE).is_file():
        config = read_hf_config(folder)
        return needs_adapter(adapter, folder).args_from_hf_config(config), config, folder
    run = find_run_config(folder)
    if run is not None:
        toml_path, model = run[0], run[1].get("model", {})
        if model.get("name", model_name) != model_name:
            raise ConfigError(f"{toml_path} trains model.name '{model['name']}'; pass --model-name {model['name']}")
        hf_config = _run_hf_config(toml_path, run[1])
        if hf_config is not None or "flavor" in model:
            if hf_config is not None:  # started from Hugging Face weights: their shape, not model.flavor
                args = needs_adapter(adapter, toml_path.parent).args_from_hf_config(hf_config)
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
    weight_set: str = "model",
) -> dict[str, torch.Tensor]:
    """Read a checkpoint of any format as a Titan-named full state dict on CPU.

    Args:
        path: the checkpoint (local).
        fmt: "hf", "dcp" or "torch".
        args: the model's args (for the RoPE permutation and tied embeddings).
        adapter: the model's Hugging Face adapter (None: it has none; Hugging Face weights cannot be read).
        expected: the model's names and shapes (`expected_shapes`); a DCP folder is read for these only.
        weight_set: which of a trainer checkpoint's sets of weights (`WEIGHT_SETS`; DCP only but "model").
    """
    if weight_set != "model" and fmt != "dcp":
        flag, what, _, saved_by = WEIGHT_SETS[weight_set]
        raise ConfigError(
            f"{flag}: {path} is a {fmt} checkpoint; only a trainer's DCP checkpoints hold the {what} ({saved_by}): "
            "point to a step-N folder"
        )
    if fmt == "hf":
        return needs_adapter(adapter, path).from_hf(read_hf_state_dict(path), args)
    if fmt == "dcp":
        return read_dcp_model(path, args, expected, weight_set)
    raw = read_torch_state_dict(torch_file_of(path))
    if "model.embed_tokens.weight" in raw or "lm_head.weight" in raw:  # a Hugging Face pytorch_model.bin
        return needs_adapter(adapter, path).from_hf(raw, args)
    return _with_tied_output(_strip_prefix(raw, "model."), args)


def read_dcp_model(
    folder: Path, args: Any, expected: dict[str, torch.Size], weight_set: str = "model"
) -> dict[str, torch.Tensor]:
    """The model's tensors from a DCP folder, of one of its sets of weights (`WEIGHT_SETS`: the weights, under no
    prefix or `model.`, whichever holds more expected names; their moving average; DiLoCo's anchors). Optimizer,
    data loader and train state entries are not read."""
    flag, what, prefixes, saved_by = WEIGHT_SETS[weight_set]
    stored = read_dcp_tensor_shapes(folder)
    prefix = max(prefixes, key=lambda p: sum(p + k in stored for k in expected))
    names = [prefix + k for k in expected if prefix + k in stored]
    if not names and weight_set != "model":
        raise ConfigError(f"{flag}: {folder} holds no {what} (no '{prefix}*' tensors); {saved_by} save them")
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
