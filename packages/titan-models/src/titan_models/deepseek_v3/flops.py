"""Parameter and FLOP counts of a DeepSeek-V3 shape, from `ModelArgs` alone (no model built)."""

from __future__ import annotations

from titan_models.deepseek_v3.model import ModelArgs
from titan_models.mtp import depth_extra_params


def _attention_params(args: ModelArgs) -> int:
    """MLA's projections and latent norms."""
    q_out = args.n_heads * args.qk_head_dim
    if args.q_lora_rank == 0:
        q = args.dim * q_out  # wq
    else:
        q = args.dim * args.q_lora_rank + args.q_lora_rank + args.q_lora_rank * q_out  # wq_a, q_norm, wq_b
    kv = args.dim * (args.kv_lora_rank + args.qk_rope_head_dim) + args.kv_lora_rank  # wkv_a, kv_norm
    kv += args.kv_lora_rank * args.n_heads * (args.qk_nope_head_dim + args.v_head_dim)  # wkv_b
    return q + kv + args.n_heads * args.v_head_dim * args.dim  # + wo


def _moe_params(args: ModelArgs, experts: int) -> int:
    """One MoE layer counting `experts` routed experts: router, experts, shared experts."""
    m = args.moe
    return args.dim * m.num_experts + 3 * experts * args.dim * m.hidden_dim + 3 * args.dim * m.shared_hidden_dim


def _count(args: ModelArgs, routed_experts: int) -> int:
    n_moe = args.n_layers - args.n_dense_layers + args.n_mtp_layers  # the MTP blocks are MoE blocks
    n_blocks = args.n_layers + args.n_mtp_layers
    blocks = n_blocks * (_attention_params(args) + 2 * args.dim)  # + attention_norm, ffn_norm
    blocks += args.n_dense_layers * 3 * args.dim * args.ffn_hidden_dim + n_moe * _moe_params(args, routed_experts)
    blocks += args.n_mtp_layers * depth_extra_params(args.dim)  # eh_proj; enorm, hnorm, head_norm
    embedding = args.vocab_size * args.dim
    output = 0 if args.tie_word_embeddings else args.vocab_size * args.dim
    return embedding + blocks + args.dim + output  # + final norm


def count_params(args: ModelArgs) -> int:
    """Number of parameters of `Transformer(args)` (the MoE's `expert_bias` is a buffer, not
    counted); a tied weight counts once.

    Args:
        args: model shape.
    """
    return _count(args, args.moe.num_experts)


def count_active_params(args: ModelArgs) -> int:
    """Parameters one token uses: as `count_params`, but each MoE layer counts only `top_k`
    routed experts (router and shared experts in full); embedding and output as `count_params`.

    Args:
        args: model shape.
    """
    return _count(args, args.moe.top_k)


def flops_per_token(args: ModelArgs, seq_len: int) -> int:
    """Training FLOPs (forward + backward) per token, as in the PaLM / torchtitan estimate.

    `6 * N_active + 6 * (n_layers + n_mtp_layers) * n_heads * (qk_head_dim + v_head_dim) * seq_len`.

    N_active is `count_active_params` without the token-embedding table (a lookup, no
    matmul); the output projection counts once even when tied. The second term is
    attention: per token and layer, `q k^T` takes `2 * n_heads * qk_head_dim * seq_len`
    FLOPs forward and `attn v` `2 * n_heads * v_head_dim * seq_len`; backward costs twice
    the forward, so 3x in all (causal masking not discounted). With
    `qk_head_dim == v_head_dim == head_dim` this is Llama's `12 * n_heads * head_dim * seq_len`.

    Args:
        args: model shape.
        seq_len: training sequence length.
    """
    embedding = args.vocab_size * args.dim
    matmul_params = count_active_params(args) - embedding + args.n_mtp_layers * embedding  # + each depth's output
    if args.tie_word_embeddings:
        matmul_params += embedding  # the tied weight is also the output projection
    attention = 6 * (args.n_layers + args.n_mtp_layers) * args.n_heads * (args.qk_head_dim + args.v_head_dim) * seq_len
    return 6 * matmul_params + attention
