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
This file holds the device and layout rules and the table; the model's rules are
in `model_rules.py`, how the run trains (checkpoints, data, torchft, ...) in
`run_rules.py`.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any, cast

from titan_core.config.errors import ConfigError, MissingPackageError
from titan_core.config.schema import JobConfig
from titan_core.job.meta_model import build_meta_model
from titan_core.job.model_rules import model_shape, moe, mtp, mup
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
from titan_core.job.run_rules import (
    attention_mask,
    checkpoint,
    data,
    ema,
    fault_tolerance,
    lr_schedule,
    master_weights,
    metrics,
    profiling,
    weight_decay,
    z_loss,
)

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


def _degrees(d: Draft) -> None:
    """The parallel degrees multiply to the world size; DDP replicates whole models only."""
    from titan_parallel import check_data_parallel

    if d.world_size is None:
        return
    d.dims = parallel_dims(d.cfg, d.world_size)
    check_data_parallel(d.dims, d.parallel.dp_mode)


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
    """The sequences (training's, validation's) split into 2 x cp chunks (x tp under sequence parallel); a known
    method and K/V exchange; Ulysses' tp x cp divides the heads."""
    from titan_parallel import check_cp, check_cp_method, check_rotate_method

    p, v = d.cfg.parallelism, d.cfg.validation
    cp, tp = p.context_parallel_degree, p.tensor_parallel_degree
    check_cp(d.cfg.training.seq_len, cp, tp)
    if v.enable and v.seq_len:  # validation's sequences split the same way
        with naming({**CONTEXT_PARALLEL_KEYS, "seq_len": "validation.seq_len"}):
            check_cp(v.seq_len, cp, tp)
    args = d.model_args if cp > 1 else None
    check_cp_method(d.parallel.cp_method, getattr(args, "n_heads", None), cp, tp)
    ring = args if d.parallel.cp_method == "ring" else None  # MLA's key and value head dims differ
    check_rotate_method(
        d.parallel.cp_rotate_method, getattr(ring, "qk_head_dim", None), getattr(ring, "v_head_dim", None)
    )


def _activation_checkpoint(d: Draft) -> None:
    """A known AC mode; 'selective' takes 'op' or a positive int; 'memory_budget' a budget in [0, 1] and compiled
    blocks."""
    from titan_parallel import check_ac

    p = d.parallel
    check_ac(p.ac_mode, p.ac_selective_option, ac_memory_budget=p.ac_memory_budget, compile=p.compile)


def _compile(d: Draft) -> None:
    """A registered `torch.compile` backend that can compile this layout's blocks (checked with the loss's too)."""
    from titan_parallel import check_compile_backend

    p, blocks = d.parallel, d.parallel.compile  # the loss alone: neither TP nor AC reach it
    if d.cfg.compile.enable:  # 'auto' is None: nothing to check
        tp = d.cfg.parallelism.tensor_parallel_degree if blocks else 1
        check_compile_backend(p.compile_backend, d.device_type, tp, p.ac_mode if blocks else "none")


NO_EVAL_SCHEDULES = ("ZBVZeroBubble", "DualPipeV")
"""Pipeline schedules whose forward-only pass fails in torch (validation is refused under them)."""


def _pipeline(d: Draft) -> None:
    """A known schedule; stages that divide over the ranks as the schedule places them; enough micro-batches;
    validation in the training schedule's shape. The module names of each stage are kept for the model setup
    (pipeline parallel only)."""
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
    for key in ("local_batch_size", "seq_len"):
        value, training = getattr(v, key), getattr(t, key)
        if v.enable and value not in (None, training):
            # The schedule cuts every batch into the microbatches it was built for, of the shape it was built for.
            raise ConfigError(
                f"validation.{key}={value} differs from training.{key}={training}; under pipeline parallel "
                "validation runs the training schedule: unset it"
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
COMPILE_KEYS = {
    **_keys(PARALLEL_OPTION_KEYS, "compile_backend", "ac_mode"),
    **_keys(DIMS_KEYS, "tp"),
    "device_type": DEVICE_KEY,
}
"""`check_compile_backend(compile_backend, device_type, tp, ac_mode)`."""
AC_KEYS = _keys(PARALLEL_OPTION_KEYS, "ac_mode", "ac_selective_option", "ac_memory_budget", "compile")
"""`check_ac(ac_mode, ac_selective_option, ac_memory_budget=, compile=)`."""
PIPELINE_RULE_KEYS = {**PIPELINE_KEYS, **_keys(DIMS_KEYS, "pp"), **_keys(RUN_KEYS, "n_layers", "local_batch_size")}
"""`check_pipeline(config, pp=, n_layers=, local_batch_size=, plan=)`."""

RULES: tuple[Rule, ...] = (
    Rule("device", _device, _keys(RUN_KEYS, "device")),
    Rule("model_shape", model_shape),
    Rule("moe", moe),
    Rule("mup", mup),
    Rule("degrees", _degrees, DEGREES_KEYS),
    Rule("mtp", mtp),
    Rule("batch", _batch),
    Rule("tensor_parallel", _tensor_parallel, TENSOR_PARALLEL_KEYS),
    Rule("expert_parallel", _expert_parallel, _keys(DIMS_KEYS, "ep")),
    Rule("context_parallel", _context_parallel, CONTEXT_PARALLEL_KEYS),
    Rule("activation_checkpoint", _activation_checkpoint, AC_KEYS),
    Rule("compile", _compile, COMPILE_KEYS),
    Rule("pipeline", _pipeline, PIPELINE_RULE_KEYS),
    Rule("converters", _converters),  # two library calls, each with its own table
    Rule("checkpoint", checkpoint),
    Rule("profiling", profiling),
    Rule("metrics", metrics),
    Rule("lr_schedule", lr_schedule),
    Rule("data", data),
    Rule("attention_mask", attention_mask),
    Rule("fault_tolerance", fault_tolerance),
    Rule("master_weights", master_weights),
    Rule("weight_decay", weight_decay),
    Rule("z_loss", z_loss),
    Rule("ema", ema),
)
"""Every rule of a valid job, in the order `resolve` runs them (later rules use earlier results)."""
