"""`device_peak_flops`: the peak FLOP/s that MFU divides by.

GPUs: a table of dense (no structured sparsity) datasheet peaks, matched on
`torch.cuda.get_device_name` as whole words, so "GH200" never borrows the
"H200" row and "A10G" never the "A10" row; a GPU not in the table gets None.
The bf16 column is the tensor-core peak (fp16 is the same on every listed
part); the fp32 column is the plain fp32 (non-TF32) peak.

CPUs have no datasheet figure that torch can look up, so the peak is measured
once with a short matmul benchmark and cached as JSON in
`$XDG_CACHE_HOME/titan/cpu_peak.json` (default `~/.cache/titan/`), keyed by CPU
model, torch version, thread count and dtype. Ranks sharing a host may each
measure on a cold cache; the write is atomic, so the file stays valid.
"""

from __future__ import annotations

import json
import logging
import os
import platform
import re
import tempfile
import time
from pathlib import Path

import torch

__all__ = ["device_peak_flops", "gpu_peak_flops", "cpu_peak_flops", "measure_cpu_matmul_flops", "cpu_peak_cache_path"]

logger = logging.getLogger("titan")

TERA = 1e12

# (name word, qualifier word or None, dense bf16 TFLOP/s, fp32 TFLOP/s).
# Rows with a qualifier come before the bare row of the same GPU.
_GPU_PEAKS: list[tuple[str, str | None, float, float]] = [
    # A100 SXM and PCIe: 312 bf16 tensor (624 with sparsity), 19.5 fp32.
    # https://www.nvidia.com/en-us/data-center/a100/ (datasheet, "Specifications")
    ("A100", None, 312.0, 19.5),
    # H100 PCIe: 756 bf16 (1513 sparse), 51 fp32; H100 NVL: 835 (1671 sparse), 60;
    # H100 SXM (reports as "NVIDIA H100 80GB HBM3"): 989 (1979 sparse), 67.
    # https://resources.nvidia.com/en-us-tensor-core/nvidia-tensor-core-gpu-datasheet
    ("H100", "PCIe", 756.0, 51.0),
    ("H100", "NVL", 835.0, 60.0),
    ("H100", None, 989.0, 67.0),
    # H200 SXM: 989 bf16 (1979 sparse), 67 fp32.
    # https://www.nvidia.com/en-us/data-center/h200/
    ("H200", None, 989.0, 67.0),
    # B200 (per GPU of HGX/DGX B200): 2.25 PF dense bf16 (4.5 sparse), 80 fp32.
    # https://www.nvidia.com/en-us/data-center/dgx-b200/ (the fp32 figure is the
    # least settled one: check it against the current datasheet).
    ("B200", None, 2250.0, 80.0),
    # L40S: 362 bf16 (733 sparse), 91.6 fp32.
    # https://resources.nvidia.com/en-us-l40s/l40s-datasheet-28413
    ("L40S", None, 362.0, 91.6),
    # L40: 181 bf16 (362 sparse), 90.5 fp32.
    # https://images.nvidia.com/content/Solutions/data-center/vgpu-L40-datasheet.pdf
    ("L40", None, 181.0, 90.5),
    # L4: 121 bf16 (242 sparse), 30.3 fp32.
    # https://www.nvidia.com/en-us/data-center/l4/
    ("L4", None, 121.0, 30.3),
    # A10G (AWS G5 instances): NVIDIA publishes no A10G datasheet; 70 dense bf16
    # and 31.2 fp32 are the figures usually quoted for it (a cut-down A10).
    # https://aws.amazon.com/ec2/instance-types/g5/
    ("A10G", None, 70.0, 31.2),
    # A10: 125 bf16 (250 sparse), 31.2 fp32.
    # https://www.nvidia.com/en-us/data-center/products/a10-gpu/
    ("A10", None, 125.0, 31.2),
]

_CPU_BENCH_SIZE = 1024  # square matmul side: 2 * 1024^3 = 2.1 GFLOP per matmul
_CPU_BENCH_TRIALS = 5
_CPU_BENCH_BUDGET_S = 2.0  # stop early after 2 trials once this much time is spent


def _has_word(name: str, word: str) -> bool:
    """Whether `word` appears in `name` as a whole word (case-insensitive)."""
    return re.search(rf"(?<![A-Za-z0-9]){re.escape(word)}(?![A-Za-z0-9])", name, re.IGNORECASE) is not None


def gpu_peak_flops(device_name: str, dtype: torch.dtype) -> float | None:
    """Dense datasheet peak FLOP/s of the GPU called `device_name`, or None if unknown.

    Args:
        device_name: as `torch.cuda.get_device_name` reports it, e.g. "NVIDIA H100 80GB HBM3".
        dtype: torch.bfloat16 / torch.float16 (tensor-core peak) or torch.float32.

    Returns:
        FLOP/s, or None for a GPU or dtype not in the table.
    """
    if dtype in (torch.bfloat16, torch.float16):
        tensor_core = True
    elif dtype == torch.float32:
        tensor_core = False
    else:
        return None
    for word, qualifier, tensor_tflops, fp32_tflops in _GPU_PEAKS:
        if _has_word(device_name, word) and (qualifier is None or _has_word(device_name, qualifier)):
            return (tensor_tflops if tensor_core else fp32_tflops) * TERA
    return None


def cpu_peak_cache_path() -> Path:
    """`$XDG_CACHE_HOME/titan/cpu_peak.json`, or `~/.cache/titan/cpu_peak.json`."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "titan" / "cpu_peak.json"


def _cpu_model_name() -> str:
    """The CPU model from /proc/cpuinfo, else from `platform`."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown-cpu"


def _cpu_cache_key(dtype: torch.dtype) -> str:
    """One cache entry per CPU model, torch version, thread count and dtype."""
    return f"{_cpu_model_name()}|torch {torch.__version__}|{torch.get_num_threads()} threads|{dtype}"


def measure_cpu_matmul_flops(dtype: torch.dtype) -> float:
    """Best FLOP/s of a few square matmuls in `dtype` on this process's CPU threads.

    Args:
        dtype: matmul dtype, e.g. torch.float32 or torch.bfloat16.

    Returns:
        FLOP/s of the fastest of up to `_CPU_BENCH_TRIALS` timed matmuls.
    """
    n = _CPU_BENCH_SIZE
    a = torch.randn(n, n).to(dtype)
    b = torch.randn(n, n).to(dtype)
    torch.mm(a, b)  # warm up kernels and thread pool
    best = float("inf")
    started = time.perf_counter()
    for trial in range(_CPU_BENCH_TRIALS):
        t0 = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - t0)
        if trial >= 1 and time.perf_counter() - started > _CPU_BENCH_BUDGET_S:
            break
    return 2.0 * n**3 / best


def _read_cache(path: Path) -> dict[str, float]:
    """The cache file's entries; an unreadable file counts as empty."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as e:
        logger.warning("%s: unreadable CPU peak cache (%s); measuring again", path, e)
        return {}
    return data if isinstance(data, dict) else {}


def _write_cache(path: Path, entries: dict[str, float]) -> None:
    """Write `entries` to `path` atomically (temp file in the same folder + os.replace)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".cpu_peak.", suffix=".tmp", dir=path.parent)
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                json.dump(entries, f, indent=1, sort_keys=True)
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
    except OSError as e:
        logger.warning("%s: cannot cache the CPU peak (%s); it will be measured again next run", path, e)


def cpu_peak_flops(dtype: torch.dtype) -> float:
    """This CPU's matmul FLOP/s for `dtype`: from the cache, or measured and cached.

    Args:
        dtype: matmul dtype.

    Returns:
        FLOP/s.
    """
    path = cpu_peak_cache_path()
    key = _cpu_cache_key(dtype)
    cached = _read_cache(path).get(key)
    if isinstance(cached, (int, float)) and cached > 0:
        return float(cached)
    flops = measure_cpu_matmul_flops(dtype)
    entries = _read_cache(path)  # re-read: another process may have added entries meanwhile
    entries[key] = flops
    _write_cache(path, entries)
    logger.info("measured CPU peak %.1f GFLOP/s for %s (cached in %s)", flops / 1e9, key, path)
    return flops


def raise_cpu_peak(dtype: torch.dtype, achieved_flops: float) -> float:
    """Correct a cached CPU peak that training has beaten (it was measured while the machine was busy).

    Measures again and caches the larger of the new measurement and `achieved_flops`.

    Args:
        dtype: matmul dtype.
        achieved_flops: FLOP/s a training step reached.

    Returns:
        The corrected peak FLOP/s.
    """
    path = cpu_peak_cache_path()
    key = _cpu_cache_key(dtype)
    flops = max(measure_cpu_matmul_flops(dtype), achieved_flops)
    entries = _read_cache(path)
    entries[key] = flops
    _write_cache(path, entries)
    logger.warning(
        "training reached %.1f GFLOP/s, above the cached CPU peak for %s (measured while the machine was busy?); "
        "the peak in %s is now %.1f GFLOP/s (set metrics.peak_tflops to fix it yourself)",
        achieved_flops / 1e9,
        key,
        path,
        flops / 1e9,
    )
    return flops


def device_peak_flops(
    device: torch.device,
    dtype: torch.dtype,
    override_tflops: float | None = None,
) -> float | None:
    """Peak FLOP/s of `device` for matmuls in `dtype`, the denominator of MFU.

    Args:
        device: the training device.
        dtype: the dtype the matmuls run in (the mixed-precision param dtype).
        override_tflops: a figure in TFLOP/s that wins over everything
            (config key `metrics.peak_tflops`).

    Returns:
        FLOP/s, or None when it is not known (a GPU not in the table, a dtype
        with no column, or another device type); MFU is then not reported.
    """
    if override_tflops is not None:
        return float(override_tflops) * TERA
    device = torch.device(device)
    if device.type == "cuda":
        return gpu_peak_flops(torch.cuda.get_device_name(device), dtype)
    if device.type == "cpu":
        return cpu_peak_flops(dtype)
    return None
