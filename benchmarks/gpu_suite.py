"""The GPU figures of docs/performance.md: Titan's training step on one GPU, row by row.

Rows (each a fresh `Trainer` in this one process; a row that fails, by OOM or
a missing feature, is recorded with its one-line reason and the suite goes on):

- llama3 "1B" (the Llama 3.2 1B shape) at seq 2048: bf16 eager, + compile,
  + compile + float8 (`model.converters = ["float8"]`, torchao), and compile
  with activation checkpointing "selective op" and "full"; at seq 4096:
  compile, and compile + AC "selective op".
- Titan vs the hand-written loop (titan_models' `Transformer`, bf16 autocast,
  fp32 cross-entropy, `clip_grad_norm_`, AdamW with Titan's kernel) from the same weights
  on the same batches, single steps interleaved (A, B, then B, A, ...).
- float8 vs bf16 on 8B-shaped layers (dim 4096, ffn 14336, 32 heads / 8 KV
  heads, 4 blocks, vocab 2048 so that the blocks dominate), both compiled.

Per row: tokens/s (median step), TFLOP/s (titan_models' flops_per_token),
MFU against titan_core.metrics.peak_flops (the bf16 datasheet peak, float8
rows too, as torchtitan reports them) and peak memory (max_memory_allocated).
Targets printed at the end: >= 45% MFU for 1B bf16 + compile, float8 >= 1.25x
bf16 on the 8B-shaped layers, Titan >= 0.98x the hand-written loop.

    benchmarks/run_gpu_suite.sh [OUT_DIR]             # on the GPU machine: wheels, then this
    python3 benchmarks/gpu_suite.py --out DIR         # titan and its deps importable
    uv run python benchmarks/gpu_suite.py --smoke --out /tmp/gpu-smoke   # CPU: debugmodel, seq 128, 2 steps, fp32

Writes DIR/results.json (after every row, so a run cut short keeps what it
measured) and DIR/results.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import gc
import json
import platform
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from titan_core.config import ConfigError, load_config
from titan_core.metrics import device_peak_flops
from titan_core.trainer import Trainer
from titan_models import get_model_spec, register_model_spec

BENCH_MODEL = "llama3-bench"  # the llama3 spec with the flavors below added
COMPILE = ("--compile.enable", "true")
FLOAT8 = ("--model.converters", "float8")
AC_OP = ("--activation_checkpoint.mode", "selective", "--activation_checkpoint.selective_ac_option", "op")
AC_FULL = ("--activation_checkpoint.mode", "full")
TARGET_MFU, TARGET_FLOAT8, TARGET_VS_HAND = 45.0, 1.25, 0.98
RUN_FOLDER = Path(tempfile.gettempdir()) / "titan-gpu-suite"  # Titan's job.dump_folder (nothing is saved)


@dataclasses.dataclass(frozen=True)
class Row:
    """One measurement: a model shape, a batch, and Titan config overrides."""

    name: str
    flavor: str
    seq_len: int
    batch: int
    overrides: tuple[str, ...] = ()


def bench_flavors(smoke: bool) -> dict:
    """Shapes the suite needs besides llama3's flavors: the 8B-shaped layers (tiny in smoke mode)."""
    flavors = dict(get_model_spec("llama3").flavors)
    if smoke:
        flavors["8B-layers"] = dataclasses.replace(flavors["debugmodel"], n_layers=2)
    else:
        flavors["8B-layers"] = dataclasses.replace(flavors["8B"], n_layers=4, vocab_size=2048, max_seq_len=8192)
    return flavors


def suite(smoke: bool) -> tuple[list[Row], Row, tuple[Row, Row]]:
    """(the 1B rows, the Titan vs hand-written row, the bf16 and float8 rows on 8B-shaped layers)."""
    if smoke:
        # float8 emulated (fp32 matmuls of float8-rounded operands): checks the path, not its speed.
        float8 = FLOAT8 + ("--float8.emulate", "true", "--float8.auto_filter_small_kn", "false")
        flavor, seq, batch = "debugmodel", 128, 2
        rows = [
            Row("eager", flavor, seq, batch),
            Row("compile", flavor, seq, batch, COMPILE),
            Row("compile + float8 (emulated)", flavor, seq, batch, COMPILE + float8),
            Row("compile + AC selective op", flavor, seq, batch, COMPILE + AC_OP),
            Row("eager + AC selective op", flavor, seq, batch, AC_OP),
            Row("eager + AC full", flavor, seq, batch, AC_FULL),
        ]
        pair = Row("titan vs hand-written (eager)", flavor, seq, batch)
        layers = (Row("tiny layers (8B's stand-in) eager", "8B-layers", seq, batch),
                  Row("tiny layers (8B's stand-in) float8 (emulated)", "8B-layers", seq, batch, float8))
    else:
        rows = [
            Row("1B s2048 bf16 eager", "1B", 2048, 4),
            Row("1B s2048 bf16 compile", "1B", 2048, 4, COMPILE),
            Row("1B s2048 bf16 compile + float8", "1B", 2048, 4, COMPILE + FLOAT8),
            Row("1B s2048 compile + AC selective op", "1B", 2048, 4, COMPILE + AC_OP),
            Row("1B s2048 compile + AC full", "1B", 2048, 4, COMPILE + AC_FULL),
            Row("1B s4096 bf16 compile", "1B", 4096, 2, COMPILE),
            Row("1B s4096 compile + AC selective op", "1B", 4096, 2, COMPILE + AC_OP),
        ]
        pair = Row("1B s2048 titan vs hand-written (eager)", "1B", 2048, 2)
        layers = (Row("8B-shaped layers x4 s4096 bf16 compile", "8B-layers", 4096, 2, COMPILE),
                  Row("8B-shaped layers x4 s4096 compile + float8", "8B-layers", 4096, 2, COMPILE + FLOAT8))
    return rows, pair, layers


def one_line(error: BaseException) -> str:
    """`Type: first line of the message`, at most 300 characters."""
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}"[:300]


def why_not(row: Row, device: torch.device, cpu_compile: bool) -> str | None:
    """The reason a row cannot run here, or None."""
    if FLOAT8[0] in row.overrides and "--float8.emulate" not in row.overrides:
        if device.type != "cuda" or torch.cuda.get_device_capability(device) < (8, 9):
            return "float8 needs a CUDA GPU with compute capability >= 8.9 (H100, H200, L4, L40S, B200)"
    if COMPILE[0] in row.overrides and device.type == "cpu" and not cpu_compile:
        return "compile rows are skipped on CPU (inductor's C++ build takes minutes on a small CPU); pass --cpu-compile"
    return None


def row_config(row: Row, dtype: str, device: torch.device, dump: Path):
    """Titan's config for `row`; a ConfigError naming `model.converters` means this Titan has no float8 yet."""
    return load_config(None, [
        "--model.name", BENCH_MODEL, "--model.flavor", row.flavor, "--training.device", device.type,
        "--training.seq_len", str(row.seq_len), "--training.local_batch_size", str(row.batch),
        "--training.steps", "1000", "--training.mixed_precision_param", dtype,
        "--lr_scheduler.warmup_steps", "0", "--metrics.enable_tensorboard", "false",
        "--job.dump_folder", str(dump), *row.overrides,
    ])


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_step(fn, batch, device: torch.device) -> float:
    sync(device)
    start = time.perf_counter()
    fn(*batch)
    sync(device)
    return time.perf_counter() - start


def free_memory(device: torch.device) -> None:
    """Drop what the last row left: Python garbage, cached CUDA blocks, compiled graphs."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    torch._dynamo.reset()


def throughput(row: Row, seconds: float, trainer: Trainer, peak: float | None) -> dict:
    """tokens/s, TFLOP/s and MFU of one step of `row` taking `seconds`."""
    tokens_per_s = row.batch * row.seq_len / seconds
    tflops = tokens_per_s * trainer.spec.flops_per_token(trainer.model_args, row.seq_len) / 1e12
    return {
        "tokens_per_s": round(tokens_per_s, 1),
        "tflops": round(tflops, 3),
        "mfu_pct": None if peak is None else round(100 * tflops * 1e12 / peak, 2),
    }


def measure_row(row: Row, args, device: torch.device, dtype: str, peak: float | None) -> dict:
    """Warm up, then time single steps of Titan's `train_step` on prefetched batches."""
    trainer = Trainer(row_config(row, dtype, device, RUN_FOLDER))
    data = iter(trainer.loader)
    batches = [tuple(t.to(device) for t in next(data)) for _ in range(min(args.steps, 4))]

    def step(inputs, labels):
        trainer.train_step([(inputs, labels)])

    for i in range(args.warmup):  # compile happens here
        timed_step(step, batches[i % len(batches)], device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times = [timed_step(step, batches[i % len(batches)], device) for i in range(args.steps)]
    result = {"status": "ok", "params_m": round(trainer.n_params / 1e6, 1), "median_step_s": round(statistics.median(times), 4)}
    result.update(throughput(row, statistics.median(times), trainer, peak))
    if device.type == "cuda":
        result["peak_mem_gib"] = round(torch.cuda.max_memory_allocated(device) / 2**30, 2)
    return result


def measure_pair(row: Row, args, device: torch.device, dtype: str, peak: float | None) -> dict:
    """Titan's step vs the hand-written loop from Titan's initial weights, steps interleaved."""
    trainer = Trainer(row_config(row, dtype, device, RUN_FOLDER))
    state = get_model_state_dict(trainer.model.parts[0], options=StateDictOptions(full_state_dict=True))
    with torch.device(device):
        plain = trainer.spec.build(trainer.model_args)
    plain.load_state_dict(state, strict=True)
    del state
    o = trainer.cfg.optimizer
    opt = torch.optim.AdamW(plain.parameters(), lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps,
                            weight_decay=o.weight_decay,  # the same step kernel as Titan's row
                            foreach=o.implementation == "foreach", fused=o.implementation == "fused")
    compute_dtype = getattr(torch, dtype)
    max_norm = trainer.cfg.training.max_norm

    def hand_written(inputs, labels):
        opt.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=compute_dtype, enabled=compute_dtype != torch.float32):
            logits = plain(inputs)  # (bs, seqlen, vocab)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(plain.parameters(), max_norm, foreach=True)
        opt.step()

    def titan(inputs, labels):
        trainer.train_step([(inputs, labels)])

    data = iter(trainer.loader)
    batches = [tuple(t.to(device) for t in next(data)) for _ in range(4)]
    contenders = [("titan", titan), ("hand-written", hand_written)]
    for _, fn in contenders:
        for i in range(args.warmup):
            timed_step(fn, batches[i % len(batches)], device)
    times: dict[str, list[float]] = {"titan": [], "hand-written": []}
    for i in range(args.pair_steps):
        for name, fn in contenders if i % 2 == 0 else contenders[::-1]:
            times[name].append(timed_step(fn, batches[i % len(batches)], device))
    ratios = sorted(hand / mine for mine, hand in zip(times["titan"], times["hand-written"]))
    q1, median, q3 = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else ratios * 3
    result = {"status": "ok", "params_m": round(trainer.n_params / 1e6, 1),
              "ratio_titan_over_hand": round(median, 4), "ratio_interquartile": [round(q1, 4), round(q3, 4)]}
    for name in times:
        result[name] = {"median_step_s": round(statistics.median(times[name]), 4),
                        **throughput(row, statistics.median(times[name]), trainer, peak)}
    return result


def run(row: Row, measure, args, device: torch.device, dtype: str, peak: float | None) -> dict:
    """One row, never raising: ok, skipped (with why) or failed (with the error's first line)."""
    result: dict = {"row": row.name, "flavor": row.flavor, "seq_len": row.seq_len, "batch": row.batch,
                    "overrides": " ".join(row.overrides)}
    started = time.perf_counter()
    try:
        row_config(row, dtype, device, RUN_FOLDER)  # the config first: does this Titan know every key?
        reason = why_not(row, device, args.cpu_compile)
    except ConfigError as e:
        missing = FLOAT8[0] in row.overrides and "converters" in str(e)
        reason = "this Titan's config has no model.converters key (float8 not wired in yet)" if missing else None
        if not missing:
            result.update(status="failed", reason=one_line(e))
    if reason is not None:
        result.update(status="skipped", reason=reason)
    elif "status" not in result:
        try:
            result.update(measure(row, args, device, dtype, peak))
        except Exception as e:  # OOM, a compile error, a missing package: record it and go on
            result.update(status="failed", reason=one_line(e))
    free_memory(device)
    result["wall_s"] = round(time.perf_counter() - started, 1)
    shown = result.get("reason") or (f"{result['tokens_per_s']:.0f} tokens/s" if "tokens_per_s" in result else
                                     f"titan / hand-written {result.get('ratio_titan_over_hand')}")
    print(f"[{result['status']}] {row.name}: {shown} ({result['wall_s']} s)", flush=True)
    return result


def environment(device: torch.device, dtype: str, peak: float | None) -> dict:
    def git(*cmd: str) -> str:
        try:
            return subprocess.run(["git", *cmd], capture_output=True, text=True, timeout=10).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""

    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "CPU"
    if device.type == "cpu":
        try:
            with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
                name = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), name)
        except OSError:
            pass
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "device": name,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "memory_gib": round(torch.cuda.get_device_properties(device).total_memory / 2**30, 1) if device.type == "cuda" else None,
        "dtype": dtype,
        "peak_tflops": None if peak is None else round(peak / 1e12, 1),
        "git": git("log", "-1", "--oneline") or "unknown",
        "uncommitted_files": len(git("status", "--short").splitlines()),
    }


def verdicts(results: dict) -> list[str]:
    """One line per target: met, NOT met, or not measured (and why)."""
    by_name = {r["row"]: r for r in results["rows"]}
    lines = []
    compiled = next((r for name, r in by_name.items() if name.endswith("bf16 compile") and r["flavor"] == "1B"), None)
    if compiled and compiled.get("mfu_pct") is not None:
        ok = compiled["mfu_pct"] >= TARGET_MFU
        verdict = "met" if ok else "NOT met"
        lines.append(f"1B bf16 + compile MFU {compiled['mfu_pct']:.1f}% (target >= {TARGET_MFU:.0f}%): {verdict}")
    else:
        lines.append(f"1B bf16 + compile MFU (target >= {TARGET_MFU:.0f}%): not measured")
    bf16, fp8 = (by_name.get(r["row"]) for r in results["layers"])
    if bf16 and fp8 and bf16.get("status") == fp8.get("status") == "ok":
        speedup = fp8["tokens_per_s"] / bf16["tokens_per_s"]
        results["float8_speedup"] = round(speedup, 3)
        verdict = "emulated: not a speed figure" if results["smoke"] else "met" if speedup >= TARGET_FLOAT8 else "NOT met"
        lines.append(f"float8 / bf16 on 8B-shaped layers {speedup:.3f}x (target >= {TARGET_FLOAT8}x): {verdict}")
    else:
        why = (fp8 or {}).get("reason") or (bf16 or {}).get("reason") or "row missing"
        lines.append(f"float8 / bf16 on 8B-shaped layers (target >= {TARGET_FLOAT8}x): not measured ({why})")
    pair = by_name.get(results["pair"])
    if pair and pair.get("status") == "ok":
        ratio = pair["ratio_titan_over_hand"]
        verdict = "met" if ratio >= TARGET_VS_HAND else "NOT met"
        lines.append(f"Titan / hand-written {ratio:.3f} (target >= {TARGET_VS_HAND}): {verdict}")
    else:
        why = (pair or {}).get("reason") or "row not run"
        lines.append(f"Titan / hand-written (target >= {TARGET_VS_HAND}): not measured ({why})")
    return lines


def markdown(results: dict) -> str:
    env = results["environment"]
    out = [
        f"# Titan GPU suite, {env['date']}",
        "",
        f"{env['device']}, torch {env['torch']} (CUDA {env['cuda']}), Python {env['python']}, {env['dtype']}, "
        f"peak {env['peak_tflops']} TFLOP/s; Titan at `{env['git']}` ({env['uncommitted_files']} uncommitted files).",
        "",
        "| row | status | tokens/s | TFLOP/s | MFU % | peak mem GiB | step s | note |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in results["rows"]:
        if "titan" in r:  # the pair row
            for name in ("titan", "hand-written"):
                m = r[name]
                out.append(f"| {r['row']}: {name} | ok | {m['tokens_per_s']:.0f} | {m['tflops']:.3g} | {m['mfu_pct']} | "
                           f"| {m['median_step_s']} | |")
            out.append(f"| {r['row']}: ratio | ok | | | | | | titan / hand-written {r['ratio_titan_over_hand']:.3f} "
                       f"(interquartile {r['ratio_interquartile'][0]:.3f}-{r['ratio_interquartile'][1]:.3f}) |")
            continue
        if r["status"] != "ok":
            out.append(f"| {r['row']} | {r['status']} | | | | | | {r['reason']} |")
            continue
        out.append(f"| {r['row']} | ok | {r['tokens_per_s']:.0f} | {r['tflops']:.3g} | {r['mfu_pct']} | "
                   f"{r.get('peak_mem_gib', '')} | {r['median_step_s']} | |")
    out += ["", "Targets:", ""] + [f"- {line}" for line in results["verdicts"]]
    return "\n".join(out) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("outputs/gpu-suite"), help="folder for results.json / results.md")
    parser.add_argument("--smoke", action="store_true", help="tiny CPU-sized run: debugmodel, seq 128, 2 steps")
    parser.add_argument("--steps", type=int, help="measured steps per row (default 10; 2 in --smoke)")
    parser.add_argument("--warmup", type=int, help="untimed steps first (default 3; 1 in --smoke)")
    parser.add_argument("--pair-steps", type=int, help="interleaved steps of each in the Titan vs hand-written row")
    parser.add_argument("--only", nargs="*", default=[], help="run only rows whose name contains one of these")
    parser.add_argument("--cpu-compile", action="store_true", help="run the compile rows on CPU too")
    args = parser.parse_args()
    args.steps = args.steps or (2 if args.smoke else 10)
    args.warmup = args.warmup or (1 if args.smoke else 3)
    args.pair_steps = args.pair_steps or (2 if args.smoke else 10)
    args.out.mkdir(parents=True, exist_ok=True)

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu" and not args.smoke:
        raise SystemExit("no CUDA device: the full suite needs a GPU; pass --smoke for the tiny CPU run")
    dtype = "float32" if device.type == "cpu" else "bfloat16"
    register_model_spec(dataclasses.replace(get_model_spec("llama3"), name=BENCH_MODEL, flavors=bench_flavors(args.smoke)))
    peak = device_peak_flops(device, getattr(torch, dtype))
    rows, pair, layers = suite(args.smoke)
    results: dict = {"environment": environment(device, dtype, peak), "smoke": args.smoke, "rows": [], "pair": pair.name,
                     "layers": [{"row": r.name} for r in layers]}
    print(json.dumps(results["environment"]), flush=True)
    plan = [(r, measure_row) for r in rows] + [(pair, measure_pair)] + [(r, measure_row) for r in layers]
    for row, measure in plan:
        if args.only and not any(word in row.name for word in args.only):
            continue
        results["rows"].append(run(row, measure, args, device, dtype, peak))
        (args.out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    results["verdicts"] = verdicts(results)
    (args.out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    (args.out / "results.md").write_text(markdown(results))
    print(markdown(results))


if __name__ == "__main__":
    main()
