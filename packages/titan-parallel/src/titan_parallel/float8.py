"""Float8 and MXFP8 training through torchao: swap `nn.Linear`s before TP and FSDP see them.

    meta model -> apply_float8 / apply_mx -> [pipeline split] -> TP -> CP -> AC -> compile -> FSDP

`apply_float8` replaces the linears it selects with torchao's `Float8Linear` (a
subclass of `nn.Linear`, so parameter names and checkpoints stay the same; the
master weights stay in their own dtype and only the matmuls run in float8, with
scales computed on the fly). What comes after reads the modules, not a flag:

- tensor parallel gives a tensorwise `Float8Linear` torchao's float8 styles
  (inputs cast to float8 before the all-gather; `tensor_parallel.planned_styles`),
  and rowwise ones the plain styles (torchao's float8 TP is tensorwise-only, so
  rowwise recipes all-gather in high precision);
- FSDP all-gathers float8 weights when `enable_fsdp_float8_all_gather` wrapped
  them (`WeightWithDynamicFloat8CastTensor`, tensorwise only);
- `precompute_float8_scales` after the optimizer step computes every weight's
  scale in one all-reduce instead of one per weight.

Without a GPU of compute capability 8.9+ (H100, L4, RTX 4090) the float8 matmuls
are emulated: operands are rounded to float8 and multiplied in fp32, so a CPU run
has float8's numerics at fp32 speed. torchao is optional (`pip install
titan-parallel[float8]`) and imported only here, only when asked for.

`apply_mx` converts to MXFP8 (float8 elements with one power-of-two scale per 32
values), which needs Blackwell tensor cores; elsewhere it refuses in one line.
"""

from __future__ import annotations

import importlib
import logging
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Literal

import torch
import torch.nn as nn

from titan_parallel.float8_matmul import Float8Loss
from titan_parallel.layout import ParallelConfigError

if TYPE_CHECKING:
    from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel

logger = logging.getLogger("titan")

Float8Recipe = Literal["tensorwise", "rowwise", "rowwise_with_gw_hp"]
INSTALL_HINT = "pip install titan-parallel[float8] (torchao)"
MX_HARDWARE = "an NVIDIA GPU with compute capability 10.0+ (B200/GB200)"


@dataclass(frozen=True)
class Float8Options:
    """Which linears become float8 and how; errors name these field names.

    Args:
        recipe_name: torchao's scaling recipe: "tensorwise" (one scale per tensor, fastest;
            float8 all-gathers for FSDP and TP), "rowwise" (one scale per row, more
            accurate), "rowwise_with_gw_hp" (rowwise, weight gradients in high precision).
        enable_fsdp_float8_all_gather: FSDP all-gathers weights in float8 (tensorwise only).
        precompute_float8_dynamic_scale_for_fsdp: compute all weight scales in one all-reduce
            after the optimizer step (with the float8 all-gather).
        filter_fqns: linears whose name contains any of these stay in high precision.
        auto_filter_small_kn: also leave GEMMs too small to gain from float8 (`gains_from_float8`).
        emulate: emulate the float8 matmuls in fp32 (no float8 hardware); see `needs_emulation`.
    """

    recipe_name: Float8Recipe = "tensorwise"
    enable_fsdp_float8_all_gather: bool = False
    precompute_float8_dynamic_scale_for_fsdp: bool = False
    filter_fqns: tuple[str, ...] = ("output",)
    auto_filter_small_kn: bool = True
    emulate: bool = False


@dataclass(frozen=True)
class MXOptions:
    """Which linears get MXFP8 matmuls; errors name these field names.

    Args:
        recipe_name: torchao's `MXFP8TrainingRecipe`: "mxfp8_rceil", "mxfp8_rceil_wgrad_with_hp"
            (weight gradients in high precision), or "mxfp8_emulated_rceil" (torchao's
            hardware-agnostic debug recipe, for tests).
        filter_fqns: linears whose name contains any of these stay in high precision.
    """

    recipe_name: str = "mxfp8_rceil"
    filter_fqns: tuple[str, ...] = ("output",)


def import_torchao(module: str):
    """Import a torchao module, or raise one line naming the install command.

    torchao registers its enums with torch on import and torch logs a deprecation
    warning for each; those lines are silenced here.

    Args:
        module: the dotted module name, e.g. "torchao.float8".
    """
    pytree_log = logging.getLogger("torch.utils._pytree")
    level = pytree_log.level
    pytree_log.setLevel(logging.ERROR)
    try:
        return importlib.import_module(module)
    except ImportError:
        raise ImportError(f"float8 and MXFP8 training need torchao, which is not installed; {INSTALL_HINT}") from None
    finally:
        pytree_log.setLevel(level)


def needs_emulation(device: torch.device) -> bool:
    """Whether float8 matmuls must be emulated on `device`: anything but a CUDA GPU of compute capability 8.9+.

    Args:
        device: the training device.
    """
    return not (
        device.type == "cuda" and torch.cuda.is_available() and torch.cuda.get_device_capability(device) >= (8, 9)
    )


def gains_from_float8(in_features: int, out_features: int, recipe: str) -> bool:
    """Whether a linear's GEMM is big enough for float8 to beat bf16 (the casts cost more on small ones).

    The thresholds are torchao's, from its H100 benchmark tables
    (github.com/pytorch/ao/tree/main/torchao/float8#performance); K = in_features,
    N = out_features. "rowwise_with_gw_hp" keeps one of its three GEMMs in bf16 and so
    gains less: rowwise's thresholds are a lower bound for it. Reimplemented rather than
    calling torchao's private `_auto_filter_for_recipe`, which lacks that recipe.

    Args:
        in_features: the linear's K.
        out_features: the linear's N.
        recipe: the float8 recipe name.
    """
    k, n = in_features, out_features
    if recipe == "tensorwise":
        return not (k <= 4096 and n <= 1024)
    return not (n <= 2048 or k <= 1024 or (n <= 4096 and k <= 2048))


def float8_filter(options: Float8Options, exclude: Sequence[str] = ()) -> Callable[[nn.Module, str], bool]:
    """torchao's `module_filter_fn`: which `(module, name)` `apply_float8` converts.

    A linear is converted when both its dims are multiples of 16 (float8 tensor-core
    GEMMs need it), its name contains none of `filter_fqns`, and, with
    `auto_filter_small_kn`, its GEMM `gains_from_float8`.

    Args:
        options: the selection (`filter_fqns`, `auto_filter_small_kn`, `recipe_name`).
        exclude: module names left out whatever the options say (the caller runs them in float8 itself).
    """

    def keep(module: nn.Module, fqn: str) -> bool:
        return float8_skip_reason(module, fqn, options, exclude) is None

    return keep


def float8_skip_reason(module: nn.Module, fqn: str, options: Float8Options, exclude: Sequence[str] = ()) -> str | None:
    """Why `float8_filter` leaves module `fqn` in high precision, in a few words; None when it converts it.

    Args:
        module: the module.
        fqn: its name in the model.
        options: the selection (`filter_fqns`, `auto_filter_small_kn`, `recipe_name`).
        exclude: module names left out whatever the options say.
    """
    if not isinstance(module, nn.Linear):
        return "not an nn.Linear"
    if fqn in exclude:
        return "excluded by the caller"
    if hits := [f for f in options.filter_fqns if f in fqn]:
        return f"filter_fqns {hits[0]!r}"
    if module.in_features % 16 or module.out_features % 16:
        return f"{module.in_features} x {module.out_features}: not multiples of 16"
    if options.auto_filter_small_kn and not gains_from_float8(
        module.in_features, module.out_features, options.recipe_name
    ):
        return f"K={module.in_features}, N={module.out_features}: too small to gain ({options.recipe_name})"
    return None


def check_float8(options: Float8Options) -> None:
    """Raise `ParallelConfigError` for options that cannot work together or here; needs no torchao.

    Args:
        options: the float8 options; errors name their field names.
    """
    if options.enable_fsdp_float8_all_gather and options.recipe_name != "tensorwise":
        raise ParallelConfigError(
            f"enable_fsdp_float8_all_gather=True works with recipe_name='tensorwise' only, not "
            f"'{options.recipe_name}' (torchao all-gathers tensorwise-scaled weights); change one of them",
            arguments=("enable_fsdp_float8_all_gather", "recipe_name"),
        )
    if options.precompute_float8_dynamic_scale_for_fsdp and not options.enable_fsdp_float8_all_gather:
        raise ParallelConfigError(
            "precompute_float8_dynamic_scale_for_fsdp=True needs enable_fsdp_float8_all_gather=True; "
            "set both or neither",
            arguments=("precompute_float8_dynamic_scale_for_fsdp", "enable_fsdp_float8_all_gather"),
        )
    if not options.emulate and needs_emulation(torch.device("cuda")):
        raise ParallelConfigError(
            "emulate=False needs an NVIDIA GPU with compute capability 8.9+ (H100, L4, RTX 4090); "
            "set emulate=True to emulate the float8 matmuls in fp32",
            arguments=("emulate",),
        )


def apply_float8(
    model: nn.Module,
    options: Float8Options,
    *,
    fsdp_shards: int = 1,
    exclude: Sequence[str] = (),
    trace_only: bool = False,
) -> list[str]:
    """Swap the selected `nn.Linear`s of `model` for torchao `Float8Linear`s, in place; returns their names.

    Call on the meta model, before tensor parallel and FSDP (they choose their float8
    behaviour from the module types). Parameter names do not change.

    Args:
        model: the whole model (before the pipeline split) or one part.
        options: recipe and selection.
        fsdp_shards: how many ranks FSDP shards over; with 1 there is nothing to
            all-gather and `enable_fsdp_float8_all_gather` is left off.
        exclude: module names to leave plain linears whatever `options` select (the output
            projection whose GEMMs the fused loss runs in float8: `float8_loss_for`).
        trace_only: the model is only traced on fake tensors (what a GPU's compiled graph saves, read on any
            host): no check for float8 hardware and no log line, as no float8 matmul will run.
    """
    if not trace_only:
        check_float8(options)
    f8 = import_torchao("torchao.float8")
    config = replace(
        f8.Float8LinearConfig.from_recipe_name(options.recipe_name),
        emulate=options.emulate,
        enable_fsdp_float8_all_gather=options.enable_fsdp_float8_all_gather and fsdp_shards > 1,
    )
    if options.recipe_name == "rowwise" and not trace_only:  # (code generation's: a trace generates none)
        # Inductor's casts must round as eager's do for rowwise's power-of-two scales
        # (pytorch/pytorch#150859; torchtitan sets the same).
        import torch._inductor.config as inductor_config

        inductor_config.emulate_precision_casts = True
    keep = float8_filter(options, exclude)
    chosen = [name for name, module in model.named_modules() if keep(module, name)]
    f8.convert_to_float8_training(model, config=config, module_filter_fn=keep)
    n_linear = sum(isinstance(m, nn.Linear) for m in model.modules())
    if trace_only:
        return chosen
    if chosen:
        logger.info(
            "float8: %d of %d linears converted (recipe %s%s%s)",
            len(chosen),
            n_linear,
            options.recipe_name,
            ", emulated" if options.emulate else "",
            ", float8 FSDP all-gather" if config.enable_fsdp_float8_all_gather else "",
        )
    else:
        logger.warning(
            "float8: none of the %d linears converted (all filtered, or below the size float8 gains at); "
            "set auto_filter_small_kn=False or shorten filter_fqns to convert them",
            n_linear,
        )
    return chosen


def float8_loss_for(model: nn.Module, head_path: str | None, options: Float8Options) -> Float8Loss | None:
    """The fused loss's float8 GEMMs (`linear_cross_entropy(float8=...)`) where `options` select the output
    projection and the recipe is tensorwise (the loss casts per tensor); None where it stays in high
    precision or another recipe converts it (then it is a `Float8Linear` and the loss the plain one).

    Pass the result's head to `apply_float8(exclude=...)` and the result to `fuse_output_loss`.

    Args:
        model: the model (meta is fine).
        head_path: the output projection's module name (`output_projection_path`), or None.
        options: the float8 options.
    """
    head = model.get_submodule(head_path) if head_path else None
    if head is None or options.recipe_name != "tensorwise" or not float8_filter(options)(head, head_path or ""):
        return None
    return Float8Loss(emulate=options.emulate)


def precompute_float8_scales(parts: Sequence[nn.Module]) -> None:
    """After the optimizer step: every float8-all-gathered weight's scale in one all-reduce (no-op for others).

    Args:
        parts: this rank's model parts.
    """
    f8 = import_torchao("torchao.float8")
    for part in parts:
        f8.precompute_float8_dynamic_scale_for_fsdp(part)


def is_tensorwise_float8(module: nn.Module) -> bool:
    """Whether `module` is a `Float8Linear` whose activations and gradients are scaled per tensor, as
    torchao's float8 TP styles require. Imports nothing: without torchao loaded there is none.

    Args:
        module: any module.
    """
    ao_linear = sys.modules.get("torchao.float8.float8_linear")
    if ao_linear is None or not isinstance(module, ao_linear.Float8Linear):
        return False
    from torchao.float8.config import ScalingGranularity, ScalingType

    c = module.config
    casts = (
        c.cast_config_input,
        c.cast_config_grad_output,
        c.cast_config_input_for_grad_weight,
        c.cast_config_grad_output_for_grad_weight,
    )
    return all(
        cc.scaling_type is ScalingType.DYNAMIC and cc.scaling_granularity is ScalingGranularity.TENSORWISE
        for cc in casts
    )


def float8_tp_style_classes() -> tuple[type[ColwiseParallel], type[RowwiseParallel], type[PrepareModuleInput]]:
    """torchao's (colwise, rowwise, prepare-input) float8 tensor-parallel styles."""
    tp = import_torchao("torchao.float8.float8_tensor_parallel")
    _gather_float8_as_bytes_on_cpu()
    return tp.Float8ColwiseParallel, tp.Float8RowwiseParallel, tp.PrepareFloat8ModuleInput


_CPU_BYTE_GATHERS: set[Callable] = set()
"""The handlers `_gather_float8_as_bytes_on_cpu` installed in torchao's op table (each installed once)."""


def _gather_float8_as_bytes_on_cpu() -> None:
    """Let torchao's float8 all-gather (TP's) run on gloo, which has no float8 dtypes.

    gloo, the only backend for CPU tensors, fails a float8 all-gather with "Invalid
    scalar type". For CPU tensors this all-gathers the same bytes viewed as uint8 (an
    all-gather copies bytes, so the result is identical); CUDA tensors keep torchao's
    own handler (NCCL gathers float8, and Inductor's async-TP patterns expect it).
    FSDP needs none of this: its float8 all-gather already moves a uint8 buffer.
    """
    ops = import_torchao("torchao.float8.float8_ops")
    from torchao.float8.float8_training_tensor import Float8TrainingTensor

    funcols = (
        torch.ops.c10d_functional.all_gather_into_tensor.default,
        torch.ops._c10d_functional.all_gather_into_tensor.default,
    )
    for op in funcols:
        torchao_gather = ops.FLOAT8_OPS_TABLE[op]
        if torchao_gather in _CPU_BYTE_GATHERS:
            continue

        def gather(aten_op, args, kwargs=None, torchao_gather=torchao_gather):
            x = args[0]
            if x._data.device.type != "cpu":
                return torchao_gather(aten_op, args, kwargs)
            out = aten_op(x._data.contiguous().view(torch.uint8), *args[1:], **(kwargs or {}))
            return Float8TrainingTensor(
                out.view(x._data.dtype), x._scale, x._orig_dtype, x._linear_mm_config, x._gemm_input_role
            )

        _CPU_BYTE_GATHERS.add(gather)
        ops.FLOAT8_OPS_TABLE[op] = gather


def has_mx_hardware() -> bool:
    """Whether this machine has MXFP8 tensor cores (CUDA compute capability 10.0+)."""
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (10, 0)


def check_mx(options: MXOptions, device_type: str) -> None:
    """Raise `ParallelConfigError` in one line naming the hardware MXFP8 needs, where the run lacks it.

    Args:
        options: the MXFP8 options (torchao's emulated recipe runs anywhere).
        device_type: the device type the model runs on, e.g. "cuda".
    """
    if options.recipe_name == "mxfp8_emulated_rceil":
        return
    if device_type != "cuda":
        raise ParallelConfigError(
            f"MXFP8 needs {MX_HARDWARE}, but device_type is {device_type!r}; use float8 linears instead",
            arguments=("device_type",),
        )
    if not has_mx_hardware():
        here = f"this GPU is {torch.cuda.get_device_name()}" if torch.cuda.is_available() else "this machine has no GPU"
        raise ParallelConfigError(f"MXFP8 needs {MX_HARDWARE}; {here}: use float8 linears instead")


def apply_mx(model: nn.Module, options: MXOptions, device_type: str = "cuda") -> list[str]:
    """Give the selected linears of `model` MXFP8 matmuls (torchao wraps their weights), in place; returns their names.

    A linear is converted when both dims are multiples of 32 (the MX block) and its
    name contains none of `filter_fqns`. Refuses first without the hardware (`check_mx`).

    Args:
        model: the whole model (before the pipeline split) or one part.
        options: recipe and selection.
        device_type: the device type the model will run on.
    """
    check_mx(options, device_type)
    config_mod = import_torchao("torchao.prototype.moe_training.config")
    quantize_ = import_torchao("torchao.quantization").quantize_
    config = config_mod.MXFP8TrainingOpConfig.from_recipe(config_mod.MXFP8TrainingRecipe(options.recipe_name))

    def keep(module: nn.Module, fqn: str) -> bool:
        return (
            isinstance(module, nn.Linear)
            and not any(f in fqn for f in options.filter_fqns)
            and module.in_features % 32 == 0
            and module.out_features % 32 == 0
        )

    chosen = [name for name, module in model.named_modules() if keep(module, name)]
    try:
        quantize_(model, config, filter_fn=keep)
    except AssertionError as err:  # torchao's check of torch's version (torchao 0.17 asks more than torch 2.11 has)
        if "torch" not in str(err):
            raise
        version = import_torchao("torchao").__version__
        raise ParallelConfigError(
            f"MXFP8 training through torchao {version} does not run on torch {torch.__version__} (torchao: {err}); "
            "install the torch release torchao names, or use float8 linears instead"
        ) from err
    logger.info("mx: %d linears use MXFP8 matmuls (recipe %s)", len(chosen), options.recipe_name)
    return chosen
