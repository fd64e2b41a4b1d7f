"""Which parameters train without weight decay: `optimizer.weight_decay_exclude`, shell-style patterns
(`fnmatch`) of the model's own parameter names (wrapper levels such as activation checkpointing or compile
ignored, as in checkpoints).

By default every parameter decays, as in torchtitan. Many recipes exempt some: Megatron-LM and nanoGPT the
norms and biases (`["*norm*", "*.bias"]`), OLMo 2 the embeddings too (`["*norm*", "tok_embeddings.*"]`). With
patterns set, each optimizer puts the matching parameters in a param group of their own with weight decay 0
(under Muon, one beside each of its two groups), on every pipeline stage alike, so that checkpoints always hold
the same groups; the patterns may change between resumes.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

from titan_parallel import canonical_name

if TYPE_CHECKING:
    import torch

__all__ = ["excluded", "split_by_decay", "unmatched", "describe_exclusion"]


def excluded(name: str, patterns: Sequence[str]) -> bool:
    """Whether parameter `name` trains without weight decay.

    Args:
        name: the parameter's name in the model (wrapper levels are ignored), e.g. `layers.0.ffn_norm.weight`.
        patterns: `optimizer.weight_decay_exclude`.
    """
    name = canonical_name(name)
    return any(fnmatch.fnmatchcase(name, pattern) for pattern in patterns)


def split_by_decay(
    named: Iterable[tuple[str, torch.Tensor]], patterns: Sequence[str]
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(decayed, excluded): the parameters of `named` whose names match none / some of `patterns`, in order.

    Args:
        named: `(name, parameter)` pairs, e.g. `model.named_parameters()`.
        patterns: `optimizer.weight_decay_exclude`.
    """
    decayed: list[torch.Tensor] = []
    without: list[torch.Tensor] = []
    for name, p in named:
        (without if excluded(name, patterns) else decayed).append(p)
    return decayed, without


def unmatched(names: Iterable[str], patterns: Sequence[str]) -> list[str]:
    """The patterns that match none of `names` (a typo would otherwise decay what it meant to exempt).

    Args:
        names: every parameter name of the whole model.
        patterns: `optimizer.weight_decay_exclude`.
    """
    names = [canonical_name(n) for n in names]
    return [pattern for pattern in patterns if not any(fnmatch.fnmatchcase(n, pattern) for n in names)]


def describe_exclusion(without: Sequence[torch.Tensor], patterns: Sequence[str]) -> str:
    """One line for the log: how many tensors and elements train without weight decay.

    Args:
        without: the parameters without weight decay.
        patterns: `optimizer.weight_decay_exclude`.
    """
    elements = sum(p.numel() for p in without)
    quoted = ", ".join(repr(p) for p in patterns)
    return f"no weight decay for {len(without)} tensors ({elements:,} elements) matching {quoted}"
