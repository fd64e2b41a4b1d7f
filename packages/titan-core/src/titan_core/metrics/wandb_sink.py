"""`WandbSink`: each logged step, and the resolved config, in a Weights & Biases run.

W&B is an optional extra (`pip install 'titan-core[wandb]'`), turned on by
`metrics.enable_wandb`; `wandb` is imported only then, so `import titan_core`
never pays for it. `require_wandb` is the check `titan_core.job_check` runs
before any process starts, so a missing package is one line, not a traceback
after the model is built.

Only rank 0 makes a sink (`MetricsLogger` does). wandb's own environment
variables keep their meaning: `WANDB_MODE=offline` (no account or network;
`wandb sync <run>` uploads later) or `disabled`, `WANDB_DIR` (default: the run
folder, so the run lands in `<dump_folder>/wandb/`), `WANDB_API_KEY`, ...
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from titan_core.config.errors import ConfigError

if TYPE_CHECKING:
    from titan_core.config import JobConfig

__all__ = ["WandbOptions", "WandbSink", "require_wandb"]

MISSING_WANDB = (
    "metrics.enable_wandb is true but the wandb package is not installed; "
    "pip install 'titan-core[wandb]', or set --metrics.enable_wandb false"
)


def require_wandb() -> None:
    """Raise `ConfigError` naming `metrics.enable_wandb` when `wandb` cannot be imported (looked up, not imported)."""
    if importlib.util.find_spec("wandb") is None:
        raise ConfigError(MISSING_WANDB)


@dataclass(frozen=True)
class WandbOptions:
    """What `wandb.init` is given.

    Args:
        project: the W&B project (`metrics.wandb_project`).
        name: the run's display name (`metrics.wandb_run_name`, else `job.description`; None = W&B picks one).
        config: the resolved job config as a plain dict, recorded as the run's config.
        run_folder: the default `dir` of the W&B files (`WANDB_DIR` wins when set).
    """

    project: str
    name: str | None
    config: Mapping[str, Any]
    run_folder: Path

    @classmethod
    def from_config(cls, cfg: JobConfig, run_folder: Path) -> WandbOptions:
        """The `[metrics]` W&B keys of `cfg`, with `cfg` itself as the run's config."""
        m = cfg.metrics
        name = m.wandb_run_name or cfg.job.description or None
        return cls(m.wandb_project, name, cfg.model_dump(mode="json"), run_folder)


class WandbSink:
    """One W&B run: `log(step, values)` per logged step, `close()` at the end (finishes the run).

    Args:
        options: the project, name, config and default folder of the run.

    Raises:
        ConfigError: `wandb` is not installed, or `wandb.init` failed (no login, say); the line names
            `metrics.enable_wandb` and the fix.
    """

    def __init__(self, options: WandbOptions) -> None:
        try:
            import wandb
        except ImportError:
            raise ConfigError(MISSING_WANDB) from None
        folder = os.environ.get("WANDB_DIR") or str(options.run_folder)
        Path(folder).mkdir(parents=True, exist_ok=True)
        self._run: wandb.Run | None = None
        try:
            self._run = wandb.init(project=options.project, name=options.name, config=dict(options.config), dir=folder)
        except wandb.errors.Error as e:  # no API key, no network, ...: the fix is the user's
            raise ConfigError(
                f"metrics.enable_wandb: wandb.init failed ({str(e).rstrip('.')}); "
                "run `wandb login`, or set WANDB_MODE=offline"
            ) from None

    def log(self, step: int, values: Mapping[str, float]) -> None:
        """Record `values` (keyed by TensorBoard tag) at `step`."""
        assert self._run is not None, "WandbSink.log after close()"
        self._run.log(dict(values), step=step)

    def close(self) -> None:
        """Finish the run: flush its records and mark it finished (offline: ready for `wandb sync`)."""
        if self._run is not None:
            self._run.finish()
            self._run = None
