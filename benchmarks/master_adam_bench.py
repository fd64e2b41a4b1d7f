"""The master-weight AdamW step against torch's fused AdamW, on a model's parameter shapes.

    python3 benchmarks/master_adam_bench.py [--flavor 1B] [--repeat 10]

Three steps over the same shapes, each timed alone (CUDA events, median of `--repeat` after 3 warm-up
steps): torch's fused AdamW on fp32 parameters and fp32 gradients (what one-rank FSDP's optimizer
runs, without FSDP's casts and copies around it); `MasterAdamW`'s Triton kernel (bf16 gradients in,
fp32 masters and bf16 copies out); its fallback (torch's fused kernel on fp32 casts of the gradients,
then a cast back). Before timing, the kernel and the fallback step the same states once: the masters
must agree to fp32 rounding and every copy must equal its master rounded to bf16.
Bytes moved per element: 28 for the first two, 40 for the fallback.
Without CUDA (`--smoke`: tiny shapes) only the timings run, of the fallback (tests/test_master_weights.py
checks the kernel there in Triton's CPU interpreter).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from titan_models.registry import get_model_args, get_model_spec
from titan_parallel.master_weights import ComputeCopies, MasterAdamW

HYPER = {"lr": 3e-4, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}


def shapes(flavor: str) -> list[torch.Size]:
    spec = get_model_spec("llama3")
    with torch.device("meta"):
        model = spec.build(get_model_args("llama3", flavor))
    return [p.shape for p in model.parameters()]


def params_and_grads(sizes: list[torch.Size], device: torch.device, seed: int):
    g = torch.Generator(device=device).manual_seed(seed)
    params = [torch.nn.Parameter(torch.randn(s, device=device, generator=g) * 0.02) for s in sizes]
    grads = [torch.randn(s, device=device, generator=g).to(torch.bfloat16) * 1e-3 for s in sizes]
    return params, grads


def timed(fn, repeat: int, device: torch.device) -> float:
    """Median seconds of `fn` over `repeat` calls after 3 warm-up calls."""
    times = []
    for i in range(3 + repeat):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            elapsed = start.elapsed_time(end) / 1e3
        else:
            t0 = time.perf_counter()
            fn()
            elapsed = time.perf_counter() - t0
        if i >= 3:
            times.append(elapsed)
    return statistics.median(times)


def master_optimizer(sizes, device, seed):
    params, grads = params_and_grads(sizes, device, seed)
    module = torch.nn.Module()
    for i, p in enumerate(params):
        module.register_parameter(f"p{i}", p)
    copies = ComputeCopies([module], torch.bfloat16)
    opt = MasterAdamW(params, copies, **HYPER)
    for p, g in zip(params, grads, strict=True):
        p.grad = None
        p.data = copies.copies[copies.index[id(p)]]
        p.grad = g
    copies.computing = True
    return opt, params, copies


def check(sizes, device) -> str:
    """The kernel and the fallback from the same states: masters' largest relative difference, copies exact."""
    runs = []
    for use_kernel in (True, False):
        opt, params, copies = master_optimizer(sizes, device, seed=1)
        opt.found_inf = torch.zeros((), device=device)
        opt.grad_scale = torch.full((), 1.7, device=device)
        opt._triton = opt._triton and use_kernel  # False: the fallback path
        opt.step()
        runs.append((copies.masters, copies.copies))
    (m1, c1), (m2, c2) = runs
    rel = max(((a - b).abs().max() / b.abs().max().clamp(min=1e-30)).item() for a, b in zip(m1, m2, strict=True))
    exact = all(torch.equal(c, m.to(torch.bfloat16)) for c, m in zip(c1, m1, strict=True))
    return f"kernel vs fallback: masters max rel. diff {rel:.2e}; every copy == its master in bf16: {exact}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--flavor", default="1B")
    parser.add_argument("--repeat", type=int, default=10)
    parser.add_argument("--smoke", action="store_true", help="tiny shapes (the check on CPU)")
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    sizes = [torch.Size([1000, 33]), torch.Size([7]), torch.Size([40000])] if args.smoke else shapes(args.flavor)
    n = sum(s.numel() for s in sizes)
    if device.type == "cuda":  # elsewhere both runs take the fallback
        print(check(sizes, device), flush=True)
    rows = []
    ref_params, grads = params_and_grads(sizes, device, seed=2)
    for p, g in zip(ref_params, grads, strict=True):
        p.grad = g.float()
    fused = torch.optim.AdamW(ref_params, fused=True, **HYPER)
    rows.append(("torch fused AdamW, fp32 grads", timed(fused.step, args.repeat, device), 28))
    opt, _, _ = master_optimizer(sizes, device, seed=2)
    kernel = opt._triton and device.type == "cuda"  # elsewhere only the fallback runs
    for label, off in (("master AdamW, Triton kernel", False), ("master AdamW, fallback", True)):
        if not off and not kernel:
            continue
        opt._triton = kernel and not off
        rows.append((label, timed(opt.step, args.repeat, device), 40 if off else 28))
    print(f"{n / 1e6:.1f}M elements in {len(sizes)} tensors, {device}")
    for label, seconds, per in rows:
        print(f"{label:34s} {seconds * 1e3:8.2f} ms  {n * per / seconds / 1e9:8.0f} GB/s ({per} B/element)")


if __name__ == "__main__":
    main()
