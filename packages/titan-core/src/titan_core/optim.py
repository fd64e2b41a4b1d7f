"""`build_optimizer`: Adam, AdamW, or Muon with AdamW beside it, with the chosen step kernel.

The `optimizer.*` config keys become one `OptimizerOptions` when the job is
resolved (`titan_core.job`); `build_optimizer` takes it, or the same plain
keyword arguments.
Weight decay applies to every parameter, norms and biases included, as in
torchtitan, unless `optimizer.weight_decay_exclude` names some
(`titan_core.weight_decay`): they get a param group of their own with weight
decay 0. Muon (`titan_core.muon`) has two groups, Muon's and AdamW's,
split by a rule (`titan_core.muon_groups.RULE`), each with its own learning
rate and weight decay; the step kernel applies to its AdamW group.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch

from titan_core.config.errors import ConfigError
from titan_core.muon import Muon, MuonOptions, muon_param_groups, resolve_ns_dtype
from titan_core.weight_decay import describe_exclusion, split_by_decay

__all__ = [
    "build_optimizer",
    "resolve_implementation",
    "OptimizerOptions",
    "MuonOptions",
    "OPTIMIZERS",
    "IMPLEMENTATIONS",
]

OPTIMIZERS: dict[str, Callable[..., torch.optim.Optimizer]] = {
    "AdamW": torch.optim.AdamW,
    "Adam": torch.optim.Adam,
    "Muon": Muon,
}
DEFAULT_MUON = MuonOptions()
IMPLEMENTATIONS = ("auto", "for-loop", "foreach", "fused")


def _fused_device_types() -> list[str]:
    """Device types with fused optimizer kernels, as torch itself reports them."""
    try:
        from torch.utils._foreach_utils import _get_fused_kernels_supported_devices
    except ImportError:  # private helper moved: fall back to the long-standing set
        return ["cuda", "cpu", "mps", "xpu", "hpu"]
    return list(_get_fused_kernels_supported_devices())


def _tensors_of(params: list[Any]) -> list[torch.Tensor]:
    """The tensors in `params`, which holds tensors or param-group dicts."""
    tensors: list[torch.Tensor] = []
    for item in params:
        if isinstance(item, dict):
            tensors.extend(item["params"])
        else:
            tensors.append(item)
    return tensors


def _check_fused_supported(params: list[Any], device_type: str) -> None:
    """Raise one line naming `optimizer.implementation` if fused cannot run here."""
    supported = _fused_device_types()
    others = "'foreach' or 'for-loop'"
    if device_type not in supported:
        raise ConfigError(
            f"optimizer.implementation: 'fused' has no kernel for device type {device_type!r} "
            f"(torch has it for {', '.join(sorted(supported))}); use {others}"
        )
    for p in _tensors_of(params):
        if not torch.is_floating_point(p):
            raise ConfigError(
                f"optimizer.implementation: 'fused' needs floating-point parameters "
                f"(float64/float32/float16/bfloat16), got {p.dtype}; use {others}"
            )


def resolve_implementation(implementation: str, device_type: str) -> tuple[str, str]:
    """The step kernel "auto" stands for on `device_type`, and why; any other choice is kept as given.

    "auto" is "fused" where torch has fused Adam/AdamW kernels for the device type (CUDA,
    CPU, XPU, ...): one kernel per step instead of one per tensor group (13% of a 1B Llama's
    throughput on an H100 against "foreach", torch 2.11), and it drops a non-finite step on
    the device without a host sync. Elsewhere "foreach".

    Returns:
        (implementation, reason), e.g. ("fused", "auto: torch has fused kernels for cuda").
    """
    if implementation != "auto":
        return implementation, "as configured"
    if device_type in _fused_device_types():
        return "fused", f"auto: torch has fused Adam/AdamW kernels for {device_type}"
    return "foreach", f"auto: torch has no fused Adam/AdamW kernels for {device_type}"


@dataclass(frozen=True)
class OptimizerOptions:
    """What `build_optimizer` builds: the optimizer, its hyperparameters and its step kernel.

    Args:
        lr: peak learning rate; the LR scheduler scales it.
        name: "AdamW", "Adam" or "Muon" (config key `optimizer.name`).
        betas: Adam's (beta1, beta2) moment decays.
        eps: added to the denominator.
        weight_decay: decay coefficient.
        implementation: "auto", "for-loop", "foreach" or "fused" (see `build_optimizer`).
        muon: Muon's own settings (used when `name` is "Muon").
        weight_decay_exclude: shell-style patterns of parameter names that train without weight decay
            (`titan_core.weight_decay`); empty: every parameter decays.
        hidden_lr_scale: muP's factor on the learning rate of the blocks' matrices (`1 / (dim / base_dim)`;
            the matrices Muon's rule picks, `titan_core.muon_groups.takes_muon`); 1: one learning rate.
    """

    lr: float
    name: str = "AdamW"
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    weight_decay: float = 0.1
    implementation: str = "foreach"
    muon: MuonOptions = DEFAULT_MUON
    weight_decay_exclude: tuple[str, ...] = ()
    hidden_lr_scale: float = 1.0


def build_optimizer(
    params: Iterable[torch.Tensor] | Iterable[dict[str, Any]] | Iterable[tuple[str, torch.Tensor]],
    options: OptimizerOptions | None = None,
    *,
    name: str = "AdamW",
    lr: float | None = None,
    betas: tuple[float, float] = (0.9, 0.95),
    eps: float = 1e-8,
    weight_decay: float = 0.1,
    implementation: str = "foreach",
    muon: MuonOptions = DEFAULT_MUON,
    weight_decay_exclude: tuple[str, ...] = (),
    hidden_lr_scale: float = 1.0,
    device_type: str,
    plan: Any = None,
    copies: Any = None,
) -> torch.optim.Optimizer:
    """Build Adam, AdamW or Muon over `params` with the requested step kernel.

    Weight decay applies to all parameters (no exemption for norms or biases,
    as in torchtitan) but those `weight_decay_exclude` matches. AdamW decays decoupled from the gradient; Adam adds
    L2 decay to the gradient. Muon takes the 2-D weights of the blocks (and
    stacked experts) and gives the rest to AdamW (`titan_core.muon_groups.RULE`).

    Args:
        params: parameters (or param-group dicts) to optimize, e.g. `model.parameters()`, or
            `(name, parameter)` pairs (`model.named_parameters()`, which Muon needs);
            FSDP2's DTensor parameters work with every implementation.
        options: every setting below but `device_type`, as one value; pass either it or the
            keywords (`lr` at least), not both.
        name: "AdamW" or "Adam" (config key `optimizer.name`).
        lr: peak learning rate; the LR scheduler scales it.
        betas: Adam's (beta1, beta2) moment decays.
        eps: added to the denominator.
        weight_decay: decay coefficient.
        implementation: "for-loop" (one tensor at a time), "foreach" (batched
            multi-tensor ops), "fused" (one kernel per step; needs a device
            type with fused kernels, e.g. cuda or cpu, and floating-point params)
            or "auto" ("fused" where the device type has it, else "foreach";
            `resolve_implementation`); Muon's AdamW group takes it, its Muon group steps per matrix.
        muon: Muon's own settings (`titan_core.muon.MuonOptions`), when `name` is "Muon".
        weight_decay_exclude: shell-style patterns of parameter names (wrapper levels ignored) that train
            without weight decay, in a param group of their own (needs `(name, parameter)` pairs); the
            optimizer's `description` says how many matched.
        hidden_lr_scale: muP's factor on the learning rate of the blocks' matrices (Muon's rule's set; needs
            `(name, parameter)` pairs and `plan`); Adam and AdamW only.
        device_type: where the parameters live, e.g. "cuda" or "cpu".
        plan: the model's `ModelPlan`, which Muon's rule reads (the blocks, the MoE module).
        copies: the model's `titan_parallel.ComputeCopies` (`optimizer.master_weights`): Adam / AdamW then step
            its fp32 masters from the bf16 gradients and write the copies in one kernel (`implementation` unused).

    Returns:
        The optimizer.

    Raises:
        ConfigError: an unknown name or implementation, "fused" on an
            unsupported device type or dtype, Muon or `weight_decay_exclude` without names (and
            Muon without a plan), or an unknown Newton-Schulz dtype.
        TypeError: neither `options` nor `lr`, or `options` with setting keywords.
    """
    keywords = OptimizerOptions(
        0.0 if lr is None else lr,
        name,
        betas,
        eps,
        weight_decay,
        implementation,
        muon,
        weight_decay_exclude,
        hidden_lr_scale,
    )
    if options is None:
        if lr is None:
            raise TypeError("build_optimizer needs lr, or options=OptimizerOptions(lr=...)")
        options = keywords
    elif lr is not None or keywords != OptimizerOptions(0.0):
        raise TypeError("build_optimizer takes options= or the setting keywords, not both")
    name, implementation = options.name, options.implementation
    if name not in OPTIMIZERS:
        raise ConfigError(f"optimizer.name: unknown optimizer {name!r}; choose one of {', '.join(OPTIMIZERS)}")
    if implementation not in IMPLEMENTATIONS:
        raise ConfigError(
            f"optimizer.implementation: unknown implementation {implementation!r}; "
            f"choose one of {', '.join(IMPLEMENTATIONS)}"
        )
    param_list: list[Any] = list(params)
    named = [item for item in param_list if isinstance(item, tuple)]
    if name == "Muon" and (plan is None or len(named) != len(param_list)):
        raise ConfigError(
            "optimizer.name: Muon splits parameters by name and the model's plan; "
            "pass model.named_parameters() and plan=<the model's ModelPlan>, or use AdamW"
        )
    exclude = options.weight_decay_exclude
    if exclude and len(named) != len(param_list):
        raise ConfigError(
            "optimizer.weight_decay_exclude matches parameter names; pass model.named_parameters(), or leave it empty"
        )
    scale = options.hidden_lr_scale
    if scale != 1.0 and (name == "Muon" or plan is None or len(named) != len(param_list)):
        raise ConfigError(
            "muP's learning-rate scale picks the blocks' matrices by name and the model's plan, for Adam or AdamW; "
            "pass model.named_parameters() and plan=<the model's ModelPlan>"
        )
    description = ""
    if named and name != "Muon":
        param_list = [p for _, p in named]
        if exclude or scale != 1.0:
            param_list, description = _adam_groups(named, exclude, scale, options.lr, plan)
    if copies is not None:
        from titan_parallel import MasterAdam, MasterAdamW

        if name not in ("Adam", "AdamW"):
            raise ConfigError(f"optimizer.name: {name!r} has no master-weight step; use Adam or AdamW")
        master = MasterAdamW if name == "AdamW" else MasterAdam
        o = options
        stepper = master(param_list, copies, lr=o.lr, betas=o.betas, eps=o.eps, weight_decay=o.weight_decay)
        return _described(stepper, description)
    implementation, _ = resolve_implementation(implementation, device_type)
    if implementation == "fused":
        _check_fused_supported([p for _, p in named] if name == "Muon" else param_list, device_type)
    kernel = {
        "for-loop": {"foreach": False, "fused": False},
        "foreach": {"foreach": True, "fused": False},
        "fused": {"foreach": False, "fused": True},
    }[implementation]
    if name == "Muon":
        o = options
        groups, names, line = muon_param_groups(
            named, plan, lr=o.lr, weight_decay=o.weight_decay, betas=o.betas, eps=o.eps, muon=o.muon,
            weight_decay_exclude=exclude,
        )  # fmt: skip
        try:
            ns_dtype, why = resolve_ns_dtype(o.muon.ns_dtype, device_type)
        except ValueError as e:
            raise ConfigError(f"optimizer.muon_{e}") from None
        optimizer = Muon(groups, param_names=names, ns_dtype=ns_dtype, **kernel)
        short = {torch.bfloat16: "bf16", torch.float32: "fp32"}[ns_dtype]
        optimizer.description = f"{line}; Newton-Schulz in {short} ({why})"  # the trainer logs it once
        return optimizer
    plain = OPTIMIZERS[name](
        param_list,
        lr=options.lr,
        betas=options.betas,
        eps=options.eps,
        weight_decay=options.weight_decay,
        **kernel,
    )
    return _described(plain, description)


def _adam_groups(
    named: list[tuple[str, Any]], exclude: tuple[str, ...], scale: float, lr: float, plan: Any
) -> tuple[list[dict[str, Any]], str]:
    """Adam's param groups: the decayed and the `exclude`d parameters (weight decay 0), each split again, under
    muP (`scale` != 1), into the rest and the blocks' matrices at `lr * scale`. Every group is present even when
    empty (a pipeline stage without some), so checkpoints hold the same groups on every stage; the log line."""
    from titan_core.muon_groups import takes_muon

    lines = []
    if exclude:
        decayed, without = split_by_decay(named, exclude)
        lines.append(describe_exclusion(without, exclude))
        halves = [(decayed, {}), (without, {"weight_decay": 0.0})]
    else:
        halves = [([p for _, p in named], {})]
    if scale == 1.0:
        return [{"params": params, **settings} for params, settings in halves], "; ".join(lines)
    matrices = {id(p) for n, p in named if takes_muon(n, p.ndim, plan)}
    groups = [{"params": [p for p in params if id(p) not in matrices], **settings} for params, settings in halves]
    groups += [
        {"params": [p for p in params if id(p) in matrices], **settings, "lr": lr * scale}
        for params, settings in halves
    ]
    elements = sum(p.numel() for _, p in named if id(p) in matrices)
    lines.append(f"muP: {len(matrices)} block matrices ({elements:,} elements) at lr x {scale:.4g}")
    return groups, "; ".join(lines)


def _described(optimizer: torch.optim.Optimizer, description: str) -> torch.optim.Optimizer:
    """`optimizer` with `description`, the line the trainer logs once about it (as `Muon.description`)."""
    optimizer.description = description  # type: ignore[attr-defined]
    return optimizer
