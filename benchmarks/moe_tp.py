"""A Mixture-of-Experts layer under tensor parallel: the two ways to split it against the whole layer.

- **split** (`etp = tp`, `MoETensorParallel`): every routed and shared expert's hidden dim is split over the
  TP ranks, so each rank computes `1 / tp` of the layer's expert FLOPs on the same all-gathered tokens, and
  holds `1 / tp` of its expert weights.
- **join** (`etp = 1`, `MoETokenParallel`, torchtitan's ETP=1): the TP ranks are the expert-parallel group;
  each routes only its own sequence shard and sends those slots by all-to-all to the rank holding their
  (whole) expert, holding `1 / tp` of the experts. The shared experts are split as under **split**.
- **whole**: before 2026-11-29 each TP rank ran the layer whole on the all-gathered tokens; that compute (the
  unsplit layer on the whole sequence, without its all-gather) is the baseline.

One torchrun launch of `--tp` gloo processes (one CPU thread each). Each rank builds the same seeded
`titan_models.moe.MoE` three times, splits two with titan-parallel's styles, and first checks them: each split
layer's output on the rank's sequence slice and the router's summed gradient against the whole layer's (fp32,
within 1e-5 relative). Then it times forward + backward of each, interleaved in rotating order so that drifts
in machine speed hit all alike.

    uv run python benchmarks/moe_tp.py                       # dim 1024, 64 experts of 384, top 8, 1 x 512 tokens
    uv run python benchmarks/moe_tp.py --seq-len 128 --rounds 2   # smoke

Prints per-rank median and best ms of each, their ratios, the expert weights each rank holds and the
activation bytes each rank sends per forward (all-gather + reduce-scatter, or the all-to-alls' rows that
leave the rank at even load).
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
    from titan_parallel.expert_parallel import apply_ep
    from titan_parallel.plan import ModelPlan
    from titan_parallel.tensor_parallel import MoETensorParallel, MoETokenParallel

    dist.init_process_group("gloo")
    rank, tp = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    moe_args = MoEArgs(
        num_experts=args.experts, top_k=args.top_k, hidden_dim=args.hidden, num_shared_experts=args.shared
    )
    whole = MoE(args.dim, moe_args)
    whole.init_weights(0.02)
    mesh = init_device_mesh("cpu", (tp,))
    split = copy.deepcopy(whole)
    parallelize_module(split, mesh, MoETensorParallel())
    joined = copy.deepcopy(whole)  # the TP ranks as the expert-parallel group: apply_ep first, on a one-block model
    holder = torch.nn.Module()
    holder.layers = torch.nn.ModuleDict({"0": torch.nn.Module()})
    holder.layers["0"].moe = joined
    apply_ep(holder, ModelPlan(blocks="layers", moe="moe"), mesh)
    parallelize_module(joined, mesh, MoETokenParallel())
    x = torch.randn(args.batch, args.seq_len, args.dim)
    grad = torch.randn_like(x)
    rows = slice(rank * args.seq_len // tp, (rank + 1) * args.seq_len // tp)

    def run_part(layer: torch.nn.Module) -> torch.Tensor:
        mine = x[:, rows].clone().requires_grad_()
        out = layer(mine)
        out.backward(grad[:, rows])
        return out

    def run_whole() -> torch.Tensor:
        out = whole(x.clone().requires_grad_())
        out.backward(grad)
        return out

    want = run_whole()
    for label, layer in (("split", split), ("join", joined)):
        got = run_part(layer)
        router = layer.router.gate.weight.grad
        router = router.full_tensor() if isinstance(router, DTensor) else router
        for name, a, b in (("output", got, want[:, rows]), ("router gradient", router, whole.router.gate.weight.grad)):
            error = ((a - b).abs().max() / b.abs().max()).item()
            if error > 1e-5:
                raise SystemExit(f"rank {rank}: the {label} layer's {name} is {error:.2e} off the whole layer's")
    layers = {"split": split, "join": joined, "whole": whole}
    times: dict[str, list[float]] = {label: [] for label in layers}
    for r in range(args.rounds):
        order = list(layers)[r % 3 :] + list(layers)[: r % 3]
        for label in order:
            for layer in layers.values():
                layer.zero_grad(set_to_none=True)
            dist.barrier()
            start = time.perf_counter()
            run_whole() if label == "whole" else run_part(layers[label])
            times[label].append(time.perf_counter() - start)

    def expert_bytes(module: torch.nn.Module) -> int:
        params = [p.to_local() if isinstance(p, DTensor) else p for n, p in module.named_parameters() if "experts" in n]
        return sum(p.numel() * p.element_size() for p in params)

    if rank == 0:
        med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
        best = {k: min(v) * 1e3 for k, v in times.items()}
        tokens, row = args.batch * args.seq_len, args.dim * 4  # fp32 rows
        sent = {  # activation bytes leaving a rank per forward (the backward sends as many)
            "split": 2 * (tp - 1) * tokens // tp * row,  # all-gather + reduce-scatter of the layer's tokens
            "join": 2 * tokens // tp * args.top_k * (tp - 1) // tp * row  # dispatch + combine, even load
            + (2 * (tp - 1) * tokens // tp * row if args.shared else 0),  # the shared experts' gather / scatter
            "whole": (tp - 1) * tokens // tp * row,  # the all-gather
        }
        print(f"MoE dim {args.dim}, {args.experts} experts of hidden {args.hidden}, top {args.top_k}, "
              f"{args.shared} shared; {args.batch} x {args.seq_len} tokens; tp {tp}; fp32; "
              f"torch {torch.__version__}; outputs and router gradients match within 1e-5")
        print(f"{'':36} {'median ms':>10} {'best ms':>9}  {'expert weights':>14}  {'sent / forward':>14}")
        names = {"split": "split over TP (etp = tp)", "join": "TP ranks join EP (etp = 1)",
                 "whole": "whole on each rank (before)"}
        for label, layer in layers.items():
            print(f"{names[label]:36} {med[label]:10.1f} {best[label]:9.1f}  "
                  f"{expert_bytes(layer) / 2**20:10.1f} MiB  {sent[label] / 2**20:10.2f} MiB")
        for label in ("split", "join"):
            print(f"whole / {label}: {med['whole'] / med[label]:.2f}x (median), "
                  f"{best['whole'] / best[label]:.2f}x (best)")
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
