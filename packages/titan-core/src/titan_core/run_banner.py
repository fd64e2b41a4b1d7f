"""The line `titan train` prints at start-up: what this run trains, on what, and how.

Built from the resolved job, so it follows whatever model, data and layout the config
asked for; `job.description`, a line the user writes, follows it when set.
"""

from __future__ import annotations

from collections.abc import Sequence

from titan_core.data.corpus import looks_like_path, torchtitan_dataset
from titan_core.job import Job
from titan_core.job.run_rules import validation_set_names


def run_banner(job: Job) -> str:
    """One line: model and size, data and tokenizer, batch and sequence length, dtype and device,
    processes and layout, then `job.description` when set.

    Args:
        job: the resolved job (its world size known, as in a training process).
    """
    cfg, t = job.cfg, job.cfg.training
    n_params = job.spec.count_params(job.model_args)
    n_active = job.spec.active_params(job.model_args)
    active = f", {n_active / 1e6:.1f}M active" if n_active != n_params else ""
    if cfg.model.attn_mask_type == "block_causal":
        active += ", attention within each document"
    if depths := getattr(job.model_args, "n_mtp_layers", 0):
        plural = "s" if depths > 1 else ""
        active += f", {depths} multi-token-prediction depth{plural} (loss weight {cfg.mtp.loss_weight:g})"
    if mup := getattr(job.model_args, "mup", None):
        width = mup.width_multiplier(job.model_args.dim)
        active += f", muP at {width:g}x the width {mup.base_dim} it was tuned at"
    source = (
        describe_mix(t.dataset_mix, t.shuffle, t.dataset_mix_phases)
        if t.dataset_mix
        else describe_dataset(t.dataset, t.dataset_path)
    )
    data = f"data: {source}"
    if cfg.validation.enable and cfg.validation.sets:
        data += f", validation sets {', '.join(validation_set_names(cfg.validation.sets))}"
    elif cfg.validation.enable:
        data += f", validation {describe_dataset(cfg.validation.dataset, cfg.validation.dataset_path, held_out=True)}"
    if cfg.validation.enable and cfg.validation.seq_len not in (None, t.seq_len):
        data += f" at {cfg.validation.seq_len} tokens per sequence"
    shape = f" with {', '.join(cfg.model.shape)}" if cfg.model.shape else ""
    # A checkpoint in Hugging Face format brings its own shape (model.flavor is not used)
    origin = f" from the Hugging Face weights in {job.hf_source}" if job.hf_source else f"/{cfg.model.flavor}"
    tokenizer = f"tokenizer {cfg.model.hf_assets_path}" if cfg.model.hf_assets_path else "byte tokenizer"
    parts = [
        f"model {cfg.model.name}{origin}{shape} ({n_params / 1e6:.1f}M params{active})",
        f"{data}, {tokenizer}",
        _describe_batch(job),
        _describe_compute(job),
        _describe_layout(job),
    ]
    if cfg.job.description:
        parts.append(cfg.job.description)
    return " | ".join(parts)


def describe_dataset(dataset: str, dataset_path: str | None, held_out: bool = False) -> str:
    """Where a `[training]` / `[validation]` section reads its documents from, in a few words.

    Args:
        dataset: the section's `dataset`.
        dataset_path: the section's `dataset_path` (local files or token shards; wins over `dataset`).
        held_out: the `[validation]` section's, which reads the stdlib corpus's held-out files.
    """
    if dataset_path:
        return dataset_path if dataset == "stdlib" else f"{dataset} from {dataset_path}"
    if dataset == "stdlib":
        return "the stdlib corpus's held-out files" if held_out else "the built-in Python stdlib corpus"
    if (torchtitan := torchtitan_dataset(dataset)) is not None:
        read, split = torchtitan
        return f"{dataset} (torchtitan's name: {read}{f', {split} split' if split else ''})"
    return dataset if looks_like_path(dataset) else f"{dataset} (Hugging Face)"


def describe_mix(mix: list, shuffle: bool, phases: Sequence = ()) -> str:
    """`mix of web 70% + code 30%, from step 800 web 50% + math 50% (token shards shuffled)`; text sources, which
    are tokenized in document order, named as such (`... (token shards shuffled: web; text tokenized in document
    order: code)`).

    Args:
        mix: `training.dataset_mix`'s entries.
        shuffle: `training.shuffle`.
        phases: `training.dataset_mix_phases`' entries.
    """
    from titan_core.data.mix_schedule import describe_weights
    from titan_core.data.mix_sources import default_name
    from titan_core.data.token_shards import is_token_shard_folder

    names = [entry.name or default_name(entry.path) for entry in mix]
    text = f"mix of {describe_weights(names, [entry.weight for entry in mix])}"
    for phase in phases:
        text += f", from step {phase.step} {describe_weights(names, [phase.weights.get(n, 0.0) for n in names])}"
    shards = [is_token_shard_folder(entry.path) for entry in mix]
    order = f"token shards {'shuffled' if shuffle else 'in file order'}"
    if all(shards):
        return f"{text} ({order})"
    text_order = "text tokenized in document order"
    if not any(shards):
        return f"{text} ({text_order})"
    sharded = ", ".join(n for n, shard in zip(names, shards, strict=True) if shard)
    read_as_text = ", ".join(n for n, shard in zip(names, shards, strict=True) if not shard)
    return f"{text} ({order}: {sharded}; {text_order}: {read_as_text})"


def _describe_batch(job: Job) -> str:
    """'global batch 8 x seq_len 256, 1 micro-batch per step' (`BatchRamp.describe`)."""
    seq = f"seq_len {job.cfg.training.seq_len}"
    if job.batch_ramp is None:  # the world size is not known yet
        return f"local batch {job.cfg.training.local_batch_size} x {seq}"
    return job.batch_ramp.describe(job.cfg.training.seq_len)


def _describe_compute(job: Job) -> str:
    """'bfloat16 on cuda, float8 tensorwise, compiled, AC selective op'."""
    dtype = str(job.parallel.param_dtype).removeprefix("torch.")
    parts = [f"{dtype} on {job.device_type}"]
    if job.converters.float8 is not None:
        parts.append(f"float8 {job.converters.float8.recipe_name}")
    if job.converters.mx is not None:
        parts.append(f"MX {job.converters.mx.recipe_name}")
    if job.cfg.compile.enable:
        backend = f"; {job.cfg.compile.backend}" if job.cfg.compile.backend != "auto" else ""
        parts.append(f"compiled ({', '.join(job.cfg.compile.components)}{backend})")
    ac = job.cfg.activation_checkpoint
    if ac.mode != "none":
        detail = {"selective": f" {ac.selective_ac_option}", "memory_budget": f" {ac.memory_budget:g}"}.get(ac.mode, "")
        parts.append(f"AC {ac.mode}{detail}")
    return ", ".join(parts)


def _describe_layout(job: Job) -> str:
    """'1 process', or '8 processes: dp_shard=2 x tp=4' ('cp=2 Ulysses' under Ulysses context parallel; 'ep=4 (etp=1:
    over the tp ranks too)' when the TP ranks join expert parallel)."""
    if job.dims is None:
        return "world size not known yet"
    d = job.dims
    degrees = {"dp_replicate": d.dp_replicate, "dp_shard": d.dp_shard, "cp": d.cp, "tp": d.tp, "pp": d.pp}
    split = " x ".join(
        f"{name}={value}" + (" Ulysses" if name == "cp" and job.parallel.cp_method == "ulysses" else "")
        for name, value in degrees.items()
        if value > 1
    )
    if d.ep > 1:
        split += f", ep={d.ep}" + (" (etp=1: over the tp ranks too)" if d.ep_spans_tp else "")
    if d.world_size == 1:
        return "1 process"
    return f"{d.world_size} processes: {split}"
