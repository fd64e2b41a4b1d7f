"""Every rule of a valid job, checked once: `check_job(cfg, world_size)`.

`titan train` calls it in the launching process before torchrun starts any
process, and each training process calls it again (for `torchrun -m
titan_core.launch` users) and trains from what it returns: the parallel
degrees, the model's shape, the pipeline's stages and the accumulation steps.

The rules themselves live with the code they protect: titan-parallel states
what makes a layout valid (`ParallelDims`, `check_tp`, `check_cp`,
`check_pipeline`, ...) and raises `ParallelConfigError` naming its own
arguments (`tp`, `microbatch_size`, ...). This module only feeds each rule the
config's values and turns its argument names into the config keys they came
from (`ARGUMENT_KEYS`), so a user reads one line naming `--parallelism.*` keys.
A rule that is Titan's alone (the global batch, validation under pipeline
parallel) is written here. `RULES` lists them all, in the order they run.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import re
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from titan_core.config.errors import ConfigError, MissingPackageError
from titan_core.config.schema import JobConfig

if TYPE_CHECKING:  # torch-heavy imports load inside the rules that need them
    import torch.nn as nn

    from titan_models import ModelSpec
    from titan_parallel import ParallelDims, PipelineConfig

ARGUMENT_KEYS: dict[str, str] = {
    # titan-parallel: ParallelDims, resolve_device, check_* and PipelineConfig arguments
    "dp_replicate": "parallelism.data_parallel_replicate_degree",
    "dp_shard": "parallelism.data_parallel_shard_degree",
    "cp": "parallelism.context_parallel_degree",
    "tp": "parallelism.tensor_parallel_degree",
    "pp": "parallelism.pipeline_parallel_degree",
    "ep": "parallelism.expert_parallel_degree",
    "world_size": "the world size (--nproc-per-node x --nnodes)",
    "dp_mode": "parallelism.dp_mode",
    "seq_len": "training.seq_len",
    "local_batch_size": "training.local_batch_size",
    "device": "training.device",
    "device_type": "training.device",
    "compile": "compile.enable",
    "async_tp": "parallelism.enable_async_tensor_parallel",
    "cp_rotate_method": "parallelism.context_parallel_rotate_method",
    "ac_mode": "activation_checkpoint.mode",
    "ac_selective_option": "activation_checkpoint.selective_ac_option",
    "schedule": "parallelism.pipeline_parallel_schedule",
    "schedule_csv": "parallelism.pipeline_parallel_schedule_csv",
    "microbatch_size": "parallelism.pipeline_parallel_microbatch_size",
    "layers_per_stage": "parallelism.pipeline_parallel_layers_per_stage",
    "first_stage_less_layers": "parallelism.pipeline_parallel_first_stage_less_layers",
    "last_stage_less_layers": "parallelism.pipeline_parallel_last_stage_less_layers",
    "module_names_per_stage": "parallelism.module_fqns_per_model_part",
    "enable_fsdp_float8_all_gather": "float8.enable_fsdp_float8_all_gather",
    "precompute_float8_dynamic_scale_for_fsdp": "float8.precompute_float8_dynamic_scale_for_fsdp",
    "emulate": "float8.emulate",
    # titan-ckpt: CheckpointManager arguments
    "load_step": "checkpoint.load_step",
    "exclude_from_loading": "checkpoint.exclude_from_loading",
    "async_mode": "checkpoint.async_mode",
    "interval": "checkpoint.interval",
    "keep_latest_k": "checkpoint.keep_latest_k",
    "initial_load_path": "checkpoint.initial_load_path",
    "initial_load_model_only": "checkpoint.initial_load_model_only",
    "folder": "checkpoint.folder",
    "enable": "checkpoint.enable",
    "load_model_fn": "checkpoint.initial_load_in_hf",
    "model_parts": "model.flavor",
}
"""The config key behind each library argument a `ParallelConfigError` / `CheckpointError` can name.
Where one argument name means different keys (`recipe_name` of [float8] and [mx]), the rule passes its own."""


def as_config_error(error: Exception, keys: Mapping[str, str] | None = None) -> ConfigError:
    """`error`'s message with each argument it names (`error.arguments`) replaced by its config key.

    Args:
        error: a library error carrying `arguments` (parameter names, each a whole word of the message).
        keys: argument -> config key; `ARGUMENT_KEYS` plus these overrides.
    """
    table = {**ARGUMENT_KEYS, **(keys or {})}
    message = str(error)
    for argument in getattr(error, "arguments", ()):
        if argument in table:
            key = table[argument]
            message = re.sub(rf"(?<![\w./]){re.escape(argument)}(?![\w/])", key, message)
            # Python's True/False as the config writes them.
            message = re.sub(rf"{re.escape(key)}=(True|False)\b", lambda m: f"{key}={m.group(1).lower()}", message)
    return ConfigError(message)


@dataclass
class CheckedJob:
    """What the rules established, for the trainer to build from.

    Args:
        cfg: the job config.
        world_size: number of processes; None when not known yet (an elastic `--nnodes` range).
        device_type: "cuda" or "cpu", as `training.device` resolves here (or the target device of an estimate).
        target_device: the device type the job is checked for without running here ("cuda" or "cpu"), as
            `titan estimate-memory` and `titan plan` do on a host without the GPUs; None = this host's device.
        dims: the parallel degrees (`dp_shard = -1` resolved); None until the world size is known.
        spec: the model family.
        model_args: the model's shape (flavor, widened to the tokenizer's vocab and `training.seq_len`).
        hf_source: the Hugging Face checkpoint folder the shape came from, if any.
        names_per_stage: module names of each pipeline stage (pipeline parallel only).
        global_batch: sequences per optimizer step over all ranks.
        accum_steps: micro-batches accumulated per step.
        tokenizer_vocab_size: the tokenizer's number of tokens.
        vocab_widened_from: the flavor's vocab size when the tokenizer widened it, else None.
    """

    cfg: JobConfig
    world_size: int | None
    device_type: str = "cpu"
    target_device: str | None = None
    dims: ParallelDims | None = None
    spec: ModelSpec | None = None
    model_args: Any = None  # the family's args dataclass (`ModelSpec[ArgsT]`)
    hf_source: str | None = None
    names_per_stage: list[list[str]] | None = None
    global_batch: int = 0
    accum_steps: int = 1
    tokenizer_vocab_size: int = 0
    vocab_widened_from: int | None = None
    _meta_model: nn.Module | None = field(default=None, repr=False)

    def meta_model(self) -> nn.Module:
        """The whole model on the meta device (built once, costs no memory), for its structure and shapes."""
        if self._meta_model is None:
            self._meta_model = _build_meta_model(self.spec, self.model_args)
        return self._meta_model


_META_MODELS: dict[tuple[str, Any], nn.Module] = {}


def _build_meta_model(spec: ModelSpec, model_args: Any) -> nn.Module:
    """`spec.build(model_args)` on the meta device, built once per shape (the last few kept):
    `titan plan` checks hundreds of layouts of one model, and the rules only read the structure."""
    import torch

    key = (spec.name, model_args)
    if key not in _META_MODELS:
        if len(_META_MODELS) >= 4:
            _META_MODELS.pop(next(iter(_META_MODELS)))
        with torch.device("meta"), _skip_init():
            _META_MODELS[key] = spec.build(model_args)
    return _META_MODELS[key]


@contextlib.contextmanager
def _skip_init() -> Iterator[None]:
    """Make `torch.nn.init`'s in-place initialisers no-ops while a structure-only model is built.

    Initialising meta tensors computes nothing, but its first use imports torch's
    decomposition machinery (torch._dynamo, ~1.5 s): the launching process would pay it
    only to check shapes. transformers' `no_init_weights` does the same.
    """
    import torch.nn.init as init

    saved = {
        name: fn for name, fn in vars(init).items() if name.endswith("_") and not name.startswith("_") and callable(fn)
    }
    try:
        for name in saved:
            setattr(init, name, lambda tensor, *args, **kwargs: tensor)
        yield
    finally:
        for name, fn in saved.items():
            setattr(init, name, fn)


Rule = Callable[[CheckedJob], None]


def _device(job: CheckedJob) -> None:
    """`training.device = 'cuda'` needs a visible GPU; fixes the device type every later rule sees."""
    from titan_parallel import resolve_device

    if job.target_device is not None:  # checked for another host: `training.device` is not looked up here
        job.device_type = job.target_device
        return
    job.device_type = resolve_device(job.cfg.training.device).type


def _model_shape(job: CheckedJob) -> None:
    """The model name and flavor exist; a tokenizer larger than a Hugging Face checkpoint's vocab is refused."""
    from titan_core.data import build_tokenizer
    from titan_models import ModelConfigError, get_model_args, get_model_spec

    cfg = job.cfg
    try:
        job.spec = get_model_spec(cfg.model.name)
        args = get_model_args(cfg.model.name, cfg.model.flavor)
    except ModelConfigError as e:  # unknown name or flavor: the message names model.name / model.flavor
        raise ConfigError(str(e)) from None
    vocab = job.tokenizer_vocab_size or build_tokenizer(cfg.model.hf_assets_path).vocab_size
    ckpt = cfg.checkpoint
    if ckpt.initial_load_in_hf and ckpt.initial_load_path:
        # Any checkpoint of the family: the shape comes from its own config.json, not model.flavor.
        from titan_ckpt import read_hf_config, resolve_hf_source

        job.hf_source = str(resolve_hf_source(ckpt.initial_load_path))
        args = job.spec.hf_adapter.args_from_hf_config(read_hf_config(job.hf_source))
        if vocab > args.vocab_size:
            raise ConfigError(
                f"the tokenizer in model.hf_assets_path has {vocab} tokens but the checkpoint "
                f"checkpoint.initial_load_path={ckpt.initial_load_path} only {args.vocab_size}; use the checkpoint's own tokenizer"
            )
    elif vocab > args.vocab_size:
        # A flavor's vocab is a default: a larger tokenizer (e.g. Llama 3's on a small flavor) widens it.
        job.vocab_widened_from = args.vocab_size
        args = dataclasses.replace(args, vocab_size=vocab)
    job.tokenizer_vocab_size = vocab
    job.model_args = dataclasses.replace(args, max_seq_len=max(args.max_seq_len, cfg.training.seq_len))


def _degrees(job: CheckedJob) -> None:
    """The parallel degrees multiply to the world size; DDP replicates whole models only."""
    from titan_parallel import ParallelDims, check_data_parallel

    if job.world_size is None:
        return
    p = job.cfg.parallelism
    job.dims = ParallelDims(
        dp_replicate=p.data_parallel_replicate_degree,
        dp_shard=p.data_parallel_shard_degree,
        cp=p.context_parallel_degree,
        tp=p.tensor_parallel_degree,
        pp=p.pipeline_parallel_degree,
        world_size=job.world_size,
        ep=p.expert_parallel_degree,
    )
    check_data_parallel(job.dims, p.dp_mode)


def _batch(job: CheckedJob) -> None:
    """`training.global_batch_size` is a multiple of local_batch_size x the data-parallel degree."""
    if job.dims is None:
        return
    t = job.cfg.training
    per_step = t.local_batch_size * job.dims.dp
    job.global_batch = per_step if t.global_batch_size == -1 else t.global_batch_size
    if job.global_batch % per_step:
        raise ConfigError(
            f"training.global_batch_size={job.global_batch} must be a multiple of training.local_batch_size x "
            f"data-parallel degree = {t.local_batch_size} x {job.dims.dp} = {per_step}; change one of them"
        )
    job.accum_steps = job.global_batch // per_step


def _tensor_parallel(job: CheckedJob) -> None:
    """The TP degree divides the heads, the feed-forward width and the vocab; async TP needs compile on CUDA."""
    from titan_parallel import check_async_tp, check_tp

    p, c = job.cfg.parallelism, job.cfg.compile
    check_tp(job.meta_model(), job.spec.plan, p.tensor_parallel_degree)
    if p.enable_async_tensor_parallel:
        check_async_tp(p.tensor_parallel_degree, job.device_type, c.enable and "model" in c.components)


def _expert_parallel(job: CheckedJob) -> None:
    """The expert-parallel degree divides each MoE layer's experts (and is carved from dp_shard x cp)."""
    from titan_parallel.expert_parallel import check_ep

    check_ep(job.meta_model(), job.spec.plan, job.cfg.parallelism.expert_parallel_degree)


def _context_parallel(job: CheckedJob) -> None:
    """The sequence splits into 2 x cp chunks (x tp under sequence parallel); a known K/V exchange."""
    from titan_parallel import check_cp, check_rotate_method

    p = job.cfg.parallelism
    check_cp(job.cfg.training.seq_len, p.context_parallel_degree, p.tensor_parallel_degree)
    args = job.model_args if p.context_parallel_degree > 1 else None  # MLA's key and value head dims differ
    check_rotate_method(
        p.context_parallel_rotate_method, getattr(args, "qk_head_dim", None), getattr(args, "v_head_dim", None)
    )


def _activation_checkpoint(job: CheckedJob) -> None:
    """A known AC mode; 'selective' takes 'op' or a positive int."""
    from titan_parallel import check_ac

    ac = job.cfg.activation_checkpoint
    check_ac(ac.mode, ac.selective_ac_option)


def pipeline_config(cfg: JobConfig) -> PipelineConfig:
    """The `parallelism.pipeline_*` keys as titan-parallel's `PipelineConfig`."""
    from titan_parallel import PipelineConfig

    p = cfg.parallelism
    return PipelineConfig(
        schedule=p.pipeline_parallel_schedule,
        schedule_csv=p.pipeline_parallel_schedule_csv,
        microbatch_size=p.pipeline_parallel_microbatch_size,
        layers_per_stage=p.pipeline_parallel_layers_per_stage,
        first_stage_less_layers=p.pipeline_parallel_first_stage_less_layers,
        last_stage_less_layers=p.pipeline_parallel_last_stage_less_layers,
        module_names_per_stage=p.module_fqns_per_model_part,
    )


def _pipeline(job: CheckedJob) -> None:
    """A known schedule; stages that divide over the ranks as the schedule places them; enough micro-batches."""
    from titan_parallel import check_pipeline

    p = job.cfg.parallelism
    n_layers = len(job.meta_model().get_submodule(job.spec.plan.blocks))
    names_per_stage = check_pipeline(
        pipeline_config(job.cfg),
        pp=p.pipeline_parallel_degree,
        n_layers=n_layers,
        local_batch_size=job.cfg.training.local_batch_size,
        plan=job.spec.plan,
    )
    if p.pipeline_parallel_degree == 1:
        return  # one stage: the schedule's name was checked, there is nothing to cut
    job.names_per_stage = names_per_stage
    if job.cfg.validation.enable:
        raise ConfigError("validation.enable is not supported with pipeline parallel yet; set it to false")


def _checkpoint(job: CheckedJob) -> None:
    """[checkpoint] keys (and training.on_nonfinite='rollback') that need checkpoint.enable; a seed checkpoint on one process; a Hugging Face
    export of the model only, from an unpipelined model."""
    ckpt = job.cfg.checkpoint
    if not ckpt.enable:
        for key in ("create_seed_checkpoint", "initial_load_path", "last_save_in_hf", "initial_load_in_hf"):
            if getattr(ckpt, key):
                raise ConfigError(f"checkpoint.{key} is set but checkpoint.enable is false; add --checkpoint.enable")
    if ckpt.create_seed_checkpoint and job.world_size not in (None, 1):
        raise ConfigError(
            f"checkpoint.create_seed_checkpoint runs on one process, not {job.world_size}; launch it with --nproc-per-node 1"
        )
    if ckpt.last_save_in_hf and not ckpt.last_save_model_only:
        raise ConfigError(
            "checkpoint.last_save_in_hf saves model weights only; also set checkpoint.last_save_model_only = true"
        )
    if job.cfg.training.on_nonfinite == "rollback" and not ckpt.enable:
        raise ConfigError(
            "training.on_nonfinite = 'rollback' reloads the newest checkpoint; add --checkpoint.enable true"
        )
    if ckpt.last_save_in_hf and job.cfg.parallelism.pipeline_parallel_degree > 1:
        raise ConfigError(
            "checkpoint.last_save_in_hf does not gather pipeline stages yet; save in DCP and run "
            "`titan convert <run>/checkpoint/step-N OUT --to hf`"
        )


def _profiling(job: CheckedJob) -> None:
    """A profiled step has a warm-up step before it; memory snapshots record CUDA's allocator."""
    from titan_core.profiling import MIN_FREQ

    pr = job.cfg.profiling
    if (pr.enable_profiling or pr.enable_memory_snapshot) and pr.profile_freq < MIN_FREQ:
        raise ConfigError(f"profiling.profile_freq must be >= {MIN_FREQ}, got {pr.profile_freq}")
    if pr.enable_memory_snapshot and job.device_type != "cuda":
        raise ConfigError(
            "profiling.enable_memory_snapshot records the CUDA caching allocator and needs a CUDA device; set it to false on CPU"
        )


def _converters(job: CheckedJob) -> None:
    """One converter per linear; [float8] options that work together; MXFP8 only on hardware that has it; torchao installed."""
    from titan_core.converters import float8_options, mx_options

    names = job.cfg.model.converters
    if "float8" in names and "mx" in names:
        raise ConfigError("model.converters lists both 'float8' and 'mx'; a linear is converted once: keep one")
    if "float8" in names:
        from titan_parallel.float8 import check_float8

        _translated(
            check_float8,
            {"recipe_name": "float8.recipe_name", "filter_fqns": "float8.filter_fqns"},
            float8_options(job.cfg, job.device_type),
        )
    if "mx" in names:
        from titan_parallel.float8 import check_mx

        _translated(
            check_mx,
            {"recipe_name": "mx.recipe_name", "filter_fqns": "mx.filter_fqns", "device_type": "training.device"},
            mx_options(job.cfg),
            job.device_type,
            prefix="model.converters = ['mx']: ",
        )
    if ("float8" in names or "mx" in names) and importlib.util.find_spec("torchao") is None:
        from titan_parallel.float8 import INSTALL_HINT

        raise MissingPackageError(
            f"model.converters = {list(names)} needs torchao, which is not installed; {INSTALL_HINT}"
        )


def _translated(rule: Callable[..., None], keys: Mapping[str, str], *args: Any, prefix: str = "") -> None:
    """Call a library rule, naming config keys (`keys` over `ARGUMENT_KEYS`) in its error, after `prefix`."""
    from titan_parallel import ParallelConfigError

    try:
        rule(*args)
    except ParallelConfigError as e:
        raise ConfigError(prefix + str(as_config_error(e, keys))) from None


def _metrics(job: CheckedJob) -> None:
    """`metrics.enable_wandb` needs the optional wandb package (`titan-core[wandb]`)."""
    if job.cfg.metrics.enable_wandb:
        from titan_core.metrics.wandb_sink import require_wandb

        require_wandb()


RULES: tuple[tuple[str, Rule], ...] = (
    ("device", _device),
    ("model_shape", _model_shape),
    ("degrees", _degrees),
    ("batch", _batch),
    ("tensor_parallel", _tensor_parallel),
    ("expert_parallel", _expert_parallel),
    ("context_parallel", _context_parallel),
    ("activation_checkpoint", _activation_checkpoint),
    ("pipeline", _pipeline),
    ("converters", _converters),
    ("checkpoint", _checkpoint),
    ("profiling", _profiling),
    ("metrics", _metrics),
)
"""Every rule of a valid job, by name, in the order `check_job` runs them (later rules use earlier results)."""


def check_job(
    cfg: JobConfig, world_size: int | None, *, tokenizer_vocab_size: int = 0, target_device: str | None = None
) -> CheckedJob:
    """Run every rule of `RULES` on `cfg`; raise `ConfigError` (one line naming the keys) at the first broken one.

    Args:
        cfg: the job config.
        world_size: the number of processes; None skips the rules that need it (an elastic range).
        tokenizer_vocab_size: the tokenizer's size when the caller has built it already (0: build it).
        target_device: check the job for this device type ("cuda" / "cpu") instead of this host's.

    Returns:
        The checked job: degrees, model shape, pipeline stages and batch arithmetic.
    """
    from titan_ckpt import CheckpointError
    from titan_parallel import ParallelConfigError

    job = CheckedJob(cfg, world_size, tokenizer_vocab_size=tokenizer_vocab_size, target_device=target_device)
    for _, rule in RULES:
        try:
            rule(job)
        except (ParallelConfigError, CheckpointError) as e:
            raise as_config_error(e) from None
    return job
