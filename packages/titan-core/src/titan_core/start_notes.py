"""What `titan train` says once at start, beside the banner: the choices the job check made for the run (the
compute dtype, a widened vocabulary, a shortened warmup), settings that do something other than the user may
expect (a batch ramp as long as the run, validation on training's own files, forced MoE balance), and, after the
checkpoint load, what the resume found. Each note is a `(logging level, line)`; rank 0 logs them (`log_notes`)."""

from __future__ import annotations

import logging
import os

from titan_core.batch_ramp import BatchRamp
from titan_core.job.resolved import Job
from titan_core.train_state import TrainState
from titan_core.validation import training_overlap

Note = tuple[int, str]


def log_notes(notes: list[Note], rank: int) -> None:
    """Log `notes` on rank 0 (every rank computes the same).

    Args:
        notes: `(logging level, line)` each.
        rank: this process's rank.
    """
    if rank == 0:
        for level, line in notes:
            logging.getLogger("titan").log(level, "%s", line)


def build_notes(job: Job, batch_ramp: BatchRamp) -> list[Note]:
    """The notes of a run as the job check resolved it, said before the model is built.

    Args:
        job: the resolved job.
        batch_ramp: the run's batch per step.
    """
    cfg, t = job.cfg, job.cfg.training
    notes: list[Note] = []
    if job.vocab_widened_from:
        notes.append((logging.INFO, f"model vocab {job.vocab_widened_from} widened to the tokenizer's "
                                    f"{job.model_args.vocab_size} tokens"))  # fmt: skip
    notes.append((logging.INFO, f"compute dtype {job.dtype_reason}"))
    if job.dtype_warning:
        notes.append((logging.WARNING, job.dtype_warning))
    if job.warmup_note:
        notes.append((logging.INFO, job.warmup_note))
    if t.batch_size_rampup_start and t.batch_size_rampup_steps >= t.steps:
        notes.append((logging.WARNING,
            f"training.batch_size_rampup_steps={t.batch_size_rampup_steps} is not shorter than training.steps="
            f"{t.steps}: the batch grows to the run's end ({batch_ramp.global_batch(t.steps)} sequences at its last "
            f"step, not training.global_batch_size={job.global_batch})"))  # fmt: skip
    if cfg.validation.enable and (overlap := training_overlap(cfg)):
        notes.append((logging.WARNING, overlap))
    if cfg.debug.moe_force_load_balance:
        notes.append((logging.WARNING, "debug.moe_force_load_balance: MoE tokens are routed round-robin in "
                                       "training, every expert equally loaded; the router does not learn to route, "
                                       "so the loss is not a real run's (for throughput measurements)"))  # fmt: skip
    return notes


def resume_notes(job: Job, state: TrainState, batch_ramp: BatchRamp, resumed: int | None) -> list[Note]:
    """The notes of the checkpoint load at `train()`'s start: what a load-only run does, a resume on another
    batch, a run with nothing left to train, an elastic restart.

    Args:
        job: the resolved job.
        state: the train state, as loaded.
        batch_ramp: the run's batch per step.
        resumed: the step resumed from, None where nothing was loaded.
    """
    cfg, t = job.cfg, job.cfg.training
    notes: list[Note] = []
    if cfg.checkpoint.load_only:
        loaded = "nothing to load: training starts from its initialisation" if resumed is None else "loaded"
        notes.append((logging.WARNING, f"checkpoint.load_only: {loaded}, and no checkpoint will be saved"))
    if resumed and not batch_ramp.steps and (change := state.batch_change(batch_ramp.full, t.seq_len)):
        notes.append((logging.WARNING, change))  # without a ramp, one batch size
    if resumed and state.step >= t.steps:
        notes.append((logging.WARNING, f"checkpoint: the run stands at step {state.step}, training.steps is "
                                       f"{t.steps}: nothing left to train; raise training.steps to go on"))  # fmt: skip
    if restarts := int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)):
        start = (
            f"resumed from step {resumed}"
            if resumed
            else "no checkpoint to resume from (checkpoint.enable), starting at step 0"
        )
        most = os.environ.get("TORCHELASTIC_MAX_RESTARTS", "?")
        notes.append((logging.WARNING, f"restart {restarts} of {most} (titan train --max-restarts): {start}"))
    return notes
