"""Rules across sections: feature combinations that cannot run, caught before any process starts.

`check_combinations` runs in `titan train` before torchrun starts N processes and
again in each trainer, so a wrong combination costs one line, not N tracebacks.
It needs no torch unless a rule depends on whether CUDA is present, and then
only asks `torch.cuda.is_available()`.
"""

from __future__ import annotations

from collections.abc import Callable

from titan_core.config.errors import ConfigError
from titan_core.config.schema import JobConfig


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def training_device_type(cfg: JobConfig, cuda_available: Callable[[], bool] = _cuda_available) -> str:
    """"cuda" or "cpu", as `training.device` resolves on this machine ("auto" asks torch)."""
    if cfg.training.device == "auto":
        return "cuda" if cuda_available() else "cpu"
    return cfg.training.device


def check_combinations(cfg: JobConfig, cuda_available: Callable[[], bool] = _cuda_available) -> None:
    """Raise `ConfigError` (one line naming the keys and the fix) for a combination that cannot run.

    Args:
        cfg: the resolved job config.
        cuda_available: how to tell whether CUDA is present (called only when a rule needs it).
    """
    p, compiled = cfg.parallelism, cfg.compile.enable and "model" in cfg.compile.components
    if p.enable_async_tensor_parallel:
        if p.tensor_parallel_degree == 1:
            raise ConfigError(
                "parallelism.enable_async_tensor_parallel needs parallelism.tensor_parallel_degree > 1; "
                "raise the degree or set enable_async_tensor_parallel = false"
            )
        device = training_device_type(cfg, cuda_available)
        if not compiled or device != "cuda":
            missing = " and ".join(
                what for what, lacking in (
                    ("compile.enable = true (with 'model' in compile.components)", not compiled),
                    (f"a CUDA device (training.device resolves to {device!r})", device != "cuda"),
                ) if lacking
            )
            raise ConfigError(
                f"parallelism.enable_async_tensor_parallel needs {missing}: it overlaps TP collectives with "
                "matmuls inside compiled graphs on CUDA symmetric memory; set compile.enable = true on a GPU, "
                "or set parallelism.enable_async_tensor_parallel = false"
            )
    if "mx" in cfg.model.converters and training_device_type(cfg, cuda_available) != "cuda":
        raise ConfigError(
            "model.converters = ['mx'] (MXFP8) needs an NVIDIA GPU with compute capability 10.0+ (B200/GB200), "
            "but training.device resolves to 'cpu'; use 'float8' (emulated off such GPUs) or drop 'mx'"
        )
