"""Which SDPA kernel is fastest for Titan's training shapes on this GPU, and do they agree?

Times forward + backward of causal `F.scaled_dot_product_attention` with each backend
pinned (`torch.nn.attention.sdpa_kernel`): cuDNN, FlashAttention-2, memory-efficient,
at the Llama 3.2 1B shape (batch 4, 32 query / 8 KV heads of 64, seq 2048) and the
Llama 3.1 8B shape (batch 1, 32 / 8 heads of 128, seq 8192), with grouped-query
attention passed natively (`enable_gqa=True`) and with K/V expanded to every head.
Each output and input gradient is compared with FlashAttention's. Then the block-causal kernel
(`model.attn_mask_type = "block_causal"`: FlexAttention, compiled, `titan_models.document_mask`) on one
document per sequence (the same mask as causal: compared with FlashAttention's too) and on 8
documents per sequence (its FLOP/s counted as causal's, as the trainer counts them).

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


def run_shape(shape: tuple[int, int, int, int, int], steps: int = 10, keep: dict | None = None) -> dict:
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
                    if keep is not None:  # FlashAttention's output and gradients, for run_flex
                        keep.update(out=reference[0], grads=grads)
                else:
                    row["max_abs_diff_out"] = (out.detach() - reference[0]).abs().max().item()
                    row["max_abs_diff_grads"] = max((a - b).abs().max().item() for a, b in zip(grads, reference[1], strict=True))
                results[key] = row
            except RuntimeError as e:  # this backend does not take these inputs here
                results[key] = {"error": str(e).strip().splitlines()[0][:200]}
    return results


def run_flex(shape: tuple[int, int, int, int, int], reference: dict, steps: int = 10) -> dict:
    """FlexAttention forward + backward under the block-causal mask, with 1 and 8 documents per sequence."""
    from titan_models.document_mask import block_causal_mask, masked_attention

    batch, heads, kv_heads, seq, head_dim = shape
    g = torch.Generator(device="cuda").manual_seed(0)  # the same q, k, v, dout as run_shape's
    q = torch.randn(batch, heads, seq, head_dim, device="cuda", dtype=torch.bfloat16, generator=g)
    k = torch.randn(batch, kv_heads, seq, head_dim, device="cuda", dtype=torch.bfloat16, generator=g)
    v = torch.randn(batch, kv_heads, seq, head_dim, device="cuda", dtype=torch.bfloat16, generator=g)
    dout = torch.randn(batch, heads, seq, head_dim, device="cuda", dtype=torch.bfloat16, generator=g)
    results: dict = {}
    for documents in (1, 8):
        key = f"flex block-causal, {documents} document{'s' if documents > 1 else ''}"
        try:
            ids = (torch.arange(seq, device="cuda") * documents // seq).expand(batch, seq)  # (batch, seq)
            mask = block_causal_mask(ids)
            qq, kk, vv = (t.detach().clone().requires_grad_() for t in (q, k, v))
            times = []
            for step in range(steps + 2):  # two untimed: compile, then the first run of the compiled kernels
                for t in (qq, kk, vv):
                    t.grad = None
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                out = masked_attention(qq, kk, vv, mask)
                out.backward(dout)
                end.record()
                torch.cuda.synchronize()
                if step >= 2:
                    times.append(start.elapsed_time(end) / 1e3)
            seconds = statistics.median(times)
            row = {"ms": round(seconds * 1e3, 3),
                   "tflops": round(attention_flops(batch, heads, seq, head_dim) / seconds / 1e12, 1)}  # fmt: skip
            if documents == 1 and "out" in reference:
                row["max_abs_diff_out"] = (out.detach() - reference["out"]).abs().max().item()
                pairs = zip([t.grad for t in (qq, kk, vv)], reference["grads"], strict=True)
                row["max_abs_diff_grads"] = max((a - b).abs().max().item() for a, b in pairs)
            results[key] = row
        except Exception as e:  # noqa: BLE001  # a torch without FlexAttention on this GPU: say so, go on
            results[key] = {"error": f"{type(e).__name__}: {str(e).strip().splitlines()[0][:200]}"}
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
        "shapes": {},
    }
    for name, shape in SHAPES.items():
        flash: dict = {}
        report["shapes"][name] = run_shape(shape, keep=flash)
        report["shapes"][name].update(run_flex(shape, flash))
    text = json.dumps(report, indent=1)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
