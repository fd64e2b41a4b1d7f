"""Which parameters Muon updates and which AdamW does: the rule, read from the model's plan.

    Muon:  the 2-D weights inside the blocks (`ModelPlan.blocks`): attention and MLP projections,
           MLA's low-rank projections, shared experts; and the 3-D stacked expert weights
           (`<ModelPlan.moe>.experts.w1/w2/w3`, dim 0 the expert), orthogonalised expert by expert.
    AdamW: everything else: embeddings, the output projection, norms, biases, and the routers
           (`<ModelPlan.moe>.router.*`; a router's few rows score experts, not features).

This is Moonlight's split ("Muon is Scalable for LLM Training", 2025, Sec. 2.2) and Keller Jordan's;
it needs no model-specific table, only the names the plan gives the blocks and the MoE module.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

from titan_parallel import ModelPlan, canonical_name

RULE = (
    "Muon for the 2-D weights of the blocks and the stacked experts (per expert); "
    "AdamW for embeddings, the output projection, norms, biases and routers"
)


def takes_muon(name: str, ndim: int, plan: ModelPlan) -> bool:
    """Whether parameter `name` gets Muon's update under `RULE`.

    Args:
        name: the parameter's name in the whole model (wrapper levels are ignored), e.g.
            `layers.3.attention.wq.weight`.
        ndim: its number of dimensions.
        plan: the model's plan (`blocks`, `moe`).
    """
    name = canonical_name(name)
    if not name.startswith(plan.blocks + "."):
        return False
    inside = name[len(plan.blocks) + 1 :].split(".", 1)[-1]  # the path inside the block
    if plan.moe is not None and inside.startswith(f"{plan.moe}.router."):
        return False
    if plan.moe is not None and inside.startswith(f"{plan.moe}.experts."):
        return ndim == 3
    return ndim == 2


@dataclass
class ParamSplit:
    """A model part's parameters split by `RULE`, each list as `(name, parameter)` in model order."""

    muon: list[tuple[str, torch.Tensor]]
    adamw: list[tuple[str, torch.Tensor]]

    def describe(self) -> str:
        """One line: how many tensors and elements each side got, and which kinds went to AdamW."""
        kinds = sorted({_kind(name) for name, _ in self.adamw})
        muon = sum(p.numel() for _, p in self.muon)
        adamw = sum(p.numel() for _, p in self.adamw)
        return (
            f"Muon {len(self.muon)} tensors ({muon / 1e6:.2f}M elements), "
            f"AdamW {len(self.adamw)} tensors ({adamw / 1e6:.2f}M elements: {', '.join(kinds) or 'none'})"
        )


def split_params(named: Iterable[tuple[str, torch.Tensor]], plan: ModelPlan) -> ParamSplit:
    """The trainable parameters of `named` split by `RULE`.

    Args:
        named: `(name, parameter)` pairs, e.g. `model.named_parameters()`.
        plan: the model's plan.
    """
    split = ParamSplit([], [])
    for name, p in named:
        if p.requires_grad:
            (split.muon if takes_muon(name, p.ndim, plan) else split.adamw).append((canonical_name(name), p))
    return split


def _kind(name: str) -> str:
    """A word for what an AdamW parameter is, for the log line."""
    leaf = name.split(".")[-2] if name.count(".") else name
    if "router" in name:
        return "routers"
    if "norm" in leaf:
        return "norms"
    if name.endswith("bias"):
        return "biases"
    if "embed" in name:
        return "embeddings"
    if leaf == "output":
        return "output"
    return "others"
