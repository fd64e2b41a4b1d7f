"""What an eager model keeps for backward: measured on fake tensors, not derived.

The analytic tier needs, per kind of block, the bytes per token autograd keeps for backward
under each activation checkpointing mode, and the same of the head and the loss. They are read
from torch here, as the compiled case is (`titan_core.memory.compiled_saved`), with the
machinery of `titan_core.memory.fake_run`:

1. Each kind of block of the meta model (blocks told apart by their parameters' names and
   shapes, `compiled_saved.block_signature`: DeepSeek-V3's dense and MoE blocks are two kinds)
   is copied into a one-block model, split by the trainer's own `apply_tp` and `apply_cp` over a
   fake process group where the layout has tensor / context parallel, given fake storage in the
   compute dtype (what FSDP's mixed precision gathers) on the target's device type, and wrapped
   as `titan_parallel.apply_ac` wraps the trainer's blocks.
2. It is called on a fake input of the rank's shape, `(batch, seq / cp, dim)` (`seq / cp / tp`
   under sequence parallel), with the RoPE table and, under CP, the rank's positions, as the
   model calls it. What it keeps for backward (`fake_run.block_saved_bytes`) is counted once
   per storage, its parameters and buffers left out (the model states count them).
3. It is called on batches of 1 and 2 sequences and fitted as `per_token x tokens + per_call`
   (`EagerSaved.act` and `per_call`): what a block keeps once per call whatever its sequences
   (RoPE's table slices; CP ring's attention mask, `seq / cp x seq` elements per block) is the
   per-call part, which the analytic tier spreads over the job's micro-batch
   (`EagerSaved.for_tokens`); what grows with the sequence length (CPU SDPA's math path keeps the
   attention matrix) is counted at the job's sequence length. Under a block-causal mask
   (`ActivationLayout.block_causal`, off CUDA) each block is called with the model's dense mask of
   the whole sequences, as the model passes it: what the attention keeps of it per block (CPU SDPA
   keeps a float copy, `seq_len` elements per token) is counted; the boolean mask itself, built
   once per forward and shared by every block, is not (`seq_len` bytes per token, once).

The final norm and output projection (`head`) and the plain loss (`logits_saved`, under
`loss_parallel()` on vocab-sharded logits where the layout has it) are measured the same way. The
fused chunked loss (`titan_parallel.linear_cross_entropy`) keeps the gradients of its input and
of the output weight (the rank's vocab shard): measured at two token counts and fitted as
`per_token x tokens + fixed`. Expert parallel does not change the bytes per token at even load
(the MoE is measured whole).

The transients are measured too, with `fake_run.walk_backward` (the backward node by node, each
node's saved tensors freed once it ran, as autograd's engine does): a block's backward at its peak
beyond what it kept (`block_backward`: the gradients of its activations net of the saved tensors
freed by then), and the plain loss's peak from the logits on through its backward beyond what it
kept (`logits`), with the logits' gradient it ends with (`logits_grad`). Nothing is derived by
hand: a model family writes no memory code.

A layout with TP / CP needs a fake process group, which cannot start where this process already
has one: `measure_eager` raises `NoFakeGroup` there (estimate before `init_process_group`, or in a
process of its own).

Results are cached per (family, args, layout) for the process: per layout 0.2-2 s for the debug
models, 1-4 s for Llama 3 8B / 70B, Qwen3 235B and DeepSeek-V3 671B at seq 8192 (busy 2-core Xeon).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import torch
import torch.nn as nn

from titan_core.memory.fake_run import (
    LiveBytes,
    SavedStorages,
    block_saved_and_backward_bytes,
    block_saved_bytes,
    fake_mesh,
    fake_target,
    on_fake,
    walk_backward,
)

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from titan_core.memory.activations import ActivationBytes, ActivationLayout
    from titan_models import ModelSpec

AC_KINDS = ("none", "op", "full")


@dataclass(frozen=True)
class FusedLossBytes:
    """What the fused chunked loss keeps for backward: `per_token x tokens + fixed` bytes.

    Args:
        per_token: bytes per token (the hidden states' gradient).
        fixed: bytes per call (the output weight's gradient).
    """

    per_token: int
    fixed: int


@dataclass(frozen=True)
class EagerSaved:
    """Measured saved-for-backward bytes of one model at one layout.

    Args:
        act: the measured `ActivationBytes`, bytes per token (`per_block` where block kinds differ).
        fused_loss: what the fused loss keeps.
        per_call: the same fields, in bytes per call rather than per token: what a block, the
            head or the loss keeps once per micro-batch whatever its sequences (per-position tensors: RoPE's
            table slices, CP ring's attention mask).
    """

    act: ActivationBytes
    fused_loss: FusedLossBytes
    per_call: ActivationBytes | None = None

    def for_tokens(self, tokens: int) -> ActivationBytes:
        """`act` with the per-call bytes spread over a micro-batch of `tokens` rank-local tokens."""
        if self.per_call is None:
            return self.act
        return _plus(self.act, self.per_call, tokens)


_FIELDS = ("block", "block_op", "block_input", "block_backward", "head", "logits", "logits_saved", "logits_grad")


def _plus(act: ActivationBytes, per_call: ActivationBytes, tokens: int) -> ActivationBytes:
    # A backward's peak beyond what was kept can fall per token (a Mixture-of-Experts block's expert weight
    # gradients, per call, dominate a short sequence while what is kept grows): never below nothing.
    more = {f: max(0, getattr(act, f) + round(getattr(per_call, f) / tokens)) for f in _FIELDS}
    blocks = tuple(_plus(a, c, tokens) for a, c in zip(act.per_block, per_call.per_block, strict=True))
    return replace(act, **more, per_block=blocks)


_CACHE: dict[tuple[Any, ...], EagerSaved] = {}
_PARTS: dict[tuple[Any, ...], dict[str, Fit]] = {}
"""A block kind's figures, or the head's and loss's (`None` for the kind), by (family, args, kind, layout), the
layout without `ep_spans_tp` where it changes nothing (no MoE in the part): the planner's layouts with and
without etp=1 share them."""


def measure_eager(
    spec: ModelSpec[Any], args: Any, layout: ActivationLayout, meta: nn.Module | None = None
) -> EagerSaved:
    """The saved-for-backward bytes of `spec`'s model of `args` run as `layout` says, and its backward's
    transients (cached; see the module docstring).

    Args:
        spec: the model family.
        args: its shape.
        layout: compute dtype, device type, TP / CP degrees and methods, sequence length, loss parallel.
        meta: the model built on the meta device, if the caller has it (else built here).

    Raises:
        NoFakeGroup: the layout has TP / CP and this process already has a process group.
    """
    key = (spec.name, repr(args), layout)
    if key not in _CACHE:
        _CACHE[key] = _measure(spec, args, layout, meta)
    return _CACHE[key]


def measure_eager_many(spec: ModelSpec[Any], args: Any, layouts: list[ActivationLayout], workers: int) -> None:
    """Measure the `layouts` not measured yet in up to `workers` processes of their own, into the cache
    `measure_eager` reads (`titan plan` on a machine with many cores: each layout is seconds of single-threaded
    Python). Layouts that differ only in `ep_spans_tp` go to one process, which measures their shared parts once.
    With fewer than two processes' worth of work nothing runs here: `measure_eager` measures each when asked.

    The processes are spawned, not forked (this process may have torch's thread pools running): each imports torch
    and Titan first, a few seconds, which the spread pays back from a handful of layouts on.

    Args:
        spec: the model family.
        args: its shape (picklable, as `get_model_args` returns it).
        layouts: the layouts to measure.
        workers: the most processes to start.
    """
    groups: dict[ActivationLayout, list[ActivationLayout]] = {}
    for layout in dict.fromkeys(layouts):
        if (spec.name, repr(args), layout) not in _CACHE:
            groups.setdefault(replace(layout, ep_spans_tp=False), []).append(layout)
    workers = min(workers, len(groups))
    if workers < 2:
        return
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    tasks = [(spec.name, args, group) for group in groups.values()]
    with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool:
        for (_, _, group), measured in zip(tasks, pool.map(_measure_group, tasks), strict=True):
            for layout, result in zip(group, measured, strict=True):
                _CACHE[spec.name, repr(args), layout] = result


def _measure_group(task: tuple[str, Any, list[ActivationLayout]]) -> list[EagerSaved]:
    """`measure_eager_many`'s work in one process: a group of layouts of the family named, measured in order."""
    from titan_models import get_model_spec

    name, args, layouts = task
    spec = get_model_spec(name)
    return [measure_eager(spec, args, layout) for layout in layouts]


def _dtype(layout: ActivationLayout) -> torch.dtype:
    return {2: torch.bfloat16, 4: torch.float32}[layout.compute_bytes]


Fit = tuple[int, int]
"""(bytes per token, bytes per call): a two-point fit over batches of 1 and 2 sequences."""


def _fit(one: int, two: int, seq: int) -> Fit:
    """The line through (seq, one) and (2 seq, two)."""
    per_token = round((two - one) / seq)
    return per_token, one - per_token * seq


def _measure(spec: ModelSpec[Any], args: Any, layout: ActivationLayout, meta: nn.Module | None) -> EagerSaved:
    from titan_core.memory.compiled_saved import block_signature
    from titan_parallel.modules import get_submodule_or_none

    dtype, device = _dtype(layout), layout.device_type
    fused = _fused_loss(dtype, device, args.dim, args.vocab_size, layout)
    if meta is None:
        from titan_core.job.meta_model import build_meta_model

        meta = build_meta_model(spec, args)
    seq = layout.seq_len // layout.cp  # the rank's tokens of each sequence
    blocks = list(meta.get_submodule(spec.plan.blocks).children())
    moe = getattr(args, "moe", None)
    kinds: dict[Any, dict[str, Fit]] = {}
    signatures = [block_signature(b) for b in blocks]
    model_key = (spec.name, repr(args))
    plain = replace(layout, ep_spans_tp=False)  # the layout of a part without a MoE
    with fake_mesh(layout.tp, layout.cp, device) as mesh:
        for block, sig in zip(blocks, signatures, strict=True):
            has_moe = spec.plan.moe is not None and get_submodule_or_none(block, spec.plan.moe) is not None
            key = (*model_key, sig, layout if has_moe else plain)
            if key in _PARTS:
                kinds[sig] = _PARTS[key]
            if sig in kinds:
                continue
            figures = {}
            for kind in AC_KINDS:

                def at(batch: int, kind: str = kind, block: nn.Module = block) -> tuple[int, ...]:
                    holder = parallel_copy(spec, {spec.plan.blocks: nn.ModuleDict({"0": block})}, mesh, layout)
                    routed = batch * seq // (layout.tp if layout.ep_spans_tp else 1)  # tokens a MoE layer routes
                    counts = even_counts(moe.num_experts, routed * moe.top_k) if moe else (lambda: 0)
                    with fake_target(device, counts):
                        on_fake(holder, dtype, device)
                        rope, positions = rope_table(meta, device), rank_positions(mesh, seq, device)
                        mask = _document_mask(layout, batch, device)
                        width = getattr(block, "input_width", args.dim)  # a multi-token-prediction block: 2 x dim
                        shape = (batch, seq // layout.tp, width)  # sequence parallel splits the block's input
                        unit = holder.get_submodule(f"{spec.plan.blocks}.0")
                        if kind == "none":  # and the backward's transients, from the same forward
                            return block_saved_and_backward_bytes(unit, rope, positions, shape, dtype, device, mask)
                        return (
                            block_saved_bytes(
                                unit, spec.plan.blocks, rope, positions, shape, dtype, device, kind, mask
                            ),
                        )

                one, two = at(1), at(2)
                figures[kind] = _fit(one[0], two[0], seq)
                if kind == "none":
                    figures["backward"] = _fit(one[1], two[1], seq)
            kinds[sig] = _PARTS[key] = figures
        head_key = (*model_key, None, plain)
        if head_key not in _PARTS:
            _PARTS[head_key] = _head_and_loss(meta, spec, mesh, layout, args.dim, seq)
        rest = _PARTS[head_key]
    per_kind = [kinds[s] for s in signatures]
    # per block where the kinds differ per token or per call (a multi-token-prediction block may differ in one only)
    split = any(len({tuple(f[i] for f in k.values()) for k in per_kind}) > 1 for i in (0, 1))
    return EagerSaved(_assemble(per_kind, rest, 0, split), fused, per_call=_assemble(per_kind, rest, 1, split))


def _assemble(kinds: list[dict[str, Fit]], rest: dict[str, Fit], i: int, split: bool) -> ActivationBytes:
    """The measured figures, `i` = 0 per token, 1 per call; with `split` (the blocks' kinds differ) `per_block`,
    each block field then the smallest over the kinds (a lower bound)."""
    from titan_core.memory.activations import ActivationBytes

    common: dict[str, Any] = {name: fit[i] for name, fit in rest.items()}
    measured = [
        ActivationBytes(
            block=k["none"][i],
            block_op=k["op"][i],
            block_input=k["full"][i],
            block_backward=k["backward"][i],
            **common,
        )
        for k in kinds
    ]
    block_fields = ("block", "block_op", "block_input", "block_backward")
    if not split:
        return measured[0]
    smallest = {f: min(getattr(a, f) for a in measured) for f in block_fields}
    return ActivationBytes(**smallest, **common, per_block=tuple(measured))


def parallel_copy(
    spec: ModelSpec[Any], children: dict[str, nn.Module], mesh: DeviceMesh | None, layout: ActivationLayout
) -> nn.Module:
    """A model holding copies of `children` (on meta), split as the trainer splits it over `mesh`."""
    holder = nn.Module()
    for name, child in children.items():
        holder.add_module(name, copy.deepcopy(child))
    if mesh is None:
        return holder
    from titan_parallel.context_parallel import apply_cp
    from titan_parallel.tensor_parallel import apply_tp

    if layout.tp > 1 and layout.ep_spans_tp:
        _stand_in_for_ep(holder, spec, mesh["tp"])
    if layout.tp > 1:
        apply_tp(holder, spec.plan, mesh["tp"], loss_parallel=layout.loss_parallel, ep_spans_tp=layout.ep_spans_tp)
    if layout.cp > 1 and spec.plan.blocks in children:
        method, rotate = layout.cp_method, layout.cp_rotate_method
        apply_cp(holder, spec.plan, mesh["cp"], cp_rotate_method=rotate, cp_method=method)  # type: ignore[arg-type]
    return holder


def _stand_in_for_ep(holder: nn.Module, spec: ModelSpec[Any], tp_mesh: DeviceMesh) -> None:
    """Mark the MoE layers' experts as split (whole `Replicate()` DTensors on `tp_mesh`), as `MoETokenParallel`
    requires, without expert parallel's exchange: each rank then runs its own tokens' slots through whole experts,
    which at even load is what arrives from the exchange (the same stand-in as for expert parallel without TP,
    whose all-to-all this measurement leaves out too)."""
    from torch.distributed.tensor import DTensor, Replicate

    from titan_parallel.expert_parallel import EXPERT_WEIGHTS, moe_modules

    for moe in moe_modules(holder, spec.plan):
        experts = moe.get_submodule("experts")
        for name in EXPERT_WEIGHTS:
            weight = getattr(experts, name)
            whole = DTensor.from_local(weight.detach(), tp_mesh, (Replicate(),), run_check=False)
            experts.register_parameter(name, nn.Parameter(whole, requires_grad=weight.requires_grad))


def rope_table(meta: nn.Module, device: str) -> torch.Tensor | None:
    """The model's RoPE table as the blocks get it: in its own dtype (FSDP's blocks cast no input,
    `titan_parallel.fsdp`; the compute copies and autocast leave buffers alone)."""
    table = getattr(meta, "rope_cache", None)
    if not isinstance(table, torch.Tensor):
        return None
    return torch.empty(table.shape, dtype=table.dtype, device=device)


def _document_mask(layout: ActivationLayout, batch: int, device: str) -> torch.Tensor | None:
    """The dense block-causal mask the model builds once per forward off CUDA, for `batch` whole sequences (under
    CP too: the ring reads it at its blocks' positions, Ulysses' core attends over whole sequences); None where
    the model builds none (causal attention) or FlexAttention's `BlockMask` (CUDA)."""
    from titan_models.document_mask import block_causal_mask, uses_flex

    if not layout.block_causal or uses_flex(torch.device(device)):
        return None
    ids = torch.zeros(batch, layout.seq_len, dtype=torch.long, device=device)  # one document: the bytes are the same
    mask = block_causal_mask(ids, flex=False)
    assert isinstance(mask, torch.Tensor)
    return mask


def rank_positions(mesh: DeviceMesh | None, seq: int, device: str) -> torch.Tensor | None:
    """Rank 0's RoPE positions under context parallel (what `apply_cp`'s pre-hook passes the blocks)."""
    if mesh is None or mesh["cp"].size() == 1:
        return None
    from titan_parallel.ring_attention import cp_positions

    return cp_positions(seq, 0, mesh["cp"].size(), device=device)


def even_counts(experts: int, slots: int) -> Callable[[], int]:
    """Successive experts' token counts at even load, over and over: `slots` token slots shared by `experts`."""
    state = {"i": 0}

    def next_count() -> int:
        e = state["i"] % experts
        state["i"] += 1
        return slots // experts + (1 if e < slots % experts else 0)

    return next_count


def _head_and_loss(
    meta: nn.Module, spec: ModelSpec[Any], mesh: DeviceMesh | None, layout: ActivationLayout, dim: int, seq: int
) -> dict[str, Fit]:
    """What the final norm and output projection keep (`head`), and the plain loss (`cross_entropy_loss`): what
    it keeps (`logits_saved`), its peak beyond that from the logits on through its backward (`logits`), and the
    gradient of the logits it ends with (`logits_grad`)."""
    from titan_core.step_loss import cross_entropy_loss

    names = [n for n in spec.plan.pp_last if n != spec.plan.blocks]  # e.g. the final norm, the output projection
    dtype, device = _dtype(layout), layout.device_type

    def at(batch: int) -> dict[str, int]:
        holder = parallel_copy(spec, {n: meta.get_submodule(n) for n in names}, mesh, layout)
        with fake_target(device):
            on_fake(holder, dtype, device)
            h = torch.empty((batch, seq // layout.tp, dim), dtype=dtype, device=device, requires_grad=True)
            labels = torch.zeros((batch, seq), dtype=torch.long, device=device)
            head = SavedStorages([*holder.parameters(), *holder.buffers()])
            with torch.autograd.graph.saved_tensors_hooks(head.pack, lambda t: t):
                for n in names:
                    h = holder.get_submodule(n)(h)
            made = h.detach().requires_grad_()  # the projection's output; its backward is the head's
            del h
            saved, live = SavedStorages([labels]), LiveBytes([labels, made])
            with live:
                logits = made.clone()  # the logits as the projection hands them over, freed once the loss took them
                live.watch()
                with torch.autograd.graph.saved_tensors_hooks(saved.pack, lambda t: t), _loss_parallel(logits):
                    losses = [cross_entropy_loss(logits, labels)]
                del logits
                with _loss_parallel(losses[0]):
                    grads = walk_backward(losses, [torch.ones_like(losses[0])])
                handed = live.now()  # the logits' gradient, for the output projection's backward
                del grads
            return {
                "head": head.total,
                "logits_saved": saved.total,
                "logits": live.peak - saved.total,
                "logits_grad": handed,
            }

    one, two = at(1), at(2)
    return {name: _fit(one[name], two[name], seq) for name in one}


def _loss_parallel(logits: torch.Tensor) -> Any:
    """`loss_parallel()` where the logits are vocab-sharded (as the trainer's step computes the loss)."""
    import contextlib

    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import loss_parallel

    return loss_parallel() if isinstance(logits, DTensor) else contextlib.nullcontext()


def _fused_loss(dtype: torch.dtype, device: str, dim: int, vocab: int, layout: ActivationLayout) -> FusedLossBytes:
    """What `linear_cross_entropy` keeps, at the rank's vocab shard under loss parallel, fitted over tokens."""
    from titan_parallel.linear_cross_entropy import linear_cross_entropy

    local_vocab = vocab // layout.tp if layout.tp > 1 and layout.loss_parallel else vocab
    tokens = (256, 512)

    def at(rows: int) -> int:
        with fake_target(device):
            h = torch.empty((rows, dim), dtype=dtype, device=device, requires_grad=True)
            weight = torch.empty((local_vocab, dim), dtype=dtype, device=device, requires_grad=True)
            labels = torch.zeros((rows,), dtype=torch.long, device=device)
            saved = SavedStorages([h, weight, labels])
            with torch.autograd.graph.saved_tensors_hooks(saved.pack, lambda t: t):
                linear_cross_entropy(h, weight, labels, chunk_rows=rows)
            return saved.total

    small, large = at(tokens[0]), at(tokens[1])
    per_token = round((large - small) / (tokens[1] - tokens[0]))
    return FusedLossBytes(per_token, small - per_token * tokens[0])
