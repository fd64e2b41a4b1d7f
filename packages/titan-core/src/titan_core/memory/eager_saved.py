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
   attention matrix) is counted at the job's sequence length.

The final norm and output projection (`head`) and the plain loss (`logits_saved`, under
`loss_parallel()` on vocab-sharded logits where the layout has it) are measured the same way. The
fused chunked loss (`titan_parallel.linear_cross_entropy`) keeps the gradients of its input and
of the output weight (the rank's vocab shard): measured at two token counts and fitted as
`per_token x tokens + fixed`. Expert parallel does not change the bytes per token at even load
(the MoE is measured whole). Transients (a block's backward, the loss's logits) are still the
family's formulas (`ModelSpec.activation_bytes`); so is everything where this process already
has a process group (a fake one cannot start beside it) and TP / CP are on.

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
    SavedStorages,
    block_saved_bytes,
    fake_mesh,
    fake_target,
    on_fake,
)

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from titan_models import ActivationBytes, ActivationLayout, ModelSpec

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
        act: the `ActivationBytes` with the measured fields (`block`, `block_op`, `block_input`, `head`,
            `logits_saved`, and `per_block` where block kinds differ); the transients are the formulas'.
        fused_loss: what the fused loss keeps.
        measured: whether the blocks and head were measured (False: the formulas', see the module docstring).
        per_call: the same fields (transients 0), in bytes per call rather than per token: what a block, the
            head or the loss keeps once per micro-batch whatever its sequences (per-position tensors: RoPE's
            table slices, CP ring's attention mask).
    """

    act: ActivationBytes
    fused_loss: FusedLossBytes
    measured: bool = True
    per_call: ActivationBytes | None = None

    def for_tokens(self, tokens: int) -> ActivationBytes:
        """`act` with the per-call bytes spread over a micro-batch of `tokens` rank-local tokens."""
        if self.per_call is None:
            return self.act
        return _plus(self.act, self.per_call, tokens)


_SAVED_FIELDS = ("block", "block_op", "block_input", "head", "logits_saved")


def _plus(act: ActivationBytes, per_call: ActivationBytes, tokens: int) -> ActivationBytes:
    more = {f: getattr(act, f) + round(getattr(per_call, f) / tokens) for f in _SAVED_FIELDS}
    blocks = tuple(_plus(a, c, tokens) for a, c in zip(act.per_block, per_call.per_block, strict=True))
    return replace(act, **more, per_block=blocks)


_CACHE: dict[tuple[Any, ...], EagerSaved] = {}


def measure_eager(
    spec: ModelSpec[Any], args: Any, layout: ActivationLayout, meta: nn.Module | None = None
) -> EagerSaved:
    """The saved-for-backward bytes of `spec`'s model of `args` run as `layout` says (cached; see the module
    docstring).

    Args:
        spec: the model family.
        args: its shape.
        layout: compute dtype, device type, TP / CP degrees and methods, sequence length, loss parallel.
        meta: the model built on the meta device, if the caller has it (else built here).
    """
    from titan_core.memory.fake_run import NoFakeGroup

    key = (spec.name, repr(args), layout)
    if key not in _CACHE:
        try:
            _CACHE[key] = _measure(spec, args, layout, meta)
        except NoFakeGroup:
            assert spec.activation_bytes is not None, "only families with formulas reach the analytic tier"
            fused = _fused_loss(_dtype(layout), layout.device_type, args.dim, args.vocab_size, layout)
            return EagerSaved(spec.activation_bytes(args, layout), fused, measured=False)
    return _CACHE[key]


def _dtype(layout: ActivationLayout) -> torch.dtype:
    return {2: torch.bfloat16, 4: torch.float32}[layout.compute_bytes]


def _measure(spec: ModelSpec[Any], args: Any, layout: ActivationLayout, meta: nn.Module | None) -> EagerSaved:
    from titan_core.memory.compiled_saved import block_signature

    assert spec.activation_bytes is not None, "the transients still come from the formulas"
    formulas = spec.activation_bytes(args, layout)
    dtype, device = _dtype(layout), layout.device_type
    fused = _fused_loss(dtype, device, args.dim, args.vocab_size, layout)
    if meta is None:
        from titan_core.job.meta_model import build_meta_model

        meta = build_meta_model(spec, args)
    seq = layout.seq_len // layout.cp  # the rank's tokens of each sequence
    blocks = list(meta.get_submodule(spec.plan.blocks).children())
    moe = getattr(args, "moe", None)
    kinds: dict[Any, dict[str, tuple[int, int]]] = {}
    signatures = [block_signature(b) for b in blocks]
    with fake_mesh(layout.tp, layout.cp, device) as mesh:
        for block, sig in zip(blocks, signatures, strict=True):
            if sig in kinds:
                continue
            figures = {}
            for ac in AC_KINDS:

                def at(batch: int, ac: str = ac, block: nn.Module = block) -> int:
                    holder = _parallel_copy(spec, {spec.plan.blocks: nn.ModuleDict({"0": block})}, mesh, layout)
                    counts = _even_counts(moe.num_experts, batch * seq * moe.top_k) if moe else (lambda: 0)
                    with fake_target(device, counts):
                        on_fake(holder, dtype, device)
                        rope, positions = _rope(meta, dtype, device), _positions(mesh, seq, device)
                        shape = (batch, seq // layout.tp, args.dim)  # sequence parallel splits the block's input
                        unit = holder.get_submodule(f"{spec.plan.blocks}.0")
                        return block_saved_bytes(unit, spec.plan.blocks, rope, positions, shape, dtype, device, ac)

                one, two = at(1), at(2)
                figures[ac] = (round((two - one) / seq), 2 * one - two)  # (per token, per call)
            kinds[sig] = figures
        head, logits_saved = _head_and_loss(meta, spec, mesh, layout, args.dim, seq)
    slope = _assemble(formulas, [kinds[s] for s in signatures], head, logits_saved, 0)
    zero = replace(
        formulas,
        block_backward=0,
        logits=0,
        per_block=tuple(replace(b, block_backward=0, logits=0) for b in formulas.per_block),
    )
    return EagerSaved(slope, fused, per_call=_assemble(zero, [kinds[s] for s in signatures], head, logits_saved, 1))


def _assemble(
    base: ActivationBytes,
    kinds: list[dict[str, tuple[int, int]]],
    head: tuple[int, int],
    loss: tuple[int, int],
    i: int,
) -> ActivationBytes:
    """`base` (the formulas' figures, for the transients) with the measured fields, `i` = 0 per token, 1 per call;
    `per_block` where the blocks' kinds differ, each field then the smallest over the kinds (a lower bound)."""
    base_blocks = base.per_block or (base,) * len(kinds)
    measured = [
        replace(
            b,
            block=k["none"][i],
            block_op=k["op"][i],
            block_input=k["full"][i],
            head=head[i],
            logits_saved=loss[i],
            per_block=(),
        )
        for k, b in zip(kinds, base_blocks, strict=True)
    ]
    act = replace(base, head=head[i], logits_saved=loss[i])
    if len({(a.block, a.block_op, a.block_input) for a in measured}) == 1 and not base.per_block:
        first = measured[0]
        return replace(act, block=first.block, block_op=first.block_op, block_input=first.block_input)
    return replace(
        act,
        block=min(a.block for a in measured),
        block_op=min(a.block_op for a in measured),
        block_input=min(a.block_input for a in measured),
        per_block=tuple(measured),
    )


def _parallel_copy(
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

    if layout.tp > 1:
        apply_tp(holder, spec.plan, mesh["tp"], loss_parallel=layout.loss_parallel)
    if layout.cp > 1 and spec.plan.blocks in children:
        method, rotate = layout.cp_method, layout.cp_rotate_method
        apply_cp(holder, spec.plan, mesh["cp"], cp_rotate_method=rotate, cp_method=method)  # type: ignore[arg-type]
    return holder


def _rope(meta: nn.Module, dtype: torch.dtype, device: str) -> torch.Tensor | None:
    """The model's RoPE table as the blocks get it (FSDP's mixed precision casts a floating input)."""
    table = getattr(meta, "rope_cache", None)
    if not isinstance(table, torch.Tensor):
        return None
    return torch.empty(table.shape, dtype=dtype if table.is_floating_point() else table.dtype, device=device)


def _positions(mesh: DeviceMesh | None, seq: int, device: str) -> torch.Tensor | None:
    """Rank 0's RoPE positions under context parallel (what `apply_cp`'s pre-hook passes the blocks)."""
    if mesh is None or mesh["cp"].size() == 1:
        return None
    from titan_parallel.ring_attention import cp_positions

    return cp_positions(seq, 0, mesh["cp"].size(), device=device)


def _even_counts(experts: int, slots: int) -> Callable[[], int]:
    """Successive experts' token counts at even load, over and over: `slots` token slots shared by `experts`."""
    state = {"i": 0}

    def next_count() -> int:
        e = state["i"] % experts
        state["i"] += 1
        return slots // experts + (1 if e < slots % experts else 0)

    return next_count


def _head_and_loss(
    meta: nn.Module, spec: ModelSpec[Any], mesh: DeviceMesh | None, layout: ActivationLayout, dim: int, seq: int
) -> tuple[tuple[int, int], tuple[int, int]]:
    """(Bytes per token, per call) the final norm and output projection keep, and the plain loss's
    (`cross_entropy_loss`)."""
    from titan_core.step import cross_entropy_loss

    names = [n for n in spec.plan.pp_last if n != spec.plan.blocks]  # e.g. the final norm, the output projection
    dtype, device = _dtype(layout), layout.device_type

    def at(batch: int, part: str) -> int:
        holder = _parallel_copy(spec, {n: meta.get_submodule(n) for n in names}, mesh, layout)
        with fake_target(device):
            on_fake(holder, dtype, device)
            h = torch.empty((batch, seq // layout.tp, dim), dtype=dtype, device=device, requires_grad=True)
            labels = torch.zeros((batch, seq), dtype=torch.long, device=device)
            head = SavedStorages([*holder.parameters(), *holder.buffers()])
            with torch.autograd.graph.saved_tensors_hooks(head.pack, lambda t: t):
                for n in names:
                    h = holder.get_submodule(n)(h)
            loss = SavedStorages([labels])
            with torch.autograd.graph.saved_tensors_hooks(loss.pack, lambda t: t), _loss_parallel(h):
                cross_entropy_loss(h, labels)
            return head.total if part == "head" else loss.total

    fits = []
    for part in ("head", "loss"):
        one, two = at(1, part), at(2, part)
        fits.append((round((two - one) / seq), 2 * one - two))  # (per token, per call)
    return fits[0], fits[1]


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
