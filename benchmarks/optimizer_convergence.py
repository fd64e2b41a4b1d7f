"""AdamW against Muon on Shakespeare: validation loss by step and by wall time, each after a small LR sweep.

    uv run python benchmarks/optimizer_convergence.py                        # the table of docs/optimizers.md
    uv run python benchmarks/optimizer_convergence.py --steps 40 --lrs 3e-3 --more-seeds ""   # quicker
    uv run python benchmarks/optimizer_convergence.py --json OUT.json        # and every curve

The same job for both: the Llama 3 debug model (5.8M parameters, 4.7M of them in the blocks'
matrices) on the byte tokenizer, sequences of 256 bytes (`--seq-len`), 8 per step (`--batch`), warmup
(a tenth of the steps) then linear decay, bf16 where the CPU has it, one process
(`titan_core.trainer.Trainer`, here, one run after another). Training reads 34 plays and poems
(`../shared/data/shakespeare/[a-s]*_gut.txt`); validation, every `--val-every` steps, the same
`--val-batches` batches of the 8 held-out ones (`[t-w]*_gut.txt`). Equal steps are equal tokens. Each
optimizer runs every learning rate of `--lrs` at seed `--seed`; the best (lowest final validation
loss) then runs at each seed of `--more-seeds`. Time is the sum of the train steps' own times
(validation left out), wall clock and this process's CPU time, after a 3-step warm-up run of each.

Muon runs at `optimizer.name = "Muon"`'s defaults (match_rms_adamw: the same learning rate for its
matrices and its AdamW group). The data is the benchmark's: the product never reads it.
Experiments, not part of the package; no guarantees.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DATA = REPO.parent / "shared" / "data" / "shakespeare"
OPTIMIZERS = ("AdamW", "Muon")


def job_args(optimizer: str, lr: float, seed: int, a: argparse.Namespace, steps: int | None = None) -> list[str]:
    steps = steps or a.steps
    val_every, val_batches = min(a.val_every, steps), a.val_batches
    return [
        "--optimizer.name", optimizer, "--optimizer.lr", str(lr), "--debug.seed", str(seed),
        "--training.steps", str(steps), "--training.seq_len", str(a.seq_len),
        "--training.local_batch_size", str(a.batch),
        "--training.dataset_path", str(DATA / "[a-s]*_gut.txt"),
        "--lr_scheduler.warmup_steps", str(max(1, steps // 10)),
        "--validation.enable", "true", "--validation.dataset_path", str(DATA / "[t-w]*_gut.txt"),
        "--validation.freq", str(val_every), "--validation.steps", str(val_batches),
        "--metrics.log_freq", str(val_every), "--metrics.enable_tensorboard", "false",
    ]  # fmt: skip


def run(args: list[str], folder: Path) -> dict:
    """Train one job here; returns {"val": {step: loss}, "seconds": [cumulative train seconds after each step],
    "cpu_seconds": [the same in this process's CPU time]}."""
    from titan_core.config import load_config
    from titan_core.trainer import Trainer

    trainer = Trainer(load_config(None, [*args, "--job.dump_folder", str(folder)]))
    times: list[tuple[float, float]] = []
    step = trainer.train_step

    def timed(*a, **k):  # on the CPU a step has finished when it returns
        start, cpu = time.perf_counter(), time.process_time()
        result = step(*a, **k)
        times.append((time.perf_counter() - start, time.process_time() - cpu))
        return result

    trainer.train_step = timed  # type: ignore[method-assign]
    trainer.train()
    records = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    val = {r["step"]: r["validation/loss"] for r in records if "validation/loss" in r}
    wall = [sum(t for t, _ in times[: i + 1]) for i in range(len(times))]
    cpu = [sum(c for _, c in times[: i + 1]) for i in range(len(times))]
    return {"val": val, "seconds": wall, "cpu_seconds": cpu}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--lrs", default="1e-3,3e-3,1e-2,3e-2", help="learning rates swept for each optimizer")
    parser.add_argument("--seed", type=int, default=1, help="seed of the sweep")
    parser.add_argument("--more-seeds", default="2,3", help="seeds the best learning rate of each runs again")
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--batch", type=int, default=8, help="sequences per step")
    parser.add_argument("--val-every", type=int, default=25)
    parser.add_argument("--val-batches", type=int, default=8)
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument("--no-warm-up", action="store_true", help="skip the untimed 3-step run of each optimizer")
    parser.add_argument("--json", help="write every curve here")
    a = parser.parse_args()
    if not DATA.is_dir():
        raise SystemExit(f"{DATA} not found: this benchmark reads the shared Shakespeare corpus")
    import torch

    torch.set_num_threads(a.threads)
    os.environ.setdefault("OMP_NUM_THREADS", str(a.threads))
    lrs = [float(x) for x in a.lrs.split(",")]
    seeds = [int(x) for x in a.more_seeds.split(",") if x]
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:

        def go(optimizer: str, lr: float, seed: int) -> dict:
            key = f"{optimizer} lr={lr:g} seed={seed}"
            args = job_args(optimizer, lr, seed, a)
            results[key] = {"optimizer": optimizer, "lr": lr, "seed": seed, **run(args, Path(tmp) / key)}
            last = results[key]
            print(f"{key:<30} final val {last['val'][a.steps]:.4f}  train {last['seconds'][-1]:.0f} s "
                  f"({last['cpu_seconds'][-1]:.0f} s CPU)", flush=True)  # fmt: skip
            return last

        for optimizer in OPTIMIZERS if not a.no_warm_up else ():  # one-off costs (kernel set-up) of first steps
            run(job_args(optimizer, lrs[0], a.seed, a, steps=3), Path(tmp) / f"warm-up {optimizer}")
        best: dict[str, float] = {}
        for optimizer in OPTIMIZERS:
            finals = {lr: go(optimizer, lr, a.seed)["val"][a.steps] for lr in lrs}
            best[optimizer] = min(finals, key=finals.__getitem__)
        for optimizer in OPTIMIZERS:
            for seed in seeds:
                go(optimizer, best[optimizer], seed)
    report(results, best, a.seed, seeds, a.steps)
    if a.json:
        Path(a.json).write_text(json.dumps(results, indent=1))


def report(results: dict, best: dict[str, float], seed: int, seeds: list[int], steps: int) -> None:
    """The sweep's final losses, then the best of each against steps and against wall time."""
    print("\nfinal validation loss, sweep at seed", seed)
    print("| lr | " + " | ".join(OPTIMIZERS) + " |\n|---|" + "---|" * len(OPTIMIZERS))
    for lr in sorted({r["lr"] for r in results.values()}):
        cells = [f"{results[k]['val'][steps]:.4f}" if (k := f"{o} lr={lr:g} seed={seed}") in results else "-"
                 for o in OPTIMIZERS]  # fmt: skip
        print(f"| {lr:g} | " + " | ".join(cells) + " |")
    curves = {o: [r for r in results.values() if r["optimizer"] == o and r["lr"] == best[o]] for o in OPTIMIZERS}
    print(f"\nbest lr of each: validation loss against steps (mean over seeds {[seed, *seeds]}; min..max)")
    print("| step | " + " | ".join(f"{o} lr={best[o]:g}" for o in OPTIMIZERS) + " |\n|---|" + "---|" * len(OPTIMIZERS))
    for step in sorted(curves[OPTIMIZERS[0]][0]["val"]):
        cells = []
        for o in OPTIMIZERS:
            values = [r["val"][step] for r in curves[o]]
            cells.append(f"{sum(values) / len(values):.4f} ({min(values):.3f}..{max(values):.3f})")
        print(f"| {step} | " + " | ".join(cells) + " |")
    print("\nagainst time: train seconds to reach each step, wall (CPU), mean over seeds, and the loss there")
    header = " | ".join(f"{o} s | {o} loss" for o in OPTIMIZERS)
    print(f"| step | {header} |\n|---|" + "---|---|" * len(OPTIMIZERS))
    for step in sorted(curves[OPTIMIZERS[0]][0]["val"]):
        cells = []
        for o in OPTIMIZERS:
            wall = sum(r["seconds"][step - 1] for r in curves[o]) / len(curves[o])
            cpu = sum(r["cpu_seconds"][step - 1] for r in curves[o]) / len(curves[o])
            loss = sum(r["val"][step] for r in curves[o]) / len(curves[o])
            cells += [f"{wall:.0f} ({cpu:.0f})", f"{loss:.4f}"]
        print(f"| {step} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
