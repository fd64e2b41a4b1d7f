"""Regional compile: `torch.compile` each block on its own.

Blocks are identical, so one compiled graph serves all of them and compile time
does not grow with depth; FSDP's hooks stay outside the compiled regions.

Under tensor parallel the attention and feed-forward of each block are compiled
(all the matmuls, RoPE, SwiGLU) and its sequence-parallel norms and residual adds
stay eager. With the residual add inside the graph, AOT autograd hands the
block's sequence-sharded DTensor input a plain-tensor gradient and the backward
fails in DTensor's `Redistribute` (`'Tensor' object has no attribute
'_local_tensor'`); a compiled sequence-parallel norm gives its input a wrong
gradient. Both seen with torch 2.15 and reproduced with the `aot_eager` backend,
so they are not Inductor's doing.

On CPU, Inductor's C++ backend computes wrong input gradients for a
tensor-parallel feed-forward graph (max error ~0.1 against eager on the debug
model, torch 2.15; `aot_eager` matches eager exactly), so there TP blocks are
captured by Dynamo and AOT autograd but not lowered by Inductor
(`compile_backend`). GPUs use Inductor.
"""

from __future__ import annotations

import torch.nn as nn

from titan_parallel.modules import iter_blocks
from titan_parallel.plan import ModelPlan, TPStyle


def compile_backend(device_type: str, tp_degree: int) -> str:
    """The `torch.compile` backend for blocks: "inductor", except "aot_eager" for TP on CPU (see above).

    Args:
        device_type: the mesh's device type.
        tp_degree: the tensor-parallel degree.
    """
    return "aot_eager" if device_type == "cpu" and tp_degree > 1 else "inductor"


def apply_compile(
    model: nn.Module, plan: ModelPlan, *, fullgraph: bool = True, per_child: bool = False, backend: str = "inductor"
) -> nn.Module:
    """Compile every block of `model` in place (`nn.Module.compile`, parameter names unchanged).

    Args:
        model: the model or pipeline stage.
        plan: names the blocks.
        fullgraph: fail rather than fall back to eager on a graph break (False lets an
            eager-only piece, such as ring attention, run between compiled graphs).
        per_child: compile each child module of a block rather than the block (under TP),
            except the sequence-parallel norms (`TPStyle.NORM` in `plan.block_tp`).
        backend: the `torch.compile` backend (see `compile_backend`).
    """
    # Sequence-parallel norms stay eager under TP: compiled, they too gave their DTensor input a wrong gradient.
    eager = {path for path, style in plan.block_tp if style is TPStyle.NORM}
    for block in iter_blocks(model, plan):
        units = [m for name, m in block.named_children() if name not in eager] if per_child else [block]
        for unit in units:
            unit.compile(fullgraph=fullgraph, backend=backend)
    return model
