"""A Mixture-of-Experts layer under tensor parallel: each rank's slice of the experts against the whole layer.

`TPStyle.MOE_INPUT` splits every routed and shared expert's hidden dim over the TP ranks, so each rank
computes `1 / tp` of the layer's expert FLOPs on the same all-gathered tokens, and holds `1 / tp` of its
expert weights. Before 2026-11-29 each TP rank ran the layer whole on those tokens; that compute (the
unsplit layer on the whole sequence, without its all-gather) is the baseline timed here.

One torchrun launch of `--tp` gloo processes (one CPU thread each). Each rank builds the same seeded
`titan_models.moe.MoE` twice, splits one with titan-parallel's style (`parallelize_module`), and first
checks it: the split layer's output on the rank's sequence slice and the router's summed gradient against
the whole layer's (fp32, within 1e-5 relative). Then it times forward + backward of both, interleaved
(split, whole, whole, split, ...) so that drifts in machine speed hit both alike.

    uv run python benchmarks/moe_tp.py                       # dim 1024, 64 experts of 384, top 8, 1 x 512 tokens
    uv run python benchmarks/moe_tp.py --seq-len 128 --rounds 2   # smoke

Prints per-rank median and best ms of each, their ratio, and the expert weights each rank holds.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--dim", type=int, default=1024)
    p.add_argument("--experts", type=int, default=64)
    p.add_argument("--hidden", type=int, default=384, help="each routed expert's hidden dim")
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--shared", type=int, default=1, help="shared experts (0: none)")
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--rounds", type=int, default=5)
    return p.parse_args()


def worker(args: argparse.Namespace) -> None:
    import copy

    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import parallelize_module

    from titan_models.moe import MoE, MoEArgs
    from titan_parallel.tensor_parallel import MoETensorParallel

    dist.init_process_group("gloo")
    rank, tp = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    moe_args = MoEArgs(
        num_experts=args.experts, top_k=args.top_k, hidden_dim=args.hidden, num_shared_experts=args.shared
    )
    whole = MoE(args.dim, moe_args)
    whole.init_weights(0.02)
    split = copy.deepcopy(whole)
    parallelize_module(split, init_device_mesh("cpu", (tp,)), MoETensorParallel())
    x = torch.randn(args.batch, args.seq_len, args.dim)
    grad = torch.randn_like(x)
    rows = slice(rank * args.seq_len // tp, (rank + 1) * args.seq_len // tp)

    def run_split() -> torch.Tensor:
        mine = x[:, rows].clone().requires_grad_()
        out = split(mine)
        out.backward(grad[:, rows])
        return out

    def run_whole() -> torch.Tensor:
        out = whole(x.clone().requires_grad_())
        out.backward(grad)
        return out

    got, want = run_split(), run_whole()
    router = split.router.gate.weight.grad
    router = router.full_tensor() if isinstance(router, DTensor) else router
    for name, a, b in (("output", got, want[:, rows]), ("router gradient", router, whole.router.gate.weight.grad)):
        error = ((a - b).abs().max() / b.abs().max()).item()
        if error > 1e-5:
            raise SystemExit(f"rank {rank}: the split layer's {name} is {error:.2e} off the whole layer's")
    times: dict[str, list[float]] = {"split": [], "whole": []}
    for r in range(args.rounds):
        for label in ("split", "whole") if r % 2 == 0 else ("whole", "split"):
            split.zero_grad(set_to_none=True)
            whole.zero_grad(set_to_none=True)
            dist.barrier()
            start = time.perf_counter()
            run_split() if label == "split" else run_whole()
            times[label].append(time.perf_counter() - start)

    def expert_bytes(module: torch.nn.Module) -> int:
        params = [p.to_local() if isinstance(p, DTensor) else p for n, p in module.named_parameters() if "experts" in n]
        return sum(p.numel() * p.element_size() for p in params)

    if rank == 0:
        med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
        best = {k: min(v) * 1e3 for k, v in times.items()}
        print(f"MoE dim {args.dim}, {args.experts} experts of hidden {args.hidden}, top {args.top_k}, "
              f"{args.shared} shared; {args.batch} x {args.seq_len} tokens; tp {tp}; fp32; "
              f"torch {torch.__version__}; outputs and router gradient match within 1e-5")
        print(f"{'':34} {'median ms':>10} {'best ms':>9}  expert weights per rank")
        print(f"{'split over TP (MOE_INPUT)':34} {med['split']:10.1f} {best['split']:9.1f}  "
              f"{expert_bytes(split) / 2**20:.1f} MiB")
        print(f"{'whole on each rank (before)':34} {med['whole']:10.1f} {best['whole']:9.1f}  "
              f"{expert_bytes(whole) / 2**20:.1f} MiB")
        print(f"whole / split: {med['whole'] / med['split']:.2f}x (median), {best['whole'] / best['split']:.2f}x (best)")
    dist.destroy_process_group()


def main() -> None:
    args = parse()
    if "LOCAL_RANK" in os.environ:
        worker(args)
        return
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(args.tp), __file__, *sys.argv[1:]]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    raise SystemExit(subprocess.run(cmd, env=env).returncode)


if __name__ == "__main__":
    main()
