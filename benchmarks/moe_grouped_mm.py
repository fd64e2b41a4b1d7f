"""The experts' grouped matmul: Titan's per-expert loop against `torch._grouped_mm`, on this device.

    uv run python benchmarks/moe_grouped_mm.py            # CPU fp32 (and CUDA bf16 where there is a GPU)

Prints milliseconds per call and the ratio, measured in one run, for a small and a
DeepSeek-V3-16B-like expert shape at even load. `titan_models.moe.grouped_mm` calls
`torch._grouped_mm` only where `grouped_mm_supported` holds (CUDA capability 9.0+, bf16);
this shows why not elsewhere.
"""

from __future__ import annotations

import time

import torch
from titan_models.moe import grouped_mm

SHAPES = ((8, 8192, 256, 256), (64, 4096, 2048, 1408))  # (experts, rows, dim, hidden)


def per_call_ms(fn, repeats: int = 3) -> float:
    fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return 1000 * (time.perf_counter() - start) / repeats


def main() -> None:
    devices = [("cpu", torch.float32)] + ([("cuda", torch.bfloat16)] if torch.cuda.is_available() else [])
    print(f"torch {torch.__version__}, {torch.get_num_threads()} CPU threads")
    print(f"{'device':<6}{'dtype':<10}{'experts x rows x dim x hidden':>32}{'loop ms':>10}{'_grouped_mm ms':>16}{'ratio':>8}")
    for device, dtype in devices:
        for experts, rows, dim, hidden in SHAPES:
            x = torch.randn(rows, dim, device=device, dtype=dtype)
            w = torch.randn(experts, hidden, dim, device=device, dtype=dtype)
            counts = torch.full((experts,), rows // experts, device=device)
            offsets = torch.cumsum(counts, 0, dtype=torch.int32)
            loop = per_call_ms(lambda: [a @ b.T for a, b in zip(x.split(counts.tolist()), w)])
            try:
                fused = per_call_ms(lambda: torch._grouped_mm(x, w.transpose(-2, -1), offs=offsets))
            except (RuntimeError, AttributeError) as err:  # no kernel for this device / dtype
                print(f"{device:<6}{str(dtype)[6:]:<10}{f'{experts} x {rows} x {dim} x {hidden}':>32}{loop:>10.2f}  _grouped_mm: {err}")
                continue
            torch.testing.assert_close(
                torch._grouped_mm(x, w.transpose(-2, -1), offs=offsets), grouped_mm(x, w, counts), atol=1e-1, rtol=1e-2
            )
            print(f"{device:<6}{str(dtype)[6:]:<10}{f'{experts} x {rows} x {dim} x {hidden}':>32}{loop:>10.2f}{fused:>16.2f}{loop / fused:>8.2f}")


if __name__ == "__main__":
    main()
