"""Finding the modules a `ModelPlan` names inside a (possibly pruned) model."""

from __future__ import annotations

from collections.abc import Iterator

import torch.nn as nn

from titan_parallel.plan import ModelPlan


def get_submodule_or_none(model: nn.Module, path: str) -> nn.Module | None:
    """The submodule at dotted `path`, or None where a pipeline stage dropped it (set to None or deleted).

    Args:
        model: the model or pipeline stage.
        path: dotted module path, e.g. "layers.0.attention".
    """
    module: nn.Module | None = model
    for part in path.split("."):
        module = getattr(module, part, None)
        if module is None:
            return None
    return module


def iter_blocks(model: nn.Module, plan: ModelPlan) -> Iterator[nn.Module]:
    """The repeated blocks of `model` (children of `plan.blocks`) in forward order.

    Args:
        model: the model or pipeline stage.
        plan: names the blocks container.
    """
    container = get_submodule_or_none(model, plan.blocks)
    if container is None:
        return iter(())
    return iter(container.children())
