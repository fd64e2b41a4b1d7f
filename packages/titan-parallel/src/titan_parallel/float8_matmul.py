"""Tensorwise float8 GEMMs for the fused output projection + loss (`linear_cross_entropy(float8=...)`).

torchao's `Float8Linear` casts inside a module's forward and backward; the fused loss runs its
three GEMMs itself, chunk by chunk, inside one autograd op, so it casts its own operands. The
recipe is torchao's tensorwise one, so the numbers are what a `Float8Linear` output projection
with the plain loss computes (`tests/test_fused_loss.py` checks against it):

- the hidden states and the weight in e4m3, the logits' gradient in e5m2;
- one scale per tensor, `finfo.max / amax` computed in float64 as torchao does, values
  saturated to the format's range;
- the GEMMs are torch's own kernel, `torch._scaled_mm` (cuBLAS), with fast accumulation for the
  forward GEMM only (torchao's default);
- without float8 tensor cores (`emulate=True`) the operands are rounded the same way and
  multiplied in fp32, as torchao emulates.

Per call the hidden states and the weight are cast once, in both layouts `_scaled_mm` needs
(row-major for the left operand, column-major for the right); each chunk's logit gradient is
cast as it comes. Under tensor parallel the weight's and the gradient's amax are all-reduced
over the group, so every vocab shard uses the scale one process would: the same values, shard
for shard.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch
import torch.distributed as dist
import torch.nn.functional as F

__all__ = [
    "Float8Loss",
    "ChunkedFloat8Matmuls",
    "to_float8",
    "amax_to_scale",
    "cast_to_float8",
    "scale_and_saturate",
    "scaled_mm",
]

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
_ALIGN = 16  # float8 tensor-core GEMMs need the inner dimension in multiples of 16


@dataclass(frozen=True)
class Float8Loss:
    """The fused loss's GEMMs in float8 (torchao's tensorwise recipe).

    Args:
        emulate: round the operands to float8 and multiply in fp32 (no float8 tensor cores:
            anything but a CUDA GPU of compute capability 8.9+).
    """

    emulate: bool = False


def to_float8(
    x: torch.Tensor, dtype: torch.dtype, group: dist.ProcessGroup | None = None, *, compiled: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """`x` scaled by one fp32 scale and saturated to the float8 `dtype`; returns (data, scale), `x ~ data / scale`.

    Args:
        x: the high-precision tensor.
        dtype: torch.float8_e4m3fn or torch.float8_e5m2.
        group: all-reduce the amax over this group first (the tensor is one shard of a larger one).
        compiled: cast in one Inductor kernel (2 bytes read, 1 written per bf16 element); else eager, in
            blocks of rows so that the fp32 temporaries stay small (a 128k x 4096 weight would need 2 GiB).
    """
    amax = torch.linalg.vector_norm(x, float("inf")).to(torch.float32)  # max |x|, without an |x| temporary
    if group is not None:
        dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=group)
    scale = amax_to_scale(amax, dtype)
    return cast_to_float8(x, scale, dtype, compiled=compiled), scale


def amax_to_scale(amax: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`finfo(dtype).max / amax` in fp32, computed in float64 as torchao does (amax clamped to 1e-12).

    Args:
        amax: fp32 max |x|, any shape (one scale per element).
        dtype: the float8 dtype.
    """
    return (torch.finfo(dtype).max / amax.to(torch.float64).clamp(min=1e-12)).to(torch.float32)


def cast_to_float8(
    x: torch.Tensor,
    scale: torch.Tensor,
    dtype: torch.dtype,
    *,
    compiled: bool = False,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """`x * scale` saturated to the float8 `dtype` (see `to_float8`'s `compiled`).

    Args:
        x: the high-precision tensor.
        scale: fp32, 0-dim.
        dtype: the float8 dtype.
        compiled: one Inductor kernel; else eager, in blocks of rows.
        out: write into this `dtype` tensor of `x`'s shape (the compiled kernel stores into it directly).
    """
    if compiled:
        key = (dtype, out is not None)
        cast = _compiled_casts.get(key)
        if cast is None:
            fn = _cast_into if out is not None else scale_and_saturate
            cast = _compiled_casts[key] = torch.compile(partial(fn, dtype=dtype))
        return cast(x, scale, out) if out is not None else cast(x, scale)
    if out is None:
        out = torch.empty(x.shape, dtype=dtype, device=x.device)
    rows_in, rows_out = x.reshape(-1, x.shape[-1]), out.view(-1, x.shape[-1])
    step = max(1, _BLOCK // max(x.shape[-1], 1))
    for start in range(0, rows_in.shape[0], step):
        rows_out[start : start + step] = scale_and_saturate(rows_in[start : start + step], scale, dtype)
    return out


def _cast_into(x: torch.Tensor, scale: torch.Tensor, out: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return out.copy_(scale_and_saturate(x, scale, dtype))


def scale_and_saturate(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`x * scale` in fp32, clamped to the float8 `dtype`'s range and cast to it (one pass when compiled).

    Args:
        x: the high-precision tensor.
        scale: fp32, 0-dim.
        dtype: the float8 dtype.
    """
    top = torch.finfo(dtype).max
    return (x.to(torch.float32) * scale).clamp(-top, top).to(dtype)


_compiled_casts: dict[tuple[torch.dtype, bool], Callable] = {}
_BLOCK = 1 << 24  # elements per eager cast block: 64 MiB of fp32 temporaries


def scaled_mm(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    b: torch.Tensor,
    b_scale: torch.Tensor,
    out_dtype: torch.dtype,
    *,
    emulate: bool,
    fast_accum: bool = False,
) -> torch.Tensor:
    """`(a / a_scale) @ (b / b_scale)` in `out_dtype` from float8 operands (`to_float8`'s outputs).

    `a` must be row-major and `b` column-major (`b = b_t.t()` with `b_t` contiguous), as
    `torch._scaled_mm` needs; an inner dimension that is not a multiple of 16 is padded with zeros.

    Args:
        a: `(m, k)` float8.
        a_scale: `a`'s fp32 scale.
        b: `(k, n)` float8, column-major.
        b_scale: `b`'s fp32 scale.
        out_dtype: the result's dtype.
        emulate: multiply in fp32 instead (no float8 tensor cores).
        fast_accum: cuBLAS's fast float8 accumulation (the forward GEMM's choice in torchao).
    """
    if emulate:
        return torch.mm(a.float() / a_scale, b.float() / b_scale).to(out_dtype)
    pad = -a.shape[1] % _ALIGN
    if pad:
        a = F.pad(a.view(torch.uint8), (0, pad)).view(a.dtype)
        b = F.pad(b.t().view(torch.uint8), (0, pad)).view(b.dtype).t()
    return torch._scaled_mm(
        a, b, a_scale.reciprocal(), b_scale.reciprocal(), out_dtype=out_dtype, use_fast_accum=fast_accum
    )


class ChunkedFloat8Matmuls:
    """The fused loss's three GEMMs in float8 for one call: `h` and the weight cast once, each chunk's
    logit gradient as it comes.

    Args:
        h: `(rows, dim)` hidden states (the whole call's: one scale, as `Float8Linear` casts its input).
        weight: `(vocab_local, dim)`, this rank's vocab shard.
        options: the float8 options.
        group: the tensor-parallel group the vocab is sharded over, or None.
        want_grads: also prepare the layouts the two gradient GEMMs need.
        compiled: cast in Inductor kernels (`to_float8`).
    """

    def __init__(
        self,
        h: torch.Tensor,
        weight: torch.Tensor,
        options: Float8Loss,
        group: dist.ProcessGroup | None,
        want_grads: bool,
        compiled: bool = False,
    ):
        if not options.emulate and (h.shape[1] % _ALIGN or weight.shape[0] % _ALIGN):
            raise ValueError(
                f"the float8 loss needs dim ({h.shape[1]}) and this rank's vocab ({weight.shape[0]}) in multiples "
                f"of {_ALIGN}; keep the output projection in high precision (filter_fqns with 'output')"
            )
        self.emulate, self.group, self.out_dtype, self.compiled = options.emulate, group, h.dtype, compiled
        self.h8, self.h_scale = to_float8(h, E4M3, compiled=compiled)  # replicated under TP: one amax on every rank
        self.w8, self.w_scale = to_float8(weight, E4M3, group, compiled=compiled)
        if want_grads:
            self.h8_t = self.h8.t().contiguous()  # (dim, rows): chunk slices of it are grad W's right operand
            self.w8_t = self.w8.t().contiguous()  # (dim, vocab): its transpose is grad h's right operand

    def logits(self, rows: slice) -> torch.Tensor:
        """`h[rows] @ weight.T` in the hidden states' dtype."""
        return scaled_mm(
            self.h8[rows], self.h_scale, self.w8.t(), self.w_scale, self.out_dtype,
            emulate=self.emulate, fast_accum=True,
        )  # fmt: skip

    def cast_gradient(self, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """A chunk's logit gradient `(chunk, vocab_local)` in e5m2 (amax all-reduced under TP): (g8, g8.T
        contiguous, scale), what `backward` takes. Without TP the fused loss casts in its gradient kernel."""
        g8, g_scale = to_float8(g, E5M2, self.group, compiled=self.compiled)
        return g8, g8.t().contiguous(), g_scale

    def backward(
        self, g8: torch.Tensor, g8_t: torch.Tensor, g_scale: torch.Tensor, rows: slice, grad_h: torch.Tensor,
        grad_w: torch.Tensor,
    ) -> None:  # fmt: skip
        """Write `g @ weight` into `grad_h[rows]` and add `g.T @ h[rows]` to `grad_w`, from the chunk's e5m2
        logit gradient `g8` `(chunk, vocab_local)`, its contiguous transpose `g8_t` and their scale."""
        grad_h[rows] = scaled_mm(g8, g_scale, self.w8_t.t(), self.w_scale, grad_h.dtype, emulate=self.emulate)
        h_chunk = self.h8_t[:, rows].contiguous().t()  # (chunk, dim), column-major
        grad_w += scaled_mm(g8_t, g_scale, h_chunk, self.h_scale, grad_w.dtype, emulate=self.emulate)
