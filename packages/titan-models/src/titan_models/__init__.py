"""Model definitions for Titan (Llama 3, Qwen3, Qwen3-MoE, DeepSeek-V3), with their parallel plans as data.

`get_model_spec(name)` returns a `ModelSpec` (builder, flavors, plan, FLOP count,
`HFAdapter`); `get_model_args(name, flavor)` returns one named shape. A model name,
shape or checkpoint config that cannot work raises `ModelConfigError` (a `ValueError`).
`import titan_models` is cheap (no torch): each name is imported from its module on first use.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS: dict[str, str] = {
    "get_model_args": "registry",
    "get_model_spec": "registry",
    "register_model_spec": "registry",
    "registered_model_specs": "registry",
    "HFAdapter": "spec",
    "ModelSpec": "spec",
    "ModelConfigError": "errors",
}

__all__ = [
    "HFAdapter",
    "ModelConfigError",
    "ModelSpec",
    "get_model_args",
    "get_model_spec",
    "register_model_spec",
    "registered_model_specs",
]

if TYPE_CHECKING:
    from titan_models.errors import ModelConfigError
    from titan_models.registry import get_model_args, get_model_spec, register_model_spec, registered_model_specs
    from titan_models.spec import HFAdapter, ModelSpec


def __getattr__(name: str) -> Any:
    """Import a public name from its module on first use (`import titan_models` stays cheap)."""
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'titan_models' has no attribute '{name}'")
    value = getattr(importlib.import_module(f"titan_models.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
