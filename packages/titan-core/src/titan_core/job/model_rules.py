"""The rules about the model a job trains: its name, flavor and `model.shape`, `[moe]`'s and `[mup]`'s settings,
and its multi-token-prediction depths. Part of `titan_core.job.rules.RULES`, which runs them before the layout rules
(whose checks read the model's final shape), the depths' right after the parallel degrees (it reads the pipeline's).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING, Any

from titan_core.config.errors import ConfigError

if TYPE_CHECKING:
    from titan_core.job.rules import Draft

__all__ = ["SPLIT_BACKWARD_SCHEDULES", "model_shape", "moe", "mtp", "mup"]


def model_shape(d: Draft) -> None:
    """The model name and flavor exist and `model.shape` changes fields the args have; a tokenizer larger than a
    Hugging Face checkpoint's vocab is refused."""
    from titan_core.data import build_tokenizer
    from titan_core.model_shape import apply_shape, for_seq_len
    from titan_models import ModelConfigError, get_model_args, get_model_spec

    cfg = d.cfg
    try:
        d.spec = get_model_spec(cfg.model.name)
        args = get_model_args(cfg.model.name, cfg.model.flavor)
    except ModelConfigError as e:  # unknown name or flavor: the message names model.name / model.flavor
        raise ConfigError(str(e)) from None
    vocab = d.tokenizer_vocab_size or build_tokenizer(cfg.model.hf_assets_path).vocab_size
    ckpt = cfg.checkpoint
    if ckpt.initial_load_in_hf and ckpt.initial_load_path:
        # Any checkpoint of the family: the shape comes from its own config.json, not model.flavor.
        from titan_ckpt import read_hf_config, resolve_hf_source

        if d.spec.hf_adapter is None:
            raise ConfigError(
                f"checkpoint.initial_load_in_hf: model.name={cfg.model.name!r} has no Hugging Face adapter; "
                "load a DCP checkpoint instead"
            )
        d.hf_source = str(resolve_hf_source(ckpt.initial_load_path))
        args = d.spec.hf_adapter.args_from_hf_config(read_hf_config(d.hf_source))
        if cfg.model.shape:  # settings that keep every weight's shape: RoPE, norm eps (a longer context)
            args = _same_weights(d.spec, args, apply_shape(args, cfg.model.shape), cfg.model.shape)
        if vocab > args.vocab_size:
            raise ConfigError(
                f"the tokenizer in model.hf_assets_path has {vocab} tokens but the checkpoint "
                f"checkpoint.initial_load_path={ckpt.initial_load_path} only {args.vocab_size}; "
                "use the checkpoint's own tokenizer"
            )
    else:
        args = apply_shape(args, cfg.model.shape)
    if not (ckpt.initial_load_in_hf and ckpt.initial_load_path) and vocab > args.vocab_size:
        # A flavor's vocab is a default: a larger tokenizer (e.g. Llama 3's on a small flavor) widens it.
        d.vocab_widened_from = args.vocab_size
        args = dataclasses.replace(args, vocab_size=vocab)
    d.tokenizer_vocab_size = vocab
    v = cfg.validation
    longest = max(cfg.training.seq_len, (v.seq_len or 0) if v.enable else 0)  # a longer validation.seq_len too
    d.model_args = for_seq_len(args, longest)


def _same_weights(spec: Any, args: Any, changed: Any, shape: list[str]) -> Any:
    """`changed`, refused in one line where it changes a weight's shape from `args`' (a Hugging Face checkpoint's)."""
    import torch

    with torch.device("meta"):
        before = {n: tuple(p.shape) for n, p in spec.build(args).state_dict().items()}
        after = {n: tuple(p.shape) for n, p in spec.build(changed).state_dict().items()}
    if before != after:
        name = next((n for n in sorted(before.keys() | after.keys()) if before.get(n) != after.get(n)), "")
        raise ConfigError(
            f"model.shape {shape}: the Hugging Face checkpoint in checkpoint.initial_load_path brings its weights' "
            f"shapes, which this changes ({name}: {before.get(name)} -> {after.get(name)}); keep to settings that "
            "leave every weight as it is (rope_theta, rope_scaling.*, norm_eps, max_seq_len)"
        )
    return changed


def moe(d: Draft) -> None:
    """`[moe]`'s coefficients (and `debug.moe_force_load_balance`) replace the flavor's (or the Hugging Face
    config's) in every MoE layer; a dense model has none to replace."""
    given = {key: value for key, value in d.cfg.moe.model_dump().items() if value is not None}
    keys = [f"moe.{key}" for key in given]
    if d.cfg.debug.moe_force_load_balance:
        given["force_load_balance"] = True
        keys.append("debug.moe_force_load_balance")
    if not keys:
        return
    moe = getattr(d.model_args, "moe", None)
    if moe is None:
        raise ConfigError(
            f"{', '.join(keys)}: model.name={d.cfg.model.name!r} flavor {d.cfg.model.flavor!r} has no "
            f"Mixture-of-Experts layers; remove {'it' if len(keys) == 1 else 'them'} or choose an MoE flavor"
        )
    if given.get("load_balance_coeff") == 0:
        given["load_balance_coeff"] = None  # no expert bias
    d.model_args = dataclasses.replace(d.model_args, moe=dataclasses.replace(moe, **given))  # values checked by [moe]


def mup(d: Draft) -> None:
    """`[mup]` on a dense Llama 3 or Qwen3 with untied embeddings, trained by Adam or AdamW (Muon's update already
    scales with each matrix's shape)."""
    from titan_core.model_shape import apply_mup

    if not d.cfg.mup.enable:
        return
    if d.cfg.optimizer.name == "Muon":
        raise ConfigError(
            "mup.enable = true with optimizer.name = 'Muon': muP scales Adam's learning rates, and Muon's update "
            "is already scaled by each matrix's shape; use optimizer.name = 'AdamW' or set mup.enable = false"
        )
    d.model_args = apply_mup(d.model_args, d.cfg.mup.model_dump())


SPLIT_BACKWARD_SCHEDULES = ("InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")
"""Pipeline schedules that split each stage's backward into input and weight gradients."""


def mtp(d: Draft) -> None:
    """`mtp.layers` sets the multi-token-prediction depths of a family that has them (`ModelArgs.n_mtp_layers`:
    every built-in one; under pipeline parallel the last stage runs them, with a copy of the embedding, on a
    schedule that does not split the weight gradients); a Hugging Face checkpoint to start from must hold that
    many (its own are loaded only as far as it asks)."""
    layers = d.cfg.mtp.layers
    if not hasattr(d.model_args, "n_mtp_layers"):
        if layers:
            raise ConfigError(
                f"mtp.layers={layers}: model.name={d.cfg.model.name!r} has no multi-token prediction; "
                "use a family whose ModelArgs has n_mtp_layers (llama3, qwen3, qwen3_moe, deepseek_v3) or set "
                "mtp.layers = 0"
            )
        return
    schedule = d.cfg.parallelism.pipeline_parallel_schedule
    if layers and d.dims is not None and d.dims.pp > 1 and schedule in SPLIT_BACKWARD_SCHEDULES:
        # measured (torch 2.15): "Trying to backward through the graph a second time" in stage_backward_weight
        raise ConfigError(
            f"mtp.layers={layers} with parallelism.pipeline_parallel_schedule='{schedule}': torch's zero-bubble "
            "schedules take a stage's weight gradients from its input's graph, and the depths' embedding is not on "
            "it; use 1F1B, GPipe or Interleaved1F1B, or set mtp.layers = 0"
        )
    if layers and d.hf_source is not None:  # the depths are loaded with the model: they must be in the checkpoint
        from titan_ckpt import read_hf_config
        from titan_core.model_source import hf_mtp_layers

        source = Path(d.hf_source)
        held = hf_mtp_layers(
            source, dataclasses.replace(d.model_args, n_mtp_layers=0), read_hf_config(source)
        ).n_mtp_layers
        if layers > held:
            raise ConfigError(
                f"mtp.layers={layers}: the Hugging Face checkpoint in checkpoint.initial_load_path holds {held} "
                f"prediction depths; set mtp.layers = {held} (or start from a Titan checkpoint that has them)"
            )
    d.model_args = dataclasses.replace(d.model_args, n_mtp_layers=layers)
