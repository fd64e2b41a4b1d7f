"""Peak FLOP/s, memory, throughput/MFU and the metrics logger."""

from __future__ import annotations

import fcntl
import io
import json
import logging
import mmap
import os
import pty
import re
import struct
import termios

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from titan_core.metrics import (
    MetricsLogger,
    ThroughputMeter,
    compute_throughput,
    device_peak_flops,
    gpu_peak_flops,
    memory_stats,
)
from titan_core.metrics import peak_flops as peak_flops_module

# ---------------------------------------------------------------- peak FLOP/s


def test_gpu_peak_table():
    # Dense datasheet figures (TFLOP/s): bf16 tensor core / plain fp32.
    assert gpu_peak_flops("NVIDIA H100 80GB HBM3", torch.bfloat16) == 989e12
    assert gpu_peak_flops("NVIDIA H100 80GB HBM3", torch.float32) == 67e12
    assert gpu_peak_flops("NVIDIA H100 PCIe", torch.bfloat16) == 756e12
    assert gpu_peak_flops("NVIDIA H100 NVL", torch.bfloat16) == 835e12
    assert gpu_peak_flops("NVIDIA H200", torch.bfloat16) == 989e12
    assert gpu_peak_flops("NVIDIA A100-SXM4-80GB", torch.bfloat16) == 312e12
    assert gpu_peak_flops("NVIDIA A100-SXM4-80GB", torch.float32) == 19.5e12
    assert gpu_peak_flops("NVIDIA B200", torch.bfloat16) == 2250e12
    assert gpu_peak_flops("NVIDIA L40S", torch.float32) == 91.6e12
    assert gpu_peak_flops("NVIDIA L4", torch.bfloat16) == 121e12
    assert gpu_peak_flops("NVIDIA A10G", torch.bfloat16) == 70e12
    assert gpu_peak_flops("NVIDIA A10", torch.bfloat16) == 125e12
    assert gpu_peak_flops("NVIDIA H100 80GB HBM3", torch.float16) == 989e12


def test_unknown_gpu_or_dtype_gives_none():
    assert gpu_peak_flops("NVIDIA GeForce RTX 4090", torch.bfloat16) is None
    assert gpu_peak_flops("NVIDIA GH200 480GB", torch.bfloat16) is None  # not the H200 row
    assert gpu_peak_flops("NVIDIA GB200", torch.bfloat16) is None  # not the B200 row
    assert gpu_peak_flops("NVIDIA H100 80GB HBM3", torch.float64) is None


def test_override_wins(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert device_peak_flops(torch.device("cpu"), torch.float32, override_tflops=123.5) == 123.5e12
    assert not (tmp_path / "titan").exists()  # nothing measured or cached


def test_cpu_peak_is_measured_once_then_read_from_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    calls = []
    real_measure = peak_flops_module.measure_cpu_matmul_flops

    def counting_measure(dtype):
        calls.append(dtype)
        return real_measure(dtype)

    monkeypatch.setattr(peak_flops_module, "measure_cpu_matmul_flops", counting_measure)

    first = device_peak_flops(torch.device("cpu"), torch.float32)
    assert calls == [torch.float32]
    assert 1e8 < first < 1e15  # any CPU does 0.1 GFLOP/s..1 PFLOP/s of fp32 matmul
    cache = tmp_path / "titan" / "cpu_peak.json"
    entries = json.loads(cache.read_text())
    (key,) = entries
    assert "torch.float32" in key and torch.__version__ in key and f"{torch.get_num_threads()} threads" in key
    assert entries[key] == first
    assert [p.name for p in cache.parent.iterdir()] == ["cpu_peak.json"]  # no temp file left
    mtime = cache.stat().st_mtime_ns

    second = device_peak_flops(torch.device("cpu"), torch.float32)
    assert second == first
    assert calls == [torch.float32]  # not measured again
    assert cache.stat().st_mtime_ns == mtime

    cache.write_text("{ not json")  # a broken cache is measured again and rewritten
    third = device_peak_flops(torch.device("cpu"), torch.float32)
    assert len(calls) == 2
    assert json.loads(cache.read_text()) == {key: third}


# ---------------------------------------------------------------- memory


def test_cpu_memory_stats_track_rss():
    before = memory_stats(torch.device("cpu"))
    assert set(before) == {"memory/rss_gib", "memory/max_rss_gib"}
    assert before["memory/rss_gib"] > 0
    # 0.25 GiB of fresh pages, each touched: an anonymous mapping of its own, not memory the allocator kept from
    # earlier tests in this process (a torch.ones of that size reused it once: RSS did not move)
    block = mmap.mmap(-1, 256 << 20)
    for offset in range(0, len(block), mmap.PAGESIZE):
        block[offset] = 1
    after = memory_stats("cpu")
    assert after["memory/rss_gib"] - before["memory/rss_gib"] > 0.2
    assert after["memory/max_rss_gib"] >= after["memory/rss_gib"] - 0.01
    block.close()


# ---------------------------------------------------------------- throughput


def test_throughput_arithmetic():
    # 8192 tokens in 2 s shared by 2 devices (e.g. tp=2): 2048 tokens/s per device;
    # 6e9 FLOPs/token -> 1.2288e13 FLOP/s = 12.288 TFLOP/s; peak 100 TFLOP/s -> 12.288 %.
    figures = compute_throughput(
        tokens=8192, seconds=2.0, flops_per_token=6e9, peak_flops=100e12, non_data_parallel_size=2
    )
    assert figures["throughput/tokens_per_s"] == pytest.approx(2048.0)
    assert figures["throughput/tflops"] == pytest.approx(12.288)
    assert figures["throughput/mfu_pct"] == pytest.approx(12.288)
    unknown_peak = compute_throughput(tokens=8192, seconds=2.0, flops_per_token=6e9, peak_flops=None)
    assert unknown_peak["throughput/tokens_per_s"] == pytest.approx(4096.0)
    assert unknown_peak["throughput/mfu_pct"] is None


def test_throughput_meter_windows():
    now = [10.0]
    meter = ThroughputMeter(flops_per_token=1e9, peak_flops=1e12, clock=lambda: now[0])
    for _ in range(3):
        meter.add_tokens(1000)
    now[0] = 11.5
    figures = meter.read()  # 3000 tokens / 1.5 s
    assert figures["throughput/tokens_per_s"] == pytest.approx(2000.0)
    assert figures["throughput/tflops"] == pytest.approx(2.0)  # 2000 * 1e9 / 1e12
    assert figures["throughput/mfu_pct"] == pytest.approx(200.0)
    meter.add_tokens(500)
    now[0] = 12.0
    assert meter.read()["throughput/tokens_per_s"] == pytest.approx(1000.0)  # new window: 500 / 0.5 s


def test_throughput_meter_raises_a_measured_peak_that_was_beaten():
    now, asked = [0.0], []

    def raise_peak(achieved: float) -> float:
        asked.append(achieved)
        return 4e12  # what a fresh measurement would give

    meter = ThroughputMeter(flops_per_token=1e9, peak_flops=1e12, clock=lambda: now[0], raise_peak=raise_peak)
    meter.add_tokens(2000)
    now[0] = 1.0
    figures = meter.read()  # 2 TFLOP/s against a 1 TFLOP/s peak: MFU 200% is impossible
    assert asked == [pytest.approx(2e12)]
    assert meter.peak_flops == 4e12 and figures["throughput/mfu_pct"] == pytest.approx(50.0)
    meter.add_tokens(1000)
    now[0] = 2.0
    assert meter.read()["throughput/mfu_pct"] == pytest.approx(25.0) and len(asked) == 1  # below the new peak


# ---------------------------------------------------------------- logger

STEP_12 = {
    "loss/global_avg": 5.4321,
    "loss/global_max": 5.5,
    "optim/grad_norm": 1.23,
    "optim/lr": 8e-4,
    "throughput/tokens_per_s": 2345.4,
    "throughput/tflops": 0.12,
    "throughput/mfu_pct": 4.1,
    "memory/rss_gib": 1.23,
}
LINE_12 = (
    "step  12/60  loss 5.4321 (max 5.50)  grad_norm 1.23  lr 8.0e-04  "
    "tokens/s 2,345  tflops 0.12  mfu 4.1%  mem 1.23GiB"
)


def test_logger_writes_tensorboard_and_console(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="titan")
    tb = tmp_path / "tb"
    metrics_logger = MetricsLogger(tb, enable_tensorboard=True, rank=0, total_steps=60, color=True)
    metrics_logger.log(12, STEP_12)
    metrics_logger.log(13, {"loss/global_avg": 5.0, "throughput/mfu_pct": None, "optim/lr": 7e-4})
    metrics_logger.log(14, {"optim/grad_norm": 19.0})
    metrics_logger.close()

    lines = [r.getMessage() for r in caplog.records if r.name == "titan"]
    # pytest's stdout is no TTY: no colour; the grad norm keeps 3 significant digits, "19.0" rather than "19"
    assert lines == [LINE_12, "step  13/60  loss 5.0000  lr 7.0e-04", "step  14/60  grad_norm 19.0"]

    events = EventAccumulator(str(tb))
    events.Reload()
    scalars = events.Tags()["scalars"]
    assert set(scalars) == set(STEP_12)
    loss = events.Scalars("loss/global_avg")
    assert [e.step for e in loss] == [12, 13]
    assert [e.value for e in loss] == pytest.approx([5.4321, 5.0])
    assert [e.step for e in events.Scalars("throughput/mfu_pct")] == [12]  # the None was skipped
    assert events.Scalars("throughput/tokens_per_s")[0].value == pytest.approx(2345.4)


def test_logger_is_silent_on_other_ranks(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="titan")
    metrics_logger = MetricsLogger(tmp_path / "tb", enable_tensorboard=True, rank=1, total_steps=60, color=False)
    metrics_logger.log(12, STEP_12)
    metrics_logger.close()
    assert not [r for r in caplog.records if r.name == "titan"]
    assert not (tmp_path / "tb").exists()


def test_tensorboard_without_folder_is_an_error():
    with pytest.raises(ValueError, match=r"enable_tensorboard is true but log_dir is None"):
        MetricsLogger(None, enable_tensorboard=True, rank=0, total_steps=10, color=False)


def test_validation_has_a_console_line_and_an_evaluation_record_none(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="titan")
    with MetricsLogger(None, enable_tensorboard=False, rank=0, total_steps=60, color=False) as metrics:
        metrics.log(12, {"validation/loss": 2.0})
        metrics.log(12, {"eval/toy/acc": 0.5, "eval/toy/acc_norm": 0.25})  # the evaluator prints its own line
        metrics.log(13, {"validation/loss": float("nan")})
        metrics.log(14, {"validation/loss": 800.0})
    lines = [r.getMessage() for r in caplog.records if r.name == "titan"]
    assert lines == ["step  12/60  validation loss 2.0000 (ppl 7.39)", "step  13/60  validation loss nan (ppl nan)",
                     "step  14/60  validation loss 800.0000 (ppl inf)"]  # fmt: skip


def test_logger_writes_one_json_record_per_logged_step(tmp_path):
    path = tmp_path / "metrics.jsonl"
    with MetricsLogger(None, enable_tensorboard=False, rank=0, total_steps=3, color=False, jsonl_path=path) as metrics:
        metrics.log(1, {"loss/global_avg": 3.5, "throughput/mfu_pct": None})
        metrics.log(1, {"validation/loss": 3.25})
    with MetricsLogger(None, enable_tensorboard=False, rank=1, total_steps=3, color=False, jsonl_path=tmp_path / "r1") as metrics:
        metrics.log(1, {"loss/global_avg": 3.5})
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert records == [{"step": 1, "loss/global_avg": 3.5, "throughput/mfu_pct": None}, {"step": 1, "validation/loss": 3.25}]
    assert not (tmp_path / "r1").exists()  # rank 0 only


def test_a_run_resumed_at_step_n_keeps_one_trajectory_in_metrics_and_tensorboard(tmp_path, caplog):
    """A process killed after step 5 (a torn last line), resumed from its step-3 checkpoint, logs steps 4 and 5 anew:
    metrics.jsonl holds each step once, the earlier records of 4 and 5 go to metrics.superseded.jsonl, and TensorBoard
    shows the new values of 4 and 5 only. A fresh start in the folder then sets the whole trajectory aside."""
    caplog.set_level(logging.INFO, logger="titan")
    path, tb = tmp_path / "metrics.jsonl", tmp_path / "tb"

    def run(start: int, steps: range, loss: float) -> None:
        with MetricsLogger(tb, enable_tensorboard=True, rank=0, total_steps=6, color=False, jsonl_path=path,
                           start_step=start) as metrics:  # fmt: skip
            for step in steps:
                metrics.log(step, {"loss/global_avg": loss + step})

    run(0, range(1, 6), 10.0)
    with open(path, "a") as f:
        f.write('{"step": 6, "loss/glo')  # killed in the middle of a write
    caplog.clear()
    run(3, range(4, 7), 20.0)
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert [(r["step"], r["loss/global_avg"]) for r in records] == [(1, 11), (2, 12), (3, 13), (4, 24), (5, 25), (6, 26)]
    aside = (tmp_path / "metrics.superseded.jsonl").read_text().splitlines()
    assert aside == ['{"step": 4, "loss/global_avg": 14.0}', '{"step": 5, "loss/global_avg": 15.0}', '{"step": 6, "loss/glo']
    lines = [r.getMessage() for r in caplog.records if r.name == "titan" and r.getMessage().startswith("metrics:")]
    assert lines == [f"metrics: {path} held 3 records past step 3 (steps 4-5) from an earlier process in this folder, "
                     "which this run logs anew from step 4: moved to metrics.superseded.jsonl"]  # fmt: skip
    events = EventAccumulator(str(tb))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("loss/global_avg")] == [(1, 11), (2, 12), (3, 13), (4, 24), (5, 25),
                                                                              (6, 26)]  # fmt: skip

    run(0, range(1, 3), 30.0)  # a fresh start in the same folder: a new trajectory
    assert [json.loads(line)["loss/global_avg"] for line in path.read_text().splitlines()] == [31, 32]
    assert len((tmp_path / "metrics.superseded.jsonl").read_text().splitlines()) == 3 + 6
    events = EventAccumulator(str(tb))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("loss/global_avg")] == [(1, 31), (2, 32)]


def _log_three_steps(monkeypatch, stream, color):
    """Log steps 1-3 with stdout = `stream` and no logging configured anywhere."""
    monkeypatch.setattr("sys.stdout", stream)
    monkeypatch.setattr(logging.root, "handlers", [])  # as in a plain script: the logger adds its own
    metrics_logger = MetricsLogger(None, enable_tensorboard=False, rank=0, total_steps=3, color=color)
    for step in (1, 2, 3):
        metrics_logger.update_progress(step)
        metrics_logger.log(step, {"loss/global_avg": 4.0 - step, "memory/rss_gib": 0.5})
    metrics_logger.close()
    assert not logging.getLogger("titan").handlers  # close() removed what it added


def test_non_tty_output_has_plain_lines_only(monkeypatch):
    stream = io.StringIO()
    _log_three_steps(monkeypatch, stream, color=True)
    assert stream.getvalue() == (
        "step  1/3  loss 3.0000  mem 0.50GiB\n"
        "step  2/3  loss 2.0000  mem 0.50GiB\n"
        "step  3/3  loss 1.0000  mem 0.50GiB\n"
    )


def test_tty_output_has_progress_bar_and_colour(monkeypatch):
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))  # a 100-column terminal
    with os.fdopen(slave, "w", encoding="utf-8") as stream:
        _log_three_steps(monkeypatch, stream, color=True)
    output = b""
    while chunk := _read_pty(master):
        output += chunk
    output = output.decode()
    os.close(master)
    assert "\r" + "\u2588" * 24 + " 3/3 steps" in output  # tqdm redraws the bar in place
    assert "steps/s" in output and "ETA 00:00" in output
    # Each log line is printed above the bar: the bar is blanked, then the (coloured) line written.
    assert re.search(r"\r +\r\x1b\[36mstep  3/3\x1b\[0m  \x1b\[32mloss 1\.0000\x1b\[0m", output), output
    assert output.endswith("\n")  # close() ends the bar's line


def _read_pty(fd: int) -> bytes:
    """What the terminal received, b"" once all is read (Linux raises EIO at the end)."""
    try:
        return os.read(fd, 1 << 16)
    except OSError:
        return b""
