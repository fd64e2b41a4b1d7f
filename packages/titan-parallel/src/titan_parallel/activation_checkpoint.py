"""Activation checkpointing: recompute a block's activations in backward instead of storing them.

Modes (`apply_ac`'s `ac_mode`, checked by `titan_parallel.layout.check_ac`):
- "full": every block is recomputed.
- "selective" with an int N: every Nth block is recomputed.
- "selective" with "op": every block, but the outputs of matmuls and attention
  are saved (every other one for matmuls), so only cheap ops are recomputed.
- "memory_budget": no wrapper; the compiled blocks keep a share of their activations and
  recompute the rest, as the compiler's partitioner chooses (`titan_parallel.compile`).

Selective "op" mode and profiler annotations: torch 2.15's selective checkpointing replays
every op of a block's forward by its count, and caches ops with effects, among them
`record_function`'s enter and exit. FSDP annotates its hooks that way, and the hooks of an
FSDP unit inside a block (the experts under expert parallel, on a mesh of their own) run a
different number of times in the recompute than in the forward: the backward failed with
"profiler._record_function_enter_new.default invocation index 3 encountered during
backward but not found in storage" (pytorch/torchtitan#3427). `apply_ac` adds those
annotation ops to torch's `SAC_IGNORED_OPS`, as torch's own fix does (pytorch/pytorch#196862):
they run each time, outside the replay, and no tensor computation changes.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any, Literal

import torch
import torch.nn as nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.utils.checkpoint import CheckpointPolicy, SelectiveCheckpointContext, create_selective_checkpoint_contexts

from titan_parallel.layout import check_ac
from titan_parallel.modules import get_submodule_or_none
from titan_parallel.plan import ModelPlan


def _ops(*names: str) -> set:
    """The aten/_c10d_functional overloads named `namespace.op`, skipping ones this torch lacks."""
    import torch.distributed._functional_collectives  # noqa: F401  (registers the _c10d_functional ops)

    found = set()
    for name in names:
        namespace, op = name.split(".")
        packet = getattr(getattr(torch.ops, namespace), op, None)
        if packet is not None:
            found.add(packet.default)
    return found


# Ops whose outputs selective "op" mode keeps: expensive to recompute.
_SAVE_OPS = _ops(
    "aten.mm",
    "aten._scaled_mm",  # float8 linears (torchao): without it every float8 matmul was recomputed
    "aten._scaled_dot_product_efficient_attention",
    "aten._scaled_dot_product_flash_attention",
    "aten._scaled_dot_product_flash_attention_for_cpu",
    "aten._scaled_dot_product_cudnn_attention",
    "_c10d_functional.reduce_scatter_tensor",
    "aten.max",
)
_FLEX_ATTENTION = getattr(torch.ops.higher_order, "flex_attention", None)  # a higher-order op, without overloads
if _FLEX_ATTENTION is not None:  # block-causal attention on GPUs: as costly to recompute as SDPA's kernels
    _SAVE_OPS.add(_FLEX_ATTENTION)


_MATMULS = _ops("aten.mm", "aten._scaled_mm")  # bf16 and float8 matmuls share the save-every-other count

_Contexts = tuple[AbstractContextManager[Any], AbstractContextManager[Any]]


def _op_policy() -> Callable[[], _Contexts]:
    def make_contexts() -> _Contexts:
        counts: dict[str, int] = defaultdict(int)

        def policy(ctx: SelectiveCheckpointContext, func: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
            mode = "recompute" if ctx.is_recompute else "forward"
            if func in _MATMULS:
                counts[f"{mode}_mm"] += 1
                # Save every other matmul: half the memory of saving all, little recompute.
                if counts[f"{mode}_mm"] % 2 == 0:
                    return CheckpointPolicy.PREFER_RECOMPUTE
            return CheckpointPolicy.MUST_SAVE if func in _SAVE_OPS else CheckpointPolicy.PREFER_RECOMPUTE

        return create_selective_checkpoint_contexts(policy)

    return make_contexts


def _ignore_annotations_in_sac() -> None:
    """Put `record_function`'s ops into torch's `SAC_IGNORED_OPS` (see the module docstring)."""
    import torch.utils.checkpoint as checkpoint

    for name in ("_record_function_enter", "_record_function_enter_new", "_record_function_exit"):
        packet = getattr(torch.ops.profiler, name, None)
        if packet is not None:
            checkpoint.SAC_IGNORED_OPS.update(getattr(packet, overload) for overload in packet.overloads())


def apply_ac(
    model: nn.Module,
    plan: ModelPlan,
    ac_mode: Literal["none", "selective", "full", "memory_budget"],
    ac_selective_option: str = "2",
) -> nn.Module:
    """Wrap the blocks of `model` for activation checkpointing, in place.

    Args:
        model: the model or pipeline stage.
        plan: names the blocks.
        ac_mode: "none", "selective" or "full"; "memory_budget" wraps nothing (`apply_compile` applies it).
        ac_selective_option: under "selective", "op" or a positive int N as a string: every Nth block.
    """
    check_ac(ac_mode, ac_selective_option)
    if ac_mode in ("none", "memory_budget"):
        return model
    container = get_submodule_or_none(model, plan.blocks)
    if container is None:
        return model
    if ac_mode == "selective" and ac_selective_option == "op":
        _ignore_annotations_in_sac()
    for i, (name, block) in enumerate(list(container.named_children())):
        if ac_mode == "full":
            wrapped = checkpoint_wrapper(block, preserve_rng_state=False)
        elif ac_selective_option == "op":
            wrapped = checkpoint_wrapper(block, context_fn=_op_policy(), preserve_rng_state=False)
        elif i % int(ac_selective_option) == 0:
            wrapped = checkpoint_wrapper(block, preserve_rng_state=False)
        else:
            continue
        container.register_module(name, wrapped)
    return model
