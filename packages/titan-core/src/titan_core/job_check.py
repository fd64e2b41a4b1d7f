"""The former name of `titan_core.job`: `check_job` is `resolve`, `CheckedJob` is `Job`.

Kept for existing callers; new code imports from `titan_core.job`.
"""

from __future__ import annotations

from titan_core.job import RULES, Job, config_error, resolve
from titan_core.job.meta_model import skip_init as _skip_init
from titan_core.job.options import pipeline_config

check_job = resolve
CheckedJob = Job

__all__ = ["RULES", "CheckedJob", "Job", "check_job", "config_error", "pipeline_config", "resolve", "_skip_init"]
