"""Training metrics: device peak FLOP/s, memory, throughput/MFU, and the logger.

- `peak_flops.py`: `device_peak_flops` (GPU datasheet table; CPU measured once, cached).
- `memory.py`: `memory_stats` (CUDA allocator peaks, or host RSS).
- `throughput.py`: `ThroughputMeter` (tokens/s, TFLOP/s and MFU per device).
- `logger.py`: `MetricsLogger` (console line, metrics.jsonl, TensorBoard, W&B, progress bar; rank 0).
- `wandb_sink.py`: `WandbSink` (the optional Weights & Biases run; `wandb` imported only when on).

All figures are dicts keyed by TensorBoard tag (`loss/global_avg`,
`throughput/tokens_per_s`, `memory/max_reserved_gib`, ...), so the trainer
merges them and hands one dict to `MetricsLogger.log`.
"""

from titan_core.metrics.logger import MetricsLogger, format_metrics_line
from titan_core.metrics.memory import memory_stats
from titan_core.metrics.peak_flops import device_peak_flops, gpu_peak_flops
from titan_core.metrics.throughput import ThroughputMeter, compute_throughput

__all__ = [
    "MetricsLogger",
    "ThroughputMeter",
    "compute_throughput",
    "device_peak_flops",
    "format_metrics_line",
    "gpu_peak_flops",
    "memory_stats",
]
