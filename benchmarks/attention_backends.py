"""Which SDPA kernel is fastest for Titan's training shapes on this GPU, and do they agree?

Times forward + backward of causal `F.scaled_dot_product_attention` with each backend
pinned (`torch.nn.attention.sdpa_kernel`): cuDNN, FlashAttention-2, memory-efficient,
at the Llama 3.2 1B shape (batch 4, 32 query / 8 KV heads of 64, seq 2048) and the
Llama 3.1 8B shape (batch 1, 32 / 8 heads of 128, seq 8192), with grouped-query
attention passed natively (`enable_gqa=True`) and with K/V expanded to every head.
Each output and input gradient is compared with FlashAttention's.

    python3 benchmarks/attention_backends.py [--out FILE.json]     # needs a CUDA GPU

The figures are in docs/performance.md; Titan's default order (`titan_parallel.attention`)
follows them.
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

SHAPES = {"1B s2048 b4": (4, 32, 8, 2048, 64), "8B s8192 b1": (1, 32, 8, 8192, 128)}
BACKENDS = {
    "flash": SDPBackend.FLASH_ATTENTION,
    "cudnn": SDPBackend.CUDNN_ATTENTION,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
}  # the first is the reference


def attention_flops(batch: int, heads: int, seq: int, head_dim: int) -> float:
    """Causal forward + backward FLOPs: 4 * b * h * s^2 * d forward (two matmuls, half masked), 2.5x that backward."""
    return 3.5 * 4 * batch * heads * seq * seq * head_dim / 2


def run_shape(shape: tuple[int, int, int, int, int], steps: int = 10) -> dict:
    batch, heads, kv_heads, seq, head_dim = shape
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(batch, heads, seq, head_dim, device="cuda", dtype=torch.bfloat16, generator=g)
    k = torch.randn(batch, kv_heads, seq, head_dim, device="cuda", dtype=torch.bfloat16, generator=g)
    v = torch.randn(batch, kv_heads, seq, head_dim, device="cuda", dtype=torch.bfloat16, generator=g)
    dout = torch.randn(batch, heads, seq, head_dim, device="cuda", dtype=torch.bfloat16, generator=g)
    results: dict = {}
    reference = None
    for name, backend in BACKENDS.items():
        for gqa in ("native", "expanded"):
            key = f"{name} gqa-{gqa}"
            try:
                qq, kk, vv = (t.detach().clone().requires_grad_() for t in (q, k, v))

                def fwd_bwd(qq=qq, kk=kk, vv=vv, gqa=gqa, backend=backend):
                    with sdpa_kernel([backend]):
                        if gqa == "native":
                            out = F.scaled_dot_product_attention(qq, kk, vv, is_causal=True, enable_gqa=True)
                        else:
                            rep = heads // kv_heads
                            out = F.scaled_dot_product_attention(
                                qq, kk.repeat_interleave(rep, 1), vv.repeat_interleave(rep, 1), is_causal=True
                            )
                    out.backward(dout)
                    return out

                out = fwd_bwd()
                grads = [t.grad.clone() for t in (qq, kk, vv)]
                times = []
                for _ in range(steps):
                    for t in (qq, kk, vv):
                        t.grad = None
                    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    start.record()
                    fwd_bwd()
                    end.record()
                    torch.cuda.synchronize()
                    times.append(start.elapsed_time(end) / 1e3)
                seconds = statistics.median(times)
                row = {
                    "ms": round(seconds * 1e3, 3),
                    "tflops": round(attention_flops(batch, heads, seq, head_dim) / seconds / 1e12, 1),
                }
                if reference is None:
                    reference = (out.detach(), grads)
                else:
                    row["max_abs_diff_out"] = (out.detach() - reference[0]).abs().max().item()
                    row["max_abs_diff_grads"] = max((a - b).abs().max().item() for a, b in zip(grads, reference[1], strict=True))
                results[key] = row
            except RuntimeError as e:  # this backend does not take these inputs here
                results[key] = {"error": str(e).strip().splitlines()[0][:200]}
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="write the figures as JSON here")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("attention_backends.py needs a CUDA GPU")
    report = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "shapes": {name: run_shape(shape) for name, shape in SHAPES.items()},
    }
    text = json.dumps(report, indent=1)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
