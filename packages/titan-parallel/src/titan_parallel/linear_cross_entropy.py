"""The output projection and the cross-entropy as one op, in row chunks: the full logits never exist.

A 128k vocabulary at 4 x 2048 tokens makes 2.1 GB of bf16 logits, 4.2 GB more once the
plain loss casts them to fp32, and the same again for their gradient. Here the rows
(tokens) are taken `chunk_rows` at a time: each chunk's logits are computed, reduced to
its loss, turned straight into their gradient, and multiplied into the gradients of the
hidden states and of the weight, all inside the forward (as Liger's fused linear
cross-entropy does). The backward only scales those by the incoming gradient. The
FLOPs are the plain path's (three matmuls); no logits are kept for backward, and at
most one chunk of them exists at a time.

Under tensor parallel the weight is vocab-sharded (`Shard(0)`): each rank computes
its shard of every chunk's logits, and the log-sum-exp and the target logit are
all-reduced over the TP group (Megatron's vocab-parallel cross-entropy). The hidden
states' gradient leaves each rank as a partial sum (`Partial()`), which the input's
redistribution reduce-scatters back to sequence shards.

Torch has no such op (`F.cross_entropy` takes logits), hence this module. The
per-chunk arithmetic (`_chunk_lse`, `_chunk_grad`) can be compiled: Inductor then reads
each bf16 chunk of logits twice and never writes it in fp32. On an H100 (torch 2.11,
8192 tokens, dim 2048, vocab 128256, bf16, forward + backward of the loss alone,
`benchmarks/fused_loss_bench.py`): compiled, 21.1 ms and 1.96 GiB against the compiled
plain loss's 20.8 ms and 1.96 GiB; eager, 5.0 GiB against the plain loss's 11.2 GiB (and
54.9 ms against 34.2 ms with the earlier, out-of-place per-chunk code, since rewritten in place).

    loss = linear_cross_entropy(h, output.weight, labels)   # == F.cross_entropy(output(h).float(), labels)

With `z_loss=w` the loss adds PaLM's z-loss, `w * logsumexp(logits)**2` per labelled token, whose
gradient `2 w lse softmax` joins the cross-entropy's in the same pass over each chunk.

With `float8=Float8Loss(...)` the three GEMMs run in float8 (`titan_parallel.float8_matmul`:
torchao's tensorwise recipe through `torch._scaled_mm`), the hidden states and the weight cast
once per call, each chunk's logit gradient as it comes.

`fuse_output_loss` makes a model's output projection compute this loss when called
with labels (`head(h, labels=labels)`), for the trainer.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from functools import partial

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor, Partial

from titan_parallel.float8_matmul import (
    E5M2,
    ChunkedFloat8Matmuls,
    Float8Loss,
    amax_to_scale,
    scale_and_saturate,
)
from titan_parallel.modules import get_submodule_or_none
from titan_parallel.plan import ModelPlan, TPStyle

__all__ = [
    "linear_cross_entropy",
    "fuse_output_loss",
    "hidden_states_out",
    "LinearCrossEntropyHead",
    "default_chunk_rows",
    "output_projection_path",
]

IGNORE_INDEX = -100  # F.cross_entropy's default


def default_chunk_rows(vocab_size: int, budget_bytes: int = 1 << 30) -> int:
    """Rows per chunk so that one chunk of fp32 logits takes at most `budget_bytes` (1 GiB): 2,093 rows
    for a 128,256-token vocabulary, i.e. 4 chunks at 8,192 tokens.

    Args:
        vocab_size: the full vocabulary (all tensor-parallel shards together).
        budget_bytes: the most bytes one chunk of fp32 logits may take.
    """
    return max(1, budget_bytes // (4 * vocab_size))


def _chunk_lse(logits: torch.Tensor) -> torch.Tensor:
    """Row log-sum-exp in fp32; logits `(rows, vocab)`."""
    return torch.logsumexp(logits.float(), dim=-1)


def _chunk_max_sumexp(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Row max and `sum(exp(logits - max))` in fp32, for combining vocab shards; logits `(rows, vocab)`."""
    x = logits.float()
    peak = x.amax(dim=-1)
    return peak, (x - peak.unsqueeze(-1)).exp().sum(dim=-1)


def _chunk_grad(
    logits: torch.Tensor, lse: torch.Tensor, target: torch.Tensor, scale: torch.Tensor, z_loss: float = 0.0
) -> torch.Tensor:
    """`(softmax(logits) * (1 + 2 z_loss lse) - onehot(target)) * scale` per row, in the logits' dtype (the
    z-loss `z_loss * lse**2` has gradient `2 z_loss lse softmax`).

    `target` holds local vocab indices, -1 where the row's label is not on this rank (or ignored);
    `scale` is 1 / (valid tokens) for valid rows, 0 for ignored ones. Written in place on one fp32
    copy (eager: five passes over the chunk, six with the z-loss; compiled, Inductor fuses them into one).
    """
    probs = logits.to(torch.float32, copy=True).sub_(lse.unsqueeze(-1)).exp_()  # (rows, vocab)
    if z_loss:
        probs.mul_((1 + 2 * z_loss * lse).unsqueeze(-1))
    rows = torch.arange(probs.shape[0], device=probs.device)
    probs.index_put_((rows, target.clamp(min=0)), -(target >= 0).to(probs.dtype), accumulate=True)
    return probs.mul_(scale.unsqueeze(-1)).to(logits.dtype)


def _chunk_grad_float8(
    logits: torch.Tensor, lse: torch.Tensor, target: torch.Tensor, scale: torch.Tensor, z_loss: float = 0.0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`_chunk_grad` cast to e5m2 with its own scale, in both layouts: (g8, g8.T contiguous, scale). Compiled,
    Inductor reads the logits for the amax and again for the cast, and never writes the bf16 gradient."""
    g = _chunk_grad(logits, lse, target, scale, z_loss)
    g_scale = amax_to_scale(g.abs().amax().float(), E5M2)
    g8 = scale_and_saturate(g, g_scale, E5M2)
    return g8, g8.t().contiguous(), g_scale


_compiled: dict[str, dict[str, Callable]] = {}  # by backend, by kernel


def _kernels(compiled: bool, backend: str = "inductor") -> tuple[Callable, Callable, Callable, Callable | None]:
    """(lse, max and sum of exps, gradient, gradient in e5m2) per chunk, compiled with `backend`; eager, the last
    is None (the fused cast would hold |g| and fp32 copies of the whole chunk: `ChunkedFloat8Matmuls.cast_gradient`
    casts in blocks)."""
    if not compiled:
        return _chunk_lse, _chunk_max_sumexp, _chunk_grad, None
    if backend not in _compiled:
        _compiled[backend] = {
            name: torch.compile(fn, backend=backend)
            for name, fn in (("lse", _chunk_lse), ("max_sumexp", _chunk_max_sumexp), ("grad", _chunk_grad),
                             ("grad_float8", _chunk_grad_float8))
        }  # fmt: skip
    kernels = _compiled[backend]
    return kernels["lse"], kernels["max_sumexp"], kernels["grad"], kernels["grad_float8"]


def _loss_and_grads(
    h: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    chunk_rows: int,
    group: dist.ProcessGroup | None,
    vocab_start: int,
    ignore_index: int,
    want_grads: bool,
    compiled: bool,
    backend: str = "inductor",
    float8: Float8Loss | None = None,
    z_loss: float = 0.0,
    z_loss_out: list[torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """(mean loss, d loss / d h, d loss / d weight); h `(rows, dim)`, weight `(vocab_local, dim)`, labels `(rows,)`;
    the mean z-loss term appended to `z_loss_out` where given."""
    lse_of, max_sumexp, grad_of, grad_float8_of = _kernels(compiled, backend)
    z_args = (z_loss,) if z_loss else ()  # the kernels' z-loss argument, left out (their default) when off
    vocab_local = weight.shape[0]
    valid = labels != ignore_index
    count = valid.sum()  # on the device: no host sync
    scale = valid.float() / count  # (rows,): 1 / valid tokens, 0 where ignored
    local = labels - vocab_start
    on_rank = valid & (local >= 0) & (local < vocab_local)
    target = torch.where(on_rank, local, -1)  # (rows,) local index, or -1
    grad_h = torch.empty_like(h) if want_grads else None
    grad_w = torch.zeros_like(weight) if want_grads else None
    total = torch.zeros((), dtype=torch.float32, device=h.device)
    z_total = torch.zeros((), dtype=torch.float32, device=h.device) if z_loss else None
    f8_compiled = compiled and backend == "inductor"  # its casts are Inductor kernels; eager under another backend
    f8 = ChunkedFloat8Matmuls(h, weight, float8, group, want_grads, f8_compiled) if float8 is not None else None
    for start in range(0, h.shape[0], chunk_rows):
        rows = slice(start, start + chunk_rows)
        h_c = h[rows]
        logits = h_c @ weight.t() if f8 is None else f8.logits(rows)  # (chunk, vocab_local)
        target_logit = logits.gather(1, target[rows].clamp(min=0).unsqueeze(-1)).squeeze(-1).float()
        target_logit = torch.where(on_rank[rows], target_logit, 0.0)
        if group is None:
            lse = lse_of(logits)  # (chunk,)
        else:  # vocab-parallel: combine the shards' max, sum of exps and target logit
            peak, sumexp = max_sumexp(logits)
            global_peak = peak.clone()
            dist.all_reduce(global_peak, op=dist.ReduceOp.MAX, group=group)
            sumexp = sumexp * (peak - global_peak).exp()
            dist.all_reduce(sumexp, group=group)
            dist.all_reduce(target_logit, group=group)
            lse = global_peak + sumexp.log()
        token_loss = lse - target_logit
        if z_total is not None:
            z_term = z_loss * lse.square()
            z_total = z_total + (z_term * valid[rows]).sum()
            token_loss = token_loss + z_term
        total = total + (token_loss * valid[rows]).sum()
        if want_grads:
            assert grad_h is not None and grad_w is not None
            if f8 is not None:  # the gradient in e5m2; one process, compiled, casts it in the same kernel
                if group is None and grad_float8_of is not None:
                    g8, g8_t, g_scale = grad_float8_of(logits, lse, target[rows], scale[rows], *z_args)
                else:
                    g8, g8_t, g_scale = f8.cast_gradient(grad_of(logits, lse, target[rows], scale[rows], *z_args))
                del logits
                f8.backward(g8, g8_t, g_scale, rows, grad_h, grad_w)
                continue
            g = grad_of(logits, lse, target[rows], scale[rows], *z_args)  # (chunk, vocab_local), logits' dtype
            del logits
            torch.mm(g, weight, out=grad_h[rows])
            grad_w.addmm_(g.t(), h_c)
    if z_total is not None and z_loss_out is not None:
        z_loss_out.append(z_total / count)
    return total / count, grad_h, grad_w


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, weight, labels, loss_and_grads):
        loss, grad_h, grad_w = loss_and_grads(h, weight, labels, want_grads=True)
        ctx.save_for_backward(grad_h, grad_w)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        grad_h, grad_w = ctx.saved_tensors
        return grad_h * grad_loss.to(grad_h.dtype), grad_w * grad_loss.to(grad_w.dtype), None, None


def linear_cross_entropy(
    h: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    chunk_rows: int | None = None,
    ignore_index: int = IGNORE_INDEX,
    compiled: bool = False,
    backend: str = "inductor",
    float8: Float8Loss | None = None,
    z_loss: float = 0.0,
    z_loss_out: list[torch.Tensor] | None = None,
) -> torch.Tensor:
    """Mean token cross-entropy of `h @ weight.T` against `labels`, in row chunks (see the module docstring).

    Equal to `F.cross_entropy((h @ weight.T).float().flatten(0, -2), labels.flatten(), ignore_index=...)`,
    gradients included, plus `z_loss` times the mean over labelled tokens of `logsumexp(logits)**2` where
    `z_loss` > 0. Under `torch.autocast` the matmuls run in the autocast dtype, as `nn.Linear` would.

    Args:
        h: `(..., dim)` hidden states; a `Replicate()` DTensor under tensor parallel.
        weight: `(vocab, dim)`; a `Shard(0)` DTensor (vocab-sharded) under tensor parallel.
        labels: `(...)` token ids, `ignore_index` where no loss is taken.
        chunk_rows: tokens per chunk; None: `default_chunk_rows(vocab)`.
        ignore_index: label value that contributes nothing.
        compiled: compile the per-chunk arithmetic (`torch.compile`).
        backend: the `torch.compile` backend where `compiled` (another than Inductor, e.g. "aot_eager", to
            bisect a compile problem).
        float8: run the three GEMMs in float8 (`titan_parallel.float8_matmul`: torchao's tensorwise
            recipe, what a `Float8Linear` output projection computes); None: in `h`'s dtype.
        z_loss: weight of the z-loss (PaLM's auxiliary loss, which keeps the softmax normaliser near 1);
            0: none.
        z_loss_out: where given (and `z_loss` > 0), a list the call appends its z-loss term to (0-dim fp32,
            no gradient, still on the device), for logging.

    Returns:
        The 0-dim fp32 loss (a plain tensor, the same on every TP rank).
    """
    group, vocab_start = None, 0
    if isinstance(weight, DTensor):
        mesh = weight.device_mesh
        if mesh.ndim != 1 or mesh.size() == 1:
            weight = weight.full_tensor()
            h = h.full_tensor() if isinstance(h, DTensor) else h
        else:
            group, rank = mesh.get_group(), mesh.get_local_rank()
            vocab = weight.shape[0]
            if vocab % mesh.size():
                raise ValueError(f"vocab size {vocab} is not divisible by the tensor-parallel degree {mesh.size()}")
            vocab_start = rank * (vocab // mesh.size())
            # Each rank's hidden-state gradient covers its vocab shard only: a partial sum over the group.
            h = h.to_local(grad_placements=(Partial(),)) if isinstance(h, DTensor) else h
            weight = weight.to_local()
    device_type = h.device.type
    if torch.is_autocast_enabled(device_type):
        dtype = torch.get_autocast_dtype(device_type)
        h, weight = h.to(dtype), weight.to(dtype)
    rows = h.reshape(-1, h.shape[-1])  # (tokens, dim)
    flat_labels = labels.reshape(-1)
    chunk = chunk_rows or default_chunk_rows(weight.shape[0] * (1 if group is None else dist.get_world_size(group)))
    if float8 is not None and chunk_rows is None and chunk > 16:
        chunk -= chunk % 16  # whole float8 tiles in the weight gradient's inner dimension (no padding)
    run = partial(
        _loss_and_grads,
        chunk_rows=chunk,
        group=group,
        vocab_start=vocab_start,
        ignore_index=ignore_index,
        compiled=compiled,
        backend=backend,
        float8=float8,
        z_loss=z_loss,
        z_loss_out=z_loss_out,
    )
    with torch.autocast(device_type, enabled=False):
        if torch.is_grad_enabled() and (rows.requires_grad or weight.requires_grad):
            return _LinearCrossEntropy.apply(rows, weight, flat_labels, run)
        return run(rows, weight, flat_labels, want_grads=False)[0]


class LinearCrossEntropyHead:
    """Mixed into a model's output `nn.Linear` by `fuse_output_loss`: called with `labels=`, it returns
    the mean token loss (`linear_cross_entropy`); called without, the logits, as before. Its `z_loss` is
    added while autograd records (training) and left out of forward-only calls (evaluation), which
    report the cross-entropy alone; each training call appends its z-loss term to `z_loss_out` where set."""

    chunk_rows: int | None = None
    compiled_loss: bool = False
    loss_backend: str = "inductor"
    float8_loss: Float8Loss | None = None
    z_loss: float = 0.0
    z_loss_out: list[torch.Tensor] | None = None

    def forward(self, h: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        if labels is None:
            return super().forward(h)  # type: ignore[misc]
        weight = self.weight  # type: ignore[attr-defined]
        z_loss = self.z_loss if torch.is_grad_enabled() else 0.0
        return linear_cross_entropy(
            h, weight, labels, chunk_rows=self.chunk_rows, compiled=self.compiled_loss, backend=self.loss_backend,
            float8=self.float8_loss, z_loss=z_loss, z_loss_out=self.z_loss_out,
        )  # fmt: skip


def fuse_output_loss(
    model: nn.Module,
    plan: ModelPlan,
    *,
    chunk_rows: int | None = None,
    compiled: bool = False,
    backend: str = "inductor",
    float8: Float8Loss | None = None,
    z_loss: float = 0.0,
) -> nn.Module | None:
    """Make `model`'s output projection compute the loss when called with labels.

    Call on the (meta) model before tensor parallel and FSDP wrap it, so their hooks see the new
    forward. The model must have a `skip_output` attribute (every Titan family does), which
    `hidden_states_out` sets: inside it the forward stops before the output projection; outside,
    the model returns logits as before. Train with
    `with hidden_states_out([model]): loss = head(model(tokens), labels=labels)`.

    Args:
        model: the model (or the pipeline stage holding the output projection).
        plan: names the output projection (`TPStyle.OUTPUT` in `plan.tp`).
        chunk_rows: tokens per chunk (None: `default_chunk_rows`).
        compiled: compile the per-chunk arithmetic.
        backend: the `torch.compile` backend where `compiled`.
        float8: the loss's GEMMs in float8 (`linear_cross_entropy`'s `float8`); leave the projection
            itself out of `apply_float8` (`output_projection_path` names it).
        z_loss: the z-loss weight in training (`LinearCrossEntropyHead`); 0: none.

    Returns:
        The output projection, now a `LinearCrossEntropyHead`; None where `model` has none (a
        pipeline stage without it) or it is not a plain `nn.Linear` (e.g. a float8 linear): the
        plain loss on full logits is used there.
    """
    path = output_projection_path(plan)
    head = get_submodule_or_none(model, path) if path else None
    if head is None or type(head) is not nn.Linear or not hasattr(model, "skip_output"):
        return None
    head.__class__ = type("LinearCrossEntropyLinear", (LinearCrossEntropyHead, nn.Linear), {})
    head.chunk_rows, head.compiled_loss, head.float8_loss = chunk_rows, compiled, float8  # type: ignore[assignment]
    head.loss_backend = backend  # type: ignore[assignment]
    head.z_loss = z_loss  # type: ignore[assignment]
    return head


def output_projection_path(plan: ModelPlan) -> str | None:
    """The module path of the model's output projection (`TPStyle.OUTPUT` in `plan.tp`), or None.

    Args:
        plan: the model's plan.
    """
    return next((path for path, style in plan.tp if style is TPStyle.OUTPUT), None)


@contextlib.contextmanager
def hidden_states_out(models: Sequence[nn.Module]) -> Iterator[None]:
    """Inside the block, each of `models` (whose output projection `fuse_output_loss` fused with the loss)
    returns its final hidden states instead of logits, for the loss to apply the projection.

    Args:
        models: models (or pipeline stages) with a `skip_output` attribute.
    """
    saved = [bool(getattr(m, "skip_output")) for m in models]  # noqa: B009
    for model in models:
        setattr(model, "skip_output", True)  # noqa: B010  # an attribute of the family's model class
    try:
        yield
    finally:
        for model, value in zip(models, saved, strict=True):
            setattr(model, "skip_output", value)  # noqa: B010
