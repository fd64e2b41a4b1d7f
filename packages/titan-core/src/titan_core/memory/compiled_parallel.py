"""What a compiled block keeps for backward under tensor and / or context parallel: the trainer's own split and
compile, on fake tensors.

Under TP the trainer compiles each child of a block but the sequence-parallel norms
(`titan_parallel.apply_compile(per_child=True)`), around DTensors; under ring CP each block
compiles around its ring attention, which runs eager between two graphs; Ulysses' all-to-alls
trace into one graph. `compiled_saved`'s plain-tensor trace of a whole block stands for none of
these. Here a one-block model is:

1. split by the trainer's `apply_tp` / `apply_cp` over a fake process group of `cp x tp` ranks
   (a CPU mesh, as `eager_saved` splits its blocks), given fake storage in the compute dtype;
2. compiled by the trainer's `apply_compile` as `parallelize_model` calls it (per child under TP,
   one graph but ring attention's breaks; at the job's memory budget, where it has one) with a
   backend that runs Inductor's partitioner and then each graph as it was cut, generating no code
   (`partition_only_backend`): each compiled graph runs its partitioned forward on fake tensors;
3. called once on a fake input of the rank's shape, `(1, seq / cp / tp, dim)`, with the rank's
   RoPE positions under CP, under `fake_run.block_saved_bytes`' hooks: the compiled graphs save
   their tensors through autograd (AOTAutograd's `CompiledFunction`), the eager norms and ring
   attention theirs, and all are counted once per storage, the parameters left out;
4. run backward once: each backward graph that runs adds its matmul and attention FLOPs
   (`parallel_block_backward_flops`), which say what a memory budget recomputes on a TP rank, which the
   per-child cut makes differ from the whole block's at tp = 1 (the 8B at seq 8192, per token:
   budget 0.75 recomputes nothing at TP 8 and at tp = 1, but 134 MFLOP per block at TP 2).

The bytes of that one sequence over the rank's `seq / cp` tokens are the figure per token, as the
eager figures are. Some tensors are kept once per call whatever the batch: ring attention's mask, and under TP
the tensorwise float8 weights (their scale is an all-reduce over the TP ranks, which the partitioner does not
recompute, so each linear keeps its float8 weight shard: the 1B block at TP 2 in float8 keeps more than in bf16).
For a micro-batch of more sequences the block is traced at two sequences as well there, and the bytes at the
job's micro-batch taken on the line through both (`parallel_block_bytes`). tests/test_memory_compiled_parallel.py
holds the count to what two real ranks (TP 2, CP 2 ring, CP 2 Ulysses, TP 2 with float8 linears) compiled by
`aot_eager` (the same partitioner, no Inductor passes) save, to the byte.

Float8 blocks are converted by `titan_parallel.apply_float8` before the split, as the trainer converts them (its
TP styles then cast to float8 before the all-gather), with the target's graph (`compiled_estimate.traced_float8`).
Each measurement starts from empty DTensor sharding caches (`fake_run.forget_sharding_specs`: a float8 block at TP 2
otherwise read less after another TP measurement than first in its process, what real ranks keep).

Not measured here: selective `op` / full AC (their figures stay eager: the checkpoint keeps the
block's input and the op policy's outputs whether or not the block compiles), Mixture-of-Experts
and MX blocks (`compiled_estimate.compiled_block_bytes` says which). `parallel_block_bytes`
turns the figure into the estimate's for the target device (the eager norms as they keep there:
`eager_norms_device_gap`). Results are cached per (family, block shape, split, seq, dtype, budget,
backend, float8 options, sequences) for the process.
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
    from titan_parallel.float8 import Float8Options

_CACHE: dict[tuple[Any, ...], ParallelBlockTrace] = {}


@dataclasses.dataclass(frozen=True)
class Split:
    """How the trainer splits a block: tensor parallel (sequence parallel between the children) and context
    parallel (`parallelism.context_parallel_method` / `context_parallel_rotate_method`)."""

    tp: int = 1
    cp: int = 1
    cp_method: str = "ring"
    cp_rotate_method: str = "allgather"

    @property
    def tokens(self) -> int:
        """Into how many parts a sequence is cut before it reaches a block's first child: `cp x tp`."""
        return self.cp * self.tp


@dataclasses.dataclass(frozen=True)
class ParallelBlockTrace:
    """One sequence through a compiled, split block on one rank (`measure_parallel_block`)."""

    saved: int
    """Bytes the block keeps for backward."""
    backward_flops: float | None
    """FLOPs (matmuls and attention, `graph_flops`) of the backward graphs the partitioner cut for the compiled
    graphs; None where the backend is not `partition_only_backend`, which hands them over. Ring attention, which
    runs eager between graphs, is not in them."""


def measure_parallel_block(
    spec: ModelSpec[Any],
    meta: nn.Module,
    *,
    split: Split,
    dim: int,
    seq_len: int,
    dtype: torch.dtype,
    memory_budget: float | None = None,
    backend: str | None = None,
    float8: Float8Options | None = None,
    sequences: int = 1,
) -> int:
    """Bytes the first block of `meta` keeps for backward on one rank of `split` when compiled as the trainer compiles
    it there, for `sequences` sequences of `seq_len` tokens (the rank's `seq_len / cp` of each; cached).

    Args:
        spec: the model family (its plan's block container and TP styles).
        meta: the model on the meta device (left untouched: its first block is copied).
        split: the tensor / context parallel degrees (not both 1).
        dim: width of the block's input (the model's `dim`).
        seq_len: tokens per sequence.
        dtype: the compute dtype: the parameters' and the input's.
        memory_budget: the partitioner's activation memory budget in [0, 1]; None: its default.
        backend: a registered `torch.compile` backend; None: Inductor's partitioner without its code generator
            (`partition_only_backend`).
        float8: the run's [float8] options, its linears converted by `titan_parallel.apply_float8` before the split,
            as the trainer converts them (`compiled_estimate.traced_float8`: the target's graph); None: no float8.
        sequences: the micro-batch, in sequences.
    """
    backend = backend or partition_only_backend()
    return _traced(spec, meta, split, dim, seq_len, dtype, memory_budget, backend, float8, sequences).saved


def parallel_block_backward_flops(
    spec: ModelSpec[Any], meta: nn.Module, *, split: Split, dim: int, seq_len: int, dtype: torch.dtype,
    memory_budget: float | None = None, float8: Float8Options | None = None,
) -> float:  # fmt: skip
    """FLOPs of the backward of `meta`'s first block on one rank of `split`, compiled as the trainer compiles it there
    (under TP its children one by one, each cut by Inductor's partitioner at `memory_budget`), for one sequence of
    `seq_len` tokens: matmuls and attention, read off the backward graphs (`graph_flops`). A budget's recompute is
    its figure over the unbudgeted one's (`plan_model.budget_recompute`). The trace is `measure_parallel_block`'s
    (cached with it).

    Args:
        spec: the model family.
        meta: the model on the meta device.
        split: the tensor / context parallel degrees (not both 1).
        dim: width of the block's input.
        seq_len: tokens per sequence.
        dtype: the compute dtype.
        memory_budget: the partitioner's activation memory budget in [0, 1]; None: its default.
        float8: the run's [float8] options (`measure_parallel_block`); None: no float8.
    """
    backend = partition_only_backend()
    flops = _traced(spec, meta, split, dim, seq_len, dtype, memory_budget, backend, float8).backward_flops
    assert flops is not None  # the partition-only backend hands the backward graphs over
    return flops


def _traced(
    spec: ModelSpec[Any], meta: nn.Module, split: Split, dim: int, seq_len: int, dtype: torch.dtype,
    memory_budget: float | None, backend: str, float8: Float8Options | None = None, batch: int = 1,
) -> ParallelBlockTrace:  # fmt: skip
    """Split, compile and call the block once forward (counting what it saves) and once backward (module docstring)."""
    from titan_core.memory.activations import ActivationLayout
    from titan_core.memory.compiled_saved import block_copy, block_signature
    from titan_core.memory.eager_saved import parallel_copy, rank_positions, rope_table
    from titan_core.memory.fake_run import block_saved_bytes, fake_mesh, on_fake
    from titan_core.memory.torch_patches import quiet_torch_logs
    from titan_parallel.compile import apply_compile, compile_granularity

    block = next(iter(meta.get_submodule(spec.plan.blocks).children()))
    key = (spec.name, block_signature(block), split, dim, seq_len, dtype, memory_budget, backend, float8, batch)
    if key in _CACHE:
        return _CACHE[key]
    from torch._subclasses.fake_tensor import FakeTensorMode

    tp, cp = split.tp, split.cp
    layout = ActivationLayout(compute_bytes=dtype.itemsize, tp=tp, cp=cp, cp_rotate_method=split.cp_rotate_method,
                              cp_method=split.cp_method, seq_len=seq_len, device_type="cpu")  # fmt: skip
    blocks = block_copy(block, spec.plan.blocks, float8)  # converted before the split: TP takes float8 styles
    with fake_mesh(tp, cp, "cpu", cuda_stand_in=False) as mesh, _backward_flops() as flops:
        holder = parallel_copy(spec, {spec.plan.blocks: blocks}, mesh, layout)
        mode = FakeTensorMode(allow_non_fake_inputs=True)
        with mode:
            on_fake(holder, dtype, "cpu")  # the partitioner does not look at the device
            rope, positions = rope_table(meta, "cpu"), rank_positions(mesh, seq_len // cp, "cpu")
        # Dynamo keys its compiled code by code object (`nn.Module._call_impl` for every module compiled) and would
        # run this block through a graph compiled for an earlier measurement's module of the same class (Ulysses
        # after ring read nearly the eager figures): each measurement compiles from an empty cache
        torch._dynamo.reset()
        granularity = compile_granularity(tp, cp, split.cp_method)  # as `parallelize_model` compiles
        apply_compile(holder, spec.plan, **granularity, backend=backend, memory_budget=memory_budget)
        unit = holder.get_submodule(f"{spec.plan.blocks}.0")
        with torch._dynamo.config.patch(automatic_dynamic_shapes=False), quiet_torch_logs():
            with mode:
                shape = (batch, seq_len // split.tokens, dim)  # the rank's part of each sequence, as the block gets it
                saved = block_saved_bytes(unit, spec.plan.blocks, rope, positions, shape, dtype, "cpu", "none",
                                          backward=True)  # fmt: skip
    _CACHE[key] = ParallelBlockTrace(saved, sum(flops) if backend == PARTITION_ONLY else None)
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
    once when it is cut): counted when it runs, not when it is compiled (a backend may be handed a graph once and
    run it for many modules)."""
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


def parallel_block_bytes(
    job: Job, act: ActivationBytes, layout: ActivationLayout, sequences: int = 1
) -> tuple[ActivationBytes, str]:
    """`compiled_estimate.compiled_block_bytes` under tensor and / or context parallel, with no AC or at the job's
    memory budget: the block split and compiled on CPU (`measure_parallel_block`), under TP less what its eager
    sequence-parallel norms keep on CPU beyond what they keep on the target device (`eager_norms_device_gap`: CUDA's
    fused RMSNorm keeps less than CPU's decomposition). It is measured on CPU because Dynamo cannot trace fake CUDA
    tensors without a GPU; the compiled graphs are device-blind (Inductor decomposes a norm inside them, Qwen3's QK
    norms, alike on both; CPU's flash attention keeps what CUDA's does), and so is ring attention, which runs eager
    between them (its own autograd function, on both devices). Selective `op` and full AC keep the eager figures
    (their checkpoints keep the block's input and the policy's outputs whether or not the block compiles).
    With `sequences` > 1, where a block keeps tensors once per call (float8 linears under TP, ring attention), it is
    traced at one and at two sequences, and what it keeps for the micro-batch is taken on the line through both.

    Args:
        job: the resolved job (compile on, TP or CP > 1).
        act: the eager figures measured for the job's layout on its device.
        layout: that layout.
        sequences: sequences per micro-batch on a rank.
    """
    from titan_core.memory.compiled_estimate import traced_float8

    cfg, dims = job.cfg, job.dims
    assert dims is not None
    ac, p = cfg.activation_checkpoint, cfg.parallelism
    split = Split(dims.tp, dims.cp, p.context_parallel_method, p.context_parallel_rotate_method)
    seq, rank_seq = cfg.training.seq_len, cfg.training.seq_len // dims.cp  # the eager figures are per rank token
    budgets = {"none": None, **({"budget": ac.memory_budget} if ac.mode == "memory_budget" else {})}
    shape = {"dim": job.model_args.dim, "dtype": job.parallel.param_dtype}
    float8 = traced_float8(cfg, job.device_type)
    try:
        meta = job.meta_model()
        traced = {kind: _traced(job.spec, meta, split, **shape, seq_len=seq, memory_budget=b,
                                backend=partition_only_backend(), float8=float8)
                  for kind, b in budgets.items()}  # fmt: skip
        # The micro-batch's bytes: per call once, the rest per sequence, on the line through one and two sequences
        # where a block keeps tensors per call (module docstring); elsewhere only a few bytes per position (the debug
        # block, bf16, per call: TP 2 none, Ulysses 2,056 of 282,888 at seq 64), counted per sequence as at tp = 1.
        per_call = (float8 is not None and split.tp > 1) or (split.cp > 1 and split.cp_method == "ring")
        whole = {}
        for kind, b in budgets.items():
            one = traced[kind].saved
            two = 2 * one
            if sequences > 1 and per_call:
                two = _traced(job.spec, meta, split, **shape, seq_len=seq, memory_budget=b,
                              backend=partition_only_backend(), float8=float8, batch=2).saved  # fmt: skip
            whole[kind] = one + (sequences - 1) * (two - one)
        gap = 0
        if split.tp > 1:  # the sequence-parallel norms run eager, on the rank's cp x tp part of a sequence
            gap = eager_norms_device_gap(job.spec, meta, tp=split.tp, seq_len=rank_seq, **shape,
                                         device=layout.device_type)  # fmt: skip
    except Exception as e:  # torch raises many kinds; the eager figures still bound the estimate
        first_line = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        return act, f"compile: tracing the {_describe(split)} block failed ({first_line}); the eager blocks' figures"
    saved = {kind: round(bytes_ / (sequences * rank_seq) - gap / rank_seq) for kind, bytes_ in whole.items()}
    measured = dataclasses.replace(act, block=saved["none"], block_budget=saved.get("budget"))
    figures = f"AC none: {saved['none']:,} (eager {act.block:,})"
    if "budget" in saved:
        base, budget = (traced[kind].backward_flops or 0.0 for kind in ("none", "budget"))
        figures += (
            f", memory budget {ac.memory_budget:g}: {saved['budget']:,}, its backward "
            f"{(budget - base) / max(base, 1.0):.0%} more matmul and attention FLOPs (the recompute)"
        )
    kept = "" if ac.mode in ("none", "memory_budget") else f"; AC {ac.mode} as eager"
    how = []
    if split.tp > 1:
        how.append(f"each child but the sequence-parallel norms, the norms as on {layout.device_type}")
    if split.cp > 1 and split.cp_method == "ring":
        how.append("around the eager ring attention")
    if float8 is not None:
        how.append(f"float8 {float8.recipe_name} linears " + ("emulated" if float8.emulate else "as on the GPU"))
    return measured, (
        f"compile: {_describe(split)} block activations measured compiled as the trainer compiles them "
        f"({'; '.join([*how, 'fake CPU tensors'])}), bytes per {'rank ' if split.cp > 1 else ''}token per block"
        f"{f' at {sequences} sequences per micro-batch' if sequences > 1 else ''}: "
        f"{figures}{kept}; the loss and the rest as eager"
    )


def _describe(split: Split) -> str:
    """'TP 8', 'CP 2 (ring)', 'TP 2 x CP 2 (ulysses)'."""
    parts = [f"TP {split.tp}"] if split.tp > 1 else []
    parts += [f"CP {split.cp} ({split.cp_method})"] if split.cp > 1 else []
    return " x ".join(parts)
