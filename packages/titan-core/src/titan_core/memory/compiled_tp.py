"""What a compiled block keeps for backward under tensor parallel: the trainer's own split and compile, on fake tensors.

Under TP the trainer compiles each child of a block but the sequence-parallel norms
(`titan_parallel.apply_compile(per_child=True)`), around DTensors, which `compiled_saved`'s
plain-tensor trace of a whole block cannot stand for. Here a one-block model is:

1. split by the trainer's `apply_tp` over a fake process group of `tp` ranks (a CPU mesh, as
   `eager_saved` splits its blocks), given fake storage in the compute dtype;
2. compiled by the trainer's `apply_compile(per_child=True)` (at the job's memory budget, where
   it has one) with a backend that runs Inductor's partitioner and then each graph as it was cut,
   generating no code (`partition_only_backend`): each compiled child runs its partitioned
   forward graph on fake tensors;
3. called once on a fake input of the rank's shape, `(1, seq / tp, dim)`, under
   `fake_run.block_saved_bytes`' hooks: the compiled children save their tensors through
   autograd (AOTAutograd's `CompiledFunction`), the eager norms theirs, and both are counted
   once per storage, the parameters left out;
4. run backward once, which hands the children's backward graphs over: their matmul and attention
   FLOPs (`tp_block_backward_flops`) say what a memory budget recomputes on a TP rank, which the
   per-child cut makes differ from the whole block's at tp = 1 (the 8B at seq 8192, per token:
   budget 0.75 recomputes nothing at TP 8 and at tp = 1, but 134 MFLOP per block at TP 2).

The bytes of that one sequence over its `seq` tokens are the figure per token, as the eager
figures are under TP. tests/test_memory_compiled_tp.py holds the count to what two real TP ranks
compiled by `aot_eager` (the same partitioner, no Inductor passes) save, to the byte.

Not measured here: selective `op` / full AC (their figures stay eager: the checkpoint keeps the
block's input and the op policy's outputs whether or not the children compile), context
parallel, Mixture-of-Experts and float8 / MX blocks (`compiled_saved.compiled_block_bytes` says
which). `tensor_parallel_block_bytes` turns the figure into the estimate's for the target device
(the eager norms as they keep there: `eager_norms_device_gap`).
Results are cached per (family, block shape, tp, seq, dtype, budget, backend) for the process.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.nn as nn

if TYPE_CHECKING:
    from titan_core.job import Job
    from titan_core.memory.activations import ActivationBytes, ActivationLayout
    from titan_models import ModelSpec

_CACHE: dict[tuple[Any, ...], TPBlockTrace] = {}


@dataclasses.dataclass(frozen=True)
class TPBlockTrace:
    """One sequence through a compiled TP block on one rank (`measure_tp_block`)."""

    saved: int
    """Bytes the block keeps for backward."""
    backward_flops: float | None
    """FLOPs (matmuls and attention, `graph_flops`) of the backward graphs the partitioner cut for the compiled
    children; None where the backend is not `partition_only_backend`, which hands them over."""


def measure_tp_block(
    spec: ModelSpec[Any],
    meta: nn.Module,
    *,
    tp: int,
    dim: int,
    seq_len: int,
    dtype: torch.dtype,
    memory_budget: float | None = None,
    backend: str | None = None,
) -> int:
    """Bytes the first block of `meta` keeps for backward on one TP rank when compiled as the trainer compiles it
    under TP, for one sequence of `seq_len` tokens (cached).

    Args:
        spec: the model family (its plan's block container and TP styles).
        meta: the model on the meta device (left untouched: its first block is copied).
        tp: tensor parallel degree (> 1).
        dim: width of the block's input (the model's `dim`).
        seq_len: tokens per sequence.
        dtype: the compute dtype: the parameters' and the input's.
        memory_budget: the partitioner's activation memory budget in [0, 1]; None: its default.
        backend: a registered `torch.compile` backend; None: Inductor's partitioner without its code generator
            (`partition_only_backend`).
    """
    return _traced(spec, meta, tp, dim, seq_len, dtype, memory_budget, backend or partition_only_backend()).saved


def tp_block_backward_flops(
    spec: ModelSpec[Any], meta: nn.Module, *, tp: int, dim: int, seq_len: int, dtype: torch.dtype,
    memory_budget: float | None = None,
) -> float:  # fmt: skip
    """FLOPs of the backward of `meta`'s first block on one TP rank, compiled as the trainer compiles it under TP
    (its children one by one, each cut by Inductor's partitioner at `memory_budget`), for one sequence of `seq_len`
    tokens: matmuls and attention, read off the backward graphs (`graph_flops`). A budget's recompute is its figure
    over the unbudgeted one's (`plan_model.budget_recompute`). The trace is `measure_tp_block`'s (cached with it).

    Args:
        spec: the model family.
        meta: the model on the meta device.
        tp: tensor parallel degree (> 1).
        dim: width of the block's input.
        seq_len: tokens per sequence.
        dtype: the compute dtype.
        memory_budget: the partitioner's activation memory budget in [0, 1]; None: its default.
    """
    flops = _traced(spec, meta, tp, dim, seq_len, dtype, memory_budget, partition_only_backend()).backward_flops
    assert flops is not None  # the partition-only backend hands the backward graphs over
    return flops


def _traced(
    spec: ModelSpec[Any], meta: nn.Module, tp: int, dim: int, seq_len: int, dtype: torch.dtype,
    memory_budget: float | None, backend: str,
) -> TPBlockTrace:  # fmt: skip
    """Split, compile and call the block once forward (counting what it saves) and once backward (module docstring)."""
    from titan_core.memory.activations import ActivationLayout
    from titan_core.memory.compiled_saved import block_signature
    from titan_core.memory.eager_saved import parallel_copy, rope_table
    from titan_core.memory.fake_run import block_saved_bytes, fake_mesh, on_fake
    from titan_core.memory.torch_patches import quiet_torch_logs
    from titan_parallel.compile import apply_compile

    block = next(iter(meta.get_submodule(spec.plan.blocks).children()))
    key = (spec.name, block_signature(block), tp, dim, seq_len, dtype, memory_budget, backend)
    if key in _CACHE:
        return _CACHE[key]
    from torch._subclasses.fake_tensor import FakeTensorMode

    layout = ActivationLayout(compute_bytes=dtype.itemsize, tp=tp, cp=1, seq_len=seq_len, device_type="cpu")
    with fake_mesh(tp, 1, "cpu", cuda_stand_in=False) as mesh, _backward_flops() as flops:
        holder = parallel_copy(spec, {spec.plan.blocks: nn.ModuleDict({"0": copy.deepcopy(block)})}, mesh, layout)
        mode = FakeTensorMode(allow_non_fake_inputs=True)
        with mode:
            on_fake(holder, dtype, "cpu")  # the partitioner does not look at the device
            rope = rope_table(meta, "cpu")
        apply_compile(holder, spec.plan, per_child=True, backend=backend, memory_budget=memory_budget)
        unit = holder.get_submodule(f"{spec.plan.blocks}.0")
        # every measurement compiles fresh modules of the same classes: room for them in Dynamo's per-code cache
        with torch._dynamo.config.patch({"automatic_dynamic_shapes": False, **_recompile_room()}), quiet_torch_logs():
            with mode:
                saved = block_saved_bytes(unit, spec.plan.blocks, rope, None, (1, seq_len // tp, dim), dtype, "cpu",
                                          "none", backward=True)  # fmt: skip
    _CACHE[key] = TPBlockTrace(saved, sum(flops) if backend == PARTITION_ONLY else None)
    return _CACHE[key]


PARTITION_ONLY = "titan_partition_only"
"""The name `partition_only_backend` registers its backend under."""

_RECORDING: list[list[float]] = []
"""The lists `_backward_flops` collects into (the innermost gets the FLOPs of each backward graph that runs)."""


def partition_only_backend() -> str:
    """A registered `torch.compile` backend (its name) that runs Inductor's `compile_fx` (its joint-graph passes and
    min-cut partitioner) with the code generator replaced: each graph the partitioner cut runs as it is. Under
    fake tensors it compiles nothing and runs nothing real, for the measurements that must compile a model as the
    trainer does. Inside `_backward_flops` each backward graph that runs also adds its FLOPs (`graph_flops`, read
    once when it is cut): counted when it runs, not when it is compiled, since Dynamo may reuse a graph compiled
    for an earlier module of the same class and shapes (Qwen3's feed-forward after Llama 3's) without compiling
    again."""
    from torch._dynamo import list_backends, register_backend

    if PARTITION_ONLY not in list_backends(exclude_tags=()):
        from torch._functorch.aot_autograd import make_boxed_func
        from torch._inductor.compile_fx import compile_fx

        from titan_core.memory.graph_flops import graph_flops

        def run_as_cut(gm: torch.fx.GraphModule, example_inputs: Sequence[Any], **kwargs: Any) -> Any:
            if not kwargs.get("is_backward", False):
                return make_boxed_func(gm.forward)
            flops = graph_flops(gm)

            def counted(*args: Any) -> Any:
                if _RECORDING:
                    _RECORDING[-1].append(flops)
                return gm.forward(*args)

            return make_boxed_func(counted)

        def partition_only(gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> Any:
            return compile_fx(gm, example_inputs, inner_compile=run_as_cut)

        register_backend(compiler_fn=partition_only, name=PARTITION_ONLY)
    return PARTITION_ONLY


@contextlib.contextmanager
def _backward_flops() -> Iterator[list[float]]:
    """The FLOPs of each backward graph of `partition_only_backend` that runs meanwhile."""
    flops: list[float] = []
    _RECORDING.append(flops)
    try:
        yield flops
    finally:
        _RECORDING.pop()


def eager_norms_device_gap(spec: ModelSpec[Any], meta: nn.Module, *, tp: int, dim: int, seq_len: int,
                           dtype: torch.dtype, device: str) -> int:  # fmt: skip
    """Bytes the block's sequence-parallel norms, which stay eager when the trainer compiles a TP block, keep for
    backward on CPU beyond what they keep on `device`, for one sequence on one TP rank (each norm run alone, eager,
    on fake tensors of the rank's `(1, seq / tp, dim)` shard, as sequence parallel runs it).

    Args:
        spec: the model family (its plan's `TPStyle.NORM` modules).
        meta: the model on the meta device.
        tp: tensor parallel degree.
        dim: the norms' width.
        seq_len: tokens per sequence.
        dtype: the compute dtype.
        device: the target device type ("cuda": its fused RMSNorm keeps less than CPU's decomposed one).
    """
    from titan_core.memory.fake_run import SavedStorages, fake_target, on_fake
    from titan_parallel import TPStyle
    from titan_parallel.modules import get_submodule_or_none

    block = next(iter(meta.get_submodule(spec.plan.blocks).children()))
    paths = [
        p for p, style in spec.plan.block_tp if style is TPStyle.NORM and get_submodule_or_none(block, p) is not None
    ]
    kept = {}
    for where in dict.fromkeys(("cpu", device)):
        total = 0
        with fake_target(where):
            for path in paths:
                norm = on_fake(copy.deepcopy(block.get_submodule(path)), dtype, where)
                x = torch.empty((1, seq_len // tp, dim), dtype=dtype, device=where, requires_grad=True)
                saved = SavedStorages([*norm.parameters(), *norm.buffers()])
                with torch.autograd.graph.saved_tensors_hooks(saved.pack, lambda t: t):
                    norm(x)
                total += saved.total
        kept[where] = total
    return kept["cpu"] - kept[device]


def _recompile_room() -> dict[str, Any]:
    """Dynamo's per-code-object cache limit, raised (its name changed across torch versions)."""
    config = torch._dynamo.config
    name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
    return {name: max(64, int(getattr(config, name)))}


def tensor_parallel_block_bytes(
    job: Job, act: ActivationBytes, layout: ActivationLayout
) -> tuple[ActivationBytes, str]:
    """`compiled_saved.compiled_block_bytes` under tensor parallel, with no AC or at the job's memory budget: the
    block compiled on CPU (`measure_tp_block`), less what its eager sequence-parallel norms keep on CPU beyond what
    they keep on the target device (`eager_norms_device_gap`: CUDA's fused RMSNorm keeps less than CPU's
    decomposition). It is measured on CPU because Dynamo cannot trace fake CUDA tensors without a GPU; the compiled
    children are device-blind (Inductor decomposes a norm inside them, Qwen3's QK norms, alike on both; CPU's flash
    attention keeps what CUDA's does). Selective `op` and full AC keep the eager figures (their checkpoints keep the
    block's input and the policy's outputs whether or not the children compile).

    Args:
        job: the resolved job (compile on, TP > 1, CP 1).
        act: the eager figures measured for the job's layout on its device.
        layout: that layout.
    """
    cfg, dims = job.cfg, job.dims
    assert dims is not None
    ac = cfg.activation_checkpoint
    seq = cfg.training.seq_len
    budgets = {"none": None, **({"budget": ac.memory_budget} if ac.mode == "memory_budget" else {})}
    common = {"tp": dims.tp, "dim": job.model_args.dim, "seq_len": seq, "dtype": job.parallel.param_dtype}
    try:
        meta = job.meta_model()
        traced = {kind: _traced(job.spec, meta, **common, memory_budget=b, backend=partition_only_backend())
                  for kind, b in budgets.items()}  # fmt: skip
        gap = eager_norms_device_gap(job.spec, meta, **common, device=layout.device_type)
    except Exception as e:  # torch raises many kinds; the eager figures still bound the estimate
        first_line = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        return act, f"compile: tracing the tensor parallel block failed ({first_line}); the eager blocks' figures"
    saved = {kind: round((trace.saved - gap) / seq) for kind, trace in traced.items()}
    measured = dataclasses.replace(act, block=saved["none"], block_budget=saved.get("budget"))
    figures = f"AC none: {saved['none']:,} (eager {act.block:,})"
    if "budget" in saved:
        base, budget = (traced[kind].backward_flops or 0.0 for kind in ("none", "budget"))
        figures += (
            f", memory budget {ac.memory_budget:g}: {saved['budget']:,}, its backward "
            f"{(budget - base) / max(base, 1.0):.0%} more matmul and attention FLOPs (the recompute)"
        )
    kept = "" if ac.mode in ("none", "memory_budget") else f"; AC {ac.mode} as eager"
    return measured, (
        f"compile: tensor parallel block activations measured compiled as the trainer compiles them (TP {dims.tp}, "
        f"each child but the sequence-parallel norms; fake CPU tensors, the norms as on {layout.device_type}), bytes "
        f"per token per block: {figures}{kept}; the loss and the rest as eager"
    )
