"""Every rule of a valid job, in the order `resolve` runs each of them once: `RULES`.

The rules live with the code they protect: titan-parallel states what makes a
layout valid (`ParallelDims`, `check_tp`, `check_cp`, `check_pipeline`, ...) and
raises `ParallelConfigError` naming its own arguments (`tp`, `microbatch_size`,
...). A rule here feeds it the job's values, built once as the library's own
options (`titan_core.job.options`), and declares the config key behind each
argument (`Rule.keys`), so that the error names the key to change. A rule that
is Titan's alone (the global batch, validation's batch under pipeline parallel) is
written here and names its keys itself.

Each rule reads what the rules before it established from the `Draft` and adds
its own; `resolve` freezes the draft into the `Job` once every rule passed.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import inspect
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from titan_core.config.errors import ConfigError, MissingPackageError
from titan_core.config.schema import JobConfig
from titan_core.job.meta_model import build_meta_model
from titan_core.job.naming import RUN_KEYS, naming
from titan_core.job.options import (
    DEVICE_KEY,
    DIMS_KEYS,
    PARALLEL_OPTION_KEYS,
    PIPELINE_KEYS,
    parallel_dims,
    parallel_options,
    pipeline_config,
)
from titan_core.job.run_rules import fault_tolerance, master_weights

if TYPE_CHECKING:
    import torch
    import torch.nn as nn

    from titan_core.batch_ramp import BatchRamp
    from titan_core.converters import Converters
    from titan_models import ModelSpec
    from titan_parallel import ParallelDims, ParallelOptions, PipelineConfig


@dataclass
class Draft:
    """What the rules have established so far (private to `titan_core.job`; `resolve` freezes it).

    A field without a default is set by the rule that establishes it (see `Job` for each);
    reading it before that rule ran raises AttributeError.
    """

    cfg: JobConfig
    world_size: int | None
    target_device: str | None
    tokenizer_vocab_size: int
    device_type: str = field(init=False)
    parallel: ParallelOptions = field(init=False)
    dtype_reason: str = field(init=False)
    dtype_warning: str | None = None
    spec: ModelSpec = field(init=False)
    model_args: Any = field(init=False)
    hf_source: str | None = None
    vocab_widened_from: int | None = None
    dims: ParallelDims | None = None
    global_batch: int | None = None
    accum_steps: int | None = None
    batch_ramp: BatchRamp | None = None
    pipeline: PipelineConfig = field(init=False)
    names_per_stage: list[list[str]] | None = None
    converters: Converters = field(init=False)
    weights_reason: str = ""
    warmup_steps: int = field(init=False)
    warmup_note: str | None = None
    meta: nn.Module | None = None

    def meta_model(self) -> nn.Module:
        """The whole model on the meta device, built on first use."""
        if self.meta is None:
            self.meta = build_meta_model(self.spec, self.model_args)
        return self.meta


@dataclass(frozen=True)
class Rule:
    """One rule of a valid job.

    Args:
        name: what it checks, e.g. "pipeline".
        check: raises at the first broken condition; records what it establishes on the draft.
        keys: argument -> config key, for the library calls `check` makes (`titan_core.job.naming`).
    """

    name: str
    check: Callable[[Draft], None]
    keys: Mapping[str, str] = field(default_factory=dict)


def _device(d: Draft) -> None:
    """`training.device = 'cuda'` needs a visible GPU; fixes the device type and the compute dtype
    (`training.mixed_precision_param` on that device), and with them the parallel options."""
    import torch

    from titan_parallel import resolve_device

    t = d.cfg.training
    if d.target_device is None:
        device = resolve_device(t.device)
    else:  # checked for another host: `training.device` is not looked up here
        device = torch.device(d.target_device)
    d.device_type = device.type
    param_dtype, d.dtype_reason, d.dtype_warning = _compute_dtype(t.mixed_precision_param, device)
    d.parallel = parallel_options(d.cfg, param_dtype)


def _compute_dtype(name: str, device: torch.device) -> tuple[torch.dtype, str, str | None]:
    """`resolve_param_dtype(name, device)`, and its warning kept for the run to log once, not said here.

    A CUDA device this host does not have (an estimate for another host) is taken to have native bf16.
    """
    import torch

    from titan_parallel.precision import resolve_param_dtype

    if device.type == "cuda" and not torch.cuda.is_available():
        dtype = torch.float32 if name == "float32" else torch.bfloat16
        return dtype, f"{name}: {str(dtype).removeprefix('torch.')}, assumed for a CUDA device (none here)", None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dtype, reason = resolve_param_dtype(name, device)
    return dtype, reason, "; ".join(str(w.message) for w in caught) or None


def _model_shape(d: Draft) -> None:
    """The model name and flavor exist and `model.shape` changes fields the args have; a tokenizer larger than a
    Hugging Face checkpoint's vocab is refused."""
    from titan_core.data import build_tokenizer
    from titan_core.model_shape import apply_shape
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
    d.model_args = dataclasses.replace(args, max_seq_len=max(args.max_seq_len, cfg.training.seq_len))


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


def _moe(d: Draft) -> None:
    """`[moe]`'s coefficients replace the flavor's (or the Hugging Face config's) in every MoE layer; a dense model
    has none to replace."""
    given = {key: value for key, value in d.cfg.moe.model_dump().items() if value is not None}
    if not given:
        return
    moe = getattr(d.model_args, "moe", None)
    if moe is None:
        keys = ", ".join(f"moe.{key}" for key in given)
        raise ConfigError(
            f"{keys}: model.name={d.cfg.model.name!r} flavor {d.cfg.model.flavor!r} has no Mixture-of-Experts "
            "layers; remove the [moe] settings or choose an MoE flavor"
        )
    if given.get("load_balance_coeff") == 0:
        given["load_balance_coeff"] = None  # no expert bias
    d.model_args = dataclasses.replace(d.model_args, moe=dataclasses.replace(moe, **given))  # values checked by [moe]


def _mup(d: Draft) -> None:
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


def _degrees(d: Draft) -> None:
    """The parallel degrees multiply to the world size; DDP replicates whole models only."""
    from titan_parallel import check_data_parallel

    if d.world_size is None:
        return
    d.dims = parallel_dims(d.cfg, d.world_size)
    check_data_parallel(d.dims, d.parallel.dp_mode)


SPLIT_BACKWARD_SCHEDULES = ("InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")
"""Pipeline schedules that split each stage's backward into input and weight gradients."""


def _mtp(d: Draft) -> None:
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
        from titan_core.convert import hf_mtp_layers

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


def _batch(d: Draft) -> None:
    """`training.global_batch_size` is a multiple of local_batch_size x the data-parallel degree; a batch-size
    ramp-up starts at such a multiple, below the full batch."""
    from titan_core.batch_ramp import BatchRamp

    t = d.cfg.training
    start, steps = t.batch_size_rampup_start, t.batch_size_rampup_steps
    if (start is None) != (steps == 0):
        given = "training.batch_size_rampup_start" if start is not None else "training.batch_size_rampup_steps"
        needed = "training.batch_size_rampup_steps" if start is not None else "training.batch_size_rampup_start"
        raise ConfigError(f"{given} needs {needed} too (a ramp-up has a start and a length); set both or neither")
    if d.dims is None:
        return
    per_step = t.local_batch_size * d.dims.dp
    global_batch = per_step if t.global_batch_size == -1 else t.global_batch_size
    if global_batch % per_step:
        raise ConfigError(
            f"training.global_batch_size={global_batch} must be a multiple of training.local_batch_size x "
            f"data-parallel degree = {t.local_batch_size} x {d.dims.dp} = {per_step}; change one of them"
        )
    if start is not None and (start % per_step or start >= global_batch):
        raise ConfigError(
            f"training.batch_size_rampup_start={start} must be a multiple of training.local_batch_size x "
            f"data-parallel degree = {t.local_batch_size} x {d.dims.dp} = {per_step}, below "
            f"training.global_batch_size={global_batch}; change one of them"
        )
    d.global_batch, d.accum_steps = global_batch, global_batch // per_step
    ramp = BatchRamp(per_step, global_batch, start, steps) if start else BatchRamp.constant(per_step, global_batch)
    d.batch_ramp = ramp


def _tensor_parallel(d: Draft) -> None:
    """The TP degree divides the heads, the feed-forward width and the vocab; async TP needs compile on CUDA."""
    from titan_parallel import check_async_tp, check_tp

    tp = d.cfg.parallelism.tensor_parallel_degree
    check_tp(d.meta_model(), d.spec.plan, tp, ep_spans_tp=d.dims is not None and d.dims.ep_spans_tp)
    if d.parallel.async_tp:
        check_async_tp(tp, d.device_type, d.parallel.compile)


def _expert_parallel(d: Draft) -> None:
    """The expert-parallel degree divides each MoE layer's experts (and is carved from dp_shard x cp)."""
    from titan_parallel.expert_parallel import check_ep

    check_ep(d.meta_model(), d.spec.plan, d.cfg.parallelism.expert_parallel_degree)


def _context_parallel(d: Draft) -> None:
    """The sequence splits into 2 x cp chunks (x tp under sequence parallel); a known method and K/V exchange;
    Ulysses' tp x cp divides the heads."""
    from titan_parallel import check_cp, check_cp_method, check_rotate_method

    p = d.cfg.parallelism
    cp, tp = p.context_parallel_degree, p.tensor_parallel_degree
    check_cp(d.cfg.training.seq_len, cp, tp)
    args = d.model_args if cp > 1 else None
    check_cp_method(d.parallel.cp_method, getattr(args, "n_heads", None), cp, tp)
    ring = args if d.parallel.cp_method == "ring" else None  # MLA's key and value head dims differ
    check_rotate_method(
        d.parallel.cp_rotate_method, getattr(ring, "qk_head_dim", None), getattr(ring, "v_head_dim", None)
    )


def _activation_checkpoint(d: Draft) -> None:
    """A known AC mode; 'selective' takes 'op' or a positive int."""
    from titan_parallel import check_ac

    check_ac(d.parallel.ac_mode, d.parallel.ac_selective_option)


NO_EVAL_SCHEDULES = ("ZBVZeroBubble", "DualPipeV")
"""Pipeline schedules whose forward-only pass fails in torch (validation is refused under them)."""


def _pipeline(d: Draft) -> None:
    """A known schedule; stages that divide over the ranks as the schedule places them; enough micro-batches.
    The module names of each stage are kept for the model setup (pipeline parallel only)."""
    from titan_parallel import ParallelConfigError, check_pipeline

    d.pipeline = pipeline_config(d.cfg)
    pp = d.cfg.parallelism.pipeline_parallel_degree
    plan = d.spec.plan
    depths = getattr(d.model_args, "n_mtp_layers", 0)  # the last entries of the blocks, all on the last stage
    n_blocks = len(cast("nn.ModuleDict", d.meta_model().get_submodule(plan.blocks)))
    cut = partial(
        check_pipeline, pp=pp, n_layers=n_blocks - depths, local_batch_size=d.cfg.training.local_batch_size, plan=plan
    )
    names_per_stage = None
    if depths and pp > 1 and d.pipeline.module_names_per_stage is None:  # the depths weigh on the last stage
        try:
            last = d.pipeline.last_stage_less_layers + depths
            names_per_stage = cut(dataclasses.replace(d.pipeline, last_stage_less_layers=last))
        except ParallelConfigError:  # too few blocks per stage to lighten the last one: the plain cut
            pass
    if names_per_stage is None:
        names_per_stage = cut(d.pipeline)
    if pp == 1:
        return  # one stage: the schedule's name was checked, there is nothing to cut
    if depths:  # the last stage runs the depths, which read the embedding: it holds a copy (SharedWeights)
        last_stage = names_per_stage[-1]
        extra = [f"{plan.blocks}.{i}" for i in range(n_blocks - depths, n_blocks)] + list(plan.pp_first)
        last_stage += [name for name in extra if name not in last_stage]
    d.names_per_stage = names_per_stage
    v, t = d.cfg.validation, d.cfg.training
    schedule = d.cfg.parallelism.pipeline_parallel_schedule
    if d.cfg.eval.enable and schedule in NO_EVAL_SCHEDULES:
        raise ConfigError(
            f"eval.enable: torch's forward-only pass (schedule.eval) fails under the V schedule "
            f"parallelism.pipeline_parallel_schedule='{schedule}'; pick another schedule or set eval.enable to false"
        )
    if v.enable and schedule in NO_EVAL_SCHEDULES:
        # torch 2.15's forward-only pass of a V schedule asserts "can't steal_bwd_input if this stage doesn't
        # have backward" (measured with both V schedules on 2 ranks).
        raise ConfigError(
            f"validation.enable: torch's forward-only pass (schedule.eval) fails under the V schedule "
            f"parallelism.pipeline_parallel_schedule='{schedule}'; pick another schedule or set validation.enable "
            "to false"
        )
    if v.enable and v.local_batch_size not in (None, t.local_batch_size):
        # The schedule cuts every batch into the microbatches it was built for.
        raise ConfigError(
            f"validation.local_batch_size={v.local_batch_size} differs from training.local_batch_size="
            f"{t.local_batch_size}; under pipeline parallel validation runs the training schedule: unset it"
        )


def _converters(d: Draft) -> None:
    """One converter per linear; [float8] options that work together; MXFP8 only on hardware that has it;
    torchao installed."""
    from titan_core.converters import FLOAT8_KEYS, MX_KEYS, build_converters
    from titan_parallel.float8 import INSTALL_HINT, check_float8, check_mx

    names = d.cfg.model.converters
    if "float8" in names and "mx" in names:
        raise ConfigError("model.converters lists both 'float8' and 'mx'; a linear is converted once: keep one")
    d.converters = build_converters(d.cfg, d.device_type)
    if d.converters.float8 is not None:
        with naming(FLOAT8_KEYS):  # each call has its own table: `recipe_name` is float8.recipe_name here
            check_float8(d.converters.float8)
    if d.converters.mx is not None:
        with naming({**MX_KEYS, "device_type": DEVICE_KEY}, prefix="model.converters = ['mx']: "):
            check_mx(d.converters.mx, d.device_type)
    if names and importlib.util.find_spec("torchao") is None:
        raise MissingPackageError(
            f"model.converters = {list(names)} needs torchao, which is not installed; {INSTALL_HINT}"
        )


def _checkpoint(d: Draft) -> None:
    """[checkpoint] keys (and 'rollback' of training.on_nonfinite / on_loss_spike) that need checkpoint.enable;
    a seed checkpoint on one process; a Hugging Face export of the model only, from an unpipelined model;
    milestones at saved steps."""
    ckpt = d.cfg.checkpoint
    if ckpt.keep_interval % ckpt.interval:
        raise ConfigError(
            f"checkpoint.keep_interval={ckpt.keep_interval} is not a multiple of checkpoint.interval={ckpt.interval}: "
            "only those steps are saved; make it one (or 0 for no milestones)"
        )
    if not ckpt.enable:
        for key in ("create_seed_checkpoint", "initial_load_path", "last_save_in_hf", "initial_load_in_hf"):
            if getattr(ckpt, key):
                raise ConfigError(f"checkpoint.{key} is set but checkpoint.enable is false; add --checkpoint.enable")
    if ckpt.create_seed_checkpoint and d.world_size not in (None, 1):
        raise ConfigError(
            f"checkpoint.create_seed_checkpoint runs on one process, not {d.world_size}; "
            "launch it with --nproc-per-node 1"
        )
    if ckpt.last_save_in_hf and not ckpt.last_save_model_only:
        raise ConfigError(
            "checkpoint.last_save_in_hf saves model weights only; also set checkpoint.last_save_model_only = true"
        )
    if d.cfg.training.on_nonfinite == "rollback" and not ckpt.enable:
        raise ConfigError(
            "training.on_nonfinite = 'rollback' reloads the newest checkpoint; add --checkpoint.enable true"
        )
    if d.cfg.training.on_loss_spike == "rollback" and not ckpt.enable:
        raise ConfigError(
            "training.on_loss_spike = 'rollback' reloads the newest checkpoint; add --checkpoint.enable true"
        )
    if ckpt.last_save_in_hf and d.cfg.parallelism.pipeline_parallel_degree > 1:
        raise ConfigError(
            "checkpoint.last_save_in_hf does not gather pipeline stages yet; save in DCP and run "
            "`titan convert <run>/checkpoint/step-N OUT --to hf`"
        )


def _profiling(d: Draft) -> None:
    """A profiled step has a warm-up step before it; memory snapshots record CUDA's allocator."""
    from titan_core.profiling import MIN_FREQ

    pr = d.cfg.profiling
    if (pr.enable_profiling or pr.enable_memory_snapshot) and pr.profile_freq < MIN_FREQ:
        raise ConfigError(f"profiling.profile_freq must be >= {MIN_FREQ}, got {pr.profile_freq}")
    if pr.enable_memory_snapshot and d.device_type != "cuda":
        raise ConfigError(
            "profiling.enable_memory_snapshot records the CUDA caching allocator and needs a CUDA device; "
            "set it to false on CPU"
        )


def _metrics(d: Draft) -> None:
    """`metrics.enable_wandb` needs the optional wandb package (`titan-core[wandb]`)."""
    if d.cfg.metrics.enable_wandb:
        from titan_core.metrics.wandb_sink import require_wandb

        require_wandb()


def _lr_schedule(d: Draft) -> None:
    """A set `lr_scheduler.warmup_steps` fits in `training.steps`; unset, it is 10 or the whole of a shorter run."""
    from titan_core.lr_schedule import resolve_warmup

    d.warmup_steps, d.warmup_note = resolve_warmup(d.cfg.lr_scheduler.warmup_steps, d.cfg.training.steps)


def _ema(d: Draft) -> None:
    """`ema.validation` scores the moving average of the weights in the validation passes: it needs both."""
    e = d.cfg.ema
    if e.validation and not (e.enable and d.cfg.validation.enable):
        missing = " and ".join(
            k for k, on in (("ema.enable", e.enable), ("validation.enable", d.cfg.validation.enable)) if not on
        )
        raise ConfigError(
            f"ema.validation = true scores the averaged weights in the validation passes; set {missing} = true"
        )


def _z_loss(d: Draft) -> None:
    """`training.z_loss_weight` under tensor parallel's loss parallel needs the fused loss: the plain loss there is
    torch's `loss_parallel` cross-entropy on vocab-sharded logits, which has no z-loss."""
    t = d.cfg.training
    if t.z_loss_weight and d.dims is not None and d.dims.tp > 1 and d.parallel.loss_parallel and not t.fused_loss:
        raise ConfigError(
            "training.z_loss_weight under tensor parallel needs training.fused_loss = true (the plain loss is torch's "
            "loss-parallel cross-entropy, without a z-loss), or parallelism.disable_loss_parallel = true"
        )


def _weight_decay(d: Draft) -> None:
    """Each pattern of `optimizer.weight_decay_exclude` matches a parameter of the model (a typo would leave
    decaying what it meant to exempt)."""
    from titan_core.weight_decay import unmatched

    patterns = d.cfg.optimizer.weight_decay_exclude
    if not patterns:
        return
    names = [name for name, _ in d.meta_model().named_parameters()]
    missing = unmatched(names, patterns)
    if missing:
        examples = ", ".join(dict.fromkeys([names[0], *(n for n in names if "norm" in n)][:3]))
        verb = "matches" if len(missing) == 1 else "match"
        raise ConfigError(
            f"optimizer.weight_decay_exclude: {', '.join(repr(p) for p in missing)} {verb} no parameter of "
            f"{d.cfg.model.name} {d.cfg.model.flavor} (its names look like {examples}); fix or remove the pattern"
        )


def _data(d: Draft) -> None:
    """`training.dataset_mix` names every source itself: `training.dataset` / `dataset_path` stay at their defaults;
    its phases name its sources. `eval.enable` needs `eval.tasks`."""
    t = d.cfg.training
    if d.cfg.eval.enable and not d.cfg.eval.tasks:
        raise ConfigError(
            "eval.enable is set but eval.tasks is empty; list JSONL files of multiple-choice examples "
            "(docs/evaluation.md) or set eval.enable to false"
        )
    v = d.cfg.validation
    if v.sets and (v.dataset_path or v.dataset != "stdlib"):
        given = f"validation.dataset_path={v.dataset_path}" if v.dataset_path else f"validation.dataset={v.dataset}"
        raise ConfigError(
            f"validation.sets and {given} are both set; add that data to validation.sets as {{path = ...}} and "
            f"unset {given.split('=')[0]}"
        )
    names = validation_set_names(v.sets)
    if len(set(names)) < len(names):
        twice = sorted({n for n in names if names.count(n) > 1})
        raise ConfigError(
            f"validation.sets: the name {twice[0]!r} labels two sets; give each set a name of its own (name = ...)"
        )
    if t.dataset_mix and (t.dataset_path or t.dataset != "stdlib"):
        given = f"training.dataset_path={t.dataset_path}" if t.dataset_path else f"training.dataset={t.dataset}"
        raise ConfigError(
            f"training.dataset_mix and {given} are both set; the mix names its sources: "
            f"add that data to training.dataset_mix as {{path = ..., weight = ...}} and unset {given.split('=')[0]}"
        )
    _mix_phases(t)


def _mix_phases(t: Any) -> None:
    """`training.dataset_mix_phases`: with a mix, at increasing steps within the run, naming its sources."""
    phases = t.dataset_mix_phases
    if not phases:
        return
    if not t.dataset_mix:
        raise ConfigError(
            "training.dataset_mix_phases needs training.dataset_mix: the phases give its sources other weights; "
            "list the sources in training.dataset_mix or unset training.dataset_mix_phases"
        )
    from titan_core.data.mix_schedule import phase_shares
    from titan_core.data.mix_sources import default_name

    names = [entry.name or default_name(entry.path) for entry in t.dataset_mix]
    previous = 1
    for i, phase in enumerate(phases):
        key = f"training.dataset_mix_phases[{i}]"
        if not previous < phase.step <= t.steps:
            raise ConfigError(
                f"{key}.step={phase.step}: phases start at increasing steps after step {previous} and at most "
                f"training.steps={t.steps}; fix the step or drop the phase"
            )
        previous = phase.step
        unknown = sorted(set(phase.weights) - set(names))
        if unknown:
            raise ConfigError(
                f"{key}.weights names {', '.join(repr(n) for n in unknown)}, not a source of training.dataset_mix "
                f"(its names: {', '.join(names)}); use those names (or set name = '...' on a source)"
            )
        phase_shares([phase.weights.get(name, 0.0) for name in names], f"{key}.weights")


def validation_set_names(sets: Sequence[Any]) -> list[str]:
    """Each `validation.sets` entry's label: its `name`, else its folder or file name."""
    from titan_core.data.mix_sources import default_name

    return [entry.name or default_name(entry.path) for entry in sets]


def _attention_mask(d: Draft) -> None:
    """`model.attn_mask_type = 'block_causal'` needs a model whose forward takes `document_ids`."""
    if d.cfg.model.attn_mask_type != "block_causal":
        return
    forward = type(d.meta_model()).forward
    if "document_ids" not in inspect.signature(forward).parameters:
        raise ConfigError(
            f"model.attn_mask_type = 'block_causal': model.name '{d.cfg.model.name}' ({forward.__qualname__}) takes "
            "no document_ids; set attn_mask_type to 'causal' or give its forward a document_ids argument "
            "(titan_models.document_mask)"
        )


def _keys(table: Mapping[str, str], *fields: str) -> dict[str, str]:
    """The entries of `table` for `fields`."""
    return {name: table[name] for name in fields}


DEGREES_KEYS = {**DIMS_KEYS, **_keys(PARALLEL_OPTION_KEYS, "dp_mode")}
"""`ParallelDims(...)` and `check_data_parallel(dims, dp_mode)`."""
TENSOR_PARALLEL_KEYS = {
    **_keys(DIMS_KEYS, "tp"),
    **_keys(PARALLEL_OPTION_KEYS, "async_tp", "compile"),
    **_keys(RUN_KEYS, "device_type"),
}
"""`check_tp(model, plan, tp)` and `check_async_tp(tp, device_type, compile)`."""
CONTEXT_PARALLEL_KEYS = {
    **_keys(DIMS_KEYS, "cp", "tp"),
    **_keys(PARALLEL_OPTION_KEYS, "cp_rotate_method", "cp_method"),
    **_keys(RUN_KEYS, "seq_len", "n_heads"),
}
"""`check_cp(seq_len, cp, tp)`, `check_cp_method(cp_method, n_heads, cp, tp)` and `check_rotate_method(cp_rotate_method,
...)`."""
AC_KEYS = _keys(PARALLEL_OPTION_KEYS, "ac_mode", "ac_selective_option")
"""`check_ac(ac_mode, ac_selective_option)`."""
PIPELINE_RULE_KEYS = {**PIPELINE_KEYS, **_keys(DIMS_KEYS, "pp"), **_keys(RUN_KEYS, "n_layers", "local_batch_size")}
"""`check_pipeline(config, pp=, n_layers=, local_batch_size=, plan=)`."""

RULES: tuple[Rule, ...] = (
    Rule("device", _device, _keys(RUN_KEYS, "device")),
    Rule("model_shape", _model_shape),
    Rule("moe", _moe),
    Rule("mup", _mup),
    Rule("degrees", _degrees, DEGREES_KEYS),
    Rule("mtp", _mtp),
    Rule("batch", _batch),
    Rule("tensor_parallel", _tensor_parallel, TENSOR_PARALLEL_KEYS),
    Rule("expert_parallel", _expert_parallel, _keys(DIMS_KEYS, "ep")),
    Rule("context_parallel", _context_parallel, CONTEXT_PARALLEL_KEYS),
    Rule("activation_checkpoint", _activation_checkpoint, AC_KEYS),
    Rule("pipeline", _pipeline, PIPELINE_RULE_KEYS),
    Rule("converters", _converters),  # two library calls, each with its own table
    Rule("checkpoint", _checkpoint),
    Rule("profiling", _profiling),
    Rule("metrics", _metrics),
    Rule("lr_schedule", _lr_schedule),
    Rule("data", _data),
    Rule("attention_mask", _attention_mask),
    Rule("fault_tolerance", fault_tolerance),
    Rule("master_weights", master_weights),
    Rule("weight_decay", _weight_decay),
    Rule("z_loss", _z_loss),
    Rule("ema", _ema),
)
"""Every rule of a valid job, in the order `resolve` runs them (later rules use earlier results)."""
