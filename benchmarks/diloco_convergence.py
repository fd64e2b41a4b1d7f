"""How close DiLoCo's loss comes to averaging the gradients every step, at the same tokens.

    uv run python benchmarks/diloco_convergence.py               # ~6 min on 2 CPU cores
    uv run python benchmarks/diloco_convergence.py --steps 40     # shorter

Each method runs two torchft replica groups of one process each through `titan lighthouse`
on this machine, `--steps` steps of the debug Llama (seq 128, batch 8 per group, fp32), the
same seed and data slices, and validates both groups on the stdlib corpus's held-out files
at the last step (10 batches). The methods:

- `per step`: the gradients averaged across the groups every step (`semi_sync_method = "none"`);
- `diloco H`: DiLoCo, a sync every H steps (outer lr 0.7, Nesterov 0.9, the paper's);
- `streaming`: 2 fragments, each all-reduce overlapped with 2 inner steps, bf16 on the wire;
- `local sgd H`: the groups' weights averaged every H steps.

With one fragment and `--steps` a multiple of H, the last step is a sync: both groups hold the
same weights, and their validation loss is the synced model's. Streaming ends with the second
fragment just synced and the first synced H/2 steps before: each group's own weights, so its
two losses differ a little. It prints, per method, both groups' validation loss, the mean
training loss of the last 10 steps and the wall time. On one machine the all-reduce is cheap,
so the wall times say little about slow links; the losses are the point.

Experiments, not part of the package; no guarantees.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from cpu_peers import cpu_description  # benchmarks/ is this script's folder, hence on sys.path

TITAN = [sys.executable, "-m", "titan_cli"]


def run_method(folder: Path, address: str, steps: int, extra: list[str]) -> dict[str, object]:
    """Both groups of one method, side by side; their final validation and last-10-step training losses."""
    procs = []
    began = time.perf_counter()
    for replica in (0, 1):
        cmd = [*TITAN, "train", "--job.dump_folder", str(folder / f"g{replica}"), "--training.steps", str(steps),
               "--training.seq_len", "128", "--training.local_batch_size", "8", "--training.mixed_precision_param",
               "float32", "--metrics.log_freq", "1", "--metrics.enable_tensorboard", "false",
               "--validation.enable", "true", "--validation.freq", str(steps), "--validation.steps", "10",
               "--fault_tolerance.enable", "true", "--fault_tolerance.group_size", "2",
               "--fault_tolerance.min_replica_size", "2", "--fault_tolerance.replica_id", str(replica),
               "--fault_tolerance.lighthouse", address, *extra]  # fmt: skip
        log = open(folder / f"g{replica}.log", "w")  # noqa: SIM115 (closed with the process)
        procs.append((subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True), log))
    for proc, log in procs:
        if proc.wait(timeout=1800) != 0:
            raise SystemExit(f"{folder.name}: a group failed; see {log.name}")
        log.close()
    wall = time.perf_counter() - began
    val, train = [], []
    for replica in (0, 1):
        records = [json.loads(line) for line in (folder / f"g{replica}" / "metrics.jsonl").read_text().splitlines()]
        val.append(next(r["validation/loss"] for r in reversed(records) if "validation/loss" in r))
        train.append(statistics.mean([r["loss/global_avg"] for r in records if "loss/global_avg" in r][-10:]))
    return {"validation": val, "train_last10": statistics.mean(train), "wall_s": wall}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100, help="training steps per run (a multiple of --every)")
    parser.add_argument("--every", type=int, default=10, help="DiLoCo's and local SGD's H (sync_steps)")
    args = parser.parse_args()
    if args.steps % args.every or args.every % 2:
        raise SystemExit("--steps must be a multiple of --every, and --every even (streaming cuts it in 2)")
    h = str(args.every)
    methods = {
        "per step": ["--fault_tolerance.semi_sync_method", "none"],
        f"diloco {h}": ["--fault_tolerance.semi_sync_method", "diloco", "--fault_tolerance.sync_steps", h],
        "streaming": ["--fault_tolerance.semi_sync_method", "diloco", "--fault_tolerance.sync_steps", h,
                      "--fault_tolerance.num_fragments", "2", "--fault_tolerance.fragment_sync_delay", "2",
                      "--fault_tolerance.sync_dtype", "bfloat16"],  # fmt: skip
        f"local sgd {h}": ["--fault_tolerance.semi_sync_method", "local_sgd", "--fault_tolerance.sync_steps", h],
    }
    print(f"{cpu_description()}; torch from {sys.executable}; {args.steps} steps, 2 groups x batch 8 x seq 128")
    with tempfile.TemporaryDirectory(prefix="diloco_convergence_") as tmp:
        root = Path(tmp)
        lighthouse_log = open(root / "lighthouse.log", "w")  # noqa: SIM115 (closed below)
        lighthouse = subprocess.Popen([*TITAN, "lighthouse", "--bind", "[::]:0", "--min-replicas", "2"],
                                      stdout=lighthouse_log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            address = None
            for _ in range(600):
                found = re.search(r"lighthouse at (\S+):", (root / "lighthouse.log").read_text())
                if found:
                    address = found.group(1)
                    break
                time.sleep(0.1)
            if address is None:
                raise SystemExit("the lighthouse did not start; see its log")
            print(f"{'method':<14}{'val loss g0':>12}{'val loss g1':>12}{'train (last 10)':>17}{'wall s':>8}")
            for name, extra in methods.items():
                folder = root / name.replace(" ", "_")
                folder.mkdir()
                result = run_method(folder, address, args.steps, extra)
                val = result["validation"]
                assert isinstance(val, list)
                print(f"{name:<14}{val[0]:>12.4f}{val[1]:>12.4f}{result['train_last10']:>17.4f}"
                      f"{result['wall_s']:>8.0f}", flush=True)  # fmt: skip
        finally:
            os.killpg(lighthouse.pid, signal.SIGKILL)
            lighthouse.wait()
            lighthouse_log.close()


if __name__ == "__main__":
    main()
