"""Tensor parallel (+ sequence and loss parallel): validation in process, parity under torchrun.

The parity run is one launch of `workers/tp_cp_worker.py tp` on 4 gloo processes: a
seeded 2-layer debugmodel (dim 256, 16 heads, 8 KV heads, FFN 768, vocab 512) split
TP=2 and TP=4, with and without loss parallel, against the same model alone.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import types
from pathlib import Path

import pytest
import torch
from titan_run import FORK_RUN, titan_env
import warm_python

from titan_models.llama3 import ModelArgs, Transformer, llama3_flavors, llama3_plan
from titan_parallel import ModelPlan, ParallelConfigError, apply_tp, check_async_tp, check_tp

WORKER = Path(__file__).parent / "workers" / "tp_cp_worker.py"
TOL = 1e-5


def launch_worker(suite: str, tmp_path: Path) -> dict:
    """Run the worker on 4 processes and return rank 0's JSON of measured differences."""
    out = tmp_path / f"{suite}.json"
    cmd = [sys.executable, str(FORK_RUN), "4", str(WORKER), suite, str(out)]
    proc = warm_python.run(cmd, env=titan_env(), timeout=300)
    assert proc.returncode == 0, f"worker failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}"
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def tp_results(tmp_path_factory) -> dict:
    results = launch_worker("tp", tmp_path_factory.mktemp("tp"))
    print(json.dumps(results, indent=1))
    return results


def meta_transformer(args: ModelArgs) -> Transformer:
    with torch.device("meta"):
        return Transformer(args)


def meta_model() -> Transformer:
    return meta_transformer(dataclasses.replace(llama3_flavors["debugmodel"], n_layers=2, vocab_size=512))


# ---- validation (no processes) --------------------------------------------------------------


def test_check_tp_accepts_divisible_degrees():
    model = meta_model()  # 16 heads, 8 KV heads, FFN 768, vocab 512
    for degree in (1, 2, 4, 8):
        check_tp(model, llama3_plan, degree)


def test_check_tp_names_the_head_count_that_does_not_divide():
    model = meta_model()
    with pytest.raises(ParallelConfigError, match=r"^tp=3 does not divide n_heads=16; choose a tp that divides it$") as err:
        check_tp(model, llama3_plan, 3)
    assert err.value.arguments == ("tp",)
    # 16 divides n_heads 16 but not n_kv_heads 8.
    with pytest.raises(ParallelConfigError, match=r"^tp=16 does not divide n_kv_heads=8;"):
        check_tp(model, llama3_plan, 16)


def test_check_tp_names_ffn_hidden_dim_and_vocab_size():
    # FFN hidden: int(2 * 4 * 64 / 3) = 170, rounded up to multiple_of: 32 -> 192, 5 -> 170 (= 2 x 85).
    args = ModelArgs(dim=64, n_layers=1, n_heads=4, n_kv_heads=4, vocab_size=96, multiple_of=32, max_seq_len=16)
    check_tp(meta_transformer(args), llama3_plan, 4)
    with pytest.raises(ParallelConfigError, match=r"^tp=4 does not divide ffn_hidden_dim=170;"):
        check_tp(meta_transformer(dataclasses.replace(args, multiple_of=5)), llama3_plan, 4)
    with pytest.raises(ParallelConfigError, match=r"^tp=2 does not divide vocab_size=97;"):
        check_tp(meta_transformer(dataclasses.replace(args, vocab_size=97)), llama3_plan, 2)


def test_check_tp_refuses_a_model_without_a_plan():
    with pytest.raises(ParallelConfigError) as err:
        check_tp(meta_model(), ModelPlan(blocks="layers"), 2)
    assert str(err.value) == "model Transformer has no tensor-parallel plan (ModelPlan.tp, ModelPlan.block_tp); set tp=1"
    assert err.value.arguments == ("tp",)
    check_tp(meta_model(), ModelPlan(blocks="layers"), 1)  # degree 1 needs no plan


def test_tp_splits_each_experts_hidden_dim_and_replicates_the_router():
    # DeepSeek-V3 debugmodel: 8 routed experts of hidden 256 and one shared, split over a fake 2-rank TP mesh.
    from torch.distributed.tensor import Replicate, Shard

    from titan_core.job.meta_model import build_meta_model
    from titan_core.memory.fake_run import fake_mesh
    from titan_models import get_model_args, get_model_spec

    spec, args = get_model_spec("deepseek_v3"), get_model_args("deepseek_v3", "debugmodel")
    with torch.device("meta"):  # a model of its own: build_meta_model's are shared (cached) and must stay plain
        model = spec.build(args)
    with fake_mesh(2, 1, "cpu") as mesh:
        apply_tp(model, spec.plan, mesh["tp"])
    moe = model.layers["1"].moe
    expected = {  # name: (placement, local shape)
        "experts.w1": (Shard(1), (8, 128, 256)),
        "experts.w3": (Shard(1), (8, 128, 256)),
        "experts.w2": (Shard(2), (8, 256, 128)),
        "shared_experts.w1.weight": (Shard(0), (128, 256)),
        "shared_experts.w2.weight": (Shard(1), (256, 128)),
        "router.gate.weight": (Replicate(), (8, 256)),
    }
    for name, (placement, shape) in expected.items():
        param = moe.get_parameter(name)
        assert (param.placements, tuple(param.to_local().shape)) == ((placement,), shape), name
    assert moe.grad_share == 0.5  # the auxiliary loss's share of each TP rank's backward
    # Under expert parallel too (a fake 2 x 2 mesh as (ep, tp)): experts split by expert, then by hidden dim.
    from titan_parallel.expert_parallel import apply_ep

    with torch.device("meta"):
        model = spec.build(args)
    with fake_mesh(2, 2, "cpu") as mesh:
        apply_ep(model, spec.plan, mesh)
        apply_tp(model, spec.plan, mesh["tp"])
    w1 = model.layers["1"].moe.experts.w1
    assert (w1.placements, tuple(w1.to_local().shape)) == ((Shard(0), Shard(1)), (4, 128, 256))
    assert model.layers["1"].moe.shared_experts.w1.weight.placements == (Shard(0),)
    # The TP ranks joining expert parallel (etp=1): whole experts split by expert over the 4 ranks of (cp, tp),
    # the shared experts colwise / rowwise, the router replicated.
    with torch.device("meta"):
        model = spec.build(args)
    with fake_mesh(2, 2, "cpu") as mesh:
        apply_ep(model, spec.plan, mesh["cp", "tp"]._flatten("ep"))
        apply_tp(model, spec.plan, mesh["tp"], ep_spans_tp=True)
    moe = model.layers["1"].moe
    expected = {
        "experts.w1": ((Shard(0),), (2, 256, 256)),
        "experts.w2": ((Shard(0),), (2, 256, 256)),
        "shared_experts.w1.weight": ((Shard(0),), (128, 256)),
        "shared_experts.w2.weight": ((Shard(1),), (256, 128)),
        "router.gate.weight": ((Replicate(),), (8, 256)),
    }
    for name, (placements, shape) in expected.items():
        param = moe.get_parameter(name)
        assert (param.placements, tuple(param.to_local().shape)) == (placements, shape), name
    assert moe.grad_share == 0.5
    # A hidden dim tp does not divide is named before anything is split; with etp=1 the routed experts stay whole.
    odd = dataclasses.replace(args, moe=dataclasses.replace(args.moe, hidden_dim=258, num_shared_experts=0))
    with pytest.raises(ParallelConfigError, match=r"^tp=4 does not divide layers\.1\.moe\.experts\.w1\.shape\[1\]=258;"):
        check_tp(build_meta_model(spec, odd), spec.plan, 4)
    check_tp(build_meta_model(spec, odd), spec.plan, 4, ep_spans_tp=True)
    # An expert weight by another name would run whole on each rank and be summed tp times: refused.
    with torch.device("meta"):
        renamed = spec.build(args)
    for block in list(renamed.layers.values())[1:]:
        block.moe.experts.register_parameter("gate_up", block.moe.experts.w1)
        del block.moe.experts.w1
    with pytest.raises(ParallelConfigError, match=r"^tensor parallel cannot split layers\.1\.moe\.experts\.gate_up: "):
        check_tp(renamed, spec.plan, 2)


def test_apply_tp_validates_before_touching_the_model():
    model = meta_model()
    before = {n: type(p) for n, p in model.named_parameters()}
    mesh_of_three = types.SimpleNamespace(size=lambda: 3, device_type="cpu")  # validation reads only the size
    with pytest.raises(ParallelConfigError, match="does not divide n_heads=16"):
        apply_tp(model, llama3_plan, mesh_of_three)
    assert {n: type(p) for n, p in model.named_parameters()} == before


def test_async_tp_needs_tp_cuda_and_compile():
    check_async_tp(2, "cuda", compile=True)
    with pytest.raises(ParallelConfigError, match=r"^async_tp needs a CUDA device \(device_type is 'cpu'\): ") as err:
        check_async_tp(2, "cpu", compile=True)
    assert err.value.arguments == ("async_tp", "device_type")
    with pytest.raises(ParallelConfigError, match=r"needs tp > 1 \(got tp=1\) and compile=True and a CUDA device") as err:
        check_async_tp(1, "cpu", compile=False)
    assert err.value.arguments == ("async_tp", "tp", "compile", "device_type")


def test_parallelize_passes_the_compile_flag_to_async_tp(tp_results):
    # Through `parallelize` (as the trainer calls it) with TP 2 on CPU: with compile on, only
    # the device is missing; before the fix the compile flag never arrived and compile was
    # always reported off.
    r = tp_results["parallelize_async_tp"]
    assert r["compile_on_error_names_cuda"] == 1.0 and r["compile_on_error_names_compile"] == 0.0
    assert r["compile_off_error_names_compile"] == 1.0


# ---- parity under torchrun ---------------------------------------------------------------------


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("mode", ["loss_parallel", "replicated_logits"])
def test_tp_matches_single_process(tp_results, tp, mode):
    r = tp_results[f"tp{tp}_{mode}"]
    assert r["wq_local_rows"] == 256 / tp  # wq really sharded: 16 heads x 16 dims over tp ranks
    assert r["logits_is_dtensor"] == (1.0 if mode == "loss_parallel" else 0.0)
    assert r["n_grads"] == 21  # embedding, 2 x (2 norms + 4 attention + 3 FFN), norm, output
    assert r["logits"] < TOL, r
    assert r["loss"] < TOL, r
    assert r["grads"] < TOL, r
    assert r["grads_rel"] < 1e-5, r


def test_tp_keeps_tied_embeddings_tied(tp_results):
    r = tp_results["tp2_tied_embeddings"]
    assert r["still_tied"] == 1.0
    assert r["n_grads"] == 20  # one shared embedding/output weight
    for key in ("logits", "loss", "grads"):
        assert r[key] < TOL, (key, r)
