"""Compiled float8 blocks in the memory estimate (`compiled_saved.measure_block(float8=...)`): a block whose linears
torchao converts is traced as the trainer converts and compiles it, with the GPU's `_scaled_mm` graph for a CUDA
target whatever this host has. Held to what one Inductor-compiled float8 block (emulated: CPU) really keeps, to the
byte; then the 1B-shaped block as the GPU runs it, the estimate's note and the planner's budgets.
"""

from __future__ import annotations

import copy
import dataclasses
import sys

import pytest
import torch
import torch.nn as nn

from titan_core.config import load_config
from titan_core.job.meta_model import build_meta_model
from titan_core.memory.analytic import estimate_analytic
from titan_core.memory.compiled_saved import measure_block
from titan_core.memory.plan_model import budget_recompute
from titan_models import get_model_args, get_model_spec
from titan_parallel import ModelPlan
from titan_parallel.compile import apply_compile
from titan_parallel.float8 import Float8Options, apply_float8
from titan_run import REPO

sys.path.insert(0, str(REPO / "tests"))
from test_memory_budget import kept_as_estimated  # noqa: E402

pytest.importorskip("torchao")

SPEC = get_model_spec("llama3")
ONE_B = ["--model.flavor", "1B", "--training.seq_len", "2048", "--training.local_batch_size", "4",
         "--training.mixed_precision_param", "bfloat16", "--compile.enable", "true"]  # fmt: skip
FLOAT8 = ["--model.converters", "float8"]


def _trace(flavor: str, ac: str, float8: Float8Options | None, *, batch: int, seq: int, dtype: torch.dtype):
    args = get_model_args("llama3", flavor)
    meta = build_meta_model(SPEC, args)
    return measure_block(
        meta.get_submodule(f"{SPEC.plan.blocks}.0"),
        family="llama3",
        blocks_path=SPEC.plan.blocks,
        rope_shape=tuple(meta.get_buffer("rope_cache").shape),
        dim=args.dim,
        batch=batch,
        seq_len=seq,
        dtype=dtype,
        ac=ac,
        float8=float8,
    )


def test_a_compiled_float8_block_keeps_what_the_estimate_reads():
    """The debug block's linears in emulated tensorwise float8 (every one: the size filter off), compiled by Inductor
    on real CPU tensors, keep the bytes `measure_block` reads from the partitioner on fake ones."""
    args = dataclasses.replace(get_model_args("llama3", "debugmodel"), n_layers=1)
    batch, seq = 2, 64
    options = Float8Options(emulate=True, filter_fqns=(), auto_filter_small_kn=False)
    estimate = _trace("debugmodel", "none", options, batch=batch, seq=seq, dtype=torch.float32)
    plain = _trace("debugmodel", "none", None, batch=batch, seq=seq, dtype=torch.float32)
    assert estimate.total != plain.total, "the float8 block was traced as the plain one"

    torch.manual_seed(0)
    with torch.device("meta"):
        model = SPEC.build(args)
    model.to_empty(device="cpu")
    model.init_weights()
    blocks = SPEC.plan.blocks
    holder = nn.Module()
    holder.add_module(blocks, nn.ModuleDict({"0": copy.deepcopy(model.get_submodule(f"{blocks}.0"))}))
    assert len(apply_float8(holder, options)) == 7  # wq wk wv wo w1 w2 w3
    torch._dynamo.reset()
    apply_compile(holder, ModelPlan(blocks=blocks), backend="inductor")
    hidden = torch.randn(batch, seq, args.dim, requires_grad=True)  # (bs, seqlen, dim), what a block receives
    kept, grads = kept_as_estimated(holder.get_submodule(f"{blocks}.0"), model.get_buffer("rope_cache"), hidden,
                                    estimate)  # fmt: skip
    assert kept == estimate.total, (kept, [(t.name, t.shape) for t in estimate.tensors])
    assert all(g is not None and torch.isfinite(g).all() for g in grads)


def test_float8_blocks_are_traced_as_the_gpu_runs_them():
    """The 1B block, bf16, one sequence of 2048 tokens, with the GPU's float8 kernels (no emulation, on a host
    without them): tensorwise keeps a matmul input in float8 (1 byte an element) and less than the bf16 block;
    rowwise, whose casts the backward redoes per row, keeps more than tensorwise and no more than bf16; selective
    op AC keeps the matmuls' bf16 outputs whichever kernel made them (and a few scalar scales)."""
    shape = {"batch": 1, "seq": 2048, "dtype": torch.bfloat16}
    tensorwise = Float8Options(emulate=False)
    rowwise = Float8Options(recipe_name="rowwise", emulate=False)
    bf16, tw, rw = (_trace("1B", "none", f, **shape) for f in (None, tensorwise, rowwise))
    assert any(t.dtype == torch.float8_e4m3fn and t.shape[0] == 2048 for t in tw.tensors), tw.tensors
    assert not any(t.dtype == torch.float8_e4m3fn for t in bf16.tensors)
    assert tw.total < rw.total <= bf16.total, (tw.total, rw.total, bf16.total)
    assert _trace("1B", "op", tensorwise, **shape).per_token == _trace("1B", "op", None, **shape).per_token
    # emulated (a CPU run's graph) is another graph: the fp32 upcasts are what its partitioner cuts
    emulated = _trace("1B", "none", dataclasses.replace(tensorwise, emulate=True), **shape)
    assert not any(t.dtype == torch.float8_e4m3fn for t in emulated.tensors)


def test_the_estimate_and_the_planner_measure_compiled_float8_blocks():
    """A CUDA target's float8 job (`emulate = 'auto'`, resolved for the target, not this GPU-less host) is
    estimated with the blocks as the GPU compiles them, and says so; an explicit `emulate = true`, emulated; under
    TP the split block's float8 linears too, their per-call weight copies spread over the micro-batch. The planner's
    memory budgets are measured with the float8 block, at tp = 1 and under TP."""
    bf16_job = load_config(None, ONE_B)
    f8_job = load_config(None, [*ONE_B, *FLOAT8])
    bf16 = estimate_analytic(bf16_job, 1, device_type="cuda")
    f8 = estimate_analytic(f8_job, 1, device_type="cuda")
    gpu_trace = _trace("1B", "none", Float8Options(emulate=False), batch=1, seq=2048, dtype=torch.bfloat16)
    (note,) = [n for n in f8.notes if n.startswith("compile: block activations measured")]
    assert "float8 tensorwise linears as on the GPU" in note and f"AC none: {gpu_trace.per_token:,}" in note, note
    # the blocks' activations fall by 16 blocks x 8192 tokens x the difference; master weights' float8 copies of
    # the converted weights (1 byte each, `float8_precast`) come on top, both in the estimate's peak
    bf16_block = _trace("1B", "none", None, batch=1, seq=2048, dtype=torch.bfloat16).per_token
    assert f8.ranks[0].total < bf16.ranks[0].total - 16 * 8192 * (bf16_block - gpu_trace.per_token) / 2
    emulated = estimate_analytic(load_config(None, [*ONE_B, *FLOAT8, "--float8.emulate", "true"]), 1,
                                 device_type="cuda")  # fmt: skip
    assert any("float8 tensorwise linears emulated" in n for n in emulated.notes), emulated.notes
    # Under TP the split block is measured with its float8 linears too. Each keeps its float8 weight shard once per
    # call (the tensorwise scale is an all-reduce over the TP ranks, which the partitioner does not recompute): at
    # one sequence per micro-batch the float8 block keeps more than the bf16 one, at this job's 4 less.
    def tp2(batch: int, *extra: str):
        args = [*ONE_B, "--parallelism.tensor_parallel_degree", "2", "--training.local_batch_size", str(batch)]
        return estimate_analytic(load_config(None, [*args, *extra]), 2, device_type="cuda")

    float8_at_4 = tp2(4, *FLOAT8)
    (tp2_note,) = [n for n in float8_at_4.notes if n.startswith("compile: TP 2 block activations measured")]
    assert "float8 tensorwise linears as on the GPU" in tp2_note and "at 4 sequences per micro-batch" in tp2_note
    assert float8_at_4.ranks[0].activations < tp2(4).ranks[0].activations
    assert tp2(1, *FLOAT8).ranks[0].activations > tp2(1).ranks[0].activations

    rows = budget_recompute(f8_job, (1, 2))
    assert {tp for tp, _, _ in rows} == {1, 2}, rows
    for tp in (1, 2):
        recompute = {budget: flops for degree, budget, flops in rows if degree == tp}
        assert recompute[0.25] >= recompute[0.5] >= recompute[0.75] >= 0, (tp, recompute)
        assert recompute[0.25] > 0, (tp, recompute)
    assert budget_recompute(load_config(None, [*ONE_B, "--model.converters", "mx"]), (1,)) == ()
