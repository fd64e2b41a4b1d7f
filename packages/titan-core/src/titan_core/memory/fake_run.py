"""Running a model's part on fake tensors as the target runs it, and counting what autograd keeps for backward.

The machinery of `titan_core.memory.eager_saved`:

- `fake_target`: `FakeTensorMode` on the target's device type. Fake CUDA tensors need no GPU for a
  forward, so CUDA's kernels decide what is saved (its fused RMSNorm; `torch._grouped_mm` for bf16
  experts, as on Hopper). SDPA's kernel choice asks the GPU, and without one falls back to the math
  path, which no GPU runs: `F.scaled_dot_product_attention` calls cuDNN's, flash's or the
  memory-efficient kernel instead, in the order `titan_parallel.attention_backend` gives an H100.
  The experts' token counts, read with `.tolist()`, are answered with an even load (`EvenLoad`).
- `fake_mesh`: tensor / context parallel over a fake process group (collectives return at once, moving
  nothing), rank 0 of `cp x tp`, as the traced tier runs, with DTensor's sharding caches emptied around the group
  (`fake_process_group`, `forget_sharding_specs`); `on_fake` gives a module fake storage, a DTensor parameter its
  local shard.
- `SavedStorages` and `block_saved_bytes`: what `torch.autograd.graph.saved_tensors_hooks` sees, plus
  what selective "op" AC caches itself (`_CachingTorchDispatchMode.storage`) and, for a checkpointed
  block, its input; each storage once (a DTensor's local shard), parameters and buffers left out.
- `LiveBytes` and `walk_backward`: a backward's peak. Autograd's engine cannot run a
  backward on fake CUDA tensors without a GPU (it sets the device of its CUDA worker thread), so
  `walk_backward` calls the graph's nodes itself, in the engine's order (highest sequence number
  first), summing (and broadcasting back) the gradients of a node's inputs as the engine does and
  freeing each node, with what it saved, once it ran (as `retain_graph=False` does); `LiveBytes` follows the bytes of
  every storage the ops make, from the op to its last reference.

Private torch APIs used (torch 2.15): `FakeTensorMode`; SAC's
`torch.utils.checkpoint._CachingTorchDispatchMode.storage` and `_VersionWrapper.val`;
`aten._local_scalar_dense` answered by a `TorchDispatchMode`; SDPA's CUDA kernels
`aten._scaled_dot_product_cudnn_attention` / `_flash_attention` / `_efficient_attention` called
directly (in place of `F.scaled_dot_product_attention` during a CUDA measurement,
`titan_core.memory.torch_patches.as_hopper`); autograd's `Node.__call__`, `Node._sequence_nr()`,
`Node._input_metadata` and `AccumulateGrad.variable` (`walk_backward`);
`CheckpointWrapper.checkpoint_fn` (a `functools.partial`); the "fake" process group of
`torch.testing._internal.distributed.fake_pg`; DTensor's sharding caches (`forget_sharding_specs`:
`torch._C._clear_DTensor_sharding_propagator_cache`, the propagator's `propagate_op_sharding` and
`_propagate_tensor_meta_cached`); a CUDA `DeviceMesh` made with the CUDA device
queries answered (`torch_patches.cuda_devices_without_gpu`: no GPU is touched). Every patch of
torch is in `titan_core.memory.torch_patches`.
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

from titan_core.memory.torch_patches import as_hopper, cuda_devices_without_gpu


class NoFakeGroup(Exception):
    """This process already has a process group: a fake one cannot be started beside it."""


@contextmanager
def fake_mesh(tp: int, cp: int, device: str, cuda_stand_in: bool = True) -> Iterator[DeviceMesh | None]:
    """A `("cp", "tp")` mesh of rank 0 over a fake process group of `cp x tp` ranks; None for one rank. With
    `cuda_stand_in`, CUDA's device queries answer as a node of `cp x tp` GPUs would meanwhile (a CUDA mesh needs
    them; Dynamo, which then asks CUDA for its RNG state, must not see them).

    Raises:
        NoFakeGroup: the process already has a process group.
    """
    if tp * cp == 1:
        yield None
        return
    import torch.distributed as dist

    if dist.is_initialized():
        raise NoFakeGroup("this process already has a process group")
    with fake_process_group(0, tp * cp):
        with cuda_devices_without_gpu(tp * cp) if cuda_stand_in else contextlib.nullcontext():
            yield DeviceMesh(device, torch.arange(cp * tp).view(cp, tp), mesh_dim_names=("cp", "tp"))


def forget_sharding_specs() -> None:
    """Empty DTensor's sharding-propagation caches (C++'s and Python's), so that no DTensor a measurement makes
    carries an earlier one's mesh.

    They are keyed by value, and a mesh compares equal to another of the same ranks and names: an op's output
    spec cached in one measurement came back in the next with the first's (destroyed) mesh, and Dynamo, which
    lifts each mesh a compiled child meets as a graph input, then took the second one from elsewhere (the TP hooks'
    closures). Only the graph's input order changed, and the min-cut partitioner breaks ties by it: the debug
    block in float8 at TP 2 kept 739,620 bytes measured after another TP block, 854,308 (what two real ranks keep)
    measured first in its process."""
    clear = getattr(torch._C, "_clear_DTensor_sharding_propagator_cache", None)
    if clear is not None:
        clear()
    propagator = DTensor._op_dispatcher.sharding_propagator
    for cached in ("propagate_op_sharding", "_propagate_tensor_meta_cached"):
        getattr(getattr(propagator, cached, None), "cache_clear", lambda: None)()


@contextmanager
def fake_process_group(rank: int, world_size: int) -> Iterator[None]:
    """The default process group, torch's "fake" backend (collectives return at once), as `rank` of `world_size`,
    destroyed after. `init_process_group` also wraps `sys.excepthook` to prefix tracebacks with `[rank0]:`, and
    never unwraps it: a planner's dozens of measurements stacked as many prefixes on each line of a later error's
    traceback. The hook is put back as it was. DTensor's sharding caches are emptied before and after
    (`forget_sharding_specs`): no DTensor of this group's meshes takes a spec cached with another's."""
    import sys

    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    hook = sys.excepthook
    forget_sharding_specs()
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()
        sys.excepthook = hook
        forget_sharding_specs()


class EvenLoad(TorchDispatchMode):
    """Answers what a fake forward cannot: the experts' token counts (`.tolist()`), with an even load."""

    def __init__(self, counts: Callable[[], int]) -> None:
        super().__init__()
        self.counts = counts

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        """Off while `torch.compile` compiles (Dynamo refuses to trace under another dispatch mode), on while the
        compiled graphs and the eager code between them run: the experts the trainer leaves eager read the counts."""
        return True

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        from torch._subclasses.fake_tensor import FakeTensor

        if func is torch.ops.aten._local_scalar_dense.default and isinstance(args[0], FakeTensor):
            return self.counts()
        return func(*args, **(kwargs or {}))


def _cuda_sdpa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> torch.Tensor:
    """`F.scaled_dot_product_attention` as an H100 runs it under `training.attention_backend = "auto"`
    (`titan_parallel.attention_backend`: cuDNN, then flash, memory-efficient): cuDNN for 16-bit inputs of equal
    q / v head widths up to 128 (grouped-query K/V as they are, a mask as an additive bias), else flash (no mask,
    equal widths up to 256), else the memory-efficient kernel (K/V repeated to the query heads). Without a GPU,
    SDPA's own choice on fake CUDA tensors falls back to the math path, which no GPU runs."""
    aten = torch.ops.aten
    if attn_mask is not None and attn_mask.dtype == torch.bool:  # as SDPA does: an additive bias in q's dtype
        attn_mask = torch.where(attn_mask.logical_not(), float("-inf"), 0.0).to(q.dtype)
    half = q.dtype in (torch.float16, torch.bfloat16)
    if half and q.shape[-1] == v.shape[-1] <= 128:
        return aten._scaled_dot_product_cudnn_attention(
            q, k, v, attn_mask, True, dropout_p, is_causal, False, scale=scale
        )[0]
    if attn_mask is None and half and q.shape[-1] == v.shape[-1] <= 256:
        return aten._scaled_dot_product_flash_attention(q, k, v, dropout_p, is_causal, False, scale=scale)[0]
    if enable_gqa and k.shape[1] != q.shape[1]:
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    return aten._scaled_dot_product_efficient_attention(q, k, v, attn_mask, True, dropout_p, is_causal, scale=scale)[0]


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (what the rank holds); a plain tensor itself."""
    return t._local_tensor if isinstance(t, DTensor) else t


def _storage(t: torch.Tensor) -> Any:
    from torch.multiprocessing.reductions import StorageWeakRef

    return StorageWeakRef(_local(t).untyped_storage())


class SavedStorages:
    """Storages kept for backward, each once, the excluded ones (parameters, buffers) left out."""

    def __init__(self, exclude: list[torch.Tensor]) -> None:
        self.skip = {_storage(t) for t in exclude}
        self.kept: dict[Any, int] = {}
        self.sac_modes: list[Any] = []  # selective AC's forward caches (`_CachingTorchDispatchMode`)

    def add(self, t: Any) -> None:
        if isinstance(t, torch.Tensor) and _storage(t) not in self.skip:
            self.kept[_storage(t)] = int(_local(t).untyped_storage().nbytes())

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        self.add(t)
        return t.detach()  # the tensor itself would tie a saved output to its own node: a cycle never freed

    @property
    def total(self) -> int:
        return sum(self.kept.values())


@contextmanager
def fake_target(device: str, counts: Callable[[], int] = lambda: 0) -> Iterator[None]:
    from torch._subclasses.fake_tensor import FakeTensorMode

    with warnings.catch_warnings(), FakeTensorMode(allow_non_fake_inputs=True), EvenLoad(counts):
        warnings.simplefilter("ignore")  # SAC's FutureWarning about saved_tensors_hooks around its region
        if device != "cuda":
            yield
            return
        with as_hopper(_cuda_sdpa):
            yield


def on_fake(module: nn.Module, dtype: torch.dtype, device: str) -> nn.Module:
    """`module` (a copy of a meta module, made outside `FakeTensorMode`) given fake storage, in place: floating
    parameters in `dtype`, buffers in their own dtype."""
    for m in module.modules():
        for name, p in m.named_parameters(recurse=False):
            local = _local(p)
            data = torch.empty(local.shape, dtype=dtype if p.is_floating_point() else p.dtype, device=device)
            if isinstance(p, DTensor):  # tensor parallel's shard: the local part, fake
                data = DTensor.from_local(
                    data, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride()
                )
            m.register_parameter(name, nn.Parameter(data, requires_grad=p.requires_grad))
        for name, buf in m.named_buffers(recurse=False):
            m.register_buffer(name, torch.empty(buf.shape, dtype=buf.dtype, device=device))
    return module


def _sac_cache(wrapper: nn.Module, into: SavedStorages) -> None:
    """Make the selective-AC `wrapper` record, after each forward, what its policy cached into `into`."""
    ckpt = wrapper.checkpoint_fn
    assert isinstance(ckpt, functools.partial), "CheckpointWrapper keeps its checkpoint as a functools.partial"
    make_contexts = ckpt.keywords["context_fn"]

    def recording() -> Any:
        forward_ctx, recompute_ctx = make_contexts()
        into.sac_modes.append(forward_ctx)
        return forward_ctx, recompute_ctx

    recorded = functools.partial(ckpt.func, *ckpt.args, **{**ckpt.keywords, "context_fn": recording})
    setattr(wrapper, "checkpoint_fn", recorded)  # noqa: B010  (a plain attribute of CheckpointWrapper, not a module)


def _block_kwargs(
    rope: torch.Tensor | None, positions: torch.Tensor | None, mask: torch.Tensor | None
) -> dict[str, torch.Tensor]:
    """A block's keyword inputs besides the hidden states, those the model passes."""
    given = {"rope_cache": rope, "positions": positions, "mask": mask}
    return {name: value for name, value in given.items() if value is not None}


def block_saved_bytes(
    block: nn.Module,
    blocks_path: str,
    rope: torch.Tensor | None,
    positions: torch.Tensor | None,
    shape: tuple[int, int, int],
    dtype: torch.dtype,
    device: str,
    ac: str,
    mask: torch.Tensor | None = None,
    backward: bool = False,
) -> int:
    """Bytes `block` (fake) keeps for backward for one call on a `shape` input (`(batch, seq, dim)`, the sequence
    split under sequence parallel) under AC kind `ac`; `rope`, `positions` and `mask` (the block-causal mask,
    shared by every block: not counted itself) as the model passes them. With `backward`, that call's backward
    runs after it (for a compile backend that reads the backward graphs: AOTAutograd hands them over then)."""
    from titan_core.memory.compiled_saved import _wrapped

    shared = [t for t in (rope, mask) if t is not None]
    saved = SavedStorages([*block.parameters(), *block.buffers(), *shared])
    unit = _wrapped(block, blocks_path, ac)
    if ac == "op":
        _sac_cache(unit, saved)
    hidden = torch.empty(shape, dtype=dtype, device=device, requires_grad=True)
    kwargs = _block_kwargs(rope, positions, mask)
    with torch.autograd.graph.saved_tensors_hooks(saved.pack, lambda t: t):
        out = unit(hidden, **kwargs)
    if backward:
        out.backward(torch.ones_like(out))
    if ac != "none":
        saved.add(hidden)  # the checkpoint keeps its input to recompute from
    for mode in saved.sac_modes:
        for outputs in mode.storage.values():  # {op: {call index: output}}; {op: [output, ...]} before torch 2.13
            for out in outputs.values() if isinstance(outputs, dict) else outputs:
                for wrapped in torch.utils._pytree.tree_leaves(out):
                    saved.add(getattr(wrapped, "val", None))
    return saved.total


class LiveBytes(TorchDispatchMode):
    """The bytes of the storages ops make while it is active: alive now (`now`) and at their largest since
    `watch` (`peak`). A storage counts from the op that made it (or `add`) until its last reference goes;
    the excluded ones (parameters, buffers, the RoPE table) never count.

    Args:
        exclude: tensors whose storages never count.
    """

    def __init__(self, exclude: list[torch.Tensor]) -> None:
        super().__init__()
        self.skip = {_storage(t) for t in exclude}
        self.live: dict[Any, int] = {}
        self.peak = 0
        self.watching = False

    def add(self, t: torch.Tensor) -> None:
        key = _storage(t)
        if key not in self.skip:
            self.live[key] = int(_local(t).untyped_storage().nbytes())

    def drop(self, t: torch.Tensor) -> None:
        """Never count `t`'s storage again (a block's output, which the next block owns)."""
        key = _storage(t)
        self.skip.add(key)
        self.live.pop(key, None)

    def now(self) -> int:
        for key in [k for k in self.live if k.expired()]:
            del self.live[key]
        return sum(self.live.values())

    def watch(self) -> None:
        """Follow the peak from here on, starting from what is alive now."""
        self.watching = True
        self.peak = self.now()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.add(t)
        if self.watching:
            self.peak = max(self.peak, self.now())
        return out


def _call(node: Any, grads: list[Any], edges: int, saved: tuple[torch.Tensor, ...] | None) -> Any:
    """Run one node: a C++ node by calling it; a Python `autograd.Function`'s (not callable) by its backward, on a
    context holding `saved`, its saved tensors read while the graph was whole (torch 2.11 frees them with the
    node's C++ half once its last consumer ran, before it runs here). The backward returns one result per forward
    argument, where the node has an edge per tensor argument (`edges`; Titan's and torch's functions used here
    take their tensors first: the rest must be None)."""
    with torch.no_grad():  # as the engine without `create_graph`: no graph of the backward, holding this one
        if callable(node):
            return node(*grads)
        fn = node._forward_cls
        backward = fn.vjp if fn.vjp is not torch.autograd.Function.vjp else fn.backward  # as `node.apply` picks
        outs = backward(_SavedContext(node, saved), *grads)
    outs = outs if isinstance(outs, tuple) else (outs,)
    assert all(o is None for o in outs[edges:]), f"{type(node).__name__}: a gradient for a non-tensor argument"
    return outs[:edges]


class _SavedContext:
    """A Python function node's context as its backward sees it, with the saved tensors read beforehand."""

    def __init__(self, node: Any, saved: tuple[torch.Tensor, ...] | None):
        self._node, self.saved_tensors = node, saved

    def __getattr__(self, name: str) -> Any:
        return getattr(self._node, name)


def _as_expected(grad: torch.Tensor, expected: Any) -> torch.Tensor:
    """A gradient as the engine hands it on (`validate_outputs`): summed down to the input's shape where the
    forward broadcast it, in the input's dtype."""
    if tuple(grad.shape) != tuple(expected.shape):
        grad = grad.sum_to_size(expected.shape)
    if grad.dtype != expected.dtype:
        grad = grad.to(expected.dtype)
    return grad


def walk_backward(outputs: list[torch.Tensor], grads: list[torch.Tensor]) -> list[torch.Tensor]:
    """Run the backward of `outputs` from `grads` node by node, in autograd's order, each node freed (with what it
    saved) once it ran, as autograd's engine does; parameters' gradients are dropped (the model states count
    them); returns the gradients of the other leaves (the input's, which the previous block takes).

    Both lists are emptied: the caller must hold no other reference to the outputs or their graph, so that each
    node is freed once it ran.

    Args:
        outputs: the tensors whose backward to run.
        grads: their gradients.
    """
    import heapq

    roots: list[Any] = [t.grad_fn for t in outputs]
    slots = [t.output_nr for t in outputs]  # which output of its node each is (a node may have several)
    # Each node's edges, input metadata and order, read while the whole graph is alive: a Python function's node
    # object holds its C++ node weakly in torch 2.11, which frees it with its last consumer, before it runs here.
    graph: dict[Any, tuple[tuple[tuple[Any, int], ...], list[Any], int]] = {}
    saved: dict[Any, tuple[torch.Tensor, ...]] = {}  # Python function nodes' saved tensors, held until they run
    consumers: dict[Any, int] = {}
    stack = list(dict.fromkeys(roots))
    seen = set(stack)  # each node read once, a root that another output's graph reaches too (a norm of it) included
    while stack:
        node = stack.pop()
        graph[node] = (tuple(node.next_functions), list(node._input_metadata), node._sequence_nr())
        if not callable(node):
            saved[node] = node.saved_tensors
        for child, _ in graph[node][0]:
            if child is not None:
                if child not in seen:
                    seen.add(child)
                    stack.append(child)
                consumers[child] = consumers.get(child, 0) + 1
    del seen
    outputs.clear()
    pending: dict[Any, list[Any]] = {}
    for root, slot, grad in zip(roots, slots, grads, strict=True):
        at_root = pending.setdefault(root, [None] * len(graph[root][1]))
        at_root[slot] = grad if at_root[slot] is None else at_root[slot] + grad
    del root, at_root, grad  # no name may hold a node or a gradient: each is freed once its node ran
    grads.clear()
    # An output computed from another (a block's hidden states and their norm) runs once every consumer has.
    ready = [(-graph[root][2], id(root), root) for root in dict.fromkeys(roots) if not consumers.get(root)]
    heapq.heapify(ready)
    del roots
    leaf_grads = []
    while ready:
        _, _, node = heapq.heappop(ready)
        consumers.pop(node, None)
        edges, _, _ = graph.pop(node)
        inputs: list[Any] | None = pending.pop(node)
        assert inputs is not None
        if type(node).__name__ == "AccumulateGrad":
            if not isinstance(node.variable, nn.Parameter) and inputs[0] is not None:
                leaf_grads.append(inputs[0])
            inputs = None
            continue
        outs = _call(node, inputs, len(edges), saved.pop(node, None))
        inputs = None
        for (child, slot), g in zip(edges, outs if isinstance(outs, tuple) else (outs,), strict=True):
            if child is None:
                continue
            metadata = graph[child][1]
            into: list[Any] | None = pending.setdefault(child, [None] * len(metadata))
            assert into is not None
            if g is not None:
                g = _as_expected(g, metadata[slot])
                into[slot] = g if into[slot] is None else into[slot] + g
            consumers[child] -= 1
            if consumers[child] == 0:
                heapq.heappush(ready, (-graph[child][2], id(child), child))
        outs = g = child = None
        into, edges = None, ()
    return leaf_grads


def block_saved_and_backward_bytes(
    block: nn.Module,
    rope: torch.Tensor | None,
    positions: torch.Tensor | None,
    shape: tuple[int, int, int],
    dtype: torch.dtype,
    device: str,
    mask: torch.Tensor | None = None,
) -> tuple[int, int]:
    """What `block` (no activation checkpointing) keeps for backward, as `block_saved_bytes(..., ac="none")`, and
    the bytes its backward holds at its peak beyond that: the incoming gradient and the gradients of its
    activations, net of the saved tensors freed by then; for one call on a `shape` input, arguments as
    `block_saved_bytes` takes them. Both from one forward (the planner measures each kind of block at every
    layout it considers)."""
    kwargs = _block_kwargs(rope, positions, mask)
    saved = SavedStorages([*block.parameters(), *block.buffers(), *(t for t in (rope, mask) if t is not None)])
    live = LiveBytes([*block.parameters(), *block.buffers(), *kwargs.values()])
    with live:
        hidden = torch.empty(shape, dtype=dtype, device=device, requires_grad=True)
        live.add(hidden)  # the block's input (the previous block's output), kept by its first norm
        with torch.autograd.graph.saved_tensors_hooks(saved.pack, lambda t: t):
            out = block(hidden, **kwargs)
        outputs = list(out) if isinstance(out, tuple) else [out]  # a multi-token-prediction block returns two
        del hidden, out
        for i in range(len(outputs)):  # no loop variable may hold an output: the walk frees them
            live.drop(outputs[i])  # the next block's input (or the head's): its saved bytes count there
        kept = live.now()
        incoming = [torch.empty_like(output) for output in outputs]
        live.watch()
        walk_backward(outputs, incoming)
    return saved.total, live.peak - kept
