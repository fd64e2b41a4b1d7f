"""Regional compile: `torch.compile` each block on its own.

Blocks are identical, so one compiled graph serves all of them and compile time
does not grow with depth; FSDP's hooks stay outside the compiled regions.

Under tensor parallel the attention and feed-forward of each block are compiled (all the
matmuls, RoPE, SwiGLU), each with its input hooks in its graph (TP's all-gather of the
sequence-parallel input, tensorwise float8's cast before it: `_compile_with_hooks`), and
its sequence-parallel norms and residual adds stay eager. With the residual add inside
the graph, AOT autograd hands the block's sequence-sharded DTensor input a plain-tensor
gradient and the backward fails in DTensor's `Redistribute` (`'Tensor' object has no
attribute '_local_tensor'`); a compiled sequence-parallel norm gives its input a wrong
gradient. Both seen with torch 2.15 and reproduced with the `aot_eager` backend, so they
are not Inductor's doing. An activation-checkpointed TP block compiles whole inside its
checkpoint wrapper, its norms and residual adds with it: there neither showed (full AC and
selective op against eager and against one process, the parity row
`compile_tp2_ac_selective_op`, torch 2.15).

On CPU, Inductor's C++ backend computes wrong input gradients for a
tensor-parallel feed-forward graph (max error ~0.1 against eager on the debug
model, torch 2.15; `aot_eager` matches eager exactly), so there TP blocks are
captured by Dynamo and AOT autograd but not lowered by Inductor
(`compile_backend`). GPUs use Inductor.

A Mixture-of-Experts block (`ModelPlan.moe`) is compiled piece by piece: every child of
the block but the MoE module, and the MoE's children but its experts (the router, the
shared experts). The experts, and the MoE's dispatch of tokens to them, stay eager, as in
torchtitan: how many tokens reach each expert is data, so their shapes are too (torch
2.15's Inductor failed on the backward of the whole block: "expected [u8, ...] to have
been codegen-ed"), and under expert parallel the experts are an FSDP unit of their own
whose hooks cannot run inside a compiled graph ("Call to `torch._dynamo.disable()`").
Inside an activation-checkpointed block the pieces are compiled within the checkpoint
wrapper, so the block is still recomputed as one. Before torch 2.15 (2.11 measured; 2.12-2.14
not tried) Dynamo traced non-reentrant checkpointing's saved-tensor hooks run from inside such
a piece, recompiled `WeakKeyDictionary.__setitem__` once per saved tensor and failed at the
recompile limit: there an activation-checkpointed MoE block stays eager (said once in the log).

A memory budget (`apply_compile(memory_budget=)`; torchtitan calls it an AC mode)
lets AOTAutograd's min-cut partitioner choose what each compiled graph keeps for backward: it
solves a knapsack for the least recompute (by FLOPs) that keeps at most that share of the
activations it would keep without one (1), down to none but the graph's inputs (0, what full AC
keeps of a block). torch reads it from `torch._functorch.config.activation_memory_budget` when it
partitions a graph, which happens inside the backend call: `budget_backend` sets it for that call
only, so the process's other compiled functions (the loss, a memory estimate's traces) keep theirs.
Both Inductor and `aot_eager` partition with min-cut. What stays eager (the experts, the
sequence-parallel norms, ring attention) keeps all its activations.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

from titan_parallel.layout import ParallelConfigError
from titan_parallel.modules import get_submodule_or_none, iter_blocks
from titan_parallel.plan import ModelPlan, TPStyle
from titan_parallel.ring_attention import RingAttention

logger = logging.getLogger("titan")
_TORCH = tuple(int(part) for part in torch.__version__.split("+")[0].split(".")[:2])


def compile_backend(device_type: str, tp_degree: int) -> str:
    """The `torch.compile` backend for blocks: "inductor", except "aot_eager" for TP on CPU (see above).

    Args:
        device_type: the mesh's device type.
        tp_degree: the tensor-parallel degree.
    """
    return "aot_eager" if device_type == "cpu" and tp_degree > 1 else "inductor"


@functools.cache  # one callable per budget: Dynamo compiles a code object again for another backend object
def budget_backend(backend: str, memory_budget: float) -> Callable[[torch.fx.GraphModule, list[torch.Tensor]], Any]:
    """The `torch.compile` backend `backend`, partitioning each graph under an activation memory budget.

    Under tensor parallel torch 2.15 hands the graphs the process group as an opaque script object, whose size the
    budgeted partitioner refuses to guess ("Cannot compute the size of ... FakeScriptObject"): it is counted as 0
    bytes here (`unsafe_treat_script_objects_as_zero_size`, where torch has it), which a process group is in
    activations; torch 2.11 passes none.

    Args:
        backend: a registered backend whose partitioner is min-cut ("inductor", "aot_eager").
        memory_budget: the share of the activations each graph keeps for backward, in [0, 1].
    """
    from torch._dynamo import lookup_backend
    from torch._functorch import config as functorch_config

    compiler = lookup_backend(backend)
    settings: dict[str, Any] = {"activation_memory_budget": memory_budget}
    if hasattr(functorch_config, "unsafe_treat_script_objects_as_zero_size"):
        settings["unsafe_treat_script_objects_as_zero_size"] = True

    def compile_with_budget(gm: torch.fx.GraphModule, example_inputs: list[torch.Tensor]) -> Any:
        with functorch_config.patch(settings):
            return compiler(gm, example_inputs)

    compile_with_budget.__name__ = f"{backend}_memory_budget_{memory_budget}"
    return compile_with_budget


def compile_granularity(tp: int, cp: int, cp_method: str) -> dict[str, bool]:
    """`apply_compile`'s `fullgraph` and `per_child` for blocks split `tp` x `cp`: each child under TP (the
    sequence-parallel norms stay eager), and one full graph per block unless ring attention (eager: its collectives
    are not traceable) breaks it; Ulysses' functional all-to-alls trace into the graph.

    Args:
        tp: tensor parallel degree.
        cp: context parallel degree.
        cp_method: "ring" or "ulysses".
    """
    return {"fullgraph": cp == 1 or cp_method == "ulysses", "per_child": tp > 1}


def apply_compile(
    model: nn.Module,
    plan: ModelPlan,
    *,
    fullgraph: bool = True,
    per_child: bool = False,
    backend: str = "inductor",
    memory_budget: float | None = None,
) -> nn.Module:
    """Compile every block of `model` in place (`nn.Module.compile`, parameter names unchanged).

    Args:
        model: the model or pipeline stage.
        plan: names the blocks, and the Mixture-of-Experts module in them (whose experts stay eager).
        fullgraph: fail rather than fall back to eager on a graph break (False lets an
            eager-only piece, such as ring attention, run between compiled graphs).
        per_child: compile each child module of a block rather than the block (under TP),
            except the sequence-parallel norms (`TPStyle.NORM` in `plan.block_tp`).
        backend: the `torch.compile` backend (see `compile_backend`).
        memory_budget: the share of its activations each compiled graph keeps for backward, recomputing the rest
            (`budget_backend`), in [0, 1]; None: the partitioner's own choice (what 1 keeps).
    """
    if memory_budget is not None and not 0.0 <= memory_budget <= 1.0:
        raise ParallelConfigError(f"memory_budget={memory_budget} is outside [0, 1]", arguments=("memory_budget",))
    compiler: str | Callable[..., Any] = backend if memory_budget is None else budget_backend(backend, memory_budget)
    # Sequence-parallel norms stay eager under TP: compiled, they too gave their DTensor input a wrong gradient.
    eager = {path for path, style in plan.block_tp if style is TPStyle.NORM} if per_child else set()
    experts = f"{plan.moe}.experts" if plan.moe is not None else None
    left_eager = 0
    for block in iter_blocks(model, plan):
        checkpointed = isinstance(block, CheckpointWrapper)
        inner = block.get_submodule("_checkpoint_wrapped_module") if checkpointed else block
        if experts is not None and get_submodule_or_none(inner, experts) is not None:
            if checkpointed and _TORCH < (2, 15):
                left_eager += 1
                continue
            units = _units_around(inner, experts, eager)
        elif per_child:  # a checkpointed block's one child is its wrapped block: compiled whole (module docstring)
            units = [m for name, m in block.named_children() if name not in eager]
        else:
            units = [block]
        for unit in units:
            if unit is block:
                unit.compile(fullgraph=fullgraph, backend=compiler)  # FSDP's hooks on the block stay outside
            else:
                _compile_with_hooks(unit, fullgraph=fullgraph, backend=compiler)
    if left_eager:
        logger.info(
            f"compile: {left_eager} activation-checkpointed Mixture-of-Experts block(s) run eager on torch "
            f"{torch.__version__} (its Dynamo traces checkpointing's hooks inside their compiled pieces; "
            "torch 2.15 compiles them)"
        )
    return model


class _WithHooks(nn.Module):
    """Calls a module's hooks and forward (`_call_impl`) from a frame of its own, which Dynamo traces whole."""

    def __init__(self, module: nn.Module):
        super().__init__()
        self.module = module

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module._call_impl(*args, **kwargs)


def _compile_with_hooks(module: nn.Module, **options: Any) -> None:
    """Compile `module` as `nn.Module.compile` does, but with its forward pre-hooks in the same graph as its forward,
    or, where ring attention breaks its graph, its forward alone (the hooks eager).

    `nn.Module.compile` compiles `_call_impl`, from which Dynamo traced a block child's own pre-hook as a graph of
    its own: tensor parallel's input preparation (the all-gather of the sequence-parallel input) apart from the
    matmuls it feeds, and with tensorwise float8, torchao's cast to float8 before that all-gather, whose float8
    output then crossed from one graph into the next. AOTAutograd expected a float8 gradient for it and got a plain
    one ("Expected a Float8TrainingTensor tangent but got a plain Tensor": TP + float8 + compile failed in its first
    backward, torch 2.15). Called from a module's forward, the child's hooks trace into its graph, as they do when a
    whole block compiles. The wrapper is not registered in the model: parameter names do not change.

    Ring attention (eager: `RingAttention.forward` is `torch.compiler.disable`d) breaks the graph inside the
    attention's forward, and Dynamo then closed the hooks' graph before that call, as above: TP x CP (ring) + float8
    + compile failed the same way. There the hooks run eager and only the forward compiles (its float8 input comes
    into a graph, which is allowed, rather than out of one).
    """
    if any(isinstance(m, RingAttention) for m in module.modules()):
        module.forward = torch.compile(module.forward, **options)
        return
    object.__setattr__(module, "_compiled_call_impl", torch.compile(_WithHooks(module), **options))


def _units_around(module: nn.Module, path: str, eager: set[str]) -> list[nn.Module]:
    """The children of `module` to compile so that the submodule at `path` (and the code of its ancestors) runs
    eager: every child off the path (less those named in `eager`), and the same inside each ancestor of `path`."""
    head, _, rest = path.partition(".")
    units = []
    for name, child in module.named_children():
        if name == head:
            units += _units_around(child, rest, set()) if rest else []
        elif name not in eager:
            units.append(child)
    return units
