"""Named DeepSeek-V3 shapes: a debug model, the 16B that torchtitan ships, and the published 671B.

| flavor     | total params     | active per token | notes |
|------------|------------------|------------------|-------|
| debugmodel | 7,955,712        | 4,416,768        | q low-rank, sigmoid routing in 2 groups |
| 16B        | 15,706,484,224   | 2,661,150,208    | DeepSeek-V2-Lite shape: direct q, softmax routing |
| 671B       | 671,026,404,352  | 37,552,282,624   | DeepSeek-V3 (without its multi-token-prediction layer) |

(`count_params` / `count_active_params`; parameters only: the MoE's `expert_bias` is a buffer.
With those 58 x 256 buffer entries the 671B holds 671,026,419,200 numbers.)

16B follows torchtitan's `deepseek_v3` "16B" (dim 2048, 27 layers of which 1 dense with
hidden 10944, 16 heads, q_lora_rank 0, kv_lora_rank 512, 64 experts of hidden 1408, top 6,
2 shared, softmax scores without renormalisation, vocab 102400), i.e. DeepSeek-V2-Lite; its
YaRN uses V2-Lite's published `mscale = mscale_all_dim = 0.707` (torchtitan rounds it to 0.70).
Softmax scoring is not what transformers' `DeepseekV3ForCausalLM` runs, so the 16B converts
to Titan's formats but not to that Hugging Face class. Derive variants with `dataclasses.replace`.
"""

from titan_models.deepseek_v3.model import ModelArgs, YaRN
from titan_models.moe import MoEArgs

_DEEPSEEK_V3_YARN = YaRN(
    factor=40.0, original_max_position_embeddings=4096, beta_fast=32.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0
)
_V2_LITE_YARN = YaRN(
    factor=40.0,
    original_max_position_embeddings=4096,
    beta_fast=32.0,
    beta_slow=1.0,
    mscale=0.707,
    mscale_all_dim=0.707,
)

deepseek_v3_flavors: dict[str, ModelArgs] = {
    "debugmodel": ModelArgs(
        dim=256,
        n_layers=4,
        n_dense_layers=1,
        n_heads=8,
        vocab_size=2048,
        ffn_hidden_dim=768,
        q_lora_rank=128,
        kv_lora_rank=128,
        qk_nope_head_dim=32,
        qk_rope_head_dim=16,
        v_head_dim=32,
        rope_scaling=None,
        max_seq_len=2048,
        moe=MoEArgs(
            num_experts=8,
            top_k=2,
            hidden_dim=256,
            num_shared_experts=1,
            score_func="sigmoid",
            route_norm=True,
            route_scale=1.0,
            n_groups=2,
            topk_groups=1,
        ),
    ),
    "16B": ModelArgs(
        dim=2048,
        n_layers=27,
        n_dense_layers=1,
        n_heads=16,
        vocab_size=102400,
        ffn_hidden_dim=10944,
        q_lora_rank=0,
        kv_lora_rank=512,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        rope_theta=10000.0,
        rope_scaling=_V2_LITE_YARN,
        max_seq_len=163840,
        moe=MoEArgs(
            num_experts=64,
            top_k=6,
            hidden_dim=1408,
            num_shared_experts=2,
            score_func="softmax",
            route_norm=False,
            route_scale=1.0,
        ),
    ),
    "671B": ModelArgs(
        dim=7168,
        n_layers=61,
        n_dense_layers=3,
        n_heads=128,
        vocab_size=129280,
        ffn_hidden_dim=18432,
        norm_eps=1e-6,
        q_lora_rank=1536,
        kv_lora_rank=512,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        rope_theta=10000.0,
        rope_scaling=_DEEPSEEK_V3_YARN,
        max_seq_len=163840,
        moe=MoEArgs(
            num_experts=256,
            top_k=8,
            hidden_dim=2048,
            num_shared_experts=1,
            score_func="sigmoid",
            route_norm=True,
            route_scale=2.5,
            n_groups=8,
            topk_groups=4,
        ),
    ),
}
