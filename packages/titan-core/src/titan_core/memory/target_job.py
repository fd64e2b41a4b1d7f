"""The job an estimate is for: resolved by every rule of `titan_core.job`, for the target device.

An estimate runs on any host (a laptop sizing a 512-GPU job), so the checks do not
look for the GPUs here, and a tokenizer that is not on this host (the shipped
configs point at `./assets/hf/...`) is replaced by the flavor's vocab size.
"""

from __future__ import annotations

from pathlib import Path

from titan_core.config.schema import JobConfig
from titan_core.job import Job, resolve


def target_device(cfg: JobConfig) -> str:
    """The device type a job trains on: 'cpu' when `training.device` says so, else 'cuda'."""
    return "cpu" if cfg.training.device == "cpu" else "cuda"


def check_target_job(cfg: JobConfig, world_size: int | None, device_type: str | None = None) -> tuple[Job, list[str]]:
    """Check `cfg` for `world_size` ranks (None: any number) of `device_type` (default: `target_device(cfg)`).

    Returns:
        The resolved job, and notes on what was assumed (one line each).

    Raises:
        ConfigError: a rule is broken; one line naming the key.
    """
    notes: list[str] = []
    vocab = 0
    assets = cfg.model.hf_assets_path
    if assets is not None and not Path(assets).expanduser().exists():
        from titan_models import get_model_args

        try:
            vocab = get_model_args(cfg.model.name, cfg.model.flavor).vocab_size
        except ValueError:
            vocab = 0  # the model_shape rule names the unknown model.name / model.flavor
        notes.append(f"model.hf_assets_path={assets} is not on this host: the flavor's vocab ({vocab}) is assumed")
    job = resolve(cfg, world_size, tokenizer_vocab_size=vocab, target_device=device_type or target_device(cfg))
    return job, notes
