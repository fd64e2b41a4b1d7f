"""Causal attention whose query / key heads are wider than its value heads (DeepSeek-V3's latent attention:
192 against 128), as one opaque op that keeps what CUDA's kernel keeps, for the compiled measurements on CPU.

The compiled measurements trace a block on fake CPU tensors (Dynamo cannot trace fake CUDA tensors without a GPU).
CPU's `F.scaled_dot_product_attention` runs unequal head widths through its math path, which the compiler
decomposes into matmuls and a softmax, and the partitioner then keeps the `(seq, seq)` scores or probabilities of
every head; an H100 runs them through the memory-efficient kernel (`fake_run._cuda_sdpa`: cuDNN and flash want equal
widths), which keeps q, k, v, the output and an fp32 log-sum-exp per head and token. `cuda_like_attention` puts
`attention` (a `torch.library` custom op with its own backward op, which the partitioner cannot look into) in
`F.scaled_dot_product_attention`'s place for those calls, so a compiled graph keeps what the GPU's kernel keeps;
calls of equal widths, or with a mask or dropout, go to torch's own as before. Torch has no op of this shape on
CPU; the real kernels below (exact softmax attention in fp32) exist so that the op also runs on real tensors
(tests/test_memory_compiled_moe.py holds them to torch's math path).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from unittest import mock

import torch
import torch.nn.functional as F

_SDPA = F.scaled_dot_product_attention


def _scores(q: torch.Tensor, k: torch.Tensor, scale: float | None) -> torch.Tensor:
    """Causal scores in fp32: `(bs, heads, seq_q, seq_k)`, the future at -inf."""
    scores = (q.float() @ k.float().transpose(-2, -1)) * (scale if scale is not None else q.shape[-1] ** -0.5)
    future = torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device).triu(1)  # as SDPA's `is_causal`
    return scores.masked_fill(future, float("-inf"))


@torch.library.custom_op("titan_memory::causal_attention", mutates_args=())
def attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal softmax attention: the output `(bs, heads, seq, v_head_dim)` in q's dtype and the fp32 log-sum-exp of
    each row of scores, what CUDA's memory-efficient kernel returns: `(bs, heads, seq)` padded with zeros to a
    multiple of 32 rows, as that kernel lays it out."""
    scores = _scores(q, k, scale)
    lse = scores.logsumexp(dim=-1)
    out = (scores - lse.unsqueeze(-1)).exp() @ v.float()
    return out.to(q.dtype), F.pad(lse, (0, _padded(q.shape[-2]) - q.shape[-2]))


def _padded(rows: int) -> int:
    return -(-rows // 32) * 32


@attention.register_fake
def _(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    lse = q.new_empty((*q.shape[:-2], _padded(q.shape[-2])), dtype=torch.float32)
    return q.new_empty((*q.shape[:-1], v.shape[-1])), lse


@torch.library.custom_op("titan_memory::causal_attention_backward", mutates_args=())
def attention_backward(
    grad: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
    scale: float | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """The gradients of q, k and v from the output's, the probabilities rebuilt from the log-sum-exp."""
    probs = (_scores(q, k, scale) - lse[..., : q.shape[-2]].unsqueeze(-1)).exp()  # (bs, heads, seq_q, seq_k)
    grad = grad.float()
    grad_v = probs.transpose(-2, -1) @ grad
    grad_probs = grad @ v.float().transpose(-2, -1)
    grad_scores = probs * (grad_probs - (grad * out.float()).sum(dim=-1, keepdim=True))
    grad_scores = grad_scores * (scale if scale is not None else q.shape[-1] ** -0.5)
    grad_q, grad_k = grad_scores @ k.float(), grad_scores.transpose(-2, -1) @ q.float()
    return grad_q.to(q.dtype), grad_k.to(k.dtype), grad_v.to(v.dtype)


@attention_backward.register_fake
def _(
    grad: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
    scale: float | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup_context(ctx: torch.autograd.function.FunctionCtx, inputs: tuple, output: tuple) -> None:
    q, k, v, scale = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse)  # what the memory-efficient kernel keeps
    ctx.scale = scale  # type: ignore[attr-defined]


def _backward(ctx: torch.autograd.function.FunctionCtx, grad: torch.Tensor, _grad_lse: torch.Tensor) -> tuple:
    q, k, v, out, lse = ctx.saved_tensors  # type: ignore[attr-defined]
    return (*attention_backward(grad, q, k, v, out, lse, ctx.scale), None)  # type: ignore[attr-defined]


attention.register_autograd(_backward, setup_context=_setup_context)


def _sdpa(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor | None = None, dropout_p: float = 0.0,
    is_causal: bool = False, scale: float | None = None, enable_gqa: bool = False,
) -> torch.Tensor:  # fmt: skip
    """`F.scaled_dot_product_attention`, causal calls of unequal q / v head widths by `attention`."""
    if is_causal and attn_mask is None and dropout_p == 0.0 and q.shape[-1] != v.shape[-1] and k.shape == q.shape:
        return attention(q, k, v, scale)[0]
    return _SDPA(q, k, v, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa)


@contextlib.contextmanager
def cuda_like_attention() -> Iterator[None]:
    """Meanwhile `F.scaled_dot_product_attention` runs causal attention of unequal head widths as `attention`
    (module docstring)."""
    with mock.patch("torch.nn.functional.scaled_dot_product_attention", _sdpa):
        yield
