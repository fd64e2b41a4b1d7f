"""Regional compile: `torch.compile` each block on its own.

Blocks are identical, so one compiled graph serves all of them and compile time
does not grow with depth; FSDP's hooks stay outside the compiled regions.
"""

from __future__ import annotations

import torch.nn as nn

from titan_parallel.modules import iter_blocks
from titan_parallel.plan import ModelPlan


def apply_compile(model: nn.Module, plan: ModelPlan, *, fullgraph: bool = True) -> nn.Module:
    """Compile every block of `model` in place (`nn.Module.compile`, parameter names unchanged).

    Args:
        model: the model or pipeline stage.
        plan: names the blocks.
        fullgraph: fail rather than fall back to eager on a graph break.
    """
    for block in iter_blocks(model, plan):
        block.compile(fullgraph=fullgraph)
    return model
