"""Parameter and FLOP counts of a Llama 3 shape, from `ModelArgs` alone (no model built)."""

from __future__ import annotations

from titan_models.llama3.model import ModelArgs
from titan_models.mtp import depth_extra_params


def count_params(args: ModelArgs) -> int:
    """Number of parameters of `Transformer(args)`; a tied weight counts once; each multi-token-prediction depth
    is a block and its `depth_extra_params`.

    Args:
        args: model shape.
    """
    head_dim = args.attention_head_dim
    attention = args.dim * head_dim * (2 * args.n_heads + 2 * args.kv_heads)  # wq, wo; wk, wv
    feed_forward = 3 * args.dim * args.ffn_hidden_dim  # w1, w2, w3
    block = attention + feed_forward + 2 * args.dim  # + attention_norm, ffn_norm
    embedding = args.vocab_size * args.dim
    output = 0 if args.tie_word_embeddings else args.vocab_size * args.dim
    depths = args.n_mtp_layers * (block + depth_extra_params(args.dim))
    return embedding + args.n_layers * block + depths + args.dim + output  # + final norm


def flops_per_token(args: ModelArgs, seq_len: int) -> int:
    """Training FLOPs (forward + backward) per token, as in the PaLM / torchtitan estimate.

    `6 * N + 12 * n_layers * n_heads * head_dim * seq_len`, where N counts every
    parameter except the token-embedding table (a lookup, no matmul); the output
    projection counts once even when tied, and once more for each multi-token-prediction depth (its rows go
    through it too). The second term is attention's `q k^T` and `attn v` matmuls (causal masking not
    discounted), in the depths' blocks too.

    Args:
        args: model shape.
        seq_len: training sequence length.
    """
    embedding = args.vocab_size * args.dim
    matmul_params = count_params(args) - embedding
    if args.tie_word_embeddings:
        matmul_params += embedding  # the tied weight is also the output projection
    matmul_params += args.n_mtp_layers * embedding  # each depth's output projection
    blocks = args.n_layers + args.n_mtp_layers
    return 6 * matmul_params + 12 * blocks * args.n_heads * args.attention_head_dim * seq_len
