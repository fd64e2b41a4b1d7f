"""Named Llama 3 shapes: a debug model, benchmark sizes, and the published Llama 3.1 models.

Benchmark names give the total parameter count (`count_params`), rounded:
10M = 10.4M, 50M = 52.4M, 110M = 113.3M, 350M = 350.3M (vocab 32768, untied);
1B is the Llama 3.2 1B shape, 1.24B with its tied 128256-row embedding.
8B / 70B / 405B are the exact Llama 3.1 shapes (8,030,261,248 / 70,553,706,496 /
405,853,388,800 parameters). Derive variants with `dataclasses.replace`.
"""

from titan_models.llama3.model import ModelArgs, RopeScaling

_LLAMA31_SCALING = RopeScaling(
    factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192
)
_LLAMA32_SCALING = RopeScaling(
    factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192
)
_BENCH_VOCAB = 32768

llama3_flavors: dict[str, ModelArgs] = {
    "debugmodel": ModelArgs(
        dim=256, n_layers=6, n_heads=16, n_kv_heads=8, vocab_size=2048, rope_theta=500000.0, max_seq_len=2048
    ),
    "10M": ModelArgs(dim=128, n_layers=8, n_heads=4, n_kv_heads=2, vocab_size=_BENCH_VOCAB, max_seq_len=8192),
    "50M": ModelArgs(dim=512, n_layers=6, n_heads=8, n_kv_heads=4, vocab_size=_BENCH_VOCAB, max_seq_len=8192),
    "110M": ModelArgs(dim=768, n_layers=10, n_heads=12, n_kv_heads=4, vocab_size=_BENCH_VOCAB, max_seq_len=8192),
    "350M": ModelArgs(dim=1024, n_layers=24, n_heads=16, n_kv_heads=8, vocab_size=_BENCH_VOCAB, max_seq_len=8192),
    "1B": ModelArgs(  # Llama 3.2 1B
        dim=2048,
        n_layers=16,
        n_heads=32,
        n_kv_heads=8,
        vocab_size=128256,
        multiple_of=256,
        ffn_dim_multiplier=1.5,
        rope_scaling=_LLAMA32_SCALING,
        max_seq_len=131072,
        tie_word_embeddings=True,
    ),
    "8B": ModelArgs(
        dim=4096,
        n_layers=32,
        n_heads=32,
        n_kv_heads=8,
        vocab_size=128256,
        multiple_of=1024,
        ffn_dim_multiplier=1.3,
        norm_eps=1e-5,
        rope_theta=500000.0,
        rope_scaling=_LLAMA31_SCALING,
        max_seq_len=131072,
    ),
    "70B": ModelArgs(
        dim=8192,
        n_layers=80,
        n_heads=64,
        n_kv_heads=8,
        vocab_size=128256,
        multiple_of=4096,
        ffn_dim_multiplier=1.3,
        norm_eps=1e-5,
        rope_theta=500000.0,
        rope_scaling=_LLAMA31_SCALING,
        max_seq_len=131072,
    ),
    "405B": ModelArgs(
        dim=16384,
        n_layers=126,
        n_heads=128,
        n_kv_heads=8,
        vocab_size=128256,
        multiple_of=4096,
        ffn_dim_multiplier=1.2,
        norm_eps=1e-5,
        rope_theta=500000.0,
        rope_scaling=_LLAMA31_SCALING,
        max_seq_len=131072,
    ),
}
