"""What one block keeps for backward under `torch.compile`: read from the compiled graph, not derived.

The eager figures (`titan_core.memory.eager_saved`) count what autograd saves op by op. A
compiled block saves what AOTAutograd's partitioner decides: it traces the block's joint
forward + backward graph and cuts it (Inductor's `min_cut_rematerialization_partition`,
after Inductor's joint-graph passes), recomputing cheap element-wise results in backward
rather than keeping them. This module asks the partitioner itself:

1. One block of the model (`compiled_block_bytes` takes the first: a dense family's
   blocks are alike; `measure_block` caches by the block's parameter shapes) is copied from
   the meta model, cast to the compute dtype (what FSDP's mixed precision gathers) and given
   fake CPU storage (`FakeTensorMode`: shapes, no memory), wrapped for activation
   checkpointing by `titan_parallel.apply_ac` as the trainer wraps it.
2. It is compiled with `torch.compile(fullgraph=True, dynamic=False)` and Inductor's own
   `compile_fx`, whose `inner_compile` (the hook that would generate code) is replaced by one that
   records the forward graph the partitioner produced and runs it as is; the block is
   called once on a fake `(batch, seq, dim)` input. Nothing is generated or built.
3. The forward graph returns the block's output, then the tensors it saves for
   backward. Their bytes, each storage once, less the block's parameters and buffers
   (the model states count those) and with the block's input counted (it is what the
   previous block produced), divided by `batch x seq`, are the bytes per token.

Under `activation_checkpoint.mode = 'memory_budget'` the block is traced with no AC wrapper and
the partitioner run at the job's budget (`torch._functorch.config.activation_memory_budget`,
set for the trace only, as `titan_parallel.compile.budget_backend` sets it for the run's
compiles): what it keeps is the run's `block_budget`; its unbudgeted cut is `block`, and the
block's backward recomputes the difference.

Results are cached per (family, block shape, batch, seq, dtype, AC kind, budget) for the process.
A measurement takes 1-2.5 s on a busy 2-core Xeon; the first in a process also imports
Inductor, 13-25 s there (with Python's bytecode cache off, as on that machine).

Device: fake CUDA tensors can be created without a GPU, but autograd's engine asks the
CUDA driver for a device context when it runs a backward (the joint trace runs one), so
the block is traced on fake CPU tensors. What that changes for a GPU: SDPA is CPU's flash
kernel, which saves what CUDA's flash / cuDNN kernels save (q, k, v, the output, an fp32
log-sum-exp per head and token; CUDA's also keep two scalars of RNG state); RMSNorm is
decomposed by Inductor on both devices (`aten._fused_rms_norm` is in its decomposition
table); the partitioner does not look at the device. Inductor's CUDA-only joint-graph
passes (matmul padding) are not run.

Tensor and context parallel blocks, which the trainer compiles child by child around eager
sequence-parallel norms and DTensors (TP) or around eager ring attention (CP), are measured by
`titan_core.memory.compiled_parallel` instead (compiled on CPU, the eager norms as on the target).
Float8 blocks (`float8=`, tp = cp = 1): the block's linears are converted by `titan_parallel.apply_float8` as the
trainer converts them, and the graph traced is the target's: torchao's `_scaled_mm` graph for a CUDA target (on
fake tensors its float8 kernels need no GPU), its fp32 emulation for a CPU one (`traced_float8`). Tensorwise keeps
some matmul inputs in float8 (1 byte an element) and recomputes more: the 1B block at seq 2048 keeps 57,480 bytes per
token against bf16's 75,912; rowwise 71,816; under selective op AC both keep bf16's 29,824, the matmuls' outputs.
An emulated block compiled by Inductor on real CPU tensors keeps exactly what its trace reads
(tests/test_memory_compiled_float8.py).

Not measured (the analytic tier keeps the eager figures there, and says so): MX linears, float8 under TP or CP,
autocast (DDP with a bf16 compute dtype), whose weight copies the analytic tier counts apart, and Mixture-of-Experts
models (the routed experts' token counts are data-dependent: Dynamo cannot put them in one graph
on fake tensors, and under AC it refuses the MoE forward's side effect inside the checkpoint;
DeepSeek-V3's dense blocks trace, but CPU SDPA runs their unequal q/k and v head widths through
the math kernel, which keeps the attention matrix CUDA's kernels do not).

Private torch APIs used (written against torch 2.15; run on torch 2.11 on the GPU machine,
2026-11-26):
- `torch._inductor.compile_fx.compile_fx(gm, example_inputs, inner_compile=...)`: Inductor's
  backend with its code generator swapped out (its `inner_compile` keyword), and the
  `is_backward` keyword Inductor passes that hook.
- `torch._functorch.aot_autograd.make_boxed_func`: the calling convention an
  `inner_compile` result must follow.
- `torch._subclasses.fake_tensor.FakeTensorMode` (documented, but under `torch._`).
- FX's `node.meta["val"]`, the fake value AOTAutograd records on each node of its graphs.
- `torch._dynamo.config.patch(automatic_dynamic_shapes=False)`: torch 2.11 remembers the shapes a function was
  compiled at by file and line, so a second batch size traced dynamic there; and `SymInt.node.hint`, the
  value a symbolic size was traced at, should one still come back.
Public but low-level: `torch.multiprocessing.reductions.StorageWeakRef` (a storage's identity).
Nothing of torch is patched.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import types
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.nn as nn

from titan_core.memory.torch_patches import quiet_torch_logs

if TYPE_CHECKING:
    from titan_core.config import JobConfig
    from titan_core.job import Job
    from titan_core.memory.activations import ActivationBytes, ActivationLayout
    from titan_parallel.float8 import Float8Options

AC_KINDS = ("none", "op", "full")
"""What a block can run as: no AC, selective "op" AC, or checkpointed whole (full AC; selective N's
checkpointed blocks)."""


@dataclass(frozen=True)
class SavedTensor:
    """One tensor a compiled block's forward keeps for backward.

    Args:
        name: the forward graph's node name (e.g. 'mm_4', 'getitem_5', 'primals_2').
        shape: its shape.
        dtype: its dtype.
        nbytes: bytes of its storage.
    """

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    nbytes: int


@dataclass(frozen=True)
class BlockSaved:
    """What one compiled block keeps for backward at one shape.

    Args:
        tensors: the saved tensors counted (parameters and buffers left out), each storage once.
        tokens: batch x seq of the measured call.
        backward_flops: FLOPs of the partitioned backward graph (matmuls and attention, as
            `torch.utils.flop_counter` counts them): the forward ops it recomputes included.
    """

    tensors: tuple[SavedTensor, ...]
    tokens: int
    backward_flops: float = 0.0

    @property
    def total(self) -> int:
        """Bytes kept for backward by the block, for its `tokens` tokens."""
        return sum(t.nbytes for t in self.tensors)

    @property
    def per_token(self) -> int:
        """Bytes per token, rounded."""
        return round(self.total / self.tokens)


_CACHE: dict[tuple[Any, ...], BlockSaved] = {}


def block_signature(block: nn.Module) -> tuple[Any, ...]:
    """What tells kinds of block apart: its class and every parameter's name, shape and dtype."""
    params = tuple((name, tuple(p.shape), p.dtype) for name, p in block.named_parameters())
    return (type(block).__qualname__, params)


def measure_block(
    meta_block: nn.Module,
    *,
    family: str,
    blocks_path: str,
    rope_shape: Sequence[int],
    dim: int,
    batch: int,
    seq_len: int,
    dtype: torch.dtype,
    ac: str,
    rope_dtype: torch.dtype = torch.float32,
    memory_budget: float | None = None,
    float8: Float8Options | None = None,
) -> BlockSaved:
    """What `meta_block` keeps for backward when compiled, for a `(batch, seq_len)` input (cached).

    Args:
        meta_block: one block of the model, on the meta device (left untouched: a copy is traced).
        family: the model family (`model.name`), for the cache key.
        blocks_path: the plan's block container (`ModelPlan.blocks`), for `apply_ac`.
        rope_shape: shape of the model's RoPE table (`rope_cache`), the blocks' second input.
        dim: width of the block's input (the model's `dim`).
        batch: sequences per (micro-)batch.
        seq_len: tokens per sequence on this rank.
        dtype: the compute dtype: the parameters' and the input's.
        ac: one of `AC_KINDS`.
        rope_dtype: the RoPE table's dtype, as the blocks get it (the model's own: no FSDP unit casts it).
        memory_budget: the partitioner's activation memory budget in [0, 1], with `ac` "none"; None: its default.
        float8: the run's [float8] options: its linears converted by `titan_parallel.apply_float8` as the trainer
            converts them (the GPU's `_scaled_mm` graph unless `emulate`), whatever this host has.

    Raises:
        ValueError: an unknown `ac`, or a budget with an AC wrapper.
    """
    if ac not in AC_KINDS:
        raise ValueError(f"ac={ac!r} is not one of {AC_KINDS}")
    if memory_budget is not None and ac != "none":
        raise ValueError(f"a memory budget replaces the AC wrapper: ac={ac!r} with memory_budget={memory_budget}")
    signature = block_signature(meta_block)
    key = (family, signature, tuple(rope_shape), rope_dtype, dim, batch, seq_len, dtype, ac, memory_budget, float8)
    if key not in _CACHE:
        rope = (tuple(rope_shape), rope_dtype)
        shape = (batch, seq_len, dim)
        _CACHE[key] = _trace(meta_block, blocks_path, rope, shape, dtype, ac, memory_budget, float8)
    return _CACHE[key]


def _wrapped(block: nn.Module, blocks_path: str, ac: str) -> nn.Module:
    """`block` wrapped for activation checkpointing as `titan_parallel.apply_ac` wraps a model's first block."""
    from titan_parallel import ModelPlan
    from titan_parallel.activation_checkpoint import apply_ac

    if ac == "none":
        return block
    holder = nn.Module()
    holder.add_module(blocks_path, nn.ModuleDict({"0": block}))
    plan = ModelPlan(blocks=blocks_path)
    if ac == "full":
        apply_ac(holder, plan, "full")
    else:
        apply_ac(holder, plan, "selective", "op")
    container = holder.get_submodule(blocks_path)
    assert isinstance(container, nn.ModuleDict)
    return container["0"]


def _call_block(block: nn.Module, hidden: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
    return block(hidden, rope_cache=rope)  # as the model's forward calls each block


def _trace(
    meta_block: nn.Module,
    blocks_path: str,
    rope_table: tuple[tuple[int, ...], torch.dtype],
    input_shape: tuple[int, int, int],
    dtype: torch.dtype,
    ac: str,
    memory_budget: float | None,
    float8: Float8Options | None,
) -> BlockSaved:
    from torch._subclasses.fake_tensor import FakeTensorMode

    block = copy.deepcopy(meta_block)
    if float8 is not None:  # converted where the trainer converts it: in the model, the blocks' names as in the run
        from titan_parallel.float8 import apply_float8

        holder = nn.Module()
        holder.add_module(blocks_path, nn.ModuleDict({"0": block}))
        apply_float8(holder, float8, trace_only=True)
    with FakeTensorMode():
        _fake_storage(block, dtype)
        hidden = torch.empty(input_shape, dtype=dtype, requires_grad=True)  # (batch, seq, dim)
        rope = torch.empty(rope_table[0], dtype=rope_table[1])  # the model's table: no block casts its inputs
    unit = _wrapped(block, blocks_path, ac)
    batch, seq_len, _ = input_shape
    return _partitioned(_call_block, (unit, hidden, rope), batch * seq_len, memory_budget, backward=True)


def measure_loss(vocab: int, dtype: torch.dtype, rows: int = 256) -> int:
    """Bytes per token that the compiled plain loss (`titan_core.step_loss.cross_entropy_loss` under
    `torch.compile`) keeps for backward, from logits of `vocab` columns in `dtype` (cached).

    Args:
        vocab: the logits' width (the vocabulary on this rank).
        dtype: the logits' dtype (the compute dtype).
        rows: tokens traced: what the loss keeps is per token (the logits and one log-sum-exp each).
    """
    key = ("loss", vocab, dtype, rows)
    if key not in _CACHE:
        from torch._subclasses.fake_tensor import FakeTensorMode

        from titan_core.step_loss import cross_entropy_loss

        # Decomposing the cross-entropy makes a real scalar constant (aten.where's 0): let the mode take it.
        with FakeTensorMode(allow_non_fake_inputs=True):
            logits = torch.empty((1, rows, vocab), dtype=dtype, requires_grad=True)  # (bs, seqlen, vocab)
            labels = torch.zeros((1, rows), dtype=torch.long)
        _CACHE[key] = _partitioned(cross_entropy_loss, (logits, labels), rows)
    return _CACHE[key].per_token


def _partitioned(
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    tokens: int,
    memory_budget: float | None = None,
    backward: bool = False,
) -> BlockSaved:
    """What `fn(*args)`, compiled with Inductor's partitioner (at `memory_budget`, where given), saves for backward
    (see the module docstring); with `backward`, also the FLOPs of the backward graph the partitioner cut (run
    once on the fake output to hand it over)."""
    from torch._functorch import config as functorch_config
    from torch._functorch.aot_autograd import make_boxed_func
    from torch._inductor.compile_fx import compile_fx

    recorded: dict[str, Any] = {}

    def record_graph(gm: torch.fx.GraphModule, example_inputs: Sequence[Any], **kwargs: Any) -> Any:
        recorded["backward" if kwargs.get("is_backward", False) else "forward"] = gm
        return make_boxed_func(functools.partial(_run_fake, gm))

    def backend(gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> Callable[..., Any]:
        # Dynamo lifts parameters into inputs (as `nn.Parameter`); the block's input is the one that needs grad.
        recorded["counted"] = [
            not isinstance(t, nn.Parameter) and isinstance(t, torch.Tensor) and t.requires_grad for t in example_inputs
        ]
        recorded["outputs"] = len(_outputs(gm))
        return cast("Callable[..., Any]", compile_fx(gm, example_inputs, inner_compile=record_graph))

    # A fresh code object: Dynamo keeps its compiled graphs on the code object, so each trace starts anew
    # and none counts towards another's recompile limit.
    fresh = types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)
    fresh.__kwdefaults__ = fn.__kwdefaults__  # the defaults too (`cross_entropy_loss`'s z-loss is off by default)
    # dynamic=False: static shapes, as a training run compiles its fixed-shape blocks (Dynamo would otherwise
    # mark sizes dynamic once it has seen this function at two shapes)
    # and no automatic dynamic shapes from an earlier trace of the same function (torch 2.11 keys that state by
    # file and line, not by code object: a planner's second batch size came back as a SymInt there)
    budget: dict[str, Any] = {} if memory_budget is None else {"activation_memory_budget": memory_budget}
    with torch._dynamo.config.patch(automatic_dynamic_shapes=False), functorch_config.patch(budget):
        with quiet_torch_logs():
            out = torch.compile(fresh, backend=backend, fullgraph=True, dynamic=False)(*args)
            if backward:  # AOTAutograd partitions at the forward, but hands the backward over at its first run
                out.backward(torch.ones_like(out))
    saved = _saved(recorded["forward"], recorded["counted"], recorded["outputs"], tokens)
    if not backward:
        return saved
    from titan_core.memory.graph_flops import graph_flops

    return dataclasses.replace(saved, backward_flops=graph_flops(recorded["backward"]))


def _run_fake(gm: torch.fx.GraphModule, *args: Any) -> Any:
    """Run a partitioned graph on its fake inputs, letting it read the real scalar constants it holds (torchao's
    rowwise float8 backward keeps unit scales as `_tensor_constant`s of its graph)."""
    from torch._guards import detect_fake_mode

    mode = detect_fake_mode(args)
    if mode is None:
        return gm.forward(*args)
    allowed = mode.allow_non_fake_inputs
    mode.allow_non_fake_inputs = True
    try:
        return gm.forward(*args)
    finally:
        mode.allow_non_fake_inputs = allowed


def _fake_storage(block: nn.Module, dtype: torch.dtype) -> None:
    """Give `block`'s parameters (cast to `dtype`, as FSDP gathers them) and buffers (kept in their dtype)
    storage on the CPU, in place; under `FakeTensorMode` the storage is fake."""
    for module in block.modules():
        for name, p in module.named_parameters(recurse=False):
            data = torch.empty(p.shape, dtype=dtype if p.is_floating_point() else p.dtype)
            module.register_parameter(name, nn.Parameter(data, requires_grad=p.requires_grad))
        for name, buf in module.named_buffers(recurse=False):
            module.register_buffer(name, torch.empty(buf.shape, dtype=buf.dtype))  # persistence: irrelevant here


def _outputs(gm: torch.fx.GraphModule) -> list[Any]:
    (output,) = gm.graph.find_nodes(op="output")
    values = output.args[0]
    return list(values) if isinstance(values, (tuple, list)) else [values]


def _saved(forward: torch.fx.GraphModule, counted: list[bool], n_outputs: int, tokens: int) -> BlockSaved:
    """The saved tensors of a partitioned forward graph: its outputs after the block's own, tensors only,
    each storage once, the graph inputs left out unless `counted`."""
    from torch.multiprocessing.reductions import StorageWeakRef

    inputs = forward.graph.find_nodes(op="placeholder")
    assert len(inputs) == len(counted), f"forward graph has {len(inputs)} inputs, Dynamo's graph {len(counted)}"
    skipped = {
        StorageWeakRef(n.meta["val"].untyped_storage())
        for n, c in zip(inputs, counted, strict=True)
        if not c and isinstance(n.meta.get("val"), torch.Tensor)
    }
    seen: set[StorageWeakRef] = set()
    tensors = []
    for node in _outputs(forward)[n_outputs:]:
        value = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
        if not isinstance(value, torch.Tensor):
            continue  # saved sizes (SymInts) and constants
        storage = StorageWeakRef(value.untyped_storage())
        if storage in skipped or storage in seen:
            continue
        seen.add(storage)
        nbytes = _concrete(value.untyped_storage().nbytes())
        tensors.append(SavedTensor(node.name, tuple(value.shape), value.dtype, nbytes))
    return BlockSaved(tuple(tensors), tokens)


def _concrete(n: int | torch.SymInt) -> int:
    """A size as an int: a symbolic one (dynamic shapes) by the value it was traced at."""
    if isinstance(n, torch.SymInt):
        hint = n.node.hint
        assert hint is not None, f"a saved tensor's size {n} has no traced value"
        return int(hint)
    return int(n)


def traced_float8(cfg: JobConfig, device_type: str) -> Float8Options | None:
    """The [float8] options a run on `device_type` converts its linears with, as its blocks are traced: None without
    float8; `emulate = 'auto'` resolves against the target, not this host (a CUDA target's float8 GPU runs
    `_scaled_mm`: that graph is traced here too).

    Args:
        cfg: the job config.
        device_type: the target's device type.
    """
    if "float8" not in cfg.model.converters:
        return None
    from titan_core.converters import float8_options

    options = float8_options(cfg, device_type)
    if device_type == "cuda" and cfg.float8.emulate == "auto":
        options = dataclasses.replace(options, emulate=False)
    return options


def compiled_block_bytes(job: Job, act: ActivationBytes, layout: ActivationLayout) -> tuple[ActivationBytes, str]:
    """`act` with a block's saved bytes (`block`, and `block_op` or `block_input` as the AC mode needs)
    measured from the compiled block, and a note for the estimate saying so; `act` unchanged, and a note
    saying why, where the compiled block is not measured (see the module docstring).

    The block is measured on one sequence of `training.seq_len` tokens: what it saves grows with the
    batch, but for the few tensors per position (RoPE's rotation, `seq_len x head_dim / 2` complex
    numbers, a few hundred bytes per position), which a batch of B sequences counts B times, an
    overcount under 1% of a block. One figure per token then serves every micro-batch size, as the
    planner tries them.

    Args:
        job: the resolved job (compile on).
        act: the eager figures measured for the job's layout.
        layout: that layout (`eager_saved.measure_eager`'s), read under tensor parallel.
    """
    from titan_parallel import uses_fsdp

    cfg = job.cfg
    dims = job.dims
    assert dims is not None, "an estimate's job is resolved for a world size"
    dtype = job.parallel.param_dtype
    eager = "the eager blocks' figures (an upper bound)"
    if cfg.activation_checkpoint.mode == "memory_budget":
        eager += ", every activation kept: the memory budget's recompute is not counted"
    why_not = None
    if not job.parallel.compile:
        why_not = "compile.components leaves the blocks eager"
    elif job.converters.mx is not None:
        why_not = "MX linears are not measured compiled"
    elif job.converters.float8 is not None and (dims.tp > 1 or dims.cp > 1):
        why_not = "float8 linears under tensor / context parallel are not measured compiled"
    elif job.spec.plan.moe is not None or act.per_block:
        why_not = "Mixture-of-Experts blocks are not measured compiled"
    elif dtype != torch.float32 and not uses_fsdp(dims, job.parallel) and not job.parallel.master_weights:
        why_not = "autocast's compiled blocks (DDP with a 16-bit compute dtype) are not measured"
    if why_not is not None:
        return act, f"compile: {why_not}; {eager}"
    if dims.tp > 1 or dims.cp > 1:
        from titan_core.memory.compiled_parallel import parallel_block_bytes

        return parallel_block_bytes(job, act, layout)
    ac = cfg.activation_checkpoint
    kinds = ["none"]
    if ac.mode == "selective" and ac.selective_ac_option == "op":
        kinds.append("op")
    elif ac.mode == "memory_budget":
        kinds.append("budget")
    elif ac.mode != "none":
        kinds.append("full")
    meta = job.meta_model()
    block = next(iter(meta.get_submodule(job.spec.plan.blocks).children()))
    rope = getattr(meta, "rope_cache", None)
    if not isinstance(rope, torch.Tensor):
        return act, f"compile: the model has no `rope_cache` to call a block with; {eager}"
    float8 = traced_float8(cfg, job.device_type)
    try:
        traced = {
            kind: measure_block(
                block,
                family=cfg.model.name,
                blocks_path=job.spec.plan.blocks,
                rope_shape=tuple(rope.shape),
                rope_dtype=rope.dtype,
                dim=job.model_args.dim,
                batch=1,
                seq_len=cfg.training.seq_len,
                dtype=dtype,
                ac="none" if kind == "budget" else kind,
                memory_budget=ac.memory_budget if kind == "budget" else None,
                float8=float8,
            )
            for kind in kinds
        }
    except Exception as e:  # torch raises many kinds; the eager figures still bound the estimate
        first_line = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        return act, f"compile: tracing the compiled block failed ({first_line}); {eager}"
    saved = {kind: t.per_token for kind, t in traced.items()}
    fields = {"none": "block", "op": "block_op", "full": "block_input", "budget": "block"}
    measured = dataclasses.replace(
        act,
        block=saved["none"],
        block_op=saved.get("op", act.block_op),
        block_input=saved.get("full", act.block_input),
        block_budget=saved.get("budget"),
    )
    names = {"budget": f"memory budget {ac.memory_budget:g}"}
    figures = ", ".join(
        f"{names.get(k, f'AC {k}')}: {v:,} (eager {getattr(act, fields[k]):,})" for k, v in saved.items()
    )
    if "budget" in traced:  # what the budget costs: the matmuls and attention its backward recomputes
        base, budget = traced["none"].backward_flops, traced["budget"].backward_flops
        more = (budget - base) / max(base, 1.0)
        figures += f", its backward {more:.0%} more matmul and attention FLOPs (the recompute)"
    linears = ""
    if float8 is not None:
        linears = f", float8 {float8.recipe_name} linears" + (" emulated" if float8.emulate else " as on the GPU")
    return measured, (
        "compile: block activations measured from the compiled graph (AOTAutograd's partitioner on fake CPU "
        f"tensors{linears}), bytes per token per block: {figures}; the loss and the rest as eager"
    )


def compiled_loss_bytes(job: Job, act: ActivationBytes) -> tuple[ActivationBytes, str | None]:
    """`act` with `logits_saved` measured from the compiled plain loss where the run compiles it (and does not
    fuse it into the output projection), with a note saying so; `act` and None otherwise.

    Args:
        job: the resolved job.
        act: the eager figures measured for the job's layout.
    """
    from titan_core.memory.run_paths import plain_loss_compiled

    if not plain_loss_compiled(job):
        return act, None
    saved = measure_loss(job.model_args.vocab_size, job.parallel.param_dtype)
    note = (
        f"compile: the plain loss keeps {saved:,} bytes per token for backward, measured from its compiled graph "
        f"(eager: {act.logits_saved:,}); its backward holds one gradient of the logits in the compute dtype"
    )
    return dataclasses.replace(act, logits_saved=saved), note
