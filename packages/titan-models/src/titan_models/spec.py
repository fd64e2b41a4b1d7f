"""The model registry: each model name maps to a `ModelSpec` bundling its builder,
named flavors, parallel plan and FLOP count. The trainer looks models up here by
the config keys `model.name` and `model.flavor`."""

from __future__ import annotations

import difflib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from torch import nn
from titan_parallel.plan import ModelPlan

from titan_models import llama3


@dataclass(frozen=True)
class ModelSpec:
    """Everything the trainer needs to know about one model family.

    Args:
        name: registry key (`model.name`).
        flavors: named shapes (`model.flavor`), each the model's args dataclass.
        build: builds the model from its args on the current default device
            (use `with torch.device("meta"):` to build without memory).
        plan: how titan-parallel may split the built model.
        flops_per_token: `(args, seq_len) -> int` training FLOPs per token.
        count_params: `(args) -> int` parameter count, computed from shapes.
        args_from_hf_config: converts a Hugging Face `config.json` dict to args;
            None for a family without Hugging Face interop.
        state_dict_adapter: converts to and from Hugging Face: `to_hf(state_dict, args)`,
            `from_hf(hf_state_dict, args)`, `args_from_hf_config(config)`,
            `hf_config_from_args(args, dtype)`, and `hf_architecture` (the transformers
            class name); see `titan_models.llama3.hf_adapter`. None without interop.
    """

    name: str
    flavors: Mapping[str, Any]
    build: Callable[[Any], nn.Module]
    plan: ModelPlan
    flops_per_token: Callable[[Any, int], int]
    count_params: Callable[[Any], int]
    args_from_hf_config: Callable[[dict[str, Any]], Any] | None = None
    state_dict_adapter: Any | None = None


_MODEL_SPECS: dict[str, ModelSpec] = {}


def register_model_spec(spec: ModelSpec) -> None:
    """Add a model family to the registry.

    Args:
        spec: the family; its `name` must not be registered yet.
    """
    if spec.name in _MODEL_SPECS:
        raise ValueError(f"model.name '{spec.name}' is already registered; pick another name for the new ModelSpec")
    _MODEL_SPECS[spec.name] = spec


def get_model_spec(name: str) -> ModelSpec:
    """Look up a model family.

    Args:
        name: the `model.name` config value.

    Raises:
        ValueError: unknown name; the message lists the valid names, closest first.
    """
    if name not in _MODEL_SPECS:
        raise ValueError(f"unknown model.name '{name}'; choose one of: {', '.join(_rank_by_similarity(name, _MODEL_SPECS))}")
    return _MODEL_SPECS[name]


def get_model_args(name: str, flavor: str) -> Any:
    """Look up the args of one named shape.

    Args:
        name: the `model.name` config value.
        flavor: the `model.flavor` config value.

    Raises:
        ValueError: unknown name or flavor; the message lists the valid choices, closest first.
    """
    flavors = get_model_spec(name).flavors
    if flavor not in flavors:
        choices = ", ".join(_rank_by_similarity(flavor, flavors))
        raise ValueError(f"unknown model.flavor '{flavor}' for model.name '{name}'; choose one of: {choices}")
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
        args_from_hf_config=llama3.args_from_hf_config,
        state_dict_adapter=llama3.llama3_state_dict_adapter,
    )
)
