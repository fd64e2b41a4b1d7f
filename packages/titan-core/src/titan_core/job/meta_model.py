"""The whole model on the meta device, for the rules that read its structure (costs no memory).

`titan plan` resolves hundreds of layouts of one model, so the model is built once
per shape (the last few kept).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch.nn as nn

    from titan_models import ModelSpec

_META_MODELS: dict[tuple[str, Any], nn.Module] = {}


def build_meta_model(spec: ModelSpec, model_args: Any) -> nn.Module:
    """`spec.build(model_args)` on the meta device, built once per shape (the last four kept).

    Args:
        spec: the model family.
        model_args: the model's shape (a frozen, hashable args dataclass).
    """
    import torch

    key = (spec.name, model_args)
    if key not in _META_MODELS:
        if len(_META_MODELS) >= 4:
            _META_MODELS.pop(next(iter(_META_MODELS)))
        with torch.device("meta"), skip_init():
            _META_MODELS[key] = spec.build(model_args)
    return _META_MODELS[key]


@contextlib.contextmanager
def skip_init() -> Iterator[None]:
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
