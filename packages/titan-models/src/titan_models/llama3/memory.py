"""What a Llama 3 block keeps for backward: the analytic tier of `titan estimate-memory`.

Bytes per token a rank processes, read off the autograd graph of `model.py`
(`torch.autograd.graph.saved_tensors_hooks` lists each saved storage; the
derivation is written out in `docs/memory.md`). With d = dim, q = n_heads x
head_dim, kv = n_kv_heads x head_dim, f = ffn_hidden_dim, b = compute-dtype bytes,
t = tensor parallel degree (sequence parallel splits what lies between blocks):

- RMSNorm: CPU's composite kernel keeps its input and the normalized value in
  fp32 plus the fp32 rstd, `(8d + 4) / t`; CUDA's fused kernel keeps the input
  and the rstd, `(b d + 4) / t`. Its output is kept, gathered, as the next
  linears' input: `b d`.
- Attention: rotated q and k, v, the SDPA output (also `wo`'s input) in b bytes,
  the log-sum-exp in fp32: `(b (2q + 2kv) + 4 n_heads) / t`. Context parallel's
  "allgather" keeps the gathered K/V (`cp` times kv) and a boolean mask; "rotate"
  keeps fp32 q, k, v and output. Ulysses keeps what attention keeps without CP (SDPA's q,
  k, v, output and lse are head shards of whole sequences: the same bytes per local token;
  K/V times `ulysses_kv_repeats` where cp does not divide a rank's KV heads), plus the
  output exchanged back, `b q`, which is no longer a view of SDPA's output.
- SwiGLU: `w1 x`, `w3 x`, `silu(w1 x)` and their product: `4 b f / t`.
- The loss: the log-softmax output in fp32 (`4 V'`, V' = vocab / t under loss
  parallel); its backward holds it, its gradient and the input's: `12 V'`.
"""

from __future__ import annotations

from typing import Protocol

from titan_models.spec import ActivationBytes, ActivationLayout
from titan_parallel.layout import ulysses_kv_repeats


class BlockShape(Protocol):
    """The shape `activation_bytes` reads: Llama 3's `ModelArgs`, and Qwen3's and DeepSeek-V3's,
    whose dense parts they count with it."""

    @property
    def dim(self) -> int: ...
    @property
    def n_heads(self) -> int: ...
    @property
    def kv_heads(self) -> int: ...
    @property
    def attention_head_dim(self) -> int: ...
    @property
    def ffn_hidden_dim(self) -> int: ...
    @property
    def vocab_size(self) -> int: ...


def activation_bytes(args: BlockShape, layout: ActivationLayout) -> ActivationBytes:
    """Saved-for-backward bytes per rank-local token of a Llama 3 model run as `layout` says.

    Args:
        args: model shape.
        layout: compute dtype, TP / CP degrees, device type, loss parallel.
    """
    b, t, cp = layout.compute_bytes, layout.tp, layout.cp
    d, f = args.dim, args.ffn_hidden_dim
    q = args.n_heads * args.attention_head_dim
    kv = args.kv_heads * args.attention_head_dim
    lse = 4 * args.n_heads
    if layout.device_type == "cpu":
        norm = (8 * d + 4) / t + b * d  # fp32 input and normalized value, rstd; the output as the linears' input
    else:
        norm = (b * d + 4) / t + b * d  # fused kernel: input and rstd
    if cp > 1 and layout.cp_method == "ulysses":
        repeats = ulysses_kv_repeats(args.kv_heads // t, cp)
        attention = (b * (3 * q + 2 * kv * repeats) + lse) / t  # exchanged q, k, v; SDPA's output; wo's input
    elif cp > 1 and layout.cp_rotate_method == "rotate":
        attention = (4 * (2 * q + 2 * kv) + lse + b * q) / t  # fp32 q, k, v, output; the output cast back for wo
    elif cp > 1:
        attention = (b * (2 * q + 2 * kv * cp) + lse) / t + layout.seq_len  # gathered K/V; bool mask, one row per token
    else:
        attention = (b * (2 * q + 2 * kv) + lse) / t
    feed_forward = 4 * b * f / t
    block = 2 * norm + attention + feed_forward
    block_input = b * d / t
    # Selective "op": the block input, every other matmul's output (wq, wv, w1, w2), the attention output and lse;
    # under TP the reduce-scattered outputs of wo and w2 too.
    block_op = block_input + b * (q + kv + f) / t + b * d + (b * q + lse) / t + (2 * b * d / t if t > 1 else 0)
    # A block's backward: the gradients of its hidden activations (f wide) and of its input and residual.
    block_backward = 3 * b * f / t + 3 * b * d
    vocab = args.vocab_size // t if (t > 1 and layout.loss_parallel) else args.vocab_size
    return ActivationBytes(
        block=round(block),
        block_op=round(block_op),
        block_input=round(block_input),
        block_backward=round(block_backward),
        head=round(norm),
        logits=12 * vocab,
        logits_saved=4 * vocab,
    )
