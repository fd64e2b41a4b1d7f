"""Titan's job config: the schema, loading (defaults < TOML < command line), TOML output, help.

cfg = load_config("llama3_8b", ["--training.steps", "100", "--checkpoint.enable"])
print(dump_toml(cfg))
"""

from titan_core.config.describe import config_help
from titan_core.config.errors import ConfigError, MissingFileError, MissingPackageError
from titan_core.config.load import (
    list_shipped_configs,
    load_config,
    resolve_config_file,
)
from titan_core.config.schema import (
    ActivationCheckpoint,
    Checkpoint,
    Comm,
    Compile,
    Debug,
    Job,
    JobConfig,
    LRScheduler,
    Metrics,
    Model,
    Optimizer,
    Parallelism,
    Profiling,
    Training,
    Validation,
)
from titan_core.config.toml_dump import dump_toml

__all__ = [
    "ActivationCheckpoint",
    "Checkpoint",
    "Comm",
    "Compile",
    "ConfigError",
    "Debug",
    "Job",
    "JobConfig",
    "LRScheduler",
    "Metrics",
    "MissingFileError",
    "MissingPackageError",
    "Model",
    "Optimizer",
    "Parallelism",
    "Profiling",
    "Training",
    "Validation",
    "config_help",
    "dump_toml",
    "list_shipped_configs",
    "load_config",
    "resolve_config_file",
]
