"""Llama 3 model, flavors, plan, counts and registry (titan-models), single process on CPU."""

import copy
import dataclasses
import math

import pytest
import torch
from torch import nn

from titan_models import get_model_args, get_model_spec
from titan_models.llama3 import (
    Attention,
    ModelArgs,
    RopeScaling,
    ScaledDotProductAttention,
    Transformer,
    apply_rotary_emb,
    compute_rope_inv_freq,
    count_params,
    flops_per_token,
    llama3_flavors,
    llama3_plan,
    precompute_rope_cache,
)
from titan_parallel.plan import TPStyle

TINY = ModelArgs(dim=64, n_layers=3, n_heads=4, n_kv_heads=2, vocab_size=97, multiple_of=32, max_seq_len=64)


def build(args: ModelArgs, seed: int = 0) -> Transformer:
    model = Transformer(args)
    torch.manual_seed(seed)
    model.init_weights()
    return model


# ---- independent reference implementations -------------------------------------------


def meta_apply_scaling(freqs: torch.Tensor, scale_factor, low_freq_factor, high_freq_factor, old_context_len):
    """Meta llama-models `apply_scaling`, element by element."""
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    new_freqs = []
    for freq in freqs.tolist():
        wavelen = 2 * math.pi / freq
        if wavelen < high_freq_wavelen:
            new_freqs.append(freq)
        elif wavelen > low_freq_wavelen:
            new_freqs.append(freq / scale_factor)
        else:
            smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
            new_freqs.append((1 - smooth) * freq / scale_factor + smooth * freq)
    return torch.tensor(new_freqs, dtype=torch.float64)


def meta_rotary(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Meta's complex-number RoPE: view pairs (2i, 2i+1) as complex, multiply by e^{i pos freq}."""
    head_dim = x.shape[-1]
    freqs = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    angles = torch.outer(positions.double(), freqs)  # (seqlen, head_dim/2)
    freqs_cis = torch.polar(torch.ones_like(angles), angles)
    xc = torch.view_as_complex(x.double().reshape(*x.shape[:-1], -1, 2))  # (bs, seqlen, heads, head_dim/2)
    return torch.view_as_real(xc * freqs_cis[None, :, None, :]).flatten(3)


def naive_gqa_attention(attn: Attention, x: torch.Tensor, theta: float) -> torch.Tensor:
    bs, seqlen, _ = x.shape
    hd = attn.head_dim
    q = (x @ attn.wq.weight.T).view(bs, seqlen, -1, hd)
    k = (x @ attn.wk.weight.T).view(bs, seqlen, -1, hd)
    v = (x @ attn.wv.weight.T).view(bs, seqlen, -1, hd).double()
    pos = torch.arange(seqlen)
    q, k = meta_rotary(q, pos, theta), meta_rotary(k, pos, theta)
    n_rep = q.shape[2] // k.shape[2]
    k = k[:, :, :, None, :].expand(-1, -1, -1, n_rep, -1).reshape(bs, seqlen, -1, hd)  # kv head j serves q heads j*n_rep..
    v = v[:, :, :, None, :].expand(-1, -1, -1, n_rep, -1).reshape(bs, seqlen, -1, hd)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(hd)
    mask = torch.ones(seqlen, seqlen, dtype=torch.bool).tril()
    probs = scores.masked_fill(~mask, float("-inf")).softmax(dim=-1)
    out = torch.einsum("bhqk,bkhd->bqhd", probs, v).reshape(bs, seqlen, -1)
    return out @ attn.wo.weight.double().T


# ---- model --------------------------------------------------------------------------


def test_forward_shapes_and_tied_embeddings():
    tokens = torch.randint(0, TINY.vocab_size, (2, 16))
    assert build(TINY)(tokens).shape == (2, 16, TINY.vocab_size)
    tied = build(dataclasses.replace(TINY, tie_word_embeddings=True))
    assert tied.output.weight is tied.tok_embeddings.weight
    assert tied(tokens).shape == (2, 16, TINY.vocab_size)
    with torch.device("meta"):
        tied_meta = Transformer(dataclasses.replace(TINY, tie_word_embeddings=True))
    tied_meta.to_empty(device="cpu")
    tied_meta.init_weights(buffer_device="cpu")
    assert tied_meta.output.weight is tied_meta.tok_embeddings.weight  # re-tied by init_weights
    # a tied weight is initialised once, as an embedding (std 0.02), not as the output (std dim**-0.5 = 0.125)
    assert tied_meta.output.weight.abs().max() <= 3 * 0.02 + 1e-7
    with pytest.raises(ValueError, match="max_seq_len"):
        build(TINY)(torch.zeros(1, TINY.max_seq_len + 1, dtype=torch.long))


def test_causality():
    model = build(TINY)
    tokens = torch.randint(0, TINY.vocab_size, (2, 12))
    changed = tokens.clone()
    t = 7
    changed[:, t] = (tokens[:, t] + 1) % TINY.vocab_size
    with torch.no_grad():
        a, b = model(tokens), model(changed)
    torch.testing.assert_close(a[:, :t], b[:, :t], rtol=0, atol=1e-6)
    assert (a[:, t:] - b[:, t:]).abs().amax(dim=-1).min() > 1e-4  # every later position sees the change


def test_meta_init_matches_cpu_init():
    args = dataclasses.replace(TINY, rope_scaling=RopeScaling())
    cpu = build(args, seed=123)
    with torch.device("meta"):
        meta = Transformer(args)
    assert meta.rope_cache.is_meta
    meta.to_empty(device="cpu")
    torch.manual_seed(123)
    meta.init_weights(buffer_device="cpu")
    cpu_sd, meta_sd = cpu.state_dict(), meta.state_dict()
    assert cpu_sd.keys() == meta_sd.keys()
    for name in cpu_sd:
        assert torch.equal(cpu_sd[name], meta_sd[name]), name
    assert torch.equal(cpu.rope_cache, meta.rope_cache)


def test_init_std_and_truncation():
    args = llama3_flavors["debugmodel"]
    model = build(args)

    def check(w, std):
        # N(0, std) truncated at +-3 std has std * sqrt(1 - 6 phi(3) / (2 Phi(3) - 1))
        phi3 = math.exp(-4.5) / math.sqrt(2 * math.pi)
        big_phi3 = 0.5 * (1 + math.erf(3 / math.sqrt(2)))
        expected = std * math.sqrt(1 - 6 * phi3 / (2 * big_phi3 - 1))
        assert w.abs().max() <= 3 * std * (1 + 1e-6)
        assert abs(w.std().item() - expected) < 0.03 * expected
        assert abs(w.mean().item()) < 0.03 * std

    check(model.tok_embeddings.weight, 0.02)
    check(model.output.weight, 256**-0.5)
    for i in (0, 5):
        block = model.layers[str(i)]
        depth_std = 0.02 / math.sqrt(2 * (i + 1))
        check(block.attention.wq.weight, 0.02)
        check(block.feed_forward.w1.weight, 0.02)
        check(block.attention.wo.weight, depth_std)
        check(block.feed_forward.w2.weight, depth_std)
        check(block.feed_forward.w3.weight, depth_std)
        assert torch.equal(block.ffn_norm.weight, torch.ones(256))
    assert torch.equal(model.norm.weight, torch.ones(256))


def test_gqa_attention_matches_naive_repeat_kv():
    torch.manual_seed(0)
    args = ModelArgs(dim=48, n_layers=1, n_heads=6, n_kv_heads=2, vocab_size=11, max_seq_len=32, rope_theta=10000.0)
    attn = Attention(args)
    for p in attn.parameters():
        nn.init.normal_(p, std=0.2)
    x = torch.randn(2, 9, 48)
    rope = precompute_rope_cache(args.attention_head_dim, args.max_seq_len, args.rope_theta)
    with torch.no_grad():
        out = attn(x, rope)
        ref = naive_gqa_attention(attn, x, args.rope_theta)
    torch.testing.assert_close(out.double(), ref, rtol=1e-4, atol=1e-5)


def test_rope_scaled_inverse_frequencies_match_meta():
    scaling = RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192)
    ours = compute_rope_inv_freq(128, 500000.0, scaling).double()
    base = 1.0 / (500000.0 ** (torch.arange(0, 128, 2, dtype=torch.float32) / 128))
    ref = meta_apply_scaling(base, 8.0, 1.0, 4.0, 8192)
    torch.testing.assert_close(ours, ref, rtol=1e-6, atol=0)
    base = base.double()
    # the three regimes are all exercised: kept, divided by 8, smoothly blended
    kept, divided = torch.isclose(ref, base), torch.isclose(ref, base / 8)
    assert kept.any() and divided.any() and (~kept & ~divided).any()
    torch.testing.assert_close(compute_rope_inv_freq(128, 500000.0, None).double(), base)


def test_rope_takes_a_bf16_cache_as_fsdp_mixed_precision_passes_it():
    """FSDP's MixedPrecisionPolicy casts each block's float inputs, the RoPE cache included, to bf16."""
    torch.manual_seed(0)
    rope = precompute_rope_cache(8, 64, 10000.0)
    x = torch.randn(2, 16, 3, 8, dtype=torch.bfloat16)
    rotated = apply_rotary_emb(x, rope.bfloat16())
    assert rotated.dtype == torch.bfloat16
    # Only the cache's bf16 rounding (2^-8 relative) separates it from the fp32-cache rotation.
    torch.testing.assert_close(rotated.float(), apply_rotary_emb(x, rope).float(), rtol=2e-2, atol=2e-2)


def test_rope_positions_rotate_like_the_full_sequence():
    torch.manual_seed(0)
    bs, T, heads, hd = 2, 16, 3, 8
    rope = precompute_rope_cache(hd, 64, 10000.0)
    x = torch.randn(bs, T, heads, hd)
    full = apply_rotary_emb(x, rope)
    torch.testing.assert_close(full.double(), meta_rotary(x, torch.arange(T), 10000.0), rtol=1e-5, atol=1e-5)
    second = apply_rotary_emb(x[:, T // 2 :], rope, positions=torch.arange(T // 2, T))
    torch.testing.assert_close(second, full[:, T // 2 :])
    per_batch = torch.arange(T // 2, T).expand(bs, -1)  # (bs, seqlen) positions
    torch.testing.assert_close(apply_rotary_emb(x[:, T // 2 :], rope, positions=per_batch), full[:, T // 2 :])
    model = build(TINY)
    tokens = torch.randint(0, TINY.vocab_size, (2, 10))
    with torch.no_grad():
        torch.testing.assert_close(model(tokens, positions=torch.arange(10)), model(tokens))


def test_pipeline_stages_run_on_hidden_states():
    args = dataclasses.replace(TINY, n_layers=6)
    full = build(args)
    first, last = copy.deepcopy(full), copy.deepcopy(full)
    for i in ("3", "4", "5"):
        del first.layers[i]
    first.norm = first.output = None
    for i in ("0", "1", "2"):
        del last.layers[i]
    last.tok_embeddings = None
    assert list(last.layers.keys()) == ["3", "4", "5"]
    tokens = torch.randint(0, args.vocab_size, (2, 8))
    with torch.no_grad():
        hidden = first(tokens)
        assert hidden.shape == (2, 8, args.dim)
        torch.testing.assert_close(last(hidden), full(tokens))
    # init_weights on stages with None modules, depth std kept by layer_id
    torch.manual_seed(0)
    first.init_weights()
    last.init_weights()
    assert last.layers["5"].attention.wo.weight.abs().max() <= 3 * 0.02 / math.sqrt(12) * (1 + 1e-6)


# ---- counts, plan, registry -------------------------------------------------------------


def test_count_params_published_and_built():
    assert count_params(llama3_flavors["8B"]) == 8_030_261_248
    assert count_params(llama3_flavors["70B"]) == 70_553_706_496
    assert count_params(llama3_flavors["405B"]) == 405_853_388_800
    for args in (llama3_flavors["debugmodel"], dataclasses.replace(TINY, tie_word_embeddings=True)):
        with torch.device("meta"):
            model = Transformer(args)
        assert count_params(args) == sum(p.numel() for p in model.parameters())
    # flavor names are honest to within 25% (1B is Llama 3.2 1B: 1.24B)
    for name, approx in (("10M", 10e6), ("50M", 50e6), ("110M", 110e6), ("350M", 350e6), ("1B", 1e9)):
        assert abs(count_params(llama3_flavors[name]) - approx) <= 0.25 * approx, name


def test_flops_per_token_by_hand():
    # debugmodel: dim 256, 6 layers, 16 heads (head_dim 16), 8 kv heads, vocab 2048,
    # ffn hidden int(2 * 1024 / 3) = 682 -> rounded up to 768
    per_block = 256 * 256 * 2 + 256 * 128 * 2 + 3 * 256 * 768 + 2 * 256
    non_embedding = 6 * per_block + 256 + 2048 * 256  # blocks, final norm, output
    expected = 6 * non_embedding + 12 * 6 * 16 * 16 * 2048
    assert expected == 69_225_984
    assert flops_per_token(llama3_flavors["debugmodel"], 2048) == expected
    tied = dataclasses.replace(llama3_flavors["debugmodel"], tie_word_embeddings=True)
    assert flops_per_token(tied, 2048) == expected  # the tied output still counts once


def test_plan_paths_resolve():
    model = build(dataclasses.replace(TINY, n_mtp_layers=1))
    blocks = model.get_submodule(llama3_plan.blocks)
    assert isinstance(blocks, nn.ModuleDict) and list(blocks.keys()) == ["0", "1", "2", "3"]  # 3: the depth
    kinds = {TPStyle.EMBEDDING: nn.Embedding, TPStyle.COLWISE: nn.Linear, TPStyle.ROWWISE: nn.Linear,
             TPStyle.OUTPUT: nn.Linear, TPStyle.NORM: nn.RMSNorm, TPStyle.BLOCK_INPUT: nn.Module,
             TPStyle.TOKENWISE: nn.Module}
    for path, style in llama3_plan.tp:
        assert isinstance(model.get_submodule(path), kinds[style]), path
    for key, block in blocks.items():
        for path, style in llama3_plan.block_tp:
            if key != "3" and path in ("input_proj", "head_norm"):  # only a depth has them
                continue
            assert isinstance(block.get_submodule(path), kinds[style]), path
        assert isinstance(block.get_submodule(llama3_plan.attention), ScaledDotProductAttention)
        for path, attrs in llama3_plan.head_counts:
            assert all(hasattr(block.get_submodule(path), a) for a in attrs)
    for path in llama3_plan.pp_first + llama3_plan.pp_last + llama3_plan.fsdp_root_units:
        model.get_submodule(path)


def test_registry_and_errors():
    spec = get_model_spec("llama3")
    assert spec.plan is llama3_plan and spec.flavors is llama3_flavors
    assert get_model_args("llama3", "8B") is llama3_flavors["8B"]
    with pytest.raises(ValueError) as err:
        get_model_args("llama3", "8b")
    message = str(err.value)
    assert "\n" not in message and "model.flavor" in message and "'8b'" in message
    listed = message.split("choose one of: ")[1].split(", ")
    assert sorted(listed) == sorted(llama3_flavors) and listed[0] == "8B"
    with pytest.raises(ValueError, match=r"model\.name 'lama3'.*llama3"):
        get_model_spec("lama3")
    with pytest.raises(ValueError, match="n_kv_heads"):
        ModelArgs(dim=64, n_heads=4, n_kv_heads=3)
