"""Checkpoint timings for a ~100M-parameter Llama 3 (flavor "110M": 113M parameters).

    uv run python benchmarks/checkpoint_bench.py [--flavor 110M] [--folder DIR] [--repeats 3]
    torchrun --nproc-per-node N benchmarks/checkpoint_bench.py ...      # FSDP over N ranks

The model is FSDP-sharded as in training, with AdamW state (a full checkpoint is about
12 bytes per parameter: fp32 weights plus two moments). The variants take turns, and
the best of `--repeats` rounds is printed:

- sync save: the training loop is blocked for the whole save (write, fsync, checksums,
  manifest, rename);
- async save: blocked only while the state is staged into CPU memory; then the time
  until the step folder is complete on disk;
- async with pinned memory (CUDA only);
- load: verify every file against the manifest, read, and set model + optimizer;
- the same without CRC-32 checksums (sizes only), to show what checksumming costs.

Experiments, not part of the package; no guarantees.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
from titan_ckpt.manager import CheckpointManager
from titan_models import get_model_args, get_model_spec
from titan_parallel import ParallelDims, ParallelOptions, init_distributed, parallelize, resolve_device, shutdown_distributed


def build_trained_model(flavor: str, device: torch.device) -> tuple[torch.nn.Module, torch.optim.Optimizer, int]:
    """A sharded Llama 3 of `flavor` and an AdamW that has taken one step (so its state exists)."""
    spec = get_model_spec("llama3")
    args = get_model_args("llama3", flavor)
    with torch.device(device):
        model = spec.build(args)
    n_params = sum(p.numel() for p in model.parameters())
    mesh = ParallelDims(world_size=dist.get_world_size()).build_mesh(device.type)
    model = parallelize(model, spec.plan, mesh, ParallelOptions())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    tokens = torch.randint(0, args.vocab_size, (1, 65), device=device)
    logits = model(tokens[:, :-1])  # (1, 64, vocab)
    torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()).backward()
    optimizer.step()
    return model, optimizer, n_params


def time_save(manager: CheckpointManager, step: int) -> tuple[float, float]:
    """One save: (seconds the training loop is blocked, seconds until the step folder is complete)."""
    dist.barrier()
    start = time.perf_counter()
    manager.save(step)
    blocked = time.perf_counter() - start
    manager.wait()
    dist.barrier()
    return blocked, time.perf_counter() - start


def time_load(root: Path, model, optimizer, device, checksums: bool) -> float:
    """Seconds to verify and restore the newest checkpoint under `root` (a fresh manager, as at start-up)."""
    manager = CheckpointManager(root, model_parts=[model], optimizers=[optimizer], device=device, checksums=checksums)
    dist.barrier()
    start = time.perf_counter()
    manager.load()
    dist.barrier()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--flavor", default="110M", help="llama3 flavor (default 110M)")
    parser.add_argument("--folder", default=None, help="where to write checkpoints (default: a temporary folder)")
    parser.add_argument("--repeats", type=int, default=3, help="rounds over all variants; the best of each is printed")
    opts = parser.parse_args()

    device = resolve_device()
    rank, world = init_distributed(device)
    model, optimizer, n_params = build_trained_model(opts.flavor, device)
    base = Path(opts.folder or tempfile.mkdtemp(prefix="titan-ckpt-bench-"))
    variants = [("sync", "disabled", True), ("sync, no checksums", "disabled", False), ("async", "async", True)]
    if device.type == "cuda":
        variants.append(("async, pinned memory", "async_with_pinned_mem", True))
    managers = {
        name: CheckpointManager(base / name.replace(", ", "-").replace(" ", "-"), model_parts=[model], optimizers=[optimizer],
                                device=device, interval=1, keep_latest_k=1, async_mode=mode, checksums=checksums)
        for name, mode, checksums in variants
    }
    rows: dict[str, list[tuple[float, float]]] = {}
    for step in range(1, opts.repeats + 1):  # round-robin, so disk write-back state affects every variant alike
        for name, mode, checksums in variants:
            rows.setdefault(f"save {name}", []).append(time_save(managers[name], step))
            if mode == "disabled":
                load_s = time_load(managers[name].folder, model, optimizer, device, checksums)
                rows.setdefault(f"load ({'verify CRC-32' if checksums else 'verify sizes only'})", []).append((load_s, load_s))
    for manager in managers.values():
        manager.close()
    size = sum(p.stat().st_size for p in next((base / "sync").glob("step-*")).rglob("*") if p.is_file())
    if rank == 0:
        print(f"\nllama3/{opts.flavor}: {n_params / 1e6:.1f}M parameters, {world} rank(s) on {device.type}, "
              f"full checkpoint {size / 1e9:.2f} GB, torch {torch.__version__}, {os.cpu_count()} CPUs")
        print(f"{'':34s} {'loop blocked':>12s} {'complete':>10s} {'GB/s':>6s}")
        for label, times in rows.items():
            blocked_s, complete_s = min(t[0] for t in times), min(t[1] for t in times)
            print(f"{label:34s} {blocked_s:11.2f}s {complete_s:9.2f}s {size / 1e9 / complete_s:6.2f}")
        print(f"(best of {opts.repeats} rounds; 'complete' = until the step folder is renamed into place)")
    if opts.folder is None and rank == 0:
        shutil.rmtree(base, ignore_errors=True)
    shutdown_distributed()


if __name__ == "__main__":
    main()
