"""Parameter and FLOP counts of a Qwen3 / Qwen3-MoE shape, from `ModelArgs` alone (no model built)."""

from __future__ import annotations

from titan_models.mtp import depth_extra_params
from titan_models.qwen3.model import ModelArgs


def _block_params(args: ModelArgs, experts: int) -> int:
    """Parameters of one block, counting `experts` routed experts (all of them, or the top-k a token uses)."""
    attention = args.dim * args.head_dim * (2 * args.n_heads + 2 * args.n_kv_heads)  # wq, wo; wk, wv
    attention += 2 * args.head_dim  # q_norm, k_norm
    if args.moe is None:
        feed_forward = 3 * args.dim * args.hidden_dim  # w1, w2, w3
    else:
        router = args.dim * args.moe.num_experts  # every expert is scored for every token
        routed = 3 * experts * args.dim * args.moe.hidden_dim  # w1, w2, w3 of each expert
        shared = 3 * args.dim * args.moe.shared_hidden_dim
        feed_forward = router + routed + shared
    return attention + feed_forward + 2 * args.dim  # + attention_norm, ffn_norm


def _total(args: ModelArgs, experts: int) -> int:
    embedding = args.vocab_size * args.dim
    output = 0 if args.tie_word_embeddings else args.vocab_size * args.dim
    depths = args.n_mtp_layers * (_block_params(args, experts) + depth_extra_params(args.dim))
    return embedding + args.n_layers * _block_params(args, experts) + depths + args.dim + output  # + final norm


def count_params(args: ModelArgs) -> int:
    """Number of parameters of `Transformer(args)`; a tied weight counts once, buffers
    (`expert_bias`) not at all; each multi-token-prediction depth is a block and its `depth_extra_params`.

    Args:
        args: model shape.
    """
    return _total(args, args.moe.num_experts if args.moe is not None else 0)


def count_active_params(args: ModelArgs) -> int:
    """Parameters one token uses: everything but the routed experts it is not sent to
    (the top-k routed experts, shared experts, router, attention, norms, embeddings).
    Equals `count_params` for a dense model.

    Args:
        args: model shape.
    """
    return _total(args, args.moe.top_k if args.moe is not None else 0)


def flops_per_token(args: ModelArgs, seq_len: int) -> int:
    """Training FLOPs (forward + backward) per token, as in the PaLM / torchtitan estimate.

    `6 * N + 12 * n_layers * n_heads * head_dim * seq_len`, where N counts the *active*
    parameters (`count_active_params`: a Mixture-of-Experts token runs only its top-k
    experts) except the token-embedding table (a lookup, no matmul); the output
    projection counts once even when tied, and once more for each multi-token-prediction depth. The second
    term is attention's `q k^T` and `attn v` matmuls (causal masking not discounted), the depths' too.

    Args:
        args: model shape.
        seq_len: training sequence length.
    """
    embedding = args.vocab_size * args.dim
    matmul_params = count_active_params(args) - embedding
    if args.tie_word_embeddings:
        matmul_params += embedding  # the tied weight is also the output projection
    matmul_params += args.n_mtp_layers * embedding  # each depth's output projection
    blocks = args.n_layers + args.n_mtp_layers
    return 6 * matmul_params + 12 * blocks * args.n_heads * args.head_dim * seq_len
