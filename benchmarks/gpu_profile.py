"""Where a Titan training step spends its time: a `torch.profiler` trace of a few steps, summarised.

Builds the same `Trainer` as `gpu_suite.py`'s rows, warms it up (compile happens
there), profiles `--steps` steps and writes, per row:

- the top kernels by device time (name, calls, total ms, share of the step),
- device time by kind: matmuls (GEMM / cuBLAS / CUTLASS / nvjet / `_scaled_mm`), attention
  (flash / cuDNN / memory-efficient), Triton kernels (Inductor's fusions), copies and
  elementwise kernels outside compiled regions, collectives,
- the gap: wall time minus device-busy time, i.e. the device idle, waiting for the host.

    python3 benchmarks/gpu_profile.py --out DIR [--row 1B-compile] [--row 8Bx8-float8] ...
    uv run python benchmarks/gpu_profile.py --smoke --out /tmp/prof     # CPU: the host-side overhead only

Rows are named in `ROWS` below. Writes DIR/profile_<row>.txt and DIR/profile.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_suite import (  # noqa: E402
    BENCH_MODEL,
    COMPILE,
    FLOAT8,
    OUTPUT_FLOAT8,
    RUN_FOLDER,
    Row,
    bench_flavors,
    row_config,
)

from titan_core.trainer import Trainer  # noqa: E402
from titan_models import get_model_spec, register_model_spec  # noqa: E402

AC_OP = ("--activation_checkpoint.mode", "selective", "--activation_checkpoint.selective_ac_option", "op")
ROWS = {
    "1B-compile": Row("1B s2048 compile", "1B", 2048, 4, COMPILE),
    "1B-compile-float8": Row("1B s2048 compile + float8", "1B", 2048, 4, COMPILE + FLOAT8),
    "8Bx8-compile-acop": Row("8B x8 s8192 compile + AC op", "8B-x8", 8192, 1, COMPILE + AC_OP),
    "8Bx8-compile-acop-float8": Row("8B x8 s8192 compile + AC op + float8", "8B-x8", 8192, 1, COMPILE + AC_OP + FLOAT8),
    "8Bx8-compile-acop-float8-output": Row(
        "8B x8 s8192 compile + AC op + float8, output in float8", "8B-x8", 8192, 1, COMPILE + AC_OP + FLOAT8 + OUTPUT_FLOAT8
    ),
    "smoke": Row("debugmodel s128 eager", "debugmodel", 128, 2),
}
KINDS = (  # (kind, substrings of kernel names), first match wins
    ("optimizer", ("adam", "multi_tensor_apply")),  # master-weight AdamW (Triton), torch's fused AdamW / grad norm
    ("attention", ("flash", "fmha", "cudnn", "attention", "sdpa")),
    ("matmul", ("gemm", "cutlass", "nvjet", "sm90_", "scaled_mm", "cublas", "matmul", "addmm", " mm")),
    ("collective", ("nccl", "allreduce", "all_gather", "reduce_scatter")),
    ("triton (compiled)", ("triton",)),
    ("copy / cast", ("copy", "memcpy", "memset", "cast", "to_copy")),
)


def kind_of(name: str) -> str:
    low = name.lower()
    return next((kind for kind, keys in KINDS if any(k in low for k in keys)), "other eager kernels")


def _annotation(event) -> bool:
    """A `record_function` range drawn on the device timeline (FSDP's, the optimizer's), not a kernel."""
    if getattr(event, "is_user_annotation", False):
        return True
    return event.name.startswith(("FSDP::", "ProfilerStep", "## ")) or "#" in event.name


def profile_row(key: str, row: Row, steps: int, warmup: int, device: torch.device, dtype: str, out: Path) -> dict:
    trainer = Trainer(row_config(row, dtype, device, RUN_FOLDER))
    data = iter(trainer.loader)
    batches = [tuple(t.to(device) for t in next(data)) for _ in range(2)]
    for i in range(warmup):
        trainer.train_step([batches[i % 2]])
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
        torch.cuda.synchronize()
    with torch.profiler.profile(activities=activities) as prof:
        start = time.perf_counter()
        for i in range(steps):
            trainer.train_step([batches[i % 2]])
        if device.type == "cuda":
            torch.cuda.synchronize()
        wall = (time.perf_counter() - start) / steps
    kernels: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for event in prof.events():
        on_device = event.device_type == torch.autograd.DeviceType.CUDA
        if device.type == "cuda" and (not on_device or _annotation(event)):
            continue
        if device.type == "cpu" and (event.cpu_parent is not None or not event.name.startswith("aten::")):
            continue  # on CPU: top-level aten ops, the host's view
        seconds = (event.device_time if on_device else event.cpu_time) / 1e6
        kernels[event.name][0] += seconds / steps
        kernels[event.name][1] += 1 / steps
    busy = sum(t for t, _ in kernels.values())
    by_kind: dict[str, float] = defaultdict(float)
    for name, (seconds, _) in kernels.items():
        by_kind[kind_of(name)] += seconds
    top = sorted(kernels.items(), key=lambda kv: -kv[1][0])[:30]
    result = {
        "row": row.name,
        "step_ms": round(wall * 1e3, 2),
        "device_busy_ms": round(busy * 1e3, 2),
        "idle_pct": round(100 * max(0.0, wall - busy) / wall, 1) if device.type == "cuda" else None,
        "by_kind_ms": {k: round(v * 1e3, 2) for k, v in sorted(by_kind.items(), key=lambda kv: -kv[1])},
        "top": [
            {"name": n[:120], "ms": round(t * 1e3, 3), "calls": round(c, 1), "pct": round(100 * t / wall, 1)}
            for n, (t, c) in top
        ],
    }
    lines = [
        f"{row.name}: step {result['step_ms']} ms, device busy {result['device_busy_ms']} ms, "
        f"idle {result['idle_pct']}%",
        "",
        "by kind (ms/step):",
    ]
    lines += [f"  {k:<22}{v:>10.2f}" for k, v in result["by_kind_ms"].items()]
    lines += ["", f"{'kernel':<100}{'ms/step':>9}{'calls':>7}{'%':>6}"]
    lines += [f"{t['name'][:99]:<100}{t['ms']:>9.3f}{t['calls']:>7.1f}{t['pct']:>6.1f}" for t in result["top"]]
    (out / f"profile_{key}.txt").write_text("\n".join(lines) + "\n")
    print("\n".join(lines[:12]), flush=True)
    del trainer
    torch._dynamo.reset()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("outputs/gpu-profile"))
    parser.add_argument("--row", action="append", choices=sorted(ROWS), help="rows to profile (repeatable)")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--smoke", action="store_true", help="CPU: the debug model, eager, fp32")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    dtype = "bfloat16" if device.type == "cuda" else "float32"
    flavors = bench_flavors(args.smoke)
    register_model_spec(dataclasses.replace(get_model_spec("llama3"), name=BENCH_MODEL, flavors=flavors))
    keys = ["smoke"] if args.smoke else (args.row or ["1B-compile"])
    results = {}
    for key in keys:
        try:
            results[key] = profile_row(key, ROWS[key], args.steps, args.warmup, device, dtype, args.out)
        except Exception as e:  # OOM or a missing package: record it, go on
            results[key] = {"error": f"{type(e).__name__}: {str(e).strip().splitlines()[0][:300]}"}
            print(f"[failed] {key}: {results[key]['error']}", flush=True)
        (args.out / "profile.json").write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
