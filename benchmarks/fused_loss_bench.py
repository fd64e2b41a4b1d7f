"""The fused chunked loss against the plain one: time, peak memory and agreement, at a 128k vocabulary.

Forward + backward of the output projection and the cross-entropy alone, from the final
hidden states `(tokens, dim)` to the gradients of the hidden states and of the weight:

- plain: `F.cross_entropy((h @ W.T).float(), labels)` (what Titan ran before), eager and compiled;
- fused: `titan_parallel.linear_cross_entropy` (token chunks, gradients in forward), eager and
  with its per-chunk arithmetic compiled (Titan's path under `compile.enable`);
- with torchao installed, float8 (tensorwise): the plain loss on torchao's `Float8Linear`
  (`float8.filter_fqns = []` with `training.fused_loss = false`), and the fused loss with its
  GEMMs in float8 (`float8.filter_fqns = []`, the default loss); on a CPU both emulate.

Each variant's loss and gradients are compared with the plain loss computed in fp32 from the
same bf16 inputs. Peak memory is `max_memory_allocated` above what the inputs hold.

    python3 benchmarks/fused_loss_bench.py [--out FILE.json]        # CUDA: 8192 tokens, dim 2048, vocab 128256, bf16
    uv run python benchmarks/fused_loss_bench.py --smoke            # CPU: small shapes, fp32, eager only
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F

from titan_parallel.linear_cross_entropy import linear_cross_entropy


def _plain(h, w, labels):
    return F.cross_entropy((h @ w.t()).float(), labels)


def _fused(compiled: bool):
    return lambda h, w, labels: linear_cross_entropy(h, w, labels, compiled=compiled)


def _float8_variants(dim: int, vocab: int, compile: bool, emulate: bool) -> dict:
    """float8 through torchao's `Float8Linear` + the plain loss, and through the fused loss; {} without torchao."""
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    except ImportError:
        return {}
    from dataclasses import replace

    from torch.func import functional_call

    from titan_parallel.float8_matmul import Float8Loss

    config = replace(Float8LinearConfig.from_recipe_name("tensorwise"), emulate=emulate)

    head = torch.nn.Sequential(torch.nn.Linear(dim, vocab, bias=False, device="meta"))
    convert_to_float8_training(head, config=config)  # once: each call runs it on the given weight

    def plain_float8(h, w, labels):
        return F.cross_entropy(functional_call(head, {"0.weight": w}, (h,)).float(), labels)

    float8 = Float8Loss(emulate=emulate)  # torch._scaled_mm on the GPU (its CPU kernel is ~250x slower than emulating)
    out = {
        "plain float8 eager": plain_float8,
        "fused float8 eager": lambda h, w, labels: linear_cross_entropy(h, w, labels, float8=float8),
    }
    if compile:
        out["plain float8 compiled"] = torch.compile(plain_float8)
        out["fused float8 compiled"] = lambda h, w, labels: linear_cross_entropy(h, w, labels, float8=float8, compiled=True)
    return out


def run(tokens: int, dim: int, vocab: int, device: torch.device, dtype: torch.dtype, compile: bool, steps: int) -> dict:
    g = torch.Generator(device=device).manual_seed(0)
    h0 = torch.randn(tokens, dim, device=device, generator=g).to(dtype)
    w0 = (torch.randn(vocab, dim, device=device, generator=g) * dim**-0.5).to(dtype)
    labels = torch.randint(0, vocab, (tokens,), device=device, generator=g)
    h_ref, w_ref = h0.float().clone().requires_grad_(), w0.float().clone().requires_grad_()
    ref_loss = _plain(h_ref, w_ref, labels)
    ref_loss.backward()
    variants = {"plain eager": _plain, "fused eager": _fused(False)}
    if compile:
        variants["plain compiled"] = torch.compile(_plain)
        variants["fused compiled"] = _fused(True)
    variants.update(_float8_variants(dim, vocab, compile, emulate=device.type != "cuda"))
    report: dict = {"tokens": tokens, "dim": dim, "vocab": vocab, "dtype": str(dtype).removeprefix("torch."),
                    "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                    "torch": torch.__version__, "variants": {}}
    for name, fn in variants.items():
        h, w = h0.clone().requires_grad_(), w0.clone().requires_grad_()

        def step(fn=fn, h=h, w=w):
            h.grad = w.grad = None
            loss = fn(h, w, labels)
            loss.backward()
            return loss

        loss = step()  # warm-up (compiles)
        times = []
        if device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        for _ in range(steps):
            start = time.perf_counter()
            loss = step()
            if device.type == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
        row = {
            "ms": round(1e3 * statistics.median(times), 3),
            "loss_rel_diff": abs(loss.item() - ref_loss.item()) / abs(ref_loss.item()),
            "grad_h_rel_diff": ((h.grad.float() - h_ref.grad).norm() / h_ref.grad.norm()).item(),
            "grad_w_rel_diff": ((w.grad.float() - w_ref.grad).norm() / w_ref.grad.norm()).item(),
        }
        if device.type == "cuda":
            row["peak_gib_above_inputs"] = round((torch.cuda.max_memory_allocated() - base) / 2**30, 3)
        report["variants"][name] = row
        print(f"{name:<16} {row}", flush=True)
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="write the figures as JSON here")
    parser.add_argument("--smoke", action="store_true", help="CPU: 256 tokens, dim 64, vocab 2048, fp32, eager")
    args = parser.parse_args()
    if args.smoke or not torch.cuda.is_available():
        report = run(256, 64, 2048, torch.device("cpu"), torch.float32, compile=False, steps=3)
    else:
        report = run(8192, 2048, 128256, torch.device("cuda"), torch.bfloat16, compile=True, steps=5)
    if args.out:
        with open(args.out, "w") as f:
            f.write(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
