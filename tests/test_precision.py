"""The compute dtype that suits the machine, one bf16 casting path for 1 and N ranks, and async TP
refused before any process starts."""

from __future__ import annotations

import json
import sys
import warnings

import pytest
import torch
from titan_parallel import ParallelOptions, mixed_precision_context, resolve_param_dtype, uses_fsdp
from titan_run import FORK_RUN, REPO, TINY, run_titan, titan_env
import warm_python

CPU = torch.device("cpu")


def fake_cpu(monkeypatch, *, amx: bool, avx512_bf16: bool) -> None:
    """Make torch's CPU feature probes answer as a given machine would, its oneDNN not held to an older ISA."""
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    monkeypatch.delenv("DNNL_MAX_CPU_ISA", raising=False)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: avx512_bf16)


def test_auto_is_float32_on_a_cpu_without_native_bf16(monkeypatch):
    fake_cpu(monkeypatch, amx=False, avx512_bf16=False)
    dtype, reason = resolve_param_dtype("auto", CPU)
    assert dtype is torch.float32
    assert reason.startswith("auto: float32, since this CPU has neither AVX512-BF16 nor AMX")


@pytest.mark.parametrize(("amx", "avx512_bf16", "named"), [(True, False, "AMX"), (False, True, "AVX512-BF16")])
def test_auto_is_bfloat16_on_a_cpu_with_native_bf16(monkeypatch, amx, avx512_bf16, named):
    fake_cpu(monkeypatch, amx=amx, avx512_bf16=avx512_bf16)
    dtype, reason = resolve_param_dtype("auto", CPU)
    assert dtype is torch.bfloat16 and named in reason


@pytest.mark.parametrize(("variable", "isa", "native"), [("ONEDNN_MAX_CPU_ISA", "AVX2", False),
    ("DNNL_MAX_CPU_ISA", "avx512_core", False), ("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_BF16", True),
    ("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_AMX", True)])  # fmt: skip
def test_auto_is_float32_where_onednn_is_held_below_bf16(monkeypatch, variable, isa, native):
    """A CPU with AVX512-BF16 whose oneDNN (torch's bf16 matmuls) is held to an older ISA computes bf16 slowly."""
    fake_cpu(monkeypatch, amx=False, avx512_bf16=True)
    monkeypatch.setenv(variable, isa)
    dtype, reason = resolve_param_dtype("auto", CPU)
    assert (dtype is torch.bfloat16) is native, reason
    if not native:
        assert f"this CPU has AVX512-BF16, but {variable}={isa} keeps torch's bf16 matmuls from it" in reason


def test_explicit_bfloat16_without_native_support_trains_but_warns(monkeypatch):
    fake_cpu(monkeypatch, amx=False, avx512_bf16=False)
    with pytest.warns(UserWarning, match=r"many times slower than in float32 \(ask for 'auto' or 'float32' instead\)"):
        dtype, _ = resolve_param_dtype("bfloat16", CPU)
    assert dtype is torch.bfloat16
    fake_cpu(monkeypatch, amx=True, avx512_bf16=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no warning where bf16 is native
        assert resolve_param_dtype("bfloat16", CPU)[0] is torch.bfloat16
    assert resolve_param_dtype("float32", CPU)[0] is torch.float32


class FakeMesh:
    """Just the sizes `uses_fsdp` reads."""

    def __init__(self, **sizes: int):
        self.sizes = sizes

    def __getitem__(self, name: str):
        size = self.sizes.get(name, 1)
        return type("Dim", (), {"size": lambda self: size})()


BF16 = ParallelOptions(param_dtype=torch.bfloat16)


def test_fsdp_where_it_shards_or_casts():
    # fp32: FSDP only where there is something to shard
    assert not uses_fsdp(FakeMesh(), ParallelOptions())  # one data-parallel rank: plain parameters
    assert not uses_fsdp(FakeMesh(tp=2), ParallelOptions())  # TP alone
    assert uses_fsdp(FakeMesh(dp_shard_cp=2), ParallelOptions())
    assert uses_fsdp(FakeMesh(dp_replicate=2), ParallelOptions())  # HSDP with one shard
    assert uses_fsdp(FakeMesh(), ParallelOptions(cpu_offload=True))  # offload is FSDP's
    # bf16: FSDP casts on every world size, one data-parallel rank included (one process, TP or PP alone)
    assert uses_fsdp(FakeMesh(), BF16)
    assert uses_fsdp(FakeMesh(tp=2), BF16)
    assert uses_fsdp(FakeMesh(dp_shard_cp=2), BF16)
    # DDP never: autocast casts, on 1 and N ranks alike
    assert not uses_fsdp(FakeMesh(dp_replicate=2), ParallelOptions(dp_mode="ddp"))
    assert not uses_fsdp(FakeMesh(), ParallelOptions(param_dtype=torch.bfloat16, dp_mode="ddp"))


def dtype_paths(nproc: int, *layouts: str) -> dict:
    """One bf16 step per layout on `nproc` gloo ranks, as tests/workers/precision_worker.py records it."""
    cmd = [sys.executable, str(FORK_RUN), str(nproc), "tests/workers/precision_worker.py", *layouts]
    # No TORCH_DISTRIBUTED_DEBUG=DETAIL: DDP's reducer crashes under its wrapper process group (torch 2.15, gloo).
    env = titan_env(debug_detail=False)
    proc = warm_python.run(cmd, cwd=REPO, env=env, timeout=300)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("PRECISION ")]
    assert proc.returncode == 0 and lines, proc.stdout[-2000:] + proc.stderr[-3000:]
    return json.loads(lines[0].removeprefix("PRECISION "))


def test_bf16_takes_one_dtype_path_on_one_and_two_ranks():
    one, two = dtype_paths(1, "fsdp", "ddp"), dtype_paths(2, "fsdp", "tp", "ddp")

    # FSDP casts: on one rank as on two, and under TP alone (one data-parallel rank).
    path = one["fsdp"]
    assert all(run["fsdp"] and run["wrapped"] for run in (path, two["fsdp"], two["tp"]))
    modules = path["modules"]
    assert {"tok_embeddings", "layers.0", "layers.1", "layers.0.attention.wq", "norm", "output"} <= set(modules)
    for name, seen in modules.items():
        assert seen["params"] in ([], ["bfloat16"]), (name, seen)  # every weight gathered in bf16
        tokens_in = name in ("<root>", "tok_embeddings")
        block = name.startswith("layers.") and name.count(".") == 1
        if block:  # the residual stream in bf16; the model's RoPE table in fp32, as RoPE computes (no cast)
            assert seen["inputs"] == ["bfloat16", "float32"], (name, seen)
        else:
            assert set(seen["inputs"]) == ({"int64"} if tokens_in else {"bfloat16"}), (name, seen)
        assert seen["output"] == "bfloat16", (name, seen)  # the residual stream (the blocks' outputs) included
    assert path["loss"] == "float32"  # cross-entropy on fp32 logits
    assert set(path["grads"].values()) == {"float32"}  # gradients land on the fp32 master weights
    assert two["fsdp"] == path and two["tp"] == path

    # DDP: autocast on one rank and two: fp32 weights and residual stream, bf16 matmul outputs.
    ddp = one["ddp"]
    assert not ddp["fsdp"] and not ddp["wrapped"] and two["ddp"] == ddp
    wq = ddp["modules"]["layers.0.attention.wq"]
    assert wq == {"params": ["float32"], "inputs": ["float32"], "output": "bfloat16"}
    assert ddp["modules"]["tok_embeddings"]["output"] == ddp["modules"]["layers.0"]["output"] == "float32"
    assert ddp != path  # what one rank computed before FSDP cast there: bf16 differed in kind from N ranks


def test_autocast_casts_where_fsdp_does_not():
    linear = torch.nn.Linear(8, 8)
    x = torch.randn(2, 8)
    with mixed_precision_context("cpu", torch.bfloat16, fsdp=False):
        assert linear(x).dtype is torch.bfloat16
    with mixed_precision_context("cpu", torch.bfloat16, fsdp=True):  # FSDP's policy casts instead
        assert linear(x).dtype is torch.float32
    with mixed_precision_context("cpu", torch.float32, fsdp=False):
        assert linear(x).dtype is torch.float32


ASYNC_TP = ["--parallelism.tensor_parallel_degree", "2", "--parallelism.enable_async_tensor_parallel", "true"]


def test_titan_train_refuses_async_tp_before_starting_processes(tmp_path):
    # Through `titan train` as a user runs it: one line, exit 2, and no torchrun traceback,
    # because the config is checked before torchrun starts the two processes.
    async_tp, device = "async_tp set by parallelism.enable_async_tensor_parallel", "device_type set by training.device"
    cases = (
        ([], ("needs compile=True and a CUDA device", async_tp, "compile set by compile.enable", device)),
        (["--compile.enable", "true"], ("needs a CUDA device", async_tp, device)),
    )
    for extra, names in cases:
        proc = run_titan(tmp_path / "run", *TINY, *ASYNC_TP, *extra, nproc=2, check=False)
        assert proc.returncode == 2, proc.stderr[-2000:]
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1, proc.stderr[-2000:]
        assert lines[0].startswith("titan: error: async_tp needs ")
        assert all(name in lines[0] for name in names), lines[0]
        assert not (tmp_path / "run").exists()
