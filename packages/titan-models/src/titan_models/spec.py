"""The types a model family is described by: `ModelSpec` (builder, flavors, parallel
plan, FLOP count) and `HFAdapter` (conversion to and from Hugging Face).

Both are generic over the family's args dataclass (`ModelSpec[ModelArgs]`), so a
type checker sees that `spec.build(spec.flavors["8B"])` gets the args it expects.
The registry of families is `titan_models.registry`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import torch
from torch import nn

from titan_parallel.plan import ModelPlan

ArgsT = TypeVar("ArgsT")
"""A model family's args dataclass (e.g. `titan_models.llama3.ModelArgs`)."""

StateDict = dict[str, torch.Tensor]


@dataclass(frozen=True)
class HFAdapter(Generic[ArgsT]):
    """How one model family converts to and from Hugging Face transformers.

    Stateless: each function takes the model's args, so one adapter serves all flavors.

    Args:
        hf_architecture: the transformers class the files load into, e.g. "LlamaForCausalLM".
        to_hf: `(state_dict, args) -> hf_state_dict`: the family's full state dict to
            Hugging Face names and layout.
        from_hf: `(hf_state_dict, args) -> state_dict`: the inverse, loadable into
            `build(args)` with `strict=True`.
        args_from_hf_config: a parsed `config.json` -> args (no flavor needed).
        hf_config_from_args: `(args, dtype_name) -> config.json dict`.
    """

    hf_architecture: str
    to_hf: Callable[[StateDict, ArgsT], StateDict]
    from_hf: Callable[[StateDict, ArgsT], StateDict]
    args_from_hf_config: Callable[[dict[str, Any]], ArgsT]
    hf_config_from_args: Callable[[ArgsT, str], dict[str, Any]]


@dataclass(frozen=True)
class ModelSpec(Generic[ArgsT]):
    """Everything the trainer needs to know about one model family.

    Args:
        name: registry key (`model.name`).
        flavors: named shapes (`model.flavor`), each the family's args.
        build: builds the model from its args on the current default device
            (use `with torch.device("meta"):` to build without memory).
        plan: how titan-parallel may split the built model.
        flops_per_token: `(args, seq_len) -> int` training FLOPs per token.
        count_params: `(args) -> int` parameter count, computed from shapes.
        hf_adapter: conversion to and from Hugging Face; None for a family without it.
        count_active_params: `(args) -> int` parameters one token uses (a Mixture-of-Experts model
            counts only its top-k routed experts); None = `count_params` (a dense model).
    """

    name: str
    flavors: Mapping[str, ArgsT]
    build: Callable[[ArgsT], nn.Module]
    plan: ModelPlan
    flops_per_token: Callable[[ArgsT, int], int]
    count_params: Callable[[ArgsT], int]
    hf_adapter: HFAdapter[ArgsT] | None = None
    count_active_params: Callable[[ArgsT], int] | None = None

    def active_params(self, args: ArgsT) -> int:
        """Parameters one token uses: `count_active_params`, or every parameter for a dense model."""
        return (self.count_active_params or self.count_params)(args)
