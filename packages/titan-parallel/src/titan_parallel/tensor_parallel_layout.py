"""Whether a model can be split by tensor parallel: the degree against every dimension TP shards.

Kept apart from `tensor_parallel` (which applies the split with DTensor) so a launcher
can check a layout on the meta model without importing `torch.distributed.tensor`.
"""

from __future__ import annotations

from typing import Any

import torch.nn as nn

from titan_parallel.layout import ParallelConfigError, at_least
from titan_parallel.modules import get_submodule_or_none, iter_blocks
from titan_parallel.plan import ModelPlan, TPStyle

__all__ = ["MOE_TP_SPLITS", "check_tp"]

MOE_TP_SPLITS: dict[str, int] = {
    "experts.w1": 1,  # (experts, hidden, dim): the hidden dim
    "experts.w3": 1,
    "experts.w2": 2,  # (experts, dim, hidden)
    "shared_experts.w1.weight": 0,  # nn.Linear (hidden, dim)
    "shared_experts.w3.weight": 0,
    "shared_experts.w2.weight": 1,  # nn.Linear (dim, hidden)
}
"""The parameters of a `TPStyle.MOE_INPUT` module that tensor parallel splits, by path inside it, and the
dim it splits: the routed experts' and the shared experts' SwiGLU hidden dim. Every other parameter (the
router) is replicated, its gradient summed over the TP ranks; `check_tp` refuses any other parameter under
`experts` or `shared_experts` (a bias, another name), whose output each rank would add whole."""


def _model_args(model: nn.Module) -> Any:
    """The model's ModelArgs-like object (its `args`, `model_args` or `config` attribute), if any."""
    for name in ("args", "model_args", "config"):
        args = getattr(model, name, None)
        if args is not None and hasattr(args, "n_heads"):
            return args
    return None


def _named_sizes(model: nn.Module, plan: ModelPlan) -> list[tuple[str, int]]:
    """(name, size) of every dimension tensor parallel divides: head counts, FFN hidden dim, vocab size."""
    sizes: list[tuple[str, int]] = []
    args = _model_args(model)
    if args is not None:
        n_heads = args.n_heads
        n_kv_heads = getattr(args, "kv_heads", None) or getattr(args, "n_kv_heads", None) or n_heads
        sizes += [("n_heads", n_heads), ("n_kv_heads", n_kv_heads)]
        for name in ("ffn_hidden_dim", "vocab_size"):
            if isinstance(getattr(args, name, None), int):
                sizes.append((name, getattr(args, name)))
    for block in iter_blocks(model, plan):
        for path, attrs in plan.head_counts:
            module = get_submodule_or_none(block, path)
            for attr in attrs:
                if module is not None and isinstance(getattr(module, attr, None), int):
                    sizes.append((attr, getattr(module, attr)))
    return sizes


def _split_sizes(model: nn.Module, plan: ModelPlan, ep_spans_tp: bool) -> list[tuple[str, int]]:
    """(name, size) of the weight dimension each planned module shards, found on the modules themselves
    (`ep_spans_tp`: a MoE's routed experts stay whole)."""
    sizes: list[tuple[str, int]] = []
    container = get_submodule_or_none(model, plan.blocks)
    first_block = next(iter(container.named_children()), None) if container is not None else None
    tables = [(model, "", plan.tp)]
    if first_block is not None:  # every block has the same shapes
        tables.append((first_block[1], f"{plan.blocks}.{first_block[0]}.", plan.block_tp))
    for root, prefix, table in tables:
        for path, style in table:
            module = get_submodule_or_none(root, path)
            if style is TPStyle.MOE_INPUT:
                sizes += _moe_split_sizes(model, plan, path, ep_spans_tp)
            if isinstance(module, nn.Linear) and style in (TPStyle.COLWISE, TPStyle.OUTPUT):
                sizes.append((f"{prefix}{path}.out_features", module.out_features))
            elif isinstance(module, nn.Linear) and style is TPStyle.ROWWISE:
                sizes.append((f"{prefix}{path}.in_features", module.in_features))
            elif isinstance(module, nn.Embedding) and style is TPStyle.EMBEDDING:
                sizes.append((f"{prefix}{path}.num_embeddings", module.num_embeddings))
    return sizes


def _moe_split_sizes(model: nn.Module, plan: ModelPlan, path: str, ep_spans_tp: bool) -> list[tuple[str, int]]:
    """(name, size) of the hidden dims `MOE_TP_SPLITS` splits, in the first block that has the MoE at `path`
    (a model's first blocks may be dense); the routed experts' left out when they stay whole (`ep_spans_tp`)."""
    container = get_submodule_or_none(model, plan.blocks)
    for index, block in container.named_children() if container is not None else ():
        moe = get_submodule_or_none(block, path)
        if moe is None:
            continue
        params = dict(moe.named_parameters())
        unknown = [n for n in params if n.split(".")[0] in ("experts", "shared_experts") and n not in MOE_TP_SPLITS]
        if unknown:  # run whole on each rank, it would add tp copies of its output into the reduce-scatter
            raise ParallelConfigError(
                f"tensor parallel cannot split {plan.blocks}.{index}.{path}.{unknown[0]}: a TPStyle.MOE_INPUT "
                f"module's experts are split by the names {', '.join(MOE_TP_SPLITS)}; name them so, or set tp=1",
                arguments=("tp",),
            )
        return [
            (f"{plan.blocks}.{index}.{path}.{name}.shape[{dim}]", params[name].shape[dim])
            for name, dim in MOE_TP_SPLITS.items()
            if name in params and not (ep_spans_tp and name.startswith("experts."))
        ]
    return []


def check_tp(model: nn.Module, plan: ModelPlan, tp: int, ep_spans_tp: bool = False) -> None:
    """Raise `ParallelConfigError` (arguments `("tp",)`) if `model` cannot be split `tp` ways.

    Checks that the plan has tensor-parallel entries and that `tp` divides the head
    counts, the FFN hidden dim and the vocab size (read from the model's `args`,
    `model_args` or `config`, and the plan's `head_counts`), and every dimension a
    planned linear, embedding or Mixture-of-Experts module (`MOE_TP_SPLITS`) shards. Cheap and
    communication-free; works on the meta device, so a launcher can call it before any process starts.

    Args:
        model: the model or pipeline stage to split.
        plan: its plan.
        tp: the tensor-parallel degree.
        ep_spans_tp: the TP ranks join expert parallel (`ParallelDims.ep_spans_tp`, as `apply_tp` takes it): the
            routed experts stay whole, so `tp` need not divide their hidden dim.
    """
    at_least(1, tp=tp)
    if tp == 1:
        return
    if not plan.tp and not plan.block_tp:
        raise ParallelConfigError(
            f"model {type(model).__name__} has no tensor-parallel plan (ModelPlan.tp, ModelPlan.block_tp); set tp=1",
            arguments=("tp",),
        )
    for name, size in _named_sizes(model, plan) + _split_sizes(model, plan, ep_spans_tp):
        if size % tp:
            raise ParallelConfigError(
                f"tp={tp} does not divide {name}={size}; choose a tp that divides it", arguments=("tp",)
            )
