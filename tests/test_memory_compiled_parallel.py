"""Compiled blocks under tensor and context parallel in the memory estimate (`titan_core.memory.compiled_parallel`):
the fake measurement against what two real ranks save, and the analytic estimate's figures and notes."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from titan_core.config import load_config
from titan_core.job.meta_model import build_meta_model
from titan_core.memory.analytic import estimate_analytic
from titan_core.memory.compiled_parallel import Split, measure_parallel_block
from titan_models import get_model_args, get_model_spec
from titan_parallel.float8 import Float8Options
from titan_run import REPO, run_json_worker

SPEC = get_model_spec("llama3")
SEQ = 64  # the worker's
FLOAT8 = Float8Options(emulate=True, auto_filter_small_kn=False, filter_fqns=())  # the worker's


def test_a_compiled_tp_or_cp_rank_keeps_what_the_fake_measurement_reads(tmp_path):
    """Two gloo ranks, the debug block split by `apply_tp` and compiled per child, or by `apply_cp` (ring attention,
    compiled around it; Ulysses, one graph), compiled by `aot_eager` (what the trainer runs on CPU), save on real
    tensors exactly the bytes `measure_parallel_block` reads on fake ones with the same backend, with no budget and
    at 0.5, measured in that order in one process (each from an empty Dynamo cache: Ulysses read after ring once
    came out near the eager figures), and TP 2 with float8 linears; compiling keeps less than eager, the budget less
    still."""
    real = run_json_worker(REPO / "tests" / "workers" / "compiled_parallel_worker.py", 2, tmp_path / "out.json")
    args = dataclasses.replace(get_model_args("llama3", "debugmodel"), n_layers=1)
    meta = build_meta_model(SPEC, args)
    splits = {"tp": Split(tp=2), "ring": Split(cp=2, cp_method="ring"), "ulysses": Split(cp=2, cp_method="ulysses")}
    fake = {
        f"{name}/{kind}": measure_parallel_block(SPEC, meta, split=split, dim=args.dim, seq_len=SEQ,
                                                 dtype=torch.float32, memory_budget=b, backend="aot_eager")
        for name, split in splits.items() for kind, b in (("none", None), ("0.5", 0.5))
    }  # fmt: skip
    # float8 after the other TP measurements: DTensor's sharding caches once handed this one the earlier meshes, and
    # the partitioner, which breaks ties by the graph's input order, kept 739,620 bytes where the ranks keep 854,308
    fake["tp-float8/none"] = measure_parallel_block(SPEC, meta, split=splits["tp"], dim=args.dim, seq_len=SEQ,
                                                    dtype=torch.float32, backend="aot_eager", float8=FLOAT8)  # fmt: skip
    assert fake == {key: real[key] for key in fake}, (fake, real)
    assert real["tp/0.5"] < real["tp/none"] < real["tp/eager"], real
    assert real["ring/0.5"] < real["ring/none"] and real["ulysses/0.5"] < real["ulysses/none"], real


def test_a_tp_float8_block_keeps_its_float8_weight_shards_once_per_call():
    """Tensorwise float8 at TP 2 (the GPU's graph, bf16): what the compiled block keeps grows by the same bytes with
    each sequence, and on top keeps once per call each linear's float8 weight shard (1 byte an element) and its
    scalar scale: the scale is an all-reduce over the TP ranks, which the partitioner does not recompute. The bf16
    block keeps nothing per call."""
    args = dataclasses.replace(get_model_args("llama3", "debugmodel"), n_layers=1)
    meta = build_meta_model(SPEC, args)
    options = Float8Options(emulate=False, auto_filter_small_kn=False, filter_fqns=())

    def kept(float8, sequences: int) -> int:
        return measure_parallel_block(SPEC, meta, split=Split(tp=2), dim=args.dim, seq_len=SEQ, dtype=torch.bfloat16,
                                      float8=float8, sequences=sequences)  # fmt: skip

    for float8 in (None, options):
        one, two, three = (kept(float8, n) for n in (1, 2, 3))
        assert three - two == two - one > 0, (float8, one, two, three)
    block = next(iter(meta.get_submodule(SPEC.plan.blocks).children()))
    shards = sum(m.weight.numel() // 2 for m in block.modules() if isinstance(m, torch.nn.Linear))
    assert 2 * kept(None, 1) - kept(None, 2) == 0
    per_call = 2 * kept(options, 1) - kept(options, 2)
    assert shards <= per_call <= shards + 4 * 16, (per_call, shards)  # and a 4-byte scale or few per linear


def test_the_estimate_of_a_compiled_tp_job_takes_off_what_compiling_saves():
    base = ["--training.seq_len", "256", "--training.local_batch_size", "1", "--training.mixed_precision_param",
            "float32", "--parallelism.tensor_parallel_degree", "2"]  # fmt: skip

    def estimate(*extra: str):
        return estimate_analytic(load_config(None, [*base, *extra]), 2, device_type="cpu")

    eager, compiled = estimate(), estimate("--compile.enable", "true")
    budget = estimate("--compile.enable", "true", "--activation_checkpoint.mode", "memory_budget",
                      "--activation_checkpoint.memory_budget", "0.5")  # fmt: skip
    assert budget.ranks[0].activations < compiled.ranks[0].activations < eager.ranks[0].activations
    note = next(n for n in compiled.notes if n.startswith("compile: TP 2 block activations"))
    assert "AC none:" in note, note
    # the budget's note says what it costs: the FLOPs its backward graphs add at TP 2 (12% at 0.5 here)
    budget_note = next(n for n in budget.notes if n.startswith("compile: TP 2 block activations"))
    share = budget_note.split("memory budget 0.5: ")[1].split("its backward ")[1].split("%")[0]
    assert int(share) > 0 and "more matmul and attention FLOPs (the recompute)" in budget_note, budget_note
    # On CPU the figure is the compiled block's own: the eager CPU figure less what compiling saved on CPU
    args = get_model_args("llama3", "debugmodel")
    measured = measure_parallel_block(SPEC, build_meta_model(SPEC, args), split=Split(tp=2), dim=args.dim,
                                      seq_len=256, dtype=torch.float32)  # fmt: skip
    figure = int(note.split("AC none: ")[1].split(" ")[0].replace(",", ""))
    assert figure == pytest.approx(measured / 256, abs=2), (figure, measured / 256)
    # per token whatever the micro-batch: the bf16 TP block keeps nothing once per call (two sequences, one trace)
    two = estimate("--compile.enable", "true", "--training.local_batch_size", "2")
    two_note = next(n for n in two.notes if n.startswith("compile: TP 2 block activations"))
    assert "at 2 sequences per micro-batch: AC none: " in two_note, two_note
    assert int(two_note.split("AC none: ")[1].split(" ")[0].replace(",", "")) == figure, (two_note, figure)
    # selective op keeps its eager figure, and says so
    op = estimate("--compile.enable", "true", "--activation_checkpoint.mode", "selective",
                  "--activation_checkpoint.selective_ac_option", "op")  # fmt: skip
    assert any("AC selective as eager" in n for n in op.notes), op.notes


@pytest.mark.parametrize("method", ["ring", "ulysses"])
def test_the_estimate_of_a_compiled_cp_job_is_the_compiled_blocks_per_rank_token(method):
    """Under CP 2 the compiled block's figure is what it keeps over the rank's half of the sequence (the eager
    figures' token), below the eager figure, and a memory budget's below that, with its recompute said."""
    base = ["--training.seq_len", "256", "--training.local_batch_size", "1", "--training.mixed_precision_param",
            "float32", "--parallelism.context_parallel_degree", "2", "--parallelism.context_parallel_method", method]

    def estimate(*extra: str):
        return estimate_analytic(load_config(None, [*base, *extra]), 2, device_type="cpu")

    eager, compiled = estimate(), estimate("--compile.enable", "true")
    budget = estimate("--compile.enable", "true", "--activation_checkpoint.mode", "memory_budget")
    assert budget.ranks[0].activations < compiled.ranks[0].activations < eager.ranks[0].activations
    note = next(n for n in budget.notes if n.startswith(f"compile: CP 2 ({method}) block activations"))
    args = get_model_args("llama3", "debugmodel")
    measured = measure_parallel_block(SPEC, build_meta_model(SPEC, args), split=Split(cp=2, cp_method=method),
                                      dim=args.dim, seq_len=256, dtype=torch.float32, memory_budget=0.5)  # fmt: skip
    figure = int(note.split("memory budget 0.5: ")[1].split()[0].rstrip(",").replace(",", ""))  # "11,392,"
    assert "bytes per rank token per block" in note and figure == round(measured / 128), (note, measured)


@pytest.mark.parametrize("family", ["llama3", "qwen3"])
def test_the_devices_differ_in_the_eager_norms_which_the_estimate_counts_on_the_target(family):
    """The TP block is compiled on CPU; what its sequence-parallel norms keep, eager either way, is taken as on the
    target (`eager_norms_device_gap`). For Llama those norms are all an eager block keeps differently on CPU and on
    CUDA (the attention kernels keep alike); Qwen3's eager block differs by more, its QK norms, which sit inside the
    compiled attention, where Inductor decomposes them alike on both devices: taking the whole eager difference off
    would undercount its compiled block."""
    from titan_core.memory.activations import ActivationLayout
    from titan_core.memory.compiled_parallel import eager_norms_device_gap
    from titan_core.memory.eager_saved import measure_eager

    spec, args, seq = get_model_spec(family), get_model_args(family, "debugmodel"), 256
    eager = {
        device: measure_eager(spec, args, ActivationLayout(compute_bytes=2, tp=2, seq_len=seq, device_type=device))
        .for_tokens(seq).block * seq
        for device in ("cpu", "cuda")
    }  # fmt: skip
    gap = eager_norms_device_gap(spec, build_meta_model(spec, args), tp=2, dim=args.dim, seq_len=seq,
                                 dtype=torch.bfloat16, device="cuda")  # fmt: skip
    assert gap > 0
    if family == "llama3":
        assert eager["cpu"] - eager["cuda"] == gap
    else:
        assert eager["cpu"] - eager["cuda"] > gap


def test_a_tp_ranks_backward_is_its_share_of_the_blocks_and_a_budget_adds_its_recompute():
    """At TP 2 a rank's compiled backward (its children's backward graphs, `parallel_block_backward_flops`) does half the
    whole block's matmul and attention FLOPs (`measure_block`'s, which are torch's FlopCounterMode's:
    test_memory_budget.py), exactly, with no budget; budget 1 recomputes nothing, lower budgets no less, budget 0
    at most what the whole block recomputes at 0 (the eager norms between the children keep the residual sums the
    whole block's budget 0 recomputes, `wo`'s matmul with them). Qwen3 is measured after Llama 3 in the same process,
    where Dynamo reuses the feed-forward compiled for Llama 3's block: its backward is counted where it runs. The
    planner's per-token figures at TP 2 are each budget's, summed over the ranks, per block, times the blocks."""
    from titan_core.memory.compiled_saved import measure_block
    from titan_core.memory.compiled_parallel import parallel_block_backward_flops
    from titan_core.memory.plan_model import budget_recompute

    budgets = (1.0, 0.75, 0.5, 0.25, 0.0)
    for name in ("llama3", "qwen3"):
        spec, args = get_model_spec(name), get_model_args(name, "debugmodel")
        meta = build_meta_model(spec, args)
        rope = meta.get_buffer("rope_cache")
        whole = {
            b: measure_block(meta.get_submodule(f"{spec.plan.blocks}.0"), family=name, blocks_path=spec.plan.blocks,
                             rope_shape=tuple(rope.shape), dim=args.dim, batch=1, seq_len=SEQ, dtype=torch.float32,
                             ac="none", memory_budget=b).backward_flops
            for b in (None, 0.0)
        }  # fmt: skip
        rank = {
            b: parallel_block_backward_flops(spec, meta, split=Split(tp=2), dim=args.dim, seq_len=SEQ,
                                             dtype=torch.float32, memory_budget=b)
            for b in (None, *budgets)
        }  # fmt: skip
        assert 2 * rank[None] == whole[None] > 0, (name, rank, whole)
        recompute = [2 * (rank[b] - rank[None]) for b in budgets]
        assert recompute[0] == 0 and recompute == sorted(recompute), (name, recompute)
        assert 0 < recompute[-1] <= whole[0.0] - whole[None], (name, recompute, whole)
        cfg = load_config(None, ["--model.name", name, "--compile.enable", "true", "--training.seq_len", str(SEQ),
                                 "--training.mixed_precision_param", "float32"])  # fmt: skip
        planned = budget_recompute(cfg, (2,))
        expected = [(2, b, args.n_layers * 2 * (rank[b] - rank[None]) / SEQ) for b in (0.75, 0.5, 0.25)]
        assert planned == tuple(expected), (name, planned, expected)
