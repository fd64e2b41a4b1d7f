"""One Triton kernel for the whole Adam / AdamW step over fp32 master weights that writes their compute copies.

Why Titan keeps its own kernel: torch's fused Adam reads gradients of the parameters' own dtype
and writes only those parameters. Training a bf16 copy from fp32 masters with it takes three
passes over every weight: cast the bf16 gradients to fp32 (6 bytes per element), the step (28),
and cast the masters back to bf16 (6). This kernel reads the bf16 gradient once and writes the
bf16 copy as it writes the master: 28 bytes per element in all, the same as torch's step alone.
The arithmetic is torch's fused kernel's, in the same order (`_adam_math` in ATen's
`fused_adam_utils.cuh`), so the two agree to fp32 rounding.

The tensors stay separate (no flat buffer): one table of device addresses per step names each
tensor's gradient, master, moments, copy and step count, and the programs walk fixed-size chunks
of them. The table is uploaded again only when an address changed (in practice, when the
caching allocator hands the gradients different blocks).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["AdamKernel"]

BLOCK = 1024
CHUNK = 16 * BLOCK  # elements per program

_kernel: Any = None


def _build_kernel() -> Any:
    """The kernel, compiled on first use (importing triton costs ~0.5 s; CPU-only runs never pay it)."""
    global _kernel
    if _kernel is not None:
        return _kernel
    import triton
    import triton.language as tl

    @triton.jit
    def adam_master_step(
        table,
        n_tensors,
        unit_tensor,
        unit_start,
        numels,
        grad_scale_ptr,
        found_inf_ptr,
        lr,
        beta1,
        beta2,
        log2_beta1,
        log2_beta2,
        eps,
        weight_decay,
        GRAD_DTYPE: tl.constexpr,
        COPY_DTYPE: tl.constexpr,
        DECOUPLED: tl.constexpr,
        HAS_SCALE: tl.constexpr,
        HAS_INF: tl.constexpr,
        BLOCK: tl.constexpr,
        CHUNK: tl.constexpr,
    ):
        u = tl.program_id(0)
        t = tl.load(unit_tensor + u)
        start = tl.load(unit_start + u)
        n = tl.load(numels + t)
        grad = tl.load(table + t).to(tl.pointer_type(GRAD_DTYPE))
        param = tl.load(table + n_tensors + t).to(tl.pointer_type(tl.float32))
        exp_avg = tl.load(table + 2 * n_tensors + t).to(tl.pointer_type(tl.float32))
        exp_avg_sq = tl.load(table + 3 * n_tensors + t).to(tl.pointer_type(tl.float32))
        copy = tl.load(table + 4 * n_tensors + t).to(tl.pointer_type(COPY_DTYPE))
        step = tl.load(tl.load(table + 5 * n_tensors + t).to(tl.pointer_type(tl.float32)))
        bias_correction1 = 1.0 - tl.exp2(step * log2_beta1)
        bias_correction2_sqrt = tl.sqrt(1.0 - tl.exp2(step * log2_beta2))
        step_size = lr / bias_correction1
        if HAS_INF:  # a dropped step writes nothing
            n = tl.where(tl.load(found_inf_ptr) == 0, n, 0)
        for offset in range(0, CHUNK, BLOCK):
            idx = start + offset + tl.arange(0, BLOCK)
            mask = idx < n
            g = tl.load(grad + idx, mask=mask, other=0.0).to(tl.float32)
            if HAS_SCALE:
                g = g / tl.load(grad_scale_ptr)
            p = tl.load(param + idx, mask=mask, other=0.0)
            if DECOUPLED:
                p = p - lr * weight_decay * p
            else:
                g = g + p * weight_decay
            m = beta1 * tl.load(exp_avg + idx, mask=mask, other=0.0) + (1.0 - beta1) * g
            v = beta2 * tl.load(exp_avg_sq + idx, mask=mask, other=0.0) + (1.0 - beta2) * g * g
            p = p - step_size * m / (tl.sqrt(v) / bias_correction2_sqrt + eps)
            tl.store(param + idx, p, mask=mask)
            tl.store(exp_avg + idx, m, mask=mask)
            tl.store(exp_avg_sq + idx, v, mask=mask)
            if COPY_DTYPE == tl.bfloat16:  # round to nearest even by hand: what `.to()` does on a GPU, and the same
                bits = p.to(tl.uint32, bitcast=True)  # in Triton's CPU interpreter, which truncates instead
                bits = bits + 0x7FFF + ((bits >> 16) & 1)
                tl.store(copy + idx, (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True), mask=mask)
            else:
                tl.store(copy + idx, p.to(COPY_DTYPE), mask=mask)

    _kernel = adam_master_step
    return _kernel


def _triton_dtype(dtype: torch.dtype) -> Any:
    import triton.language as tl

    return {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}[dtype]


def _log2(beta: float) -> float:
    return math.log2(beta) if beta > 0 else -math.inf  # beta**step = 0


class AdamKernel:
    """The step over one fixed list of tensors (one parameter group): built once, called every step.

    Args:
        numels: each tensor's number of elements, in the order every call passes the tensors.
        device: where the tensors live.
    """

    def __init__(self, numels: Sequence[int], device: torch.device):
        units = [(i, start) for i, n in enumerate(numels) for start in range(0, n, CHUNK)]
        self.device = device
        self.sizes = list(numels)
        self.n_tensors = len(numels)
        self.unit_tensor = torch.tensor([i for i, _ in units], dtype=torch.int32, device=device)
        self.unit_start = torch.tensor([s for _, s in units], dtype=torch.int64, device=device)
        self.numels = torch.tensor(list(numels), dtype=torch.int64, device=device)
        self.n_units = len(units)
        self._addresses: list[int] = []
        self._table = torch.empty(6 * self.n_tensors, dtype=torch.int64, device=device)
        # Two pinned host buffers, used in turn: a buffer is rewritten only once the upload from it two uploads ago
        # finished, so the host never waits on the step just queued (it may run up to two steps ahead).
        pin = device.type == "cuda"
        self._hosts = [torch.empty(6 * self.n_tensors, dtype=torch.int64, pin_memory=pin) for _ in range(2)]
        self._uploads: list[torch.cuda.Event | None] = [None, None]
        self._turn = 0

    def _upload(self, addresses: list[int]) -> None:
        """Copy the tensors' addresses to the device table, unless they are the last call's."""
        if addresses == self._addresses:
            return
        turn, self._turn = self._turn, 1 - self._turn
        upload = self._uploads[turn]
        if upload is not None:
            upload.synchronize()
        host = self._hosts[turn]
        host.copy_(torch.tensor(addresses, dtype=torch.int64))
        self._table.copy_(host, non_blocking=True)
        if self.device.type == "cuda":
            event = torch.cuda.Event()
            event.record()
            self._uploads[turn] = event
        self._addresses = addresses

    def __call__(
        self,
        grads: Sequence[torch.Tensor],
        masters: Sequence[torch.Tensor],
        exp_avgs: Sequence[torch.Tensor],
        exp_avg_sqs: Sequence[torch.Tensor],
        copies: Sequence[torch.Tensor],
        steps: Sequence[torch.Tensor],
        *,
        lr: float,
        beta1: float,
        beta2: float,
        eps: float,
        weight_decay: float,
        decoupled: bool,
        grad_scale: torch.Tensor | None,
        found_inf: torch.Tensor | None,
    ) -> None:
        """One step: masters, moments and copies updated in place; `steps` were already advanced.

        Every gradient has one dtype, every copy one dtype; masters, moments and steps are fp32.
        """
        lists = (grads, masters, exp_avgs, exp_avg_sqs, copies, steps)
        self._upload([t.data_ptr() for tensors in lists for t in tensors])
        kernel = _build_kernel()
        dummy = self.numels  # an unused pointer argument
        kernel[(self.n_units,)](
            self._table,
            self.n_tensors,
            self.unit_tensor,
            self.unit_start,
            self.numels,
            grad_scale if grad_scale is not None else dummy,
            found_inf if found_inf is not None else dummy,
            float(lr),
            beta1,
            beta2,
            _log2(beta1),
            _log2(beta2),
            eps,
            weight_decay,
            GRAD_DTYPE=_triton_dtype(grads[0].dtype),
            COPY_DTYPE=_triton_dtype(copies[0].dtype),
            DECOUPLED=decoupled,
            HAS_SCALE=grad_scale is not None,
            HAS_INF=found_inf is not None,
            BLOCK=BLOCK,
            CHUNK=CHUNK,
        )
