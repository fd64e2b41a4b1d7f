"""What a DeepSeek-V3 block keeps for backward: the analytic tier of `titan estimate-memory`.

Bytes per token a rank processes, read off the autograd graph of `model.py` with
`torch.autograd.graph.saved_tensors_hooks`, as for Llama 3 (`titan_models.llama3.memory`:
its RMSNorm, SwiGLU and loss terms apply unchanged; the MoE's and selective "op"'s are
`titan_models.qwen3.memory`'s). Notation: d, b, t, f as there, hq = n_heads, `Q = hq x
qk_head_dim` (queries and keys), `V = hq x v_head_dim` (values, attention output),
`U = hq x (qk_nope_head_dim + v_head_dim)` (`wkv_b`'s output), r_q = q_lora_rank,
r_kv = kv_lora_rank, p = qk_rope_head_dim, S = seq_len.

Multi-head Latent Attention:

- The low-rank latents run whole on every TP rank (`TPStyle.REPLICATED`), so they are not
  divided by t. `q_norm` and `kv_norm` keep what an RMSNorm keeps (on CPU fp32 input and
  normalized value and the rstd, `8 r + 4`; on CUDA the input and the rstd, `b r + 4`),
  and their outputs are kept as `wq_b`'s and `wkv_b`'s inputs, `b r`. `kv_norm`'s input is a
  view of `wkv_a`'s output, so where the kernel keeps the input itself (CPU in fp32, CUDA) it
  keeps that whole storage, `r_kv + p` wide.
- Per head (divided by t): the query and the key (each `Q`, built by a concatenation), the
  values (a view of `wkv_b`'s output: its storage, `U`), the output (also `wo`'s input, `V`)
  and the log-sum-exp `4 hq`: `b (2 Q + U + V) + 4 hq`, on CUDA (memory-efficient SDPA:
  flash needs equal head dims) and on CPU where qk_head_dim = v_head_dim (flash). On CPU
  with different head dims SDPA runs its math path, which keeps fp32 copies of the scaled q,
  the scaled k, v and the softmax probabilities, `4 (2 Q + V + hq S)`, and the output
  copied for `wo`, `b V`.
- RoPE keeps a `(positions, p / 2)` complex table per call, per position and not per token:
  left out (under 0.3% of the debug model's block).
- Context parallel "allgather" keeps the gathered keys and values (`c` times `Q` and `V`) and,
  with a fused kernel, the bool mask (`S`); "rotate" needs equal head dims and keeps fp32 q,
  k, v and output, `4 (2 Q + 2 V)`, and the output cast back, `b V`. Ulysses exchanges q and k
  in one buffer and v in another, so with a fused kernel it keeps `b (2 Q + V)` of inputs, the
  output and `wo`'s input (the output exchanged back), `b (2 Q + 3 V) + 4 hq`; on CPU's math path
  it keeps what that path keeps without CP.

The first `n_dense_layers` blocks have a SwiGLU of `ffn_hidden_dim`, the others a MoE: where
a model has both, `ActivationBytes.per_block` gives each block its kind's figures. Under
selective "op" the attention runs `wq_a`, `wq_b`, `wkv_a`, `wkv_b`, `wo` (or `wq`, `wkv_a`,
`wkv_b`, `wo`) before the feed-forward's matmuls, and the SDPA output and log-sum-exp are
kept where a fused kernel runs (the math path is recomputed).
"""

from __future__ import annotations

from titan_models.deepseek_v3.model import ModelArgs
from titan_models.llama3.memory import activation_bytes as llama3_activation_bytes
from titan_models.qwen3.memory import FeedForwardBytes, matmul_outputs_kept, moe_bytes, swiglu_bytes
from titan_models.spec import ActivationBytes, ActivationLayout


def _latent_norm(width: int, stored: int, layout: ActivationLayout) -> float:
    """An RMSNorm over a `width`-wide latent whose input is a view of a `stored`-wide output, and its output."""
    b = layout.compute_bytes
    if layout.device_type == "cpu":
        kept_input = 4 * (stored if b == 4 else width)  # fp32: the input itself; bf16: its fp32 copy
        return kept_input + 4 * width + 4 + b * width
    return b * stored + 4 + b * width


def mla_bytes(args: ModelArgs, layout: ActivationLayout) -> tuple[float, float, list[float]]:
    """Multi-head Latent Attention's terms per token: kept without AC; the SDPA outputs kept under
    selective "op"; the output widths of its matmuls in forward order (see the module docstring).

    Args:
        args: model shape.
        layout: how the rank runs.
    """
    b, t, cp = layout.compute_bytes, layout.tp, layout.cp
    hq, s = args.n_heads, layout.seq_len
    q, v = hq * args.qk_head_dim, hq * args.v_head_dim
    u = hq * (args.qk_nope_head_dim + args.v_head_dim)
    lse = 4 * hq
    latent = _latent_norm(args.kv_lora_rank, args.kv_lora_rank + args.qk_rope_head_dim, layout)
    widths = [args.kv_lora_rank + args.qk_rope_head_dim, u / t, args.dim]  # wkv_a, wkv_b, wo
    if args.q_lora_rank:
        latent += _latent_norm(args.q_lora_rank, args.q_lora_rank, layout)
        widths = [args.q_lora_rank, q / t, *widths]  # wq_a, wq_b
    else:
        widths = [q / t, *widths]  # wq
    fused = layout.device_type == "cuda" or args.qk_head_dim == args.v_head_dim  # else CPU SDPA's math path
    ulysses = cp > 1 and layout.cp_method == "ulysses"
    if ulysses and fused:  # exchanged q and k (one buffer), v; SDPA's output; wo's input
        heads, mask = b * (2 * q + 3 * v) + lse, 0
    elif ulysses:  # CPU's math path on head shards: as without CP
        heads, mask = 4 * (2 * q + v + hq * s) + b * v, 0
    elif cp > 1 and layout.cp_rotate_method == "rotate":  # fp32 q, k, v, output; the output cast back
        heads, mask = 4 * (2 * q + 2 * v) + lse + b * v, 0
    elif fused:  # q, k (gathered under CP), v (gathered, or the view of wkv_b's output), output, lse
        values = v * cp if cp > 1 else u
        heads, mask = b * (q + q * cp + values + v) + lse, s if cp > 1 else 0
    else:  # fp32 scaled q, scaled k, v and probabilities over S keys; the output copied for wo
        heads, mask = 4 * (q + q * cp + v * cp + hq * s) + b * v, 0
    op_kernel = (b * v + lse) / t if fused else 0
    return latent + heads / t + mask, op_kernel, widths


def activation_bytes(args: ModelArgs, layout: ActivationLayout) -> ActivationBytes:
    """Saved-for-backward bytes per rank-local token of a DeepSeek-V3 model run as `layout` says.

    Args:
        args: model shape.
        layout: compute dtype, TP / CP degrees, device type, loss parallel.
    """
    b, t, d = layout.compute_bytes, layout.tp, args.dim
    llama = llama3_activation_bytes(args, layout)  # its `head` is one RMSNorm and its output; the loss
    attention, op_kernel, widths = mla_bytes(args, layout)
    wo_scatter = b * d / t if t > 1 else 0  # wo's reduce-scatter output, kept under "op"
    op_attention = llama.block_input + b * matmul_outputs_kept(widths, 0) + op_kernel + wo_scatter

    def block(ffn: FeedForwardBytes) -> ActivationBytes:
        return ActivationBytes(
            block=round(2 * llama.head + attention + ffn.saved),
            block_op=round(op_attention + ffn.op),
            block_input=llama.block_input,
            block_backward=round(3 * b * d + ffn.backward),
            head=llama.head,
            logits=llama.logits,
            logits_saved=llama.logits_saved,
        )

    dense = block(swiglu_bytes(d, args.ffn_hidden_dim, layout, done=len(widths)))
    moe = block(moe_bytes(args.moe, d, layout, done=len(widths)))
    if args.n_dense_layers == 0:
        return moe
    if args.n_dense_layers == args.n_layers:
        return dense
    kinds = (dense, moe)
    return ActivationBytes(
        block=min(k.block for k in kinds),
        block_op=min(k.block_op for k in kinds),
        block_input=llama.block_input,
        block_backward=min(k.block_backward for k in kinds),
        head=llama.head,
        logits=llama.logits,
        logits_saved=llama.logits_saved,
        per_block=tuple(dense if i < args.n_dense_layers else moe for i in range(args.n_layers)),
    )
