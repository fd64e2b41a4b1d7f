"""The config sections of what runs beside the training step: metrics, profiling, the comm watch, debug
switches, validation, downstream evals and torchft fault tolerance. `JobConfig` (`schema.py`) holds them."""

from typing import Literal

from titan_core.config.section import (
    MinusOneOrPositive,
    NonNegativeInt,
    PositiveFloat,
    PositiveInt,
    Section,
    UnitFraction,
)


class Metrics(Section):
    """Logging and TensorBoard."""

    log_freq: PositiveInt = 1
    """Log loss, throughput and memory every this many steps."""
    enable_tensorboard: bool = True
    """Write TensorBoard event files."""
    save_tb_folder: str = "tb"
    """TensorBoard folder, relative to job.dump_folder."""
    disable_color_printing: bool = False
    """Print logs without ANSI colours."""
    per_layer_norms: bool = False
    """Also log each block's gradient norm (before clipping) and parameter norm: grad_norm/layers.3, param_norm/..."""
    per_layer_updates: bool = False
    """Also log each block's update norm and update / weight norm ratio (a weight copy during log steps)."""
    peak_tflops: PositiveFloat | None = None
    """The device's peak TFLOP/s for MFU; unset = the GPU table, or on CPU a figure measured once and cached."""
    enable_wandb: bool = False
    """Also log to Weights & Biases (pip install 'titan-core[wandb]'; WANDB_MODE=offline works without an account)."""
    wandb_project: str = "titan"
    """W&B project name."""
    wandb_run_name: str | None = None
    """W&B run name; unset = job.description, or W&B's own name when that is empty."""


class Profiling(Section):
    """torch.profiler traces and CUDA memory snapshots."""

    enable_profiling: bool = False
    """Record torch.profiler traces."""
    save_traces_folder: str = "profile_traces"
    """Trace folder, relative to job.dump_folder."""
    profile_freq: PositiveInt = 10
    """Write a trace every this many steps."""
    profiler_warmup: NonNegativeInt = 1
    """Steps profiled unrecorded before the traced ones in each profile_freq window (torchtitan's key)."""
    profiler_active: PositiveInt = 1
    """Steps traced at the end of each profile_freq window, into one trace (torchtitan's key)."""
    enable_memory_snapshot: bool = False
    """Record CUDA memory snapshots."""
    save_memory_snapshot_folder: str = "memory_snapshot"
    """Snapshot folder, relative to job.dump_folder."""


class Comm(Section):
    """Collective communication."""

    init_timeout_seconds: PositiveInt = 300
    """Collective timeout until the first step ends (start-up, compile)."""
    train_timeout_seconds: PositiveInt = 100
    """Collective timeout after the first step: a rank that dies or stalls ends the job within it."""
    trace_buf_size: NonNegativeInt = 20000
    """Entries in the NCCL flight recorder, dumped into the run folder on a timeout; 0 = off."""


class Debug(Section):
    """Reproducibility."""

    seed: int | None = 0
    """Random seed; unset = not seeded."""
    deterministic: bool = False
    """Use deterministic algorithms (slower)."""
    deterministic_warn_only: bool = False
    """Under debug.deterministic, an op without a deterministic algorithm warns instead of failing."""
    moe_force_load_balance: bool = False
    """Route MoE tokens round-robin in training: every expert equally loaded, for throughput tests (docs/moe.md)."""
    inject_loss_spike_step: int | None = None
    """Multiply this step's loss on the last rank by 10, once: tries training.on_loss_spike; unset = never."""


class ValidationSet(Section):
    """One set of `validation.sets`: `{path = "...", name = "code"}` (TOML inline table)."""

    path: str
    """As validation.dataset: 'stdlib' (its held-out files), a token-shard folder, local files, or a hub dataset."""
    name: str | None = None
    """Label in metrics (`validation/<name>/loss`) and the log; unset = the folder or file name."""
    text_field: str | None = None
    """JSON field / parquet column of the text (text sets); unset = training.dataset_text_field."""


class Validation(Section):
    """Periodic evaluation on held-out data."""

    enable: bool = False
    """Run validation during training."""
    dataset: str = "stdlib"
    """Validation dataset name (as training.dataset)."""
    dataset_path: str | None = None
    """Local file or folder to read the validation dataset from."""
    sets: list[ValidationSet] = []
    """Several held-out sets, each logged as validation/<name>/loss (their mean as validation/loss); [] = dataset."""
    freq: PositiveInt = 50
    """Validate every this many steps."""
    steps: MinusOneOrPositive = 10
    """Batches per validation; -1 = all of the data, one pass to its end (the last partial batch left out)."""
    local_batch_size: PositiveInt | None = None
    """Sequences per validation batch on each rank; unset = training.local_batch_size."""
    seq_len: PositiveInt | None = None
    """Tokens per validation sequence (e.g. longer than training's, for long context); unset = training.seq_len."""


class Eval(Section):
    """Downstream multiple-choice tasks scored by log-likelihood during training (docs/evaluation.md)."""

    enable: bool = False
    """Score eval.tasks every eval.freq steps and at the last step: accuracy and length-normalised accuracy."""
    tasks: list[str] = []
    """JSONL files, one task each, lines {"context": str, "endings": [str, ...], "label": int}; or 'name=path'."""
    freq: PositiveInt = 100
    """Evaluate every this many steps."""
    max_examples: PositiveInt | None = None
    """Score the first this many examples of each task; unset = all."""


class FaultTolerance(Section):
    """torchft replica groups: data parallel across jobs that fail and rejoin alone (docs/fault_tolerance.md)."""

    enable: bool = False
    """This job is one torchft replica group; it trains with the other groups (semi_sync_method says how)."""
    replica_id: NonNegativeInt = 0
    """This group's number, 0 .. group_size - 1: its slice of the data and its name at the lighthouse."""
    group_size: PositiveInt = 1
    """Replica groups in the run; the data is split over group_size x the group's data-parallel degree."""
    min_replica_size: PositiveInt = 1
    """Fewest groups that commit a step; with fewer alive the groups wait at the quorum."""
    lighthouse: str = ""
    """The lighthouse's address (`titan lighthouse` prints it), e.g. http://host:29510; empty: $TORCHFT_LIGHTHOUSE."""
    timeout_seconds: PositiveFloat = 10.0
    """Cross-group all-reduce, commit vote and live recovery give up after this; the step is then retried."""
    quorum_timeout_seconds: PositiveFloat = 60.0
    """How long a group waits at the quorum for min_replica_size groups, and for the lighthouse at start."""
    process_group: Literal["auto", "gloo", "nccl"] = "auto"
    """The cross-group collectives' backend (torchft's): 'auto' = NCCL when training on CUDA, gloo otherwise."""
    semi_sync_method: Literal["none", "diloco", "local_sgd"] = "none"
    """'none': gradients averaged each step; 'diloco': an outer Nesterov step each sync_steps; 'local_sgd': mean."""
    sync_steps: PositiveInt = 100
    """With semi_sync_method: inner steps each group takes alone between two synchronisations (DiLoCo's H)."""
    outer_lr: PositiveFloat = 0.7
    """DiLoCo's outer learning rate: the outer SGD's step on the groups' mean weight change (the paper's 0.7)."""
    outer_momentum: UnitFraction = 0.9
    """DiLoCo's outer Nesterov momentum (the paper's 0.9); 0 for plain SGD."""
    num_fragments: PositiveInt = 1
    """With semi_sync_method: the blocks cut into this many fragments, each synced in turn (streaming DiLoCo)."""
    fragment_sync_delay: NonNegativeInt = 0
    """Inner steps each sync's all-reduce runs behind before its outer step (streaming DiLoCo's overlap, tau)."""
    sync_dtype: Literal["float32", "bfloat16"] = "float32"
    """The dtype DiLoCo's pseudo-gradients cross the groups in: bfloat16 halves the bytes (the outer step is fp32)."""
    fragment_update_alpha: UnitFraction = 0.0
    """At a sync the weights become (1 - alpha) x the synced anchors + alpha x the group's own (streaming DiLoCo)."""
