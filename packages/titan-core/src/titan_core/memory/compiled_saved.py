"""What one block keeps for backward under `torch.compile`: read from the compiled graph, not derived.

The eager figures (`titan_core.memory.eager_saved`) count what autograd saves op by op. A
compiled block saves what AOTAutograd's partitioner decides: it traces the block's joint
forward + backward graph and cuts it (Inductor's `min_cut_rematerialization_partition`,
after Inductor's joint-graph passes), recomputing cheap element-wise results in backward
rather than keeping them. This module asks the partitioner itself:

1. One block of the model (`compiled_estimate.compiled_block_bytes` takes the first: a dense family's
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
Float8 blocks (`float8=`; under TP / CP `compiled_parallel` converts them alike): the block's linears are converted
by `titan_parallel.apply_float8` as the trainer converts them, and the graph traced is the target's: torchao's
`_scaled_mm` graph for a CUDA target (on fake tensors its float8 kernels need no GPU), its fp32 emulation for a CPU
one (`compiled_estimate.traced_float8`). Tensorwise keeps some matmul inputs in float8 (1 byte an element) and
recomputes more: the 1B block at seq 2048 keeps 57,480 bytes per token against bf16's 75,912; rowwise 71,816; under
selective op AC both keep bf16's 29,824, the matmuls' outputs.
An emulated block compiled by Inductor on real CPU tensors keeps exactly what its trace reads
(tests/test_memory_compiled_float8.py).

Not measured (the analytic tier keeps the eager figures there, and says so): MX linears, and autocast (DDP with a
bf16 compute dtype), whose weight copies the analytic tier counts apart. Mixture-of-Experts models are not traced
whole here (the routed experts' token counts are data-dependent: Dynamo cannot put them in one graph on fake
tensors): `compiled_parallel` compiles their blocks around the eager experts, as the trainer does.

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


def block_copy(meta_block: nn.Module, blocks_path: str, float8: Float8Options | None) -> nn.ModuleDict:
    """A copy of `meta_block` as the model's block "0" (`{"0": copy}`), its linears converted by
    `titan_parallel.apply_float8` where the trainer converts them (in the model, before any split: the blocks' names
    as in the run, which the float8 filters read) when `float8` is given."""
    blocks = nn.ModuleDict({"0": copy.deepcopy(meta_block)})
    if float8 is not None:
        from titan_parallel.float8 import apply_float8

        holder = nn.Module()
        holder.add_module(blocks_path, blocks)
        apply_float8(holder, float8, trace_only=True)
    return blocks


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

    block = block_copy(meta_block, blocks_path, float8)["0"]
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
