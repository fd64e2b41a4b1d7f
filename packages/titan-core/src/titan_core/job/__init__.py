"""The job config, resolved once into what a run is built from: `resolve(cfg, world_size) -> Job`.

`titan train` resolves the job in the launching process before torchrun starts any
process, and each training process resolves it again (for `torchrun -m
titan_core.launch` users) and builds from the `Job` alone: the parallel degrees,
the model's shape, the pipeline's stages, the accumulation steps, and the
libraries' own options (`ParallelOptions`, `PipelineConfig`, `OptimizerOptions`,
`CheckpointOptions`), each built from the config in one place.

    options.py     config keys -> each library's options, with the key behind each field (`*_KEYS`)
    rules.py       every rule of a valid job, in order (`RULES`), each run once
    naming.py      a library error -> a `ConfigError` naming the keys, by lookup
    resolved.py    `Job` (frozen) and `resolve`
    meta_model.py  the model on the meta device, for the rules that read its structure
"""

from __future__ import annotations

from titan_core.job.naming import config_error
from titan_core.job.resolved import Job, resolve
from titan_core.job.rules import RULES, Rule

__all__ = ["Job", "RULES", "Rule", "config_error", "resolve"]
