"""The code paths a job takes that change what its memory holds, as the memory tiers count them: which loss
it computes (the fused chunked loss, in float8 or not, or the plain loss on full logits, compiled or eager)
and which weights get a float8 copy. Each answer is the one `titan_core.model_setup` acts on."""

from __future__ import annotations

from typing import TYPE_CHECKING

from titan_core.model_setup import float8_loss_of, loss_compiled_for, precasts_float8_weights

if TYPE_CHECKING:
    from titan_core.job import Job


def plain_loss_compiled(job: Job) -> bool:
    """Whether the run computes the plain loss compiled (`training.fused_loss` resolved to false)."""
    return loss_compiled_for(job) and not fused_loss_applies(job)


def fused_loss_applies(job: Job) -> bool:
    """Whether the run computes the fused chunked loss (`training.fused_loss`, and an output projection
    that MX and float8 leave a plain linear, as `fuse_output_loss` requires, or whose GEMMs float8 runs
    inside the loss: `float8_loss_of`)."""
    if not job.cfg.training.fused_loss:
        return False
    mx, float8 = job.converters.mx, job.converters.float8
    if mx is not None and "output" not in mx.filter_fqns:
        return False
    if float8 is None or "output" in float8.filter_fqns:
        return True
    from titan_parallel.float8 import float8_filter
    from titan_parallel.linear_cross_entropy import output_projection_path

    model, path = job.meta_model(), output_projection_path(job.spec.plan)
    converted = path is not None and float8_filter(float8)(model.get_submodule(path), path)
    return not converted or float8_loss_of(model, job.spec.plan, job.converters) is not None


def float8_loss_applies(job: Job) -> bool:
    """Whether the fused loss runs the output projection's GEMMs in float8 (`float8_loss_of`)."""
    if not job.cfg.training.fused_loss or job.converters.float8 is None:
        return False
    return float8_loss_of(job.meta_model(), job.spec.plan, job.converters) is not None


def precast_float8_weights(job: Job) -> int:
    """How many weights master weights keep a float8 copy of (`titan_parallel.float8_precast`, 1 byte each):
    every linear tensorwise [float8] converts, the output projection not where the fused loss casts it."""
    float8 = job.converters.float8
    if float8 is None or not precasts_float8_weights(job.parallel.master_weights, job.converters):
        return 0
    from titan_parallel.float8 import float8_filter
    from titan_parallel.linear_cross_entropy import output_projection_path

    head = output_projection_path(job.spec.plan) if float8_loss_applies(job) else None
    keep = float8_filter(float8, exclude=[head] if head else [])
    return sum(m.weight.numel() for name, m in job.meta_model().named_modules() if keep(m, name))
