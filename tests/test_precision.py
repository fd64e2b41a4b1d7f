"""The compute dtype that suits the machine, mixed precision without FSDP, and async TP refused
before any process starts."""

from __future__ import annotations

import warnings

import pytest
import torch
from titan_parallel import ParallelOptions, mixed_precision_context, resolve_param_dtype, uses_fsdp
from titan_run import TINY, run_titan

CPU = torch.device("cpu")


def fake_cpu(monkeypatch, *, amx: bool, avx512_bf16: bool) -> None:
    """Make torch's CPU feature probes answer as a given machine would."""
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


def test_fsdp_only_where_there_is_something_to_shard():
    assert not uses_fsdp(FakeMesh(), ParallelOptions())  # one data-parallel rank: plain parameters
    assert not uses_fsdp(FakeMesh(tp=2), ParallelOptions())  # TP alone
    assert uses_fsdp(FakeMesh(dp_shard_cp=2), ParallelOptions())
    assert uses_fsdp(FakeMesh(dp_replicate=2), ParallelOptions())  # HSDP with one shard
    assert uses_fsdp(FakeMesh(), ParallelOptions(cpu_offload=True))  # offload is FSDP's
    assert not uses_fsdp(FakeMesh(dp_replicate=2), ParallelOptions(dp_mode="ddp"))


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
    for extra, names in (([], ("compile.enable", "CUDA device")), (["--compile.enable", "true"], ("CUDA device",))):
        proc = run_titan(tmp_path / "run", *TINY, *ASYNC_TP, *extra, nproc=2, check=False)
        assert proc.returncode == 2, proc.stderr[-2000:]
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1, proc.stderr[-2000:]
        assert lines[0].startswith("titan: error: parallelism.enable_async_tensor_parallel needs ")
        assert all(name in lines[0] for name in names), lines[0]
        assert ("needs compile.enable" in lines[0]) == (not extra)
        assert not (tmp_path / "run").exists()
