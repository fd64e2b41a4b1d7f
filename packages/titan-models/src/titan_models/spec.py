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
class ActivationLayout:
    """How one rank runs the model, as far as the bytes its activations take depend on it.

    Args:
        compute_bytes: bytes per element of the compute dtype (2 for bf16, 4 for fp32).
        tp: tensor parallel degree (with sequence parallel: norms and residuals split the sequence).
        cp: context parallel degree (the rank's tokens are `seq_len / cp` of each sequence).
        cp_rotate_method: "allgather" or "rotate" (how ring attention exchanges K/V).
        cp_method: "ring" or "ulysses" (context parallel's attention; `cp_rotate_method` is ring's).
        seq_len: tokens per (full) sequence.
        device_type: "cuda" or "cpu" (kernels differ in what they save, e.g. RMSNorm).
        loss_parallel: under TP, whether the loss runs on vocab-sharded logits.
    """

    compute_bytes: int = 2
    tp: int = 1
    cp: int = 1
    cp_rotate_method: str = "allgather"
    cp_method: str = "ring"
    seq_len: int = 2048
    device_type: str = "cuda"
    loss_parallel: bool = True


@dataclass(frozen=True)
class ActivationBytes:
    """Bytes one rank keeps for backward, per token it processes (`seq_len / cp` of each sequence).

    Args:
        block: one block, nothing recomputed.
        block_op: one block under selective "op" activation checkpointing (outputs of matmuls and attention kept).
        block_input: one block's input: all that full activation checkpointing keeps.
        block_backward: transient bytes of one block's backward beyond what it saved (gradients of its activations).
        head: the final norm and the output projection's input (the logits are `logits`).
        logits: the logits and the loss over the vocab, at their largest (backward of the log-softmax).
        logits_saved: what the loss keeps for backward (the log-softmax output).
        per_block: where a model's blocks differ (DeepSeek-V3's dense and Mixture-of-Experts blocks),
            each block's own figures by layer index, whose `block*` fields apply to that block; the
            `block*` fields above are then each the smallest over the blocks (a lower bound). Empty:
            every block is as above.
    """

    block: int
    block_op: int
    block_input: int
    block_backward: int
    head: int
    logits: int
    logits_saved: int
    per_block: tuple[ActivationBytes, ...] = ()


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
        activation_bytes: `(args, ActivationLayout) -> ActivationBytes`, the family's saved-tensor
            formulas for `titan estimate-memory`'s analytic tier; None = only the traced tier.
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
    activation_bytes: Callable[[ArgsT, ActivationLayout], ActivationBytes] | None = None
    count_active_params: Callable[[ArgsT], int] | None = None

    def active_params(self, args: ArgsT) -> int:
        """Parameters one token uses: `count_active_params`, or every parameter for a dense model."""
        return (self.count_active_params or self.count_params)(args)
