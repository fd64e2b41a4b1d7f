"""Estimated against measured peak memory on one GPU: the GPU rows of docs/memory.md's accuracy table.

    python3 benchmarks/gpu_memory.py --suite OUT/results.json --out OUT [--measure] [--plan]

The measured figures are `benchmarks/gpu_suite.py`'s (`torch.cuda.max_memory_allocated` over
the timed steps of Titan's own `train_step`, read from its results.json); this script makes the
estimates for the same configs (llama3 1B, seq 2048, local batch 4, bf16, fused AdamW):

- the analytic tier (`estimate_memory`, per-block figures; under compile, the saved tensors of
  Inductor's partitioned graph of one block) and the traced tier;
- with `--measure`, the measured tier (two and three blocks, two real steps each, on this GPU)
  for the defaults + compile row;
- with `--plan`, `titan plan`'s micro-batch for the compiled 1B on this GPU (1 rank), then a real
  run of it (it must fit) and the estimate for the next larger one (it must not).

Writes OUT/memory.json and OUT/memory.md.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROWS = {  # suite row name -> Titan overrides on top of the 1B job below
    "1B s2048 defaults (eager)": [],
    "1B s2048 defaults + compile": ["--compile.enable", "true"],
    "1B s2048 compile, plain loss": ["--compile.enable", "true", "--training.fused_loss", "false"],
    "1B s2048 compile + AC selective op": [
        "--compile.enable",
        "true",
        "--activation_checkpoint.mode",
        "selective",
        "--activation_checkpoint.selective_ac_option",
        "op",
    ],
    # float8 blocks traced as the GPU's `_scaled_mm` graph (tensorwise: the matmul inputs kept in float8)
    "1B s2048 compile + float8": ["--compile.enable", "true", "--model.converters", "float8"],
    "1B s2048 compile + AC memory budget 0.5": [
        "--compile.enable",
        "true",
        "--activation_checkpoint.mode",
        "memory_budget",
        "--activation_checkpoint.memory_budget",
        "0.5",
    ],
}
JOB = [
    "--model.name",
    "llama3",
    "--model.flavor",
    "1B",
    "--training.seq_len",
    "2048",
    "--training.local_batch_size",
    "4",
    "--training.mixed_precision_param",
    "bfloat16",
    "--metrics.enable_tensorboard",
    "false",
    "--checkpoint.enable",
    "false",
]
GIB = 2**30


def config(overrides: list[str]):
    from titan_core.config import load_config

    return load_config(None, [*JOB, *overrides])


def estimates(name: str, overrides: list[str], measured: float | None, measure: bool) -> dict:
    """Every tier's estimate for one row, in GiB, with its error against `measured`."""
    from titan_core.memory import estimate_memory

    row: dict = {"row": name, "measured_gib": measured}
    tiers = {"analytic": {}, "traced": {"traced": True}}
    if measure:
        tiers["measured"] = {"measure": True}
    for tier, kw in tiers.items():
        started = time.perf_counter()
        try:
            est = estimate_memory(config(overrides), 1, device_type=None if kw.get("measure") else "cuda", **kw)
        except Exception as e:  # noqa: BLE001 - a tier that fails is recorded with its reason
            row[tier] = {"error": f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:200]}"}
            continue
        gib = max(r.total for r in est.ranks) / GIB
        entry = {"gib": round(gib, 2), "seconds": round(time.perf_counter() - started, 1), "tier": est.tier}
        if measured:
            entry["error_pct"] = round(100 * (gib - measured) / measured, 1)
        row[tier] = entry
        print(f"{name}: {tier} {entry}", flush=True)
    return row


def plan_check() -> dict:
    """`titan plan`'s micro-batch for the compiled 1B on this GPU, run for real; the next larger one estimated."""
    import torch

    from titan_core.memory import estimate_memory
    from titan_core.memory.plan import PlanRequest, layout_config, prepare_plan, search

    overrides = tuple(JOB + ROWS["1B s2048 defaults + compile"])
    gpu = f"{torch.cuda.get_device_properties(0).total_memory}B"
    plan = search(
        prepare_plan(
            PlanRequest(
                config=None, overrides=overrides, gpus=1, gpus_per_node=1, gpu_memory=gpu, global_batch=32, top=3
            )
        )
    )
    if not plan.fits:
        return {"error": "titan plan found no layout that fits"}
    best = plan.fits[0]
    run_cfg = layout_config(plan, best.layout)
    mb = run_cfg.training.local_batch_size
    out: dict = {
        "layout": str(best.layout),
        "local_batch": mb,
        "estimate_gib": round(best.peak / GIB, 2),
        "usable_gib": round(plan.usable / GIB, 2),
    }
    bigger = run_cfg.model_copy(deep=True)  # the next micro-batch the search tried: the next divisor of the batch
    bigger.training.local_batch_size = 2 * mb
    out["next_local_batch"] = 2 * mb
    out["next_estimate_gib"] = round(
        max(r.total for r in estimate_memory(bigger, 1, device_type="cuda").ranks) / GIB, 2
    )
    for name, cfg in (("ran", run_cfg), ("next_ran", bigger)):
        out[name], out[name.replace("ran", "measured_gib")] = real_peak(cfg)
    print(f"plan: {out}", flush=True)
    return out


def real_peak(cfg) -> tuple[str, float]:
    """Three real steps of `cfg` on this GPU: "ok" or the OOM's first line, and max_memory_allocated in GiB."""
    import gc

    import torch

    from titan_core.trainer import Trainer

    status = "ok"
    torch.cuda.reset_peak_memory_stats()
    try:
        trainer = Trainer(cfg)
        data = iter(trainer.loader)
        for _ in range(3):
            inputs, labels = (t.cuda() for t in next(data))
            trainer.train_step([(inputs, labels)])
        torch.cuda.synchronize()
    except torch.OutOfMemoryError as e:
        status = f"OOM: {str(e).splitlines()[0][:120]}"
    peak = round(torch.cuda.max_memory_allocated() / GIB, 2)
    trainer = data = None
    gc.collect()
    torch.cuda.empty_cache()
    torch._dynamo.reset()
    return status, peak


def markdown(rows: list[dict], plan: dict | None, env: str) -> str:
    lines = [
        f"GPU memory accuracy ({env})",
        "",
        "| row | measured GiB | analytic | traced | measured tier |",
        "|---|---|---|---|---|",
    ]

    def cell(entry: dict | None) -> str:
        if not entry:
            return ""
        if "error" in entry:
            return entry["error"][:60]
        err = f" ({entry['error_pct']:+.1f}%)" if "error_pct" in entry else ""
        return f"{entry['gib']:.2f}{err}"

    for r in rows:
        m = r["measured_gib"]
        lines.append(
            f"| {r['row']} | {m if m is not None else ''} | {cell(r.get('analytic'))} | {cell(r.get('traced'))} | {cell(r.get('measured'))} |"
        )
    if plan:
        lines += ["", f"titan plan (compiled 1B, one GPU): {json.dumps(plan)}"]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--suite", type=Path, help="gpu_suite.py's results.json (measured peaks)")
    parser.add_argument("--out", type=Path, default=Path("outputs/gpu-memory"))
    parser.add_argument("--measure", action="store_true", help="also the measured tier for the defaults + compile row")
    parser.add_argument("--plan", action="store_true", help="titan plan's micro-batch, run for real")
    args = parser.parse_args()
    import torch

    args.out.mkdir(parents=True, exist_ok=True)
    measured: dict[str, float] = {}
    if args.suite and args.suite.exists():
        for r in json.loads(args.suite.read_text()).get("rows", []):
            if r.get("status") == "ok" and "peak_mem_gib" in r:
                measured[r["row"]] = r["peak_mem_gib"]
    rows = []
    for name, overrides in ROWS.items():
        rows.append(
            estimates(name, overrides, measured.get(name), args.measure and name == "1B s2048 defaults + compile")
        )
        (args.out / "memory.json").write_text(json.dumps({"rows": rows}, indent=1))
    plan = plan_check() if args.plan and torch.cuda.is_available() else None
    dev = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    env = f"{dev}, torch {torch.__version__}, {time.strftime('%Y-%m-%d')}"
    (args.out / "memory.json").write_text(json.dumps({"env": env, "rows": rows, "plan": plan}, indent=1))
    (args.out / "memory.md").write_text(markdown(rows, plan, env))
    print(markdown(rows, plan, env))


if __name__ == "__main__":
    sys.exit(main())
