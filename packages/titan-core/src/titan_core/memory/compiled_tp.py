"""What a compiled block keeps for backward under tensor parallel: the trainer's own split and compile, on fake tensors.

Under TP the trainer compiles each child of a block but the sequence-parallel norms
(`titan_parallel.apply_compile(per_child=True)`), around DTensors, which `compiled_saved`'s
plain-tensor trace of a whole block cannot stand for. Here a one-block model is:

1. split by the trainer's `apply_tp` over a fake process group of `tp` ranks (a CPU mesh, as
   `eager_saved` splits its blocks), given fake storage in the compute dtype;
2. compiled by the trainer's `apply_compile(per_child=True)` (at the job's memory budget, where
   it has one) with a backend that runs Inductor's partitioner and then each graph as it was cut,
   generating no code (`compiled_saved.partition_only_backend`): each compiled child runs its
   partitioned forward graph on fake tensors;
3. called once on a fake input of the rank's shape, `(1, seq / tp, dim)`, under
   `fake_run.block_saved_bytes`' hooks: the compiled children save their tensors through
   autograd (AOTAutograd's `CompiledFunction`), the eager norms theirs, and both are counted
   once per storage, the parameters left out.

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

import copy
import dataclasses
from typing import TYPE_CHECKING, Any

import torch
import torch.nn as nn

if TYPE_CHECKING:
    from titan_core.job import Job
    from titan_core.memory.activations import ActivationBytes, ActivationLayout
    from titan_models import ModelSpec

_CACHE: dict[tuple[Any, ...], int] = {}


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
            (`compiled_saved.partition_only_backend`).
    """
    from titan_core.memory.activations import ActivationLayout
    from titan_core.memory.compiled_saved import block_signature, partition_only_backend
    from titan_core.memory.eager_saved import parallel_copy, rope_table
    from titan_core.memory.fake_run import block_saved_bytes, fake_mesh, on_fake
    from titan_core.memory.torch_patches import quiet_torch_logs
    from titan_parallel.compile import apply_compile

    backend = backend or partition_only_backend()
    block = next(iter(meta.get_submodule(spec.plan.blocks).children()))
    key = (spec.name, block_signature(block), tp, dim, seq_len, dtype, memory_budget, backend)
    if key in _CACHE:
        return _CACHE[key]
    from torch._subclasses.fake_tensor import FakeTensorMode

    layout = ActivationLayout(compute_bytes=dtype.itemsize, tp=tp, cp=1, seq_len=seq_len, device_type="cpu")
    with fake_mesh(tp, 1, "cpu", cuda_stand_in=False) as mesh:
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
                total = block_saved_bytes(unit, spec.plan.blocks, rope, None, (1, seq_len // tp, dim), dtype, "cpu",
                                          "none")  # fmt: skip
    _CACHE[key] = total
    return total


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
        compiled = {kind: measure_tp_block(job.spec, meta, **common, memory_budget=b) for kind, b in budgets.items()}
        gap = eager_norms_device_gap(job.spec, meta, **common, device=layout.device_type)
    except Exception as e:  # torch raises many kinds; the eager figures still bound the estimate
        first_line = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        return act, f"compile: tracing the tensor parallel block failed ({first_line}); the eager blocks' figures"
    saved = {kind: round((total - gap) / seq) for kind, total in compiled.items()}
    measured = dataclasses.replace(act, block=saved["none"], block_budget=saved.get("budget"))
    figures = f"AC none: {saved['none']:,} (eager {act.block:,})"
    if "budget" in saved:
        figures += f", memory budget {ac.memory_budget:g}: {saved['budget']:,}"
    kept = "" if ac.mode in ("none", "memory_budget") else f"; AC {ac.mode} as eager"
    return measured, (
        f"compile: tensor parallel block activations measured compiled as the trainer compiles them (TP {dims.tp}, "
        f"each child but the sequence-parallel norms; fake CPU tensors, the norms as on {layout.device_type}), bytes "
        f"per token per block: {figures}{kept}; the loss and the rest as eager"
    )
