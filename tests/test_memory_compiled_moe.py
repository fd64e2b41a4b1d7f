"""Compiled Mixture-of-Experts blocks in the memory estimate (`titan_core.memory.compiled_parallel` at one rank, the
routed experts eager at even load) and the stand-in for CUDA's attention kernel where head widths differ
(`titan_core.memory.wide_attention`): the fake measurement against what a real compiled block saves, the stand-in
against torch's attention and CUDA's kernel, and the estimate's figures and notes."""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from titan_core.config import load_config
from titan_core.job.meta_model import build_meta_model
from titan_core.memory.analytic import estimate_analytic
from titan_core.memory.compiled_parallel import Split, measure_parallel_block
from titan_core.memory.wide_attention import attention, cuda_like_attention
from titan_models import get_model_args, get_model_spec
from titan_parallel.compile import apply_compile
from titan_parallel.modules import get_submodule_or_none

SEQ = 64


def real_saved_bytes(name: str, flavor: str, index: int, *, compiled: bool, target: str) -> int:
    """What block `index` of a real model (random routing: uneven load) keeps for backward, compiled as the trainer
    compiles it (`aot_eager`, what it runs on CPU) or eager, counted by a `saved_tensors_hooks` pack written here:
    each storage once, parameters, buffers and the RoPE table left out, the block's input counted."""
    spec, args = get_model_spec(name), get_model_args(name, flavor)
    torch.manual_seed(0)
    model = spec.build(args)
    model.init_weights()
    rope = model.get_buffer("rope_cache")
    holder = nn.Module()
    block = copy.deepcopy(model.get_submodule(f"{spec.plan.blocks}.{index}"))
    holder.add_module(spec.plan.blocks, nn.ModuleDict({"0": block}))
    if compiled:
        torch._dynamo.reset()
        apply_compile(holder, spec.plan, backend="aot_eager")
    own = {t.untyped_storage().data_ptr() for t in (*block.parameters(), *block.buffers(), rope)}
    hidden = torch.randn(1, SEQ, args.dim, requires_grad=True)
    saved = {hidden.untyped_storage().data_ptr(): hidden.untyped_storage().nbytes()}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.untyped_storage().data_ptr() not in own:
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    like_cuda = cuda_like_attention() if target == "cuda" else contextlib.nullcontext()
    with like_cuda, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        block(hidden, rope_cache=rope)
    return sum(saved.values())


def test_a_compiled_moe_block_keeps_what_the_fake_measurement_reads():
    """Qwen3-MoE's block and DeepSeek-V3's dense and MoE blocks, compiled as the trainer compiles them (the routed
    experts eager between the compiled pieces), keep on real tensors with real (uneven) routing exactly the bytes
    the fake measurement reads at even load with the same backend (the experts' bytes depend on the token slots,
    not on how they spread); DeepSeek-V3's for a CUDA target too, its attention of unequal head widths as CUDA's
    kernel keeps it. Compiling keeps less than eager in each."""
    rows = [("qwen3_moe", "debugmodel_moe", 0, "cpu"), ("deepseek_v3", "debugmodel", 0, "cpu"),
            ("deepseek_v3", "debugmodel", 3, "cpu"), ("deepseek_v3", "debugmodel", 3, "cuda")]  # fmt: skip
    for name, flavor, index, target in rows:
        spec, args = get_model_spec(name), get_model_args(name, flavor)
        meta = build_meta_model(spec, args)
        block = meta.get_submodule(f"{spec.plan.blocks}.{index}")
        assert (get_submodule_or_none(block, spec.plan.moe) is not None) == (index > 0 or name == "qwen3_moe")
        fake = measure_parallel_block(spec, meta, split=Split(), dim=args.dim, seq_len=SEQ, dtype=torch.float32,
                                      backend="aot_eager", index=index, target=target)  # fmt: skip
        real = real_saved_bytes(name, flavor, index, compiled=True, target=target)
        eager = real_saved_bytes(name, flavor, index, compiled=False, target=target)
        assert fake == real < eager, (name, index, target, fake, real, eager)


def test_the_stand_in_attention_computes_torchs_attention_and_keeps_what_cudas_kernel_keeps():
    """`attention` (q / k heads 24 wide, v 16) gives torch's causal attention and its gradients (fp32, 1e-5); in a
    block it keeps q, k, v, the output and an fp32 log-sum-exp per head and token, what CUDA's memory-efficient
    kernel keeps, where CPU's math path keeps the scores: the DeepSeek-V3 block for a CUDA target keeps less."""
    torch.manual_seed(0)
    q, k = torch.randn(2, 3, 10, 24, requires_grad=True), torch.randn(2, 3, 10, 24, requires_grad=True)
    v = torch.randn(2, 3, 10, 16, requires_grad=True)
    grad = torch.randn(2, 3, 10, 16)
    out, lse = attention(q, k, v, 0.3)
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.3)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    scores = (q @ k.transpose(-2, -1) * 0.3).masked_fill(torch.ones(10, 10, dtype=torch.bool).triu(1), float("-inf"))
    torch.testing.assert_close(lse, F.pad(scores.logsumexp(-1), (0, 22)), rtol=1e-5, atol=1e-5)  # to 32 rows
    mine = torch.autograd.grad(out, (q, k, v), grad)
    theirs = torch.autograd.grad(ref, (q, k, v), grad)
    for a, b in zip(mine, theirs, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)

    saved: list[torch.Tensor] = []
    with cuda_like_attention(), torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.3)
    shapes = [(2, 3, 10, 24), (2, 3, 10, 24), (2, 3, 10, 16), (2, 3, 10, 16), (2, 3, 32)]  # q, k, v, out, lse
    assert sorted(tuple(t.shape) for t in saved) == sorted(shapes), [t.shape for t in saved]
    assert [t.dtype for t in saved if t.dim() == 3] == [torch.float32]

    from titan_core.memory.fake_run import _cuda_sdpa, fake_target

    with fake_target("cuda"):  # what an H100's kernel keeps for the same call in bf16, on fake CUDA tensors
        qc, kc, vc = (torch.empty(t.shape, dtype=torch.bfloat16, device="cuda", requires_grad=True) for t in (q, k, v))
        cuda: list[torch.Tensor] = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: cuda.append(t) or t, lambda t: t):
            _cuda_sdpa(qc, kc, vc, is_causal=True, scale=0.3)
    big = sorted((tuple(t.shape), t.dtype) for t in cuda if t.dim() >= 3)  # less the RNG state's two scalars
    q16, k16, v16 = (t.detach().bfloat16().requires_grad_() for t in (q, k, v))
    stand_in: list[torch.Tensor] = []
    with cuda_like_attention(), torch.autograd.graph.saved_tensors_hooks(lambda t: stand_in.append(t) or t,
                                                                         lambda t: t):  # fmt: skip
        F.scaled_dot_product_attention(q16, k16, v16, is_causal=True, scale=0.3)
    assert big == sorted((tuple(t.shape), t.dtype) for t in stand_in), (big, stand_in)


@pytest.fixture(scope="module")
def estimates():
    base = ["--training.seq_len", "256", "--training.local_batch_size", "2", "--training.mixed_precision_param",
            "float32"]  # fmt: skip
    models = {"qwen3_moe": ["--model.name", "qwen3_moe", "--model.flavor", "debugmodel_moe"],
              "deepseek_v3": ["--model.name", "deepseek_v3", "--model.flavor", "debugmodel"]}  # fmt: skip
    return {
        (name, compiled): estimate_analytic(load_config(None, [*base, *flags, "--compile.enable", compiled]), 1,
                                            device_type="cpu")  # fmt: skip
        for name, flags in models.items()
        for compiled in ("false", "true")
    }


def test_a_compiled_moe_job_is_estimated_with_its_compiled_blocks(estimates):
    """The estimate of a compiled MoE job counts each block kind's compiled figure (DeepSeek-V3: its dense and its
    MoE blocks apart), below the eager one, and says so; its peak is lower than the eager job's."""
    for name in ("qwen3_moe", "deepseek_v3"):
        eager, compiled = estimates[(name, "false")], estimates[(name, "true")]
        note = next(n for n in compiled.notes if n.startswith("compile:"))
        assert note.startswith("compile: block activations measured compiled"), note
        assert "the routed experts eager at even load" in note, note
        assert compiled.peak < eager.peak, (name, compiled.peak, eager.peak)
    note = next(n for n in estimates[("deepseek_v3", "true")].notes if n.startswith("compile:"))
    assert "dense block, AC none" in note and "MoE block, AC none" in note, note


def test_a_bf16_moe_block_for_a_cuda_target_runs_its_experts_as_one_grouped_matmul():
    """For a CUDA target a bf16 MoE block's experts run as Hopper's `torch._grouped_mm` (on fake CPU tensors), as the
    trainer runs them there, rather than CPU's per-expert loop: the same bytes but the int32 group offsets each of
    the three grouped matmuls keeps (the loop reads the counts on the host)."""
    spec, args = get_model_spec("qwen3_moe"), get_model_args("qwen3_moe", "debugmodel_moe")
    meta = build_meta_model(spec, args)
    kept = {
        target: measure_parallel_block(spec, meta, split=Split(), dim=args.dim, seq_len=SEQ, dtype=torch.bfloat16,
                                       target=target)  # fmt: skip
        for target in ("cpu", "cuda")
    }
    assert kept["cuda"] - kept["cpu"] == 3 * 4 * args.moe.num_experts, kept


def test_layouts_that_differ_where_a_block_cannot_see_it_share_its_trace(monkeypatch):
    """Expert parallel spanning the TP ranks picks the MoE input's TP style only (a dense block is split alike with or
    without it) and the CP methods mean nothing at cp = 1: DeepSeek-V3's dense block at TP 2 is traced once for both
    `ep_spans_tp` values and any CP method, its MoE block once for each `ep_spans_tp` value."""
    from titan_core.memory import compiled_parallel
    from titan_parallel.tensor_parallel import planned_styles

    spec, args = get_model_spec("deepseek_v3"), get_model_args("deepseek_v3", "debugmodel")
    meta = build_meta_model(spec, args)
    blocks = list(meta.get_submodule(spec.plan.blocks).children())
    dense, moe = (next(i for i, b in enumerate(blocks) if (get_submodule_or_none(b, spec.plan.moe) is None) == d)
                  for d in (True, False))  # fmt: skip

    def styles(index: int, spans: bool) -> dict[str, str]:
        planned = planned_styles(blocks[index], spec.plan.block_tp, loss_parallel=True, ep_spans_tp=spans)
        return {path: type(style).__name__ for path, style in planned.items()}

    assert styles(dense, True) == styles(dense, False)
    assert styles(moe, True) != styles(moe, False)
    monkeypatch.setattr(compiled_parallel, "_CACHE", {})

    def traces(index: int, split: Split) -> int:
        before = len(compiled_parallel._CACHE)
        measure_parallel_block(spec, meta, split=split, dim=args.dim, seq_len=SEQ, dtype=torch.float32, index=index)
        return len(compiled_parallel._CACHE) - before

    assert traces(dense, Split(2, ep_spans_tp=False)) == 1
    assert traces(dense, Split(2, ep_spans_tp=True, cp_method="ulysses", cp_rotate_method="rotate")) == 0
    assert traces(moe, Split(2, ep_spans_tp=False)) == 1
    assert traces(moe, Split(2, ep_spans_tp=True)) == 1
