"""The model registry: each model name maps to a `ModelSpec`. The trainer looks models
up here by the config keys `model.name` and `model.flavor`."""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from typing import Any

from titan_models import deepseek_v3, llama3, qwen3
from titan_models.errors import ModelConfigError
from titan_models.spec import ModelSpec

_MODEL_SPECS: dict[str, ModelSpec[Any]] = {}


def register_model_spec(spec: ModelSpec[Any]) -> None:
    """Add a model family to the registry.

    Args:
        spec: the family; its `name` must not be registered yet.
    """
    if spec.name in _MODEL_SPECS:
        raise ValueError(f"model.name '{spec.name}' is already registered; pick another name for the new ModelSpec")
    _MODEL_SPECS[spec.name] = spec


def get_model_spec(name: str) -> ModelSpec[Any]:
    """Look up a model family.

    Args:
        name: the `model.name` config value.

    Raises:
        ModelConfigError: unknown name; the message lists the valid names, closest first.
    """
    if name not in _MODEL_SPECS:
        raise ModelConfigError(
            f"unknown model.name '{name}'; choose one of: {', '.join(_rank_by_similarity(name, _MODEL_SPECS))}"
        )
    return _MODEL_SPECS[name]


def registered_model_specs() -> dict[str, ModelSpec[Any]]:
    """Every registered family by `model.name`, in registration order."""
    return dict(_MODEL_SPECS)


def get_model_args(name: str, flavor: str) -> Any:
    """Look up the args of one named shape.

    Args:
        name: the `model.name` config value.
        flavor: the `model.flavor` config value.

    Raises:
        ModelConfigError: unknown name or flavor; the message lists the valid choices, closest first.
    """
    flavors = get_model_spec(name).flavors
    if flavor not in flavors:
        choices = ", ".join(_rank_by_similarity(flavor, flavors))
        raise ModelConfigError(f"unknown model.flavor '{flavor}' for model.name '{name}'; choose one of: {choices}")
    return flavors[flavor]


def _rank_by_similarity(value: str, choices: Mapping[str, Any]) -> list[str]:
    """`choices`' keys, most similar to `value` first (case-insensitive; ties keep their order)."""

    def similarity(choice: str) -> float:
        return difflib.SequenceMatcher(None, value.lower(), choice.lower()).ratio()

    return sorted(choices, key=similarity, reverse=True)


register_model_spec(
    ModelSpec(
        name="llama3",
        flavors=llama3.llama3_flavors,
        build=llama3.Transformer,
        plan=llama3.llama3_plan,
        flops_per_token=llama3.flops_per_token,
        count_params=llama3.count_params,
        hf_adapter=llama3.llama3_hf_adapter,
    )
)

register_model_spec(
    ModelSpec(
        name="qwen3",
        flavors=qwen3.qwen3_flavors,
        build=qwen3.Transformer,
        plan=qwen3.qwen3_plan,
        flops_per_token=qwen3.flops_per_token,
        count_params=qwen3.count_params,
        hf_adapter=qwen3.qwen3_hf_adapter,
        count_active_params=qwen3.count_active_params,
    )
)
register_model_spec(
    ModelSpec(
        name="qwen3_moe",
        flavors=qwen3.qwen3_moe_flavors,
        build=qwen3.Transformer,
        plan=qwen3.qwen3_moe_plan,
        flops_per_token=qwen3.flops_per_token,
        count_params=qwen3.count_params,
        hf_adapter=qwen3.qwen3_moe_hf_adapter,
        count_active_params=qwen3.count_active_params,
    )
)

register_model_spec(
    ModelSpec(
        name="deepseek_v3",
        flavors=deepseek_v3.deepseek_v3_flavors,
        build=deepseek_v3.Transformer,
        plan=deepseek_v3.deepseek_v3_plan,
        flops_per_token=deepseek_v3.flops_per_token,
        count_params=deepseek_v3.count_params,
        hf_adapter=deepseek_v3.deepseek_v3_hf_adapter,
        count_active_params=deepseek_v3.count_active_params,
    )
)
