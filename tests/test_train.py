"""`titan train` end to end: the default run learns, FSDP matches one process, accumulation matches a big batch."""

from __future__ import annotations

import math
import os
import re

import pytest
import torch
from titan_parallel.precision import native_bf16

from titan_run import SHARED_DATA, TINY, losses, read_metrics, run_titan, run_titan_all


def test_default_run_loss_falls_and_writes_run_folder(tmp_path):
    # The built-in default run (debugmodel, stdlib corpus, byte tokenizer, dtype "auto"), only shorter.
    run = tmp_path / "run"
    proc = run_titan(run, "--training.steps", "25", "--training.seq_len", "128", "--lr_scheduler.warmup_steps", "5")
    # "auto" computes in bf16 only where the CPU has native bf16, and says so once.
    native = torch.cpu._is_amx_tile_supported() or torch.cpu._is_avx512_bf16_supported()
    if os.environ.get("ONEDNN_MAX_CPU_ISA") or os.environ.get("DNNL_MAX_CPU_ISA"):  # a cap: test_precision's rule
        native = native_bf16(torch.device("cpu"))[0]
    assert proc.stderr.count("compute dtype auto: ") == 1, proc.stderr[-3000:]
    assert f"compute dtype auto: {'bfloat16' if native else 'float32'}, since this CPU has " in proc.stderr
    records = read_metrics(run)
    assert [r["step"] for r in records] == list(range(1, 26))
    first, last = records[0]["loss/global_avg"], records[-1]["loss/global_avg"]
    # A fresh model predicts ~uniformly over its 2048-token vocab: ln(2048) = 7.62.
    assert abs(first - math.log(2048)) < 1.0
    assert last < first - 2.5, (first, last)
    assert all(r["throughput/tokens_per_s"] > 0 and r["memory/rss_gib"] > 0 for r in records)
    # Each step logs the LR its update used: warmup s / (W + 1) over W = 5 steps, then linear decay over
    # the other D = 20 to 0 at D + 1, of optimizer.lr = 8e-4 (the formula of titan_core.lr_schedule).
    expected_lr = [8e-4 * (s / 6 if s <= 5 else 1 - (s - 5) / 21) for s in range(1, 26)]
    assert [r["optim/lr"] for r in records] == pytest.approx(expected_lr, rel=1e-12)
    assert (run / "config.toml").read_text().count("[training]") == 1
    assert list((run / "tb").glob("events.out.tfevents.*")), "no TensorBoard event file"


def test_gradient_accumulation_equals_larger_batch(tmp_path):
    big = tmp_path / "big"
    accum = tmp_path / "accum"
    run_titan_all({big: [*TINY, "--training.local_batch_size", "8"],
                   accum: [*TINY, "--training.local_batch_size", "2", "--training.global_batch_size", "8"]})  # fmt: skip
    diffs = [abs(a - b) for a, b in zip(losses(big), losses(accum), strict=True)]
    assert max(diffs) < 1e-5, diffs


def test_bad_config_is_one_clear_line(tmp_path):
    proc = run_titan(tmp_path / "bad", "--training.step", "5", check=False)
    assert proc.returncode == 2
    assert proc.stderr.strip() == (
        "titan: error: unknown config key 'training.step' (from --training.step); did you mean 'training.steps'?"
    )
    proc = run_titan(tmp_path / "bad", "--model.flavor", "debugmodle", check=False)
    assert proc.returncode == 2
    err = proc.stderr.strip().splitlines()
    assert len(err) == 1 and "model.flavor" in err[0] and "debugmodel" in err[0]
    assert not (tmp_path / "bad" / "metrics.jsonl").exists()


def test_mesh_that_does_not_fit_the_world_fails_before_work(tmp_path):
    proc = run_titan(tmp_path / "bad", "--parallelism.data_parallel_shard_degree", "3", nproc=2, check=False)
    assert proc.returncode == 2
    [line] = proc.stderr.strip().splitlines()  # checked before torchrun starts: no traceback
    assert "parallelism.data_parallel_shard_degree" in line and "2" in line, line


def test_validation_and_profiler_traces(tmp_path):
    run = tmp_path / "run"
    hamlet = str(SHARED_DATA / "shakespeare" / "hamlet_gut.txt")
    proc = run_titan(run, *TINY, "--training.local_batch_size", "4", "--validation.enable", "--validation.freq", "4",
                     "--validation.steps", "2", "--validation.dataset_path", hamlet,
                     "--profiling.enable_profiling", "--profiling.profile_freq", "5", "--job.print_config",
                     "--training.gc_freq", "4")
    assert "garbage collection: Python's automatic collector off, every 4 steps (asked for)" in proc.stderr
    # job.print_config: the resolved config, as the run folder's config.toml holds it, once at start-up
    assert proc.stderr.count("config (job.print_config)") == 1, proc.stderr[-3000:]
    assert "[validation]\nenable = true\n" in proc.stderr and (run / "config.toml").read_text() in proc.stderr
    records = read_metrics(run)
    val = [(r["step"], r["validation/loss"]) for r in records if "validation/loss" in r]
    assert [s for s, _ in val] == [4, 8, 10]
    assert val[-1][1] < val[0][1]  # the model learns English-ish bytes from the stdlib; Hamlet's loss falls too
    # each validation is one console line with its loss and perplexity
    shown = re.findall(r"step +(\d+)/10  validation loss (\S+) \(ppl (\S+)\)", proc.stdout + proc.stderr)
    assert [(int(s), float(v)) for s, v, _ in shown] == [(s, round(v, 4)) for s, v in val]
    assert [float(p) for *_, p in shown] == [round(math.exp(v), 2) for _, v in val]
    traces = sorted((run / "profile_traces").glob("iteration_*/rank0_trace.json"), key=lambda t: len(str(t)))
    assert [t.parent.name for t in traces] == ["iteration_5", "iteration_10"]
    assert '"traceEvents"' in traces[0].read_text()[:10000]
    proc = run_titan(tmp_path / "bad", *TINY, "--profiling.enable_memory_snapshot", check=False)
    assert proc.returncode == 2 and "profiling.enable_memory_snapshot" in proc.stderr


def test_the_profiler_traces_the_last_active_steps_of_each_window(tmp_path):
    """`profiling.profiler_warmup` / `profiler_active` (torchtitan's keys): every `profile_freq` steps one trace of the
    window's last `active` steps, after `warmup` steps profiled unrecorded (torch.profiler's own step markers, read
    from the written traces)."""
    import json

    from titan_core.profiling import Profiler

    profiler = Profiler(tmp_path, None, freq=4, rank=0, device=torch.device("cpu"), warmup=1, active=2)
    x = torch.ones(8, 8)
    for step in range(1, 9):
        x = (x @ x).tanh()
        profiler.step(step)
    profiler.close()
    traces = {t.parent.name: json.loads(t.read_text()) for t in tmp_path.glob("iteration_*/rank0_trace.json")}
    steps = {name: sorted(e["name"] for e in trace["traceEvents"] if e.get("name", "").startswith("ProfilerStep#"))
             for name, trace in traces.items()}  # fmt: skip
    assert steps == {"iteration_4": ["ProfilerStep#2", "ProfilerStep#3"],
                     "iteration_8": ["ProfilerStep#6", "ProfilerStep#7"]}, steps  # fmt: skip


def test_periodic_gc_collects_the_young_generations_every_n_steps_with_the_collector_off():
    """`training.gc_freq` (torchtitan's): Python's automatic collector off while training, `gc.collect(1)` every N
    steps (seen through `gc.callbacks`), on again after; 'auto' is 50 on CUDA and Python's own on CPU."""
    import gc

    from titan_core.gc_control import PeriodicGC, resolve_gc_freq

    assert resolve_gc_freq("auto", "cuda") == (50, "auto: on CUDA")
    assert resolve_gc_freq("auto", "cpu") == (0, "auto: Python's own on cpu")
    assert resolve_gc_freq(7, "cpu") == (7, "asked for")
    collected: list[int] = []

    def seen(phase: str, info: dict) -> None:
        if phase == "start":
            collected.append(info["generation"])

    assert gc.isenabled()
    gc.callbacks.append(seen)
    try:
        collector = PeriodicGC(3)
        assert not gc.isenabled() and collected[-1] == 1  # a clean start (Python may have collected just before)
        before = len(collected)
        for step in range(1, 8):
            collector.step(step)
            keep = [[] for _ in range(2000)]  # tracked containers past the gen-0 threshold (700): Python would collect
            del keep
        assert collected[before:] == [1, 1]  # steps 3 and 6, nothing else
        collector.close()
        assert gc.isenabled()
        collected.clear()
        untouched = PeriodicGC(0)
        untouched.step(3)
        untouched.close()
        assert gc.isenabled() and collected == []
    finally:
        gc.callbacks.remove(seen)
        gc.enable()


def test_tokenizer_from_hf_assets_path_widens_a_small_flavor(tmp_path):
    # A tiktoken-format BPE file (the original Llama 3 tokenizer.model format): GPT-2's 50,256 ranks
    # plus 256 special tokens, far more than debugmodel's 2,048-token vocab.
    assets = tmp_path / "assets"
    assets.mkdir()
    (assets / "gpt2.tiktoken").write_bytes((SHARED_DATA / "tokenizers" / "gpt2.tiktoken").read_bytes())
    run = tmp_path / "run"
    run_titan(run, *TINY, "--training.steps", "3", "--model.hf_assets_path", str(assets))
    first = read_metrics(run)[0]["loss/global_avg"]
    assert abs(first - math.log(50256 + 256)) < 1.0, first  # ~uniform over the widened vocab, not over 2048


def test_torch_warnings_a_run_cannot_act_on_are_left_out_of_its_log():
    """torch 2.15 logs "is_opaque_value is deprecated" once per rank when it compiles tensor-parallel blocks,
    Inductor's CPU compile "No CUDA runtime is found" with torch's CUDA build on a host without a GPU, and torchao's
    import "<enum ...> is an Enum subclass ...": the launcher's logging leaves those out (once, however often it is
    set up) and lets every other record of the same loggers through."""
    import logging

    from titan_core.launch import setup_logging
    from titan_core.log_filters import TORCH_NOISE

    setup_logging()
    setup_logging()
    for name, start in TORCH_NOISE:
        logger = logging.getLogger(name)
        seen: list[str] = []
        handler = logging.Handler()
        handler.emit = lambda record, seen=seen: seen.append(record.getMessage())  # type: ignore[method-assign]
        logger.addHandler(handler)
        try:
            logger.warning(f"{start}, use something else instead")
            logger.warning("a warning worth reading")
        finally:
            logger.removeHandler(handler)
        assert seen == ["a warning worth reading"], (name, seen)
        assert len(logger.filters) == 1, logger.filters


def test_deterministic_algorithms_warn_only(monkeypatch):
    from titan_core.train_state import set_determinism

    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # restored after the test
    try:
        assert set_determinism(3, deterministic=True, warn_only=True) == 3
        assert torch.are_deterministic_algorithms_enabled() and torch.is_deterministic_algorithms_warn_only_enabled()
        set_determinism(3, deterministic=True)
        assert torch.are_deterministic_algorithms_enabled() and not torch.is_deterministic_algorithms_warn_only_enabled()
    finally:
        torch.use_deterministic_algorithms(False)
