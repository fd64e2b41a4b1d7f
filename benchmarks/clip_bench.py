"""Gradient clipping in place against clipping inside fused AdamW, at a model's parameter shapes.

The step runner clips with the optimizer's kernel when every optimizer is torch's fused
Adam / AdamW (`titan_parallel.grad_clip.clip_divisor` as the kernel's `grad_scale`): the
gradients are divided as the kernel reads them, where `clip_grad_norm_` reads and writes
every gradient once more before the step. This times both, interleaved, on the same
fp32 parameters and gradients (the 1B Llama's shapes by default), and prints each
path's median milliseconds and their ratio.

    python3 benchmarks/clip_bench.py                      # on a GPU: llama3 1B shapes
    uv run python benchmarks/clip_bench.py --smoke        # CPU: debugmodel shapes, seconds
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from titan_models import get_model_spec
from titan_parallel.grad_clip import clip_divisor, grad_norm


def _params(flavor: str, device: torch.device) -> list[torch.nn.Parameter]:
    spec = get_model_spec("llama3")
    with torch.device("meta"):
        shapes = [p.shape for p in spec.build(spec.flavors[flavor]).parameters()]
    params = [torch.nn.Parameter(torch.randn(s, device=device) * 0.02) for s in shapes]
    for p in params:
        p.grad = torch.randn_like(p)
    return params


def _timed(fn, device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--flavor", default="1B", help="llama3 flavor whose parameter shapes to use (default 1B)")
    parser.add_argument("--reps", type=int, default=10, help="timed steps of each path (default 10)")
    parser.add_argument("--smoke", action="store_true", help="CPU, debugmodel shapes, 3 reps")
    opts = parser.parse_args()
    device = torch.device("cpu" if opts.smoke or not torch.cuda.is_available() else "cuda")
    if opts.smoke:
        opts.flavor, opts.reps = "debugmodel", 3
    params = _params(opts.flavor, device)
    grads = [p.grad.clone() for p in params]  # each step starts from the same gradients
    opt = torch.optim.AdamW(params, lr=1e-4, fused=True)
    max_norm = 0.5 * float(grad_norm(params))  # the clip acts

    def restore() -> None:
        for p, g in zip(params, grads, strict=True):
            p.grad.copy_(g)

    def in_place() -> None:
        torch.nn.utils.clip_grad_norm_(params, max_norm, foreach=True)
        opt.step()

    def in_kernel() -> None:
        opt.grad_scale = clip_divisor(grad_norm(params), max_norm)
        opt.step()
        del opt.grad_scale

    times: dict[str, list[float]] = {"clip in place + fused AdamW": [], "clip inside fused AdamW": []}
    for rep in range(opts.reps + 2):  # the first two of each: warm-up
        for name, fn in zip(times, (in_place, in_kernel), strict=True):
            restore()
            seconds = _timed(fn, device)
            if rep >= 2:
                times[name].append(seconds)
    n = sum(p.numel() for p in params)
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(f"llama3 {opts.flavor} shapes, {n / 1e6:.1f}M fp32 parameters, {where}, torch {torch.__version__}")
    medians = {name: statistics.median(t) * 1e3 for name, t in times.items()}
    for name, ms in medians.items():
        print(f"{name:>28}: {ms:8.3f} ms (median of {opts.reps})")
    first, second = medians.values()
    print(f"in place / inside the kernel: {first / second:.3f}x, {first - second:.3f} ms saved per step")


if __name__ == "__main__":
    main()
