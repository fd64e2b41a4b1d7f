"""Warmup-stable-decay (WSD) learning-rate schedule as a `LambdaLR`.

The factor that scales `optimizer.lr` follows torchtitan's
`linear_warmup_stable_decay`, with `step` the scheduler's 0-based count of
`scheduler.step()` calls (the factor for step s is used by optimizer step s+1):

- warmup, step < W:          (step + 1) / (W + 1)
- stable, step < W + S:      1
- decay,  the last D steps:  progress p = (step + 1 - W - S) / (D + 1), then
  linear 1 - p, sqrt 1 - sqrt(p) or cosine (1 + cos(pi p)) / 2, mapped onto
  [min_lr_factor, 1] as min_lr_factor + (1 - min_lr_factor) * shape
- steps past the end keep the last step's factor.

D = round(decay_ratio * steps), or steps - W when `decay_ratio` is None;
S = steps - W - D. `steps` is `lr_scheduler.total_steps` where set (torchtitan's key: a short run follows the
start of a longer run's schedule), else `training.steps`.
"""

from __future__ import annotations

import functools
import logging
import math
from typing import TYPE_CHECKING

import torch
from torch.optim.lr_scheduler import LambdaLR

from titan_core.config.errors import ConfigError

if TYPE_CHECKING:
    from titan_core.config.schema import JobConfig

__all__ = [
    "build_lr_scheduler",
    "warmup_stable_decay_factor",
    "resolve_warmup",
    "schedule_steps",
    "DECAY_TYPES",
    "DEFAULT_WARMUP_STEPS",
]

logger = logging.getLogger("titan")

DECAY_TYPES = ("linear", "sqrt", "cosine")
DEFAULT_WARMUP_STEPS = 10
"""`lr_scheduler.warmup_steps` when unset, for a run of at least that many steps."""


def schedule_steps(cfg: JobConfig) -> tuple[int, str]:
    """The steps the schedule spans and the key they come from: `lr_scheduler.total_steps`, else `training.steps`.

    Args:
        cfg: the job's config.
    """
    total = cfg.lr_scheduler.total_steps
    return (total, "lr_scheduler.total_steps") if total is not None else (cfg.training.steps, "training.steps")


def resolve_warmup(configured: int | None, steps: int, steps_key: str = "training.steps") -> tuple[int, str | None]:
    """The warmup a run of `steps` steps takes, and a note for the log when the default was shortened.

    Unset, it is `DEFAULT_WARMUP_STEPS`, or all of a shorter run (`titan train --training.steps 1`
    is a smoke run, not a mistake). Set, it must fit in the run.

    Args:
        configured: `lr_scheduler.warmup_steps`; None when unset.
        steps: the steps the schedule spans (`lr_scheduler.total_steps`, else `training.steps`).
        steps_key: the key `steps` comes from, for messages.

    Returns:
        (warmup steps, note or None).

    Raises:
        ConfigError: a set warmup outside [0, steps].
    """
    if configured is None:
        if steps >= DEFAULT_WARMUP_STEPS:
            return DEFAULT_WARMUP_STEPS, None
        return steps, (
            f"lr_scheduler.warmup_steps unset: warming up over all {steps} step(s) of {steps_key} "
            f"(the default {DEFAULT_WARMUP_STEPS} is longer than the run)"
        )
    if not 0 <= configured <= steps:
        raise ConfigError(
            f"lr_scheduler.warmup_steps: {configured} must be between 0 and {steps_key} ({steps}); "
            f"lower it, unset it, or raise {steps_key}"
        )
    return configured, None


def warmup_stable_decay_factor(
    step: int,
    *,
    warmup_steps: int,
    stable_steps: int,
    decay_steps: int,
    decay_type: str,
    min_lr_factor: float,
) -> float:
    """The LR multiplier after `step` scheduler steps (see the module docstring).

    Args:
        step: 0-based scheduler step (`LambdaLR.last_epoch`).
        warmup_steps: W, steps of linear warmup.
        stable_steps: S, steps at the full LR after warmup.
        decay_steps: D, steps of decay at the end.
        decay_type: "linear", "sqrt" or "cosine".
        min_lr_factor: the factor the decay ends at.

    Returns:
        The factor in (0, 1].
    """
    warmup_stable = warmup_steps + stable_steps
    # Past the last step the LR is undefined; keep the last step's factor.
    step = min(step, warmup_stable + decay_steps)
    if step < warmup_steps:
        return (step + 1) / (warmup_steps + 1)
    if step < warmup_stable or decay_steps == 0:
        return 1.0
    progress = (step + 1 - warmup_stable) / (decay_steps + 1)
    if decay_type == "linear":
        shape = 1.0 - progress
    elif decay_type == "sqrt":
        shape = 1.0 - math.sqrt(progress)
    else:  # cosine
        shape = 0.5 * (1.0 + math.cos(math.pi * progress))
    return min_lr_factor + (1.0 - min_lr_factor) * shape


def build_lr_scheduler(
    optimizer: torch.optim.Optimizer,
    *,
    steps: int,
    warmup_steps: int,
    decay_ratio: float | None = None,
    decay_type: str = "linear",
    min_lr_factor: float = 0.0,
    steps_key: str = "training.steps",
) -> LambdaLR:
    """Build the warmup-stable-decay schedule for `optimizer`.

    The returned scheduler's `state_dict()` holds only its step count and last
    LRs (the factor function is a `functools.partial` of a module function, so
    nothing of the schedule's settings is saved): resuming rebuilds it from the
    config and loads the count.

    Args:
        optimizer: the optimizer whose `lr` the schedule scales.
        steps: the optimizer steps the schedule spans (`lr_scheduler.total_steps`, else `training.steps`); steps
            past them keep the last factor.
        warmup_steps: steps of linear warmup (`lr_scheduler.warmup_steps`).
        decay_ratio: fraction of `steps` spent decaying at the end; None decays
            over all steps after warmup. If warmup plus decay exceed `steps`,
            decay is shortened to the steps left after warmup (with a warning).
        decay_type: "linear", "sqrt" or "cosine".
        min_lr_factor: final LR as a fraction of the peak.
        steps_key: the key `steps` comes from, for messages.

    Returns:
        A `LambdaLR`; call `step()` once after each optimizer step.

    Raises:
        ConfigError: warmup longer than training, an unknown decay type, or
            a factor or ratio outside [0, 1].
    """
    resolve_warmup(warmup_steps, steps, steps_key)  # refuses one outside [0, steps]
    if decay_type not in DECAY_TYPES:
        raise ConfigError(f"lr_scheduler.decay_type: unknown {decay_type!r}; choose one of {', '.join(DECAY_TYPES)}")
    if not 0.0 <= min_lr_factor <= 1.0:
        raise ConfigError(f"lr_scheduler.min_lr_factor: {min_lr_factor} must be in [0, 1]")
    if decay_ratio is None:
        decay_steps = steps - warmup_steps
    else:
        if not 0.0 <= decay_ratio <= 1.0:
            raise ConfigError(f"lr_scheduler.decay_ratio: {decay_ratio} must be in [0, 1] or unset")
        decay_steps = round(steps * decay_ratio)
        if warmup_steps + decay_steps > steps:
            logger.warning(
                "lr_scheduler: warmup (%d) + decay (%d) steps exceed %s (%d); decaying over %d steps",
                warmup_steps,
                decay_steps,
                steps_key,
                steps,
                steps - warmup_steps,
            )
            decay_steps = steps - warmup_steps
    lr_lambda = functools.partial(
        warmup_stable_decay_factor,
        warmup_steps=warmup_steps,
        stable_steps=steps - warmup_steps - decay_steps,
        decay_steps=decay_steps,
        decay_type=decay_type,
        min_lr_factor=min_lr_factor,
    )
    return LambdaLR(optimizer, lr_lambda)
