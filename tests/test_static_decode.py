"""The static decode step of `titan generate` against the eager references, on CPU in float32.

Tiny Titan models (llama3, qwen3) with large random weights, a batch of prompts of
different lengths: the static step (eager, and compiled with the `aot_eager` backend,
the same Dynamo/AOT capture as Inductor without its slow C++ build) gives the same
greedy tokens as recomputing every sequence from scratch (`use_kv_cache=False`) and as
the dynamic cache loop, EOS included; the step compiles to one graph and reads nothing
back to the host; `--dtype auto`, `--compile`'s default and the bandwidth table; the
decode benchmark's smoke run.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib.util
from collections.abc import Iterator

import pytest
import torch
from torch._dynamo.utils import counters

from titan_core.config.errors import ConfigError
from titan_core.generation import (
    GREEDY,
    SamplingParams,
    generate,
    kv_cache,
    peak_memory_bandwidth,
    resolve_compile,
    resolve_dtype,
    resolve_tuning,
)
from titan_core.generation.decode_speed import DecodeTiming
from titan_core.generation.fused_linears import fuse_shared_input_linears
from titan_core.generation.generate import last_position_logits
from titan_core.generation.static_decode import StaticDecoder, cache_slots
from titan_models import get_model_spec
from titan_models.llama3.model import ModelArgs as Llama3Args
from titan_models.qwen3.model import ModelArgs as Qwen3Args
from titan_parallel.plan import ModelPlan
from titan_run import REPO

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")

PROMPTS = [[1, 5, 9, 33, 40, 7, 8, 100], [1, 200, 3], [7, 7, 11, 250, 19]]  # different lengths: left-padded
NEW_TOKENS = 10
TINY_ARGS = {
    "llama3": Llama3Args(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=256, multiple_of=32, max_seq_len=64),
    "qwen3": Qwen3Args(
        dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=32, hidden_dim=96, vocab_size=256, max_seq_len=64
    ),
}
"""Family -> ModelArgs of a tiny model of it, grouped-query attention included."""


@functools.cache
def tiny_model(family: str) -> tuple[torch.nn.Module, ModelPlan]:
    """A tiny model of `family` in eval mode and its plan; weights drawn with std 0.15 so that
    greedy decoding does not settle on one token."""
    spec = get_model_spec(family)
    torch.manual_seed(0)
    model = spec.build(TINY_ARGS[family])
    model.init_weights()
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() > 1:
                param.normal_(0.0, 0.15)
    return model.eval().requires_grad_(False), spec.plan


@pytest.fixture(scope="module", params=sorted(TINY_ARGS))
def tiny(request) -> tuple[torch.nn.Module, ModelPlan]:
    """(model, plan) of each family in TINY_ARGS."""
    return tiny_model(request.param)


def test_static_step_matches_the_references(tiny):
    model, plan = tiny
    recompute = generate(model, plan, PROMPTS, NEW_TOKENS, use_kv_cache=False, return_logits=True)
    dynamic = generate(model, plan, PROMPTS, NEW_TOKENS, static_cache=False).tokens
    static = generate(model, plan, PROMPTS, NEW_TOKENS, return_logits=True)
    assert static.tokens == dynamic == recompute.tokens
    assert all(len(row) == NEW_TOKENS for row in static.tokens) and len({t for row in static.tokens for t in row}) > 3
    for a, b in zip(static.step_logits, recompute.step_logits, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
    assert static.kv_bytes_per_token > 0 and static.timing is not None and static.timing.batch_size == len(PROMPTS)


def test_fused_projections_match_the_separate_linears_and_leave_the_model_as_it_was(tiny):
    """`fuse_linears` (the default) computes q/k/v and w1/w3 as one matmul each: same logits as the model's own
    linears, every block's two groups fused, and on exit the same modules and weights."""
    model, plan = tiny
    modules = [(name, type(m)) for name, m in model.named_modules()]
    weights = {name: t.clone() for name, t in model.state_dict().items()}
    separate = generate(model, plan, PROMPTS, NEW_TOKENS, return_logits=True, fuse_linears=False)
    fused = generate(model, plan, PROMPTS, NEW_TOKENS, return_logits=True)
    assert fused.tokens == separate.tokens
    for a, b in zip(fused.step_logits, separate.step_logits, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    with fuse_shared_input_linears(model, plan) as groups:
        assert groups == 2 * len(model.layers)
        attention = model.layers["0"].attention
        assert not any(type(getattr(attention, name)) is torch.nn.Linear for name in ("wq", "wk", "wv"))
    assert [(name, type(m)) for name, m in model.named_modules()] == modules
    assert all(torch.equal(t, weights[name]) for name, t in model.state_dict().items())


def test_a_moe_block_fuses_its_attention_only():
    spec = get_model_spec("qwen3_moe")
    with torch.device("meta"):
        model = spec.build(spec.flavors[next(iter(spec.flavors))])
    model.to_empty(device="cpu")
    with fuse_shared_input_linears(model, spec.plan) as groups:
        assert groups == len(model.layers)  # q/k/v in each block; the experts are no nn.Linear


def test_compiled_step_matches_eager_with_eos(tiny):
    model, plan = tiny
    counters.clear()
    free = generate(model, plan, PROMPTS, NEW_TOKENS, use_kv_cache=False).tokens
    compiled = generate(model, plan, PROMPTS, NEW_TOKENS, compile=True, compile_backend="aot_eager").tokens
    assert compiled == free
    assert not counters["graph_break"] and counters["stats"]["unique_graphs"] == 1  # one graph, no break
    # the first sequence's first token that appears at index 2 or later becomes the end of sequence (the random
    # weights differ between torch releases: which token that is, is read from the run)
    cut = next(i for i, t in enumerate(free[0]) if i >= 2 and free[0].index(t) == i)
    eos = free[0][cut]
    reference = generate(model, plan, PROMPTS, NEW_TOKENS, eos_ids=[eos], use_kv_cache=False).tokens
    for kwargs in ({}, {"compile": True, "compile_backend": "aot_eager"}):
        stopped = generate(model, plan, PROMPTS, NEW_TOKENS, eos_ids=[eos], **kwargs).tokens
        assert stopped == reference, kwargs
        assert stopped[0] == free[0][: cut + 1]  # cut after the EOS, kept as the last token
        for row, full in zip(stopped, free, strict=True):
            assert row == (full[: full.index(eos) + 1] if eos in full else full)


def test_deepseek_latent_cache_matches_the_expanded_cache_and_compiles():
    """MLA's latent cache (`wkv_b` absorbed): the static step's logits equal recomputing from scratch and caching
    every head's keys and values, in 1/5 of the cache bytes at this shape (71x at DeepSeek-V3's), and the step
    compiles to one graph, its MoE layers included (`gathered_mm`: 3 sequences x top 2 <= 8 experts). In
    float64: in fp32 (measured with every block dense) each of the three differs from the others by up to 2.1e-5 on
    logits of up to 9 (the expanded cache from recomputing as much as the latent), which would hide a small bug;
    in float64 they agree to the fp32 rounding the returned logits take (up to 4.8e-7)."""
    spec = get_model_spec("deepseek_v3")
    args = dataclasses.replace(spec.flavors["debugmodel"], vocab_size=256, max_seq_len=64)  # MoE blocks 1-3
    torch.manual_seed(0)
    model = spec.build(args)
    model.init_weights()
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() > 1:
                param.normal_(0.0, 0.15)
    model.to(torch.float64).eval().requires_grad_(False)
    recompute = generate(model, spec.plan, PROMPTS, NEW_TOKENS, use_kv_cache=False, return_logits=True)
    latent = generate(model, spec.plan, PROMPTS, NEW_TOKENS, return_logits=True)  # the prompt expanded, then absorbed
    dynamic = generate(model, spec.plan, PROMPTS, NEW_TOKENS, return_logits=True, static_cache=False)  # slot by slot
    assert latent.tokens == dynamic.tokens == recompute.tokens and len({t for row in latent.tokens for t in row}) > 3
    with kv_cache(model, spec.plan, len(PROMPTS), cache_slots(PROMPTS, NEW_TOKENS), "cpu", latent=False) as cache:
        decoder = StaticDecoder(model, cache, PROMPTS, NEW_TOKENS, GREEDY, (), torch.Generator())
        expanded = [decoder.prefill()] + [decoder.step() for _ in range(NEW_TOKENS - 1)]
        expanded_bytes = cache.bytes_per_token()
    for a, b, c, d in zip(latent.step_logits, recompute.step_logits, expanded, dynamic.step_logits, strict=True):
        torch.testing.assert_close(a, b, atol=2e-6, rtol=0)
        torch.testing.assert_close(a, c.float(), atol=2e-6, rtol=0)
        torch.testing.assert_close(d, b, atol=2e-6, rtol=0)
    assert latent.kv_bytes_per_token == args.n_layers * (args.kv_lora_rank + args.qk_rope_head_dim) * 8
    assert expanded_bytes == args.n_layers * args.n_heads * (args.qk_head_dim + args.v_head_dim) * 8
    counters.clear()
    compiled = generate(model, spec.plan, PROMPTS, NEW_TOKENS, compile=True, compile_backend="aot_eager")
    assert compiled.tokens == recompute.tokens
    assert not counters["graph_break"] and counters["stats"]["unique_graphs"] == 1


def test_compiled_sampling_draws_what_eager_draws():
    model, plan = tiny_model("llama3")  # one family: the draw does not depend on the model
    hot = SamplingParams(temperature=0.9, top_k=50, top_p=0.95)
    runs = [
        generate(model, plan, PROMPTS, NEW_TOKENS, sampling=hot, seed=3, **kwargs).tokens
        for kwargs in ({"use_kv_cache": False}, {}, {"compile": True, "compile_backend": "aot_eager"})
    ]
    assert runs[0] == runs[1] == runs[2]
    assert runs[0] != generate(model, plan, PROMPTS, NEW_TOKENS, sampling=GREEDY).tokens  # it did sample


READS = ("item", "tolist", "__bool__", "__int__", "__float__", "__index__", "numpy", "cpu")


@contextlib.contextmanager
def host_reads(sites: list[str]) -> Iterator[None]:
    """Record every call of a `torch.Tensor` method that reads a value back to the host."""
    saved = {name: getattr(torch.Tensor, name) for name in READS}

    def wrap(name):
        def counted(self, *args, **kwargs):
            sites.append(name)
            return saved[name](self, *args, **kwargs)

        return counted

    try:
        for name in READS:
            setattr(torch.Tensor, name, wrap(name))
        yield
    finally:
        for name, fn in saved.items():
            setattr(torch.Tensor, name, fn)


@torch.no_grad()
def test_decode_step_reads_nothing_on_the_host(tiny):
    model, plan = tiny
    generator = torch.Generator().manual_seed(0)
    with last_position_logits(model, plan), kv_cache(model, plan, 3, cache_slots(PROMPTS, 4), "cpu") as cache:
        decoder = StaticDecoder(model, cache, PROMPTS, 4, SamplingParams(temperature=1.0, top_k=5), [2], generator)
        decoder.prefill()
        sites: list[str] = []
        with host_reads(sites):
            for _ in range(3):
                decoder.draw()
                decoder.step()
        assert sites == []
        assert decoder.count.tolist() == [4]


def test_auto_dtype_and_compile_defaults(monkeypatch):
    cpu, gpu = torch.device("cpu"), torch.device("cuda")
    assert resolve_dtype("auto", cpu)[0] == torch.float32
    assert resolve_compile(None, cpu)[0] is False
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: not including_emulation)
    assert resolve_dtype("auto", gpu)[0] == torch.bfloat16  # native bf16 only: emulation does not count
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: False)
    assert resolve_dtype("auto", gpu)[0] == torch.float32
    assert resolve_dtype("float32", gpu)[0] == torch.float32 and resolve_dtype("bfloat16", cpu)[0] == torch.bfloat16
    assert resolve_compile(None, gpu)[0] is True and resolve_compile(False, gpu)[0] is False
    assert resolve_compile(True, cpu)[0] is True
    # kernel tuning: on by default where the step compiles on CUDA; never without compiling
    assert resolve_tuning(None, gpu, True) == (True, "default on CUDA")
    assert resolve_tuning(None, cpu, True)[0] is False and resolve_tuning(True, cpu, True)[0] is True
    assert resolve_tuning(None, gpu, False)[0] is False and resolve_tuning(False, gpu, True)[0] is False
    with pytest.raises(ConfigError, match="--dtype int8 is not a dtype; pass auto, float32 or bfloat16"):
        resolve_dtype("int8", cpu)


def test_compile_needs_the_static_cache(tiny):
    model, plan = tiny
    with pytest.raises(ConfigError, match="--no-kv-cache"):
        generate(model, plan, PROMPTS, 2, use_kv_cache=False, compile=True)


@pytest.mark.parametrize(
    "name, peak",
    [
        ("NVIDIA H100 80GB HBM3", 3.35e12),
        ("NVIDIA H100 PCIe", 2.0e12),
        ("NVIDIA H200", 4.8e12),
        ("NVIDIA A100-SXM4-80GB", 2.0e12),
        ("NVIDIA A100-PCIE-40GB", 1.555e12),
        ("NVIDIA L4", 0.3e12),
        ("NVIDIA B200", 8e12),
        ("NVIDIA GH200 480GB", None),  # not the H200
        ("NVIDIA L40S", None),  # not the L4
        ("Tesla V100-SXM2-16GB", None),
    ],
)
def test_peak_memory_bandwidth(name, peak):
    assert peak_memory_bandwidth(name) == peak


def test_bytes_per_step_adds_the_kv_cache_in_use():
    # batch 2, prompt of 4 slots, 3 timed steps after 1 warm-up step: slots in use 4+2, 4+3, 4+4
    timing = DecodeTiming(
        batch_size=2,
        prompt_slots=4,
        prefill_s=0.1,
        warmup_steps=1,
        warmup_s=1.0,
        steps=3,
        decode_s=0.5,
        kv_slots=6 + 7 + 8,
    )
    assert timing.bytes_per_step(param_bytes=1000, kv_bytes_per_token=10) == 1000 + 10 * 2 * (6 + 7 + 8) / 3
    assert timing.steps_per_s == 6.0 and timing.tokens_per_s == 12.0


def _decode_bench():
    """`benchmarks/decode_bench.py` as a module (benchmarks are scripts, not a package)."""
    spec = importlib.util.spec_from_file_location("decode_bench", REPO / "benchmarks" / "decode_bench.py")
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return bench


def test_decode_bench_smoke():
    """The benchmark's eager run (the compiled one is the step the tests above compile)."""
    bench = _decode_bench()
    figures = bench.run_decode_bench("debugmodel", 8, "cpu", compile=False)
    assert figures["tokens_match"] and figures["dtype"] == "float32" and list(figures["runs"]) == ["eager"]
    eager = figures["runs"]["eager"]
    assert len(eager["tokens"]) == 8 and eager["decode_steps"] == 7 and eager["warmup_steps"] == 0
    assert eager["bandwidth_share"] is None and eager["decode_tokens_per_s"] > 0
    assert eager["bytes_per_step"] > figures["parameter_bytes"]  # the KV cache adds to the weights
    assert bench.first_mismatch([1, 2, 3], [1, 2, 3]) is None
    assert bench.first_mismatch([1, 2, 3], [1, 5, 3]) == 1 and bench.first_mismatch([1, 2], [1, 2, 3]) == 2


def test_decode_bench_tells_a_near_tie_from_a_real_difference():
    """`mismatch_margin`: where two tokens' output rows are equal their logits tie exactly (the eager run keeps
    the lower id, argmax's first); a token far below the chosen one is not a near-tie."""
    import copy

    bench = _decode_bench()
    model, plan = tiny_model("llama3")
    model = copy.deepcopy(model)
    prompt = PROMPTS[0]
    tokens = generate(model, plan, [prompt], 4).tokens[0]
    twin = 255 if tokens[-1] != 255 else 254
    assert twin > tokens[-1]  # so the twin's tie never changes what greedy picks
    with torch.no_grad():
        model.output.weight[twin] = model.output.weight[tokens[-1]]
    assert generate(model, plan, [prompt], 4).tokens[0] == tokens
    tie = bench.mismatch_margin(model, plan, prompt, tokens, twin)
    assert tie["logit_gap"] == 0.0 and tie["near_tie"] and tie["eager_token"] == tokens[-1]
    logits = generate(model, plan, [prompt], 4, return_logits=True).step_logits[-1][0]
    lowest = int(logits.argmin())
    far = bench.mismatch_margin(model, plan, prompt, tokens, lowest)
    assert far["logit_gap"] > 100 * far["dtype_spacing"] and not far["near_tie"]
