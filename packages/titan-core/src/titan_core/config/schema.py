"""The job config schema: sections and field names follow torchtitan v0.2.

The defaults ARE the built-in default run: a small Llama 3 ("debugmodel") on
the offline Python-stdlib corpus with the byte tokenizer, on CPU, about a
minute. The schema checks each value's type and range; the rules across keys
(degrees, divisibility, schedules, combinations) are `titan_core.job`'s. Every
field is documented by the string on the line below it; those strings are also
what `titan train --help-config` prints.
"""

from typing import Annotated, Literal

from pydantic import Field, field_validator

from titan_core.config.run_sections import Comm, Debug, Eval, FaultTolerance, Metrics, Profiling, Validation
from titan_core.config.section import (
    Degree,
    MinusOneOrNonNegative,
    MinusOneOrPositive,
    NonNegativeFloat,
    NonNegativeInt,
    PositiveFloat,
    PositiveInt,
    Section,
    UnitFraction,
)


class Job(Section):
    """The run as a whole."""

    dump_folder: str = "./outputs"
    """Run folder: checkpoints, TensorBoard logs, traces and config.toml go under it."""
    description: str = ""
    """Your own line about this run, printed at start-up after the summary of its model, data and layout."""
    print_config: bool = False
    """Log the resolved config at start-up, as the run folder's config.toml holds it (rank 0; torchtitan's key)."""


class Model(Section):
    """Which model to build."""

    name: str = "llama3"
    """Model family, a name registered in titan_models (e.g. 'llama3')."""
    flavor: str = "debugmodel"
    """Size of the model family (e.g. 'debugmodel', '10M', '110M', '8B', '70B', '405B')."""
    hf_assets_path: str | None = None
    """Folder with tokenizer.json / tokenizer.model / config.json; unset = the offline byte tokenizer."""
    converters: list[Literal["float8", "mx"]] = []
    """Swap linears before parallelizing: 'float8' (torchao float8 training, see [float8]) or 'mx' (MXFP8, see [mx])."""
    attn_mask_type: Literal["causal", "block_causal"] = "causal"
    """'causal': attend across packed documents; 'block_causal': only within each (FlexAttention on GPUs)."""
    shape: list[str] = []
    """Changes to the flavor's shape, 'field=value' of its ModelArgs, e.g. ['dim=512', 'n_heads=8']; [] = as is."""


class Optimizer(Section):
    """The optimizer."""

    name: Literal["AdamW", "Adam", "Muon"] = "AdamW"
    """'AdamW' / 'Adam' (torch.optim), or 'Muon': Muon for the blocks' 2-D weights and experts, AdamW for the rest."""
    lr: PositiveFloat = 8e-4
    """Peak learning rate (reached at the end of warmup); under Muon, the Muon group's."""
    beta1: UnitFraction = 0.9
    """Adam's first-moment decay."""
    beta2: UnitFraction = 0.95
    """Adam's second-moment decay."""
    eps: PositiveFloat = 1e-8
    """Adam's epsilon, added to the denominator."""
    weight_decay: NonNegativeFloat = 0.1
    """Decoupled (AdamW, Muon) or L2 (Adam) weight decay; under Muon, the Muon group's."""
    weight_decay_exclude: list[str] = []
    """Parameters without weight decay: fnmatch patterns of names, e.g. ['*norm*', 'tok_embeddings.*']; [] = none."""
    implementation: Literal["auto", "for-loop", "foreach", "fused"] = "auto"
    """Step kernel: 'auto' = 'fused' where torch has it for the device (fastest, drops a NaN step on the device)."""
    master_weights: Literal["auto", "on", "off"] = "auto"
    """bf16 on one GPU without FSDP: fp32 masters, bf16 copies the Adam/AdamW step writes ('auto': on one CUDA rank)."""
    muon_momentum: UnitFraction = 0.95
    """Muon's momentum decay (name = 'Muon')."""
    muon_nesterov: bool = True
    """Muon's update uses Nesterov momentum."""
    muon_ns_steps: PositiveInt = 5
    """Newton-Schulz iterations per orthogonalised matrix."""
    muon_adjust_lr_fn: Literal["match_rms_adamw", "original"] = "match_rms_adamw"
    """Muon's lr per matrix: 'match_rms_adamw' (x 0.2 sqrt(max(A,B)); AdamW's lr carries over) or 'original'."""
    muon_ns_dtype: Literal["auto", "bfloat16", "float32"] = "auto"
    """Muon's Newton-Schulz dtype: 'auto' = bf16 (torch's) where bf16 is native, else fp32 (30-150x faster there)."""
    adamw_lr: PositiveFloat | None = None
    """Under Muon: lr of the AdamW group (embeddings, output, norms, biases, routers); unset = optimizer.lr."""
    adamw_weight_decay: NonNegativeFloat | None = None
    """Under Muon: weight decay of the AdamW group; unset = optimizer.weight_decay."""


class LRScheduler(Section):
    """Warmup-stable-decay learning-rate schedule."""

    warmup_steps: NonNegativeInt | None = None
    """Steps of linear warmup from ~0 to optimizer.lr; unset = 10, or all of training.steps when it is fewer."""
    decay_ratio: UnitFraction | None = None
    """Fraction of the steps spent decaying at the end (WSD); unset = decay over all steps after warmup."""
    decay_type: Literal["linear", "sqrt", "cosine"] = "linear"
    """Shape of the decay."""
    min_lr_factor: UnitFraction = 0.0
    """Final learning rate as a fraction of optimizer.lr."""
    total_steps: PositiveInt | None = None
    """Steps the schedule spans (a short run follows the start of a long run's); unset = training.steps."""


class DatasetSource(Section):
    """One source of `training.dataset_mix`: `{path = "...", weight = 0.7}` (TOML inline table)."""

    path: str
    """A token-shard folder (`titan tokenize`), 'stdlib', .txt/.jsonl/.parquet files, or a hub dataset (NAME:CONFIG)."""
    weight: float
    """Share of the samples, relative to the other sources' weights (normalised to sum to 1)."""
    name: str | None = None
    """Label in metrics (`data/<name>/tokens`) and messages; unset = the folder or file name."""
    text_field: str | None = None
    """JSON field / parquet column of the text (text sources); unset = training.dataset_text_field."""


class MixPhase(Section):
    """One entry of `training.dataset_mix_phases`: `{step = 800, weights = {web = 0.5, math = 0.5}}`."""

    step: int
    """First step trained on these weights, >= 2 (the mix's own weights before the first phase)."""
    weights: dict[str, float]
    """Source name -> weight from that step on; a source not named sits the phase out (weight 0)."""


def _check_dataset_mix(value: object) -> object:
    """One line naming `training.dataset_mix[i].<key>` and the fix, before pydantic's own checks.

    Args:
        value: the raw `training.dataset_mix` value.
    """
    if not isinstance(value, list):
        return value  # pydantic says it is not a list
    example = "write dataset_mix = [{path = '...', weight = 0.7}, {path = '...', weight = 0.3}]"
    for i, entry in enumerate(value):
        if isinstance(entry, DatasetSource):
            continue
        if isinstance(entry, str) and entry.lstrip().startswith("{"):  # one table, not a list of them
            raise ValueError("training.dataset_mix is one table, not a list of them: put it in [...]")
        if not isinstance(entry, dict):
            raise ValueError(f"training.dataset_mix[{i}] is {entry!r}, not a table; {example}")
        unknown = set(entry) - set(DatasetSource.model_fields)
        if unknown:
            raise ValueError(
                f"training.dataset_mix[{i}] has unknown key(s) {sorted(unknown)}; "
                f"the keys are {list(DatasetSource.model_fields)}"
            )
        if not isinstance(entry.get("path"), str) or not entry["path"].strip():
            raise ValueError(f"training.dataset_mix[{i}].path is missing or empty; {example}")
        weight = entry.get("weight")
        if weight is None:
            raise ValueError(f"training.dataset_mix[{i}].weight is missing; {example}")
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not 0 < weight < float("inf"):
            raise ValueError(
                f"training.dataset_mix[{i}].weight must be a positive number, got {weight!r}; "
                "give every source a weight > 0 (weights are normalised to sum to 1)"
            )
    return value


class Training(Section):
    """Data, batch, precision and the length of the run."""

    dataset: str = "stdlib"
    """'stdlib' (offline Python stdlib corpus), local files or a hub dataset (NAME:CONFIG as 'allenai/c4:en')."""
    dataset_path: str | None = None
    """Local file or folder to read the dataset from instead of its default location."""
    dataset_text_field: str = "text"
    """Column holding the text, for Hugging Face datasets."""
    dataset_mix: list[DatasetSource] = []
    """Weighted sources instead of dataset/dataset_path: [{path = "...", weight = 0.7}, ...]; see docs/data.md."""
    dataset_mix_phases: list[MixPhase] = []
    """Other weights from a step on, e.g. [{step = 800, weights = {web = 0.5, math = 0.5}}]: an annealing mix."""
    shuffle: bool = True
    """Token-shard data in a seeded permutation of seq_len+1 windows per epoch; text read on the fly stays in order."""
    shuffle_seed: NonNegativeInt = 0
    """Picks the shuffle's permutations (saved with the data position: a resume must use the same)."""
    local_batch_size: PositiveInt = 8
    """Sequences per micro-batch on each data-parallel rank."""
    global_batch_size: MinusOneOrPositive = -1
    """Sequences per step, all ranks; -1 = local_batch_size x DP degree; a multiple of that accumulates gradients."""
    batch_size_rampup_start: PositiveInt | None = None
    """Global batch at step 1, growing linearly to global_batch_size over batch_size_rampup_steps; unset = no ramp."""
    batch_size_rampup_steps: NonNegativeInt = 0
    """Steps of the batch-size ramp-up (with batch_size_rampup_start); the full batch from the step after."""
    seq_len: PositiveInt = 256
    """Tokens per sequence."""
    max_norm: PositiveFloat = 1.0
    """Clip the global gradient norm to this value; inf: no clipping (the norm is still measured and logged)."""
    steps: PositiveInt = 60
    """Optimizer steps to train for."""
    gc_freq: Literal["auto"] | NonNegativeInt = "auto"
    """Python's GC off in the loop, run every N steps on all ranks; 0: Python's own; 'auto': 50 on CUDA, else 0."""
    mixed_precision_param: Literal["auto", "bfloat16", "float32"] = "auto"
    """Compute dtype (master copy fp32): 'auto' = bf16 on a GPU or CPU with native bf16 (AVX512-BF16/AMX), else fp32."""
    mixed_precision_reduce: Literal["float32", "bfloat16"] = "float32"
    """Dtype of gradient reduce-scatter / all-reduce under FSDP."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Where to train: 'auto' = CUDA when available, else CPU."""
    fused_loss: bool = True
    """Output projection + cross-entropy in token chunks, gradients taken in forward: no full logits, no fp32 copy."""
    z_loss_weight: NonNegativeFloat = 0.0
    """Adds this x mean logsumexp(logits)^2 to the training loss (PaLM's z-loss, e.g. 1e-4); validation omits it."""
    attention_backend: Literal["auto", "cudnn", "flash", "efficient", "math"] = "auto"
    """SDPA kernel order: 'auto' = cuDNN first on Hopper+ GPUs, flash first before; a name pins that kernel."""
    enable_cpu_offload: bool = False
    """Keep FSDP-sharded parameters, gradients and optimizer state on CPU."""
    on_nonfinite: Literal["stop", "skip_step", "rollback"] = "stop"
    """NaN/inf loss or grad norm: 'stop' (exit), 'skip_step' (drop the update), 'rollback' (reload ckpt, next data)."""
    max_nonfinite_in_a_row: PositiveInt = 3
    """Consecutive non-finite steps tolerated by 'skip_step' / 'rollback' before the run stops."""
    on_loss_spike: Literal["none", "skip", "rollback"] = "none"
    """Loss above loss_spike_factor x its running average: 'skip' the batch, 'rollback' (reload ckpt, next data)."""
    loss_spike_factor: Annotated[float, Field(gt=1)] = 2.0
    """A step's global loss above this multiple of the running average (EMA 0.99, accepted steps) is a spike."""
    loss_spike_warmup_steps: PositiveInt = 100
    """Accepted steps that build the running average before spikes are looked for."""
    max_loss_spikes_in_a_row: PositiveInt = 10
    """Consecutive spikes tolerated by 'skip' / 'rollback' before the run stops (the loss moved for good)."""
    prefetch_batches: NonNegativeInt = 2
    """Batches of pre-tokenized data read ahead in a background thread; 0 = read in the training step."""

    @field_validator("dataset_mix", mode="before")
    @classmethod
    def _check_dataset_mix(cls, value: object) -> object:
        return _check_dataset_mix(value)


class Parallelism(Section):
    """How the job is split over devices (the degrees multiply to the world size)."""

    data_parallel_replicate_degree: Degree = 1
    """Replicas in HSDP (or DDP); 1 = plain FSDP."""
    data_parallel_shard_degree: MinusOneOrPositive = -1
    """FSDP shards; -1 = the rest of the world after the other degrees."""
    fsdp_reshard_after_forward: Literal["default", "always", "never"] = "default"
    """Free gathered params after forward: 'default' = yes, except under pipeline parallel or on one shard rank."""
    fsdp_reduce_every_microbatch: bool = True
    """Reduce-scatter each accumulated micro-batch's gradients; false: once per step, unsharded gradients kept."""
    dp_mode: str = "fsdp"
    """Data parallelism flavour: 'fsdp' (FSDP2 sharding, HSDP with replicas) or 'ddp' (replication)."""
    tensor_parallel_degree: Degree = 1
    """Tensor (and sequence) parallel degree."""
    enable_async_tensor_parallel: bool = False
    """Overlap TP communication with compute (needs compile.enable and CUDA)."""
    disable_loss_parallel: bool = False
    """Gather the logits before the loss instead of computing it sharded over the vocab."""
    pipeline_parallel_degree: Degree = 1
    """Pipeline stages over ranks."""
    pipeline_parallel_schedule: str = "1F1B"
    """Pipeline schedule: GPipe, 1F1B, Interleaved1F1B, InterleavedZeroBubble, ZBVZeroBubble or DualPipeV."""
    pipeline_parallel_schedule_csv: str | None = None
    """CSV file with a custom pipeline schedule; overrides pipeline_parallel_schedule when set."""
    pipeline_parallel_microbatch_size: PositiveInt = 1
    """Sequences per pipeline micro-batch."""
    pipeline_parallel_layers_per_stage: PositiveInt | None = None
    """Transformer blocks per (virtual) stage; unset = derived from the degree and the schedule."""
    pipeline_parallel_first_stage_less_layers: NonNegativeInt = 1
    """Blocks fewer on the first stage, which also holds the embedding."""
    pipeline_parallel_last_stage_less_layers: NonNegativeInt = 1
    """Blocks fewer on the last stage, which also holds the norm and output."""
    module_fqns_per_model_part: list[list[str]] | None = None
    """Explicit module names per model part, e.g. [["tok_embeddings", "layers.0"], ["layers.1", "norm", "output"]]."""
    context_parallel_degree: Degree = 1
    """Context parallel degree: sequences are split over this many ranks."""
    context_parallel_method: str = "ring"
    """Context parallel's attention: 'ring' (exchange K/V) or 'ulysses' (all-to-alls to head shards and back)."""
    context_parallel_rotate_method: str = "allgather"
    """How ring attention exchanges key/value shards: 'allgather' or 'rotate' (read under method 'ring' only)."""
    expert_parallel_degree: Degree = 1
    """MoE: split the experts over this many ranks, carved from the FSDP x CP ranks (adds no processes)."""
    expert_tensor_parallel_degree: int = -1
    """MoE under TP and EP: -1 or the TP degree = TP splits each expert; 1 = the TP ranks join expert parallel."""


class Checkpoint(Section):
    """Distributed checkpointing (DCP) and Hugging Face import/export."""

    enable: bool = False
    """Save checkpoints, and resume from the latest one in the run folder."""
    folder: str = "checkpoint"
    """Checkpoint folder, relative to job.dump_folder."""
    interval: PositiveInt = 500
    """Save every this many steps (and at the last step)."""
    enable_first_step_checkpoint: bool = False
    """Also save after step 1: an early proof that saving works (and a state to go back to)."""
    load_only: bool = False
    """Load as set (resume, load_step, initial_load_path), never save: e.g. to evaluate or debug from a checkpoint."""
    keep_latest_k: NonNegativeInt = 10
    """Keep this many newest checkpoints; 0 = keep all."""
    keep_interval: NonNegativeInt = 0
    """Also keep every checkpoint whose step is a multiple of this (milestones keep_latest_k spares); 0 = none."""
    async_mode: Literal["disabled", "async", "async_with_pinned_mem"] = "disabled"
    """Save in the background: 'async' in a thread, 'async_with_pinned_mem' also staging in pinned memory."""
    last_save_model_only: bool = False
    """Save only the model weights (no optimizer, no data state) at the last step."""
    export_dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Dtype of the weights in a model-only last save."""
    load_step: MinusOneOrNonNegative = -1
    """Step to resume from; -1 = the latest one found."""
    exclude_from_loading: list[str] = []
    """State keys not to load on resume, e.g. ["optimizer", "lr_scheduler", "dataloader"]."""
    initial_load_path: str | None = None
    """Checkpoint to start from when the run folder has none (e.g. pretrained weights)."""
    initial_load_model_only: bool = True
    """Load only the model weights from initial_load_path."""
    initial_load_in_hf: bool = False
    """initial_load_path holds Hugging Face safetensors, not a DCP checkpoint."""
    last_save_in_hf: bool = False
    """Write the last (model-only) save as Hugging Face safetensors."""
    create_seed_checkpoint: bool = False
    """Only initialise the model on one process, save it as step 0 and exit."""


class ActivationCheckpoint(Section):
    """Recompute activations in backward instead of keeping them."""

    mode: str = "none"
    """'none', 'full' (every block recomputed), 'selective' or 'memory_budget' (compiled blocks), as below."""
    selective_ac_option: str = "2"
    """An int N = checkpoint every Nth block, or 'op' = keep the outputs of costly ops only."""
    memory_budget: float = 0.5
    """Under 'memory_budget': the share of their activations the compiled blocks keep (0 = as full AC, 1 = as none)."""

    @field_validator("selective_ac_option", mode="before")
    @classmethod
    def _accept_int(cls, value: object) -> object:
        return str(value) if isinstance(value, int) and not isinstance(value, bool) else value


class Compile(Section):
    """torch.compile."""

    enable: bool = False
    """Compile the components below."""
    components: list[Literal["model", "loss"]] = ["model", "loss"]
    """What to compile: each transformer block ('model') and/or the loss."""
    backend: str = "auto"
    """torch.compile backend: 'auto' = Inductor (aot_eager for TP on CPU); 'aot_eager' / 'eager' bisect a problem."""


class Float8(Section):
    """Float8 linears through torchao (when model.converters has 'float8')."""

    recipe_name: Literal["tensorwise", "rowwise", "rowwise_with_gw_hp"] = "tensorwise"
    """Scaling: 'tensorwise' (fastest; fp8 all-gather), 'rowwise' (more accurate), 'rowwise_with_gw_hp' (+ hp wgrad)."""
    enable_fsdp_float8_all_gather: bool = False
    """FSDP all-gathers weights in float8 (half bf16's traffic); tensorwise only, and only with FSDP over 2+ ranks."""
    precompute_float8_dynamic_scale_for_fsdp: bool = False
    """Compute every weight's float8 scale in one all-reduce after the optimizer step (with the float8 all-gather)."""
    filter_fqns: list[str] = ["output"]
    """Linears whose name contains any of these stay in high precision (the output projection by default)."""
    auto_filter_small_kn: bool = True
    """Skip linears too small to gain from float8 (torchao's H100 limits); false: all with dims divisible by 16."""
    emulate: Literal["auto"] | bool = "auto"
    """Emulate float8 matmuls in fp32: 'auto' = unless on a CUDA GPU of capability 8.9+ (H100, L4); true = anywhere."""


class MX(Section):
    """MXFP8 linears through torchao (when model.converters has 'mx'); needs a B200/GB200-class GPU (sm_100+)."""

    recipe_name: Literal["mxfp8_rceil", "mxfp8_rceil_wgrad_with_hp"] = "mxfp8_rceil"
    """torchao MXFP8 recipe: 'mxfp8_rceil', or 'mxfp8_rceil_wgrad_with_hp' (weight gradients in high precision)."""
    filter_fqns: list[str] = ["output"]
    """Linears whose name contains any of these stay in high precision (the output projection by default)."""


class MoE(Section):
    """Mixture-of-Experts balancing and router losses (Qwen3-MoE, DeepSeek-V3); unset = the model flavor's."""

    aux_loss_coeff: NonNegativeFloat | None = None
    """Weight of the sequence-wise balance loss (0 = off); unset = the flavor's (Qwen3-MoE 1e-3, DeepSeek-V3 0)."""
    load_balance_coeff: NonNegativeFloat | None = None
    """Expert-bias step per step (aux-loss-free balancing; 0 = no bias); unset = the flavor's (DeepSeek-V3 1e-3)."""
    router_z_loss_coeff: NonNegativeFloat | None = None
    """Weight of the router z-loss, mean logsumexp(router logits)^2 (ST-MoE; OLMoE 1e-3); unset = the flavor's (0)."""


class MTP(Section):
    """Multi-token prediction (DeepSeek-V3's MTP, any built-in model): extra depths trained to predict tokens
    further ahead, through the shared embedding and output."""

    layers: NonNegativeInt = 0
    """Prediction depths (DeepSeek-V3 1); 0 = none. Not with pipeline or context parallel (docs/models.md)."""
    loss_weight: NonNegativeFloat = 0.3
    """Weight of the depths' mean cross-entropy in the loss (DeepSeek-V3: 0.3 for its first 10T tokens, then 0.1)."""


class EMA(Section):
    """An exponential moving average of the weights, checkpointed beside them (titan convert --ema exports it)."""

    enable: bool = False
    """Keep the average: after every applied step ema = decay * ema + (1 - decay) * weights, fp32, sharded."""
    decay: Annotated[float, Field(ge=0, lt=1)] = 0.999
    """Decay per step: the average spans about 1 / (1 - decay) steps (0.999: ~1000)."""
    warmup: bool = False
    """Ramp the decay up as min(decay, (1 + step) / (10 + step)) (TensorFlow's num_updates): less of the init."""
    validation: bool = False
    """Each validation pass also scores the averaged weights: validation_ema/loss (needs validation.enable)."""


class MuP(Section):
    """The maximal update parametrization (muP): settings tuned at base_dim hold when the model is wider."""

    enable: bool = False
    """Scale init, multipliers and the blocks' Adam learning rates with model width / base_dim (docs/optimizers.md)."""
    base_dim: PositiveInt = 256
    """The width (the model's dim) the hyperparameters were tuned at; at dim = base_dim muP is the usual model."""
    base_head_dim: NonNegativeInt = 0
    """The head width of the tuned model; 0 = this model's (the usual way to widen: more heads)."""
    embedding_multiplier: PositiveFloat = 1.0
    """Factor on the token embeddings in the forward (the muP guide's alpha_input), tuned at base_dim."""
    output_multiplier: PositiveFloat = 1.0
    """Factor on the logits, divided by dim / base_dim (the muP guide's alpha_output), tuned at base_dim."""


class JobConfig(Section):
    """The whole job: one field per section, each section one TOML table."""

    job: Job = Field(default_factory=Job)
    """The run as a whole."""
    model: Model = Field(default_factory=Model)
    """Which model to build."""
    optimizer: Optimizer = Field(default_factory=Optimizer)
    """The optimizer."""
    lr_scheduler: LRScheduler = Field(default_factory=LRScheduler)
    """The learning-rate schedule."""
    training: Training = Field(default_factory=Training)
    """Data, batch, precision and run length."""
    parallelism: Parallelism = Field(default_factory=Parallelism)
    """How the job is split over devices."""
    checkpoint: Checkpoint = Field(default_factory=Checkpoint)
    """Checkpointing."""
    activation_checkpoint: ActivationCheckpoint = Field(default_factory=ActivationCheckpoint)
    """Activation checkpointing."""
    compile: Compile = Field(default_factory=Compile)
    """torch.compile."""
    float8: Float8 = Field(default_factory=Float8)
    """Float8 training (model.converters = ["float8"])."""
    mx: MX = Field(default_factory=MX)
    """MXFP8 training (model.converters = ["mx"])."""
    moe: MoE = Field(default_factory=MoE)
    """Mixture-of-Experts balancing and router losses."""
    mtp: MTP = Field(default_factory=MTP)
    """Multi-token prediction."""
    ema: EMA = Field(default_factory=EMA)
    """A moving average of the weights."""
    mup: MuP = Field(default_factory=MuP)
    """The maximal update parametrization (width-transferable hyperparameters)."""
    metrics: Metrics = Field(default_factory=Metrics)
    """Logging and TensorBoard."""
    profiling: Profiling = Field(default_factory=Profiling)
    """Profiling."""
    comm: Comm = Field(default_factory=Comm)
    """Collective communication."""
    debug: Debug = Field(default_factory=Debug)
    """Reproducibility."""
    validation: Validation = Field(default_factory=Validation)
    """Validation."""
    eval: Eval = Field(default_factory=Eval)
    """Downstream multiple-choice evaluation."""
    fault_tolerance: FaultTolerance = Field(default_factory=FaultTolerance)
    """torchft replica groups."""
