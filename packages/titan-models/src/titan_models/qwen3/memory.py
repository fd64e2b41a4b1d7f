"""What a Qwen3 / Qwen3-MoE block keeps for backward: the analytic tier of `titan estimate-memory`.

Bytes per token a rank processes, read off the autograd graph of `model.py` with
`torch.autograd.graph.saved_tensors_hooks`, as for Llama 3 (`titan_models.llama3.memory`,
whose formulas this starts from: the norms, GQA attention, SwiGLU and the loss are the same
modules). Notation as there (d, q, kv, f, b, t), plus hq = n_heads, hkv = n_kv_heads and,
for the Mixture-of-Experts, E experts, k = top_k, h = an expert's hidden size, h_s = the
shared experts' hidden size:

- QK-norm, an RMSNorm per head on q and on k before RoPE: on CPU the composite kernel keeps
  its input and normalized value in fp32 and one fp32 rstd per head,
  `(8 (q + kv) + 4 (hq + hkv)) / t`; on CUDA the fused kernel keeps its input and the rstd,
  `(b (q + kv) + 4 (hq + hkv)) / t`. RoPE (rotate-half) keeps only the cos / sin table, a
  buffer, so the rotated q and k that attention keeps are Llama 3's. Selective "op"
  recomputes the norms: that block keeps what Llama 3's does.
- With `args.moe` the SwiGLU (`4 b f / t`) becomes the MoE, `moe_activation_bytes` (the
  router's scores, the index tensors, each token slot's input row, its expert's SwiGLU and
  output row, the shared experts), at even expert load. Tensor parallel runs the MoE whole on
  every TP rank, on the all-gathered sequence (`TPStyle.MOE_INPUT`): its bytes per token are
  not divided by t. Its gathered input, `b d`, is the norm output Llama 3's formula already
  keeps for the linears (here for the router and the shared experts).
- Selective "op" keeps the output of every other `aten.mm` of the block, counted from its
  first (`titan_parallel.activation_checkpoint`): after attention's four (wq, wk, wv, wo) the
  router (`E` wide) is the 5th; on CPU, and on CUDA without bf16 `torch._grouped_mm`, each
  expert's w1, w3 and w2 are one matmul each (at even load `k h / E`, `k h / E`, `k d / E`
  wide per token), so about half of `b k (2 h + d)` is kept; `torch._grouped_mm` is not a
  matmul the policy keeps, so on CUDA in bf16 the experts are recomputed whole; then the
  shared experts' w1, w3, w2. Under TP a MoE block has one reduce-scatter (wo's), `b d / t`.
- A MoE block's backward holds the gradients of the slots' hidden activations and of their
  input and output rows, `3 b (k h + h_s) + 2 b k d`, beside the block's `3 b d`.

Expert parallel does not change these at even load: a rank runs its E / ep experts on `k`
token slots per token of its own (the exchange's two index tensors, `16 k`, are left out).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from titan_models.llama3.memory import activation_bytes as llama3_activation_bytes
from titan_models.moe import MoEArgs, moe_activation_bytes
from titan_models.qwen3.model import ModelArgs
from titan_models.spec import ActivationBytes, ActivationLayout


@dataclass(frozen=True)
class FeedForwardBytes:
    """What one block's feed-forward adds, per token.

    Args:
        saved: kept for backward, nothing recomputed.
        op: kept under selective "op" (matmul outputs, reduce-scatter outputs).
        backward: gradients of its activations during its backward.
    """

    saved: float
    op: float
    backward: float


def matmul_outputs_kept(widths: list[float], done: int) -> float:
    """Elements per token of the matmul outputs selective "op" keeps: the 1st, 3rd, 5th, ... `aten.mm` of a block.

    Args:
        widths: output widths per token of the matmuls from the `done + 1`-th on, in forward order.
        done: matmuls the block ran before them.
    """
    return sum(w for i, w in enumerate(widths, start=done + 1) if i % 2 == 1)


def swiglu_bytes(dim: int, hidden: int, layout: ActivationLayout, done: int) -> FeedForwardBytes:
    """Llama 3's SwiGLU terms (`w1 x`, `w3 x`, `silu(w1 x)`, their product), split over TP.

    Args:
        dim: model width.
        hidden: SwiGLU hidden size (before TP).
        layout: how the rank runs.
        done: matmuls the block ran before `w1` (4 after Llama 3's attention).
    """
    b, t = layout.compute_bytes, layout.tp
    kept = matmul_outputs_kept([hidden / t, hidden / t, dim], done)  # w1, w3, w2 (w2's partial sum is full width)
    return FeedForwardBytes(
        saved=4 * b * hidden / t,
        op=b * kept + (b * dim / t if t > 1 else 0),  # + w2's reduce-scatter output
        backward=3 * b * hidden / t,
    )


def moe_bytes(moe: MoEArgs, dim: int, layout: ActivationLayout, done: int) -> FeedForwardBytes:
    """A `MoE` feed-forward's terms at even expert load; whole on every TP rank (see the module docstring).

    Args:
        moe: the MoE's shape.
        dim: model width.
        layout: how the rank runs.
        done: matmuls the block ran before the router's.
    """
    b, e, k, h, h_s = layout.compute_bytes, moe.num_experts, moe.top_k, moe.hidden_dim, moe.shared_hidden_dim
    grouped = layout.device_type == "cuda" and b == 2  # `grouped_mm_supported`: bf16 on Hopper and newer
    widths: list[float] = [e]  # the router
    if not grouped:
        widths += [k * h / e] * e + [k * h / e] * e + [k * dim / e] * e  # w1, w3, w2: one matmul per expert
    if h_s:
        widths += [h_s, h_s, dim]  # shared experts' w1, w3, w2
    return FeedForwardBytes(
        saved=moe_activation_bytes(moe, dim, b),
        op=b * matmul_outputs_kept(widths, done),
        backward=3 * b * (k * h + h_s) + 2 * b * k * dim,
    )


def activation_bytes(args: ModelArgs, layout: ActivationLayout) -> ActivationBytes:
    """Saved-for-backward bytes per rank-local token of a Qwen3 or Qwen3-MoE model run as `layout` says.

    Args:
        args: model shape (`args.moe` set: Qwen3-MoE).
        layout: compute dtype, TP / CP degrees, device type, loss parallel.
    """
    b, t = layout.compute_bytes, layout.tp
    llama = llama3_activation_bytes(args, layout)  # norms, GQA attention, SwiGLU of `ffn_hidden_dim`, the loss
    heads = args.n_heads + args.n_kv_heads
    width = args.n_heads * args.head_dim + args.n_kv_heads * args.head_dim  # q + kv
    qk_norm = ((8 if layout.device_type == "cpu" else b) * width + 4 * heads) / t
    if args.moe is None:
        return replace(llama, block=round(llama.block + qk_norm))
    swiglu = swiglu_bytes(args.dim, args.ffn_hidden_dim, layout, done=4)
    moe = moe_bytes(args.moe, args.dim, layout, done=4)
    return replace(
        llama,
        block=round(llama.block + qk_norm - swiglu.saved + moe.saved),
        block_op=round(llama.block_op - swiglu.op + moe.op),
        block_backward=round(llama.block_backward - swiglu.backward + moe.backward),
    )
