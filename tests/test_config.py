"""The job config: schema defaults, defaults < TOML < command line, override syntax,
one-line errors with suggestions, TOML round trip, shipped configs.

Expected values are typed in from the spec (torchtitan v0.2 names and Titan's
default run), not read back from the code.
"""

import math
from pathlib import Path

import pydantic
import pytest

from titan_core.config import (
    ConfigError,
    JobConfig,
    config_help,
    dump_toml,
    list_shipped_configs,
    load_config,
)

SHIPPED = {
    "llama3_debugmodel",
    "llama3_10m",
    "llama3_110m",
    "llama3_8b",
    "llama3_70b",
    "llama3_405b",
}


def get(cfg: JobConfig, dotted: str):
    section, key = dotted.split(".")
    return getattr(getattr(cfg, section), key)


def write(tmp_path: Path, text: str, name: str = "job.toml") -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def config_error(config_file, overrides) -> str:
    """The ConfigError message of a load that must fail; it must be one line."""
    with pytest.raises(ConfigError) as info:
        load_config(config_file, overrides)
    message = str(info.value)
    assert "\n" not in message, message
    return message


# ---------------------------------------------------------------- defaults

SPEC_DEFAULTS = {
    "job.dump_folder": "./outputs",
    "job.description": "",
    "job.print_config": False,
    "model.name": "llama3",
    "model.flavor": "debugmodel",
    "model.hf_assets_path": None,
    "model.converters": [],
    "model.attn_mask_type": "causal",
    "model.shape": [],
    "optimizer.name": "AdamW",
    "optimizer.lr": 8e-4,
    "optimizer.beta1": 0.9,
    "optimizer.beta2": 0.95,
    "optimizer.eps": 1e-8,
    "optimizer.weight_decay": 0.1,
    "optimizer.weight_decay_exclude": [],
    "optimizer.implementation": "auto",
    "optimizer.master_weights": "auto",
    "optimizer.muon_momentum": 0.95,
    "optimizer.muon_nesterov": True,
    "optimizer.muon_ns_steps": 5,
    "optimizer.muon_adjust_lr_fn": "match_rms_adamw",
    "optimizer.muon_ns_dtype": "auto",
    "optimizer.adamw_lr": None,
    "optimizer.adamw_weight_decay": None,
    "lr_scheduler.warmup_steps": None,
    "lr_scheduler.decay_ratio": None,
    "lr_scheduler.decay_type": "linear",
    "lr_scheduler.min_lr_factor": 0.0,
    "lr_scheduler.total_steps": None,
    "training.dataset": "stdlib",
    "training.dataset_path": None,
    "training.dataset_text_field": "text",
    "training.dataset_mix": [],
    "training.dataset_mix_phases": [],
    "training.shuffle": True,
    "training.shuffle_seed": 0,
    "training.local_batch_size": 8,
    "training.global_batch_size": -1,
    "training.batch_size_rampup_start": None,
    "training.batch_size_rampup_steps": 0,
    "training.seq_len": 256,
    "training.max_norm": 1.0,
    "training.gc_freq": "auto",
    "training.steps": 60,
    "training.mixed_precision_param": "auto",
    "training.mixed_precision_reduce": "float32",
    "training.device": "auto",
    "training.fused_loss": True,
    "training.z_loss_weight": 0.0,
    "training.attention_backend": "auto",
    "training.enable_cpu_offload": False,
    "training.on_nonfinite": "stop",
    "training.max_nonfinite_in_a_row": 3,
    "training.on_loss_spike": "none",
    "training.loss_spike_factor": 2.0,
    "training.loss_spike_warmup_steps": 100,
    "training.max_loss_spikes_in_a_row": 10,
    "training.prefetch_batches": 2,
    "parallelism.data_parallel_replicate_degree": 1,
    "parallelism.data_parallel_shard_degree": -1,
    "parallelism.fsdp_reshard_after_forward": "default",
    "parallelism.fsdp_reduce_every_microbatch": True,
    "parallelism.dp_mode": "fsdp",
    "parallelism.tensor_parallel_degree": 1,
    "parallelism.enable_async_tensor_parallel": False,
    "parallelism.disable_loss_parallel": False,
    "parallelism.pipeline_parallel_degree": 1,
    "parallelism.pipeline_parallel_schedule": "1F1B",
    "parallelism.pipeline_parallel_schedule_csv": None,
    "parallelism.pipeline_parallel_microbatch_size": 1,
    "parallelism.pipeline_parallel_layers_per_stage": None,
    "parallelism.pipeline_parallel_first_stage_less_layers": 1,
    "parallelism.pipeline_parallel_last_stage_less_layers": 1,
    "parallelism.module_fqns_per_model_part": None,
    "parallelism.context_parallel_degree": 1,
    "parallelism.context_parallel_method": "ring",
    "parallelism.context_parallel_rotate_method": "allgather",
    "parallelism.expert_parallel_degree": 1,
    "parallelism.expert_tensor_parallel_degree": -1,
    "checkpoint.enable": False,
    "checkpoint.folder": "checkpoint",
    "checkpoint.interval": 500,
    "checkpoint.keep_latest_k": 10,
    "checkpoint.keep_interval": 0,
    "checkpoint.enable_first_step_checkpoint": False,
    "checkpoint.load_only": False,
    "checkpoint.async_mode": "disabled",
    "checkpoint.last_save_model_only": False,
    "checkpoint.export_dtype": "float32",
    "checkpoint.load_step": -1,
    "checkpoint.exclude_from_loading": [],
    "checkpoint.initial_load_path": None,
    "checkpoint.initial_load_model_only": True,
    "checkpoint.initial_load_in_hf": False,
    "checkpoint.last_save_in_hf": False,
    "checkpoint.create_seed_checkpoint": False,
    "activation_checkpoint.mode": "none",
    "activation_checkpoint.selective_ac_option": "2",
    "activation_checkpoint.memory_budget": 0.5,
    "compile.enable": False,
    "compile.components": ["model", "loss"],
    "compile.backend": "auto",
    "float8.recipe_name": "tensorwise",
    "float8.enable_fsdp_float8_all_gather": False,
    "float8.precompute_float8_dynamic_scale_for_fsdp": False,
    "float8.filter_fqns": ["output"],
    "float8.auto_filter_small_kn": True,
    "float8.emulate": "auto",
    "mx.recipe_name": "mxfp8_rceil",
    "mx.filter_fqns": ["output"],
    "moe.aux_loss_coeff": None,
    "moe.load_balance_coeff": None,
    "moe.router_z_loss_coeff": None,
    "mtp.layers": 0,
    "mtp.loss_weight": 0.3,
    "ema.enable": False,
    "ema.decay": 0.999,
    "ema.warmup": False,
    "ema.validation": False,
    "mup.enable": False,
    "mup.base_dim": 256,
    "mup.base_head_dim": 0,
    "mup.embedding_multiplier": 1.0,
    "mup.output_multiplier": 1.0,
    "metrics.log_freq": 1,
    "metrics.enable_tensorboard": True,
    "metrics.save_tb_folder": "tb",
    "metrics.disable_color_printing": False,
    "metrics.enable_wandb": False,
    "metrics.wandb_project": "titan",
    "metrics.wandb_run_name": None,
    "metrics.per_layer_norms": False,
    "metrics.per_layer_updates": False,
    "metrics.peak_tflops": None,
    "profiling.enable_profiling": False,
    "profiling.save_traces_folder": "profile_traces",
    "profiling.profile_freq": 10,
    "profiling.profiler_warmup": 1,
    "profiling.profiler_active": 1,
    "profiling.enable_memory_snapshot": False,
    "profiling.save_memory_snapshot_folder": "memory_snapshot",
    "comm.init_timeout_seconds": 300,
    "comm.train_timeout_seconds": 100,
    "comm.trace_buf_size": 20000,
    "debug.seed": 0,
    "debug.deterministic": False,
    "debug.deterministic_warn_only": False,
    "debug.moe_force_load_balance": False,
    "debug.inject_loss_spike_step": None,
    "validation.enable": False,
    "validation.dataset": "stdlib",
    "validation.dataset_path": None,
    "validation.sets": [],
    "validation.freq": 50,
    "validation.steps": 10,
    "validation.local_batch_size": None,
    "validation.seq_len": None,
    "eval.enable": False,
    "eval.tasks": [],
    "eval.freq": 100,
    "eval.max_examples": None,
    "fault_tolerance.enable": False,
    "fault_tolerance.replica_id": 0,
    "fault_tolerance.group_size": 1,
    "fault_tolerance.min_replica_size": 1,
    "fault_tolerance.lighthouse": "",
    "fault_tolerance.timeout_seconds": 10.0,
    "fault_tolerance.quorum_timeout_seconds": 60.0,
    "fault_tolerance.process_group": "auto",
    "fault_tolerance.semi_sync_method": "none",
    "fault_tolerance.sync_steps": 100,
    "fault_tolerance.outer_lr": 0.7,
    "fault_tolerance.outer_momentum": 0.9,
    "fault_tolerance.num_fragments": 1,
    "fault_tolerance.fragment_sync_delay": 0,
    "fault_tolerance.sync_dtype": "float32",
    "fault_tolerance.fragment_update_alpha": 0.0,
}


def test_defaults_are_the_spec_default_run():
    cfg = load_config(None, [])
    for dotted, expected in SPEC_DEFAULTS.items():
        assert get(cfg, dotted) == expected, dotted
    assert cfg == JobConfig()
    # The schema has exactly the spec's keys, no more.
    dumped = {f"{s}.{k}" for s, table in cfg.model_dump().items() for k in table}
    assert dumped == set(SPEC_DEFAULTS)


def test_every_field_is_documented_and_listed_in_help():
    text = config_help()
    for section_name, section_field in JobConfig.model_fields.items():
        for key, field in section_field.annotation.model_fields.items():
            assert field.description and len(field.description) > 10, f"{section_name}.{key}"
            assert f"--{section_name}.{key} " in text
            assert field.description in text
    assert "'linear' | 'sqrt' | 'cosine'" in text  # Literal choices are listed


def test_models_forbid_extra_keys_and_validate_assignment():
    cfg = JobConfig()
    with pytest.raises(pydantic.ValidationError):
        cfg.training.steps = 0
    with pytest.raises(pydantic.ValidationError):
        cfg.training.mixed_precision_param = "fp8"
    with pytest.raises(pydantic.ValidationError):
        JobConfig(training={"stepz": 3})
    cfg.training.steps = 7
    assert cfg.training.steps == 7


# ---------------------------------------------------------------- precedence


def test_precedence_defaults_then_toml_then_cli(tmp_path):
    path = write(
        tmp_path,
        """
[training]
steps = 20
seq_len = 128
device = "cpu"

[optimizer]
lr = 1e-3

[model]
hf_assets_path = "./assets/tok"
""",
    )
    cfg = load_config(path, ["--training.steps", "7", "--optimizer.beta1=0.8", "--model.hf_assets_path", "none"])
    assert cfg.training.steps == 7  # CLI over TOML
    assert cfg.optimizer.beta1 == 0.8  # CLI over default
    assert cfg.model.hf_assets_path is None  # CLI unsets what TOML set
    assert cfg.training.seq_len == 128  # TOML over default
    assert cfg.training.device == "cpu"  # TOML over default
    assert cfg.optimizer.lr == 1e-3  # TOML over default
    assert cfg.training.local_batch_size == 8  # default
    assert cfg.lr_scheduler.warmup_steps is None  # default: 10, fitted to the run by the job check
    only_toml = load_config(path, [])
    assert (only_toml.training.steps, only_toml.model.hf_assets_path) == (20, "./assets/tok")


# ---------------------------------------------------------------- override syntax


@pytest.mark.parametrize(
    "overrides, dotted, expected",
    [
        (["--training.steps", "5"], "training.steps", 5),
        (["--training.steps=5"], "training.steps", 5),
        (["--training.seq-len", "64"], "training.seq_len", 64),
        (["--optimizer.lr", "3e-4"], "optimizer.lr", 3e-4),
        (["--optimizer.lr=0.25"], "optimizer.lr", 0.25),
        (["--debug.seed", "-1"], "debug.seed", -1),
        (["--debug.seed", "none"], "debug.seed", None),
        (["--debug.seed=null"], "debug.seed", None),
        (["--lr_scheduler.decay_ratio", "0.2"], "lr_scheduler.decay_ratio", 0.2),
        (["--training.mixed_precision_param", "float32"], "training.mixed_precision_param", "float32"),
        (["--job.description", "a b = c"], "job.description", "a b = c"),
        (["--job.description=x=y"], "job.description", "x=y"),
        (["--activation_checkpoint.selective_ac_option", "op"], "activation_checkpoint.selective_ac_option", "op"),
        (["--parallelism.data_parallel_shard_degree", "4"], "parallelism.data_parallel_shard_degree", 4),
        (["--training.steps", "5", "--training.steps", "6"], "training.steps", 6),  # last one wins
    ],
)
def test_override_syntax(overrides, dotted, expected):
    assert get(load_config(None, overrides), dotted) == expected


@pytest.mark.parametrize(
    "overrides, expected",
    [
        (["--checkpoint.enable"], True),
        (["--checkpoint.enable", "--training.steps", "3"], True),
        (["--checkpoint.enable", "true"], True),
        (["--checkpoint.enable", "True"], True),
        (["--checkpoint.enable", "1"], True),
        (["--checkpoint.enable=yes"], True),
        (["--checkpoint.enable", "false"], False),
        (["--checkpoint.enable", "FALSE"], False),
        (["--checkpoint.enable=0"], False),
        (["--checkpoint.enable", "no"], False),
    ],
)
def test_bool_flags(overrides, expected):
    cfg = load_config(None, overrides)
    assert cfg.checkpoint.enable is expected
    if "--training.steps" in overrides:
        assert cfg.training.steps == 3
    # A bare flag can also switch off a key whose default is true.
    assert load_config(None, ["--metrics.enable_tensorboard", "false"]).metrics.enable_tensorboard is False


@pytest.mark.parametrize(
    "overrides, dotted, expected",
    [
        (["--compile.components", "model"], "compile.components", ["model"]),
        (["--compile.components", "loss,model"], "compile.components", ["loss", "model"]),
        (["--compile.components", "model, loss"], "compile.components", ["model", "loss"]),
        (['--compile.components=["loss"]'], "compile.components", ["loss"]),
        (
            ["--checkpoint.exclude_from_loading", "optimizer,dataloader"],
            "checkpoint.exclude_from_loading",
            ["optimizer", "dataloader"],
        ),
        (["--checkpoint.exclude_from_loading", ""], "checkpoint.exclude_from_loading", []),
        (["--checkpoint.exclude_from_loading", "[]"], "checkpoint.exclude_from_loading", []),
        (
            [
                "--parallelism.module_fqns_per_model_part",
                '[["tok_embeddings", "layers.0"], ["layers.1", "norm", "output"]]',
            ],
            "parallelism.module_fqns_per_model_part",
            [["tok_embeddings", "layers.0"], ["layers.1", "norm", "output"]],
        ),
    ],
)
def test_list_overrides(overrides, dotted, expected):
    assert get(load_config(None, overrides), dotted) == expected


# ---------------------------------------------------------------- errors


def test_unknown_cli_key_suggests_the_closest():
    message = config_error(None, ["--training.step", "5"])
    assert message == "unknown config key 'training.step' (from --training.step); did you mean 'training.steps'?"
    assert "did you mean 'training.steps'?" in config_error(None, ["--trainin.steps", "5"])
    assert "did you mean 'optimizer.lr'?" in config_error(None, ["--training.lr", "1e-3"])
    assert "did you mean 'training.seq_len'?" in config_error(None, ["--training.seqlen=4"])
    assert "--help-config" in config_error(None, ["--training.zzzzzz", "1"])  # nothing close


def test_unknown_toml_key_names_file_and_suggestion(tmp_path):
    path = write(tmp_path, "[training]\nsteps = 5\nlocal_batchsize = 2\n")
    message = config_error(path, [])
    assert "'training.local_batchsize'" in message
    assert path in message
    assert "did you mean 'training.local_batch_size'?" in message
    section_path = write(tmp_path, "[optimiser]\nlr = 1e-3\n", "section.toml")
    message = config_error(section_path, [])
    assert "'optimiser'" in message and section_path in message and "'optimizer'" in message


def test_bad_literal_names_key_value_and_allowed_values(tmp_path):
    message = config_error(None, ["--training.mixed_precision_param", "fp8"])
    assert message.startswith("training.mixed_precision_param: 'fp8' is not one of 'auto', 'bfloat16', 'float32'")
    message = config_error(None, ["--compile.components", "model,lose"])
    assert "compile.components" in message and "'lose'" in message and "'model', 'loss'" in message
    message = config_error(write(tmp_path, '[lr_scheduler]\ndecay_type = "exp"\n'), [])
    assert "lr_scheduler.decay_type: 'exp' is not one of 'linear', 'sqrt', 'cosine'" in message


def test_bad_types(tmp_path):
    message = config_error(None, ["--training.steps", "abc"])
    assert "training.steps" in message and "'abc'" in message and "integer" in message
    message = config_error(None, ["--optimizer.lr", "fast"])
    assert "optimizer.lr" in message and "'fast'" in message and "number" in message
    message = config_error(None, ["--checkpoint.enable", "maybe"])
    assert "checkpoint.enable" in message and "'maybe'" in message and "boolean" in message
    message = config_error(None, ["--parallelism.module_fqns_per_model_part", "a,b"])
    assert "parallelism.module_fqns_per_model_part" in message and "JSON" in message
    message = config_error(write(tmp_path, '[training]\nseq_len = "long"\n'), [])
    assert "training.seq_len" in message and "'long'" in message and "integer" in message
    message = config_error(write(tmp_path, "[training]\nseq_len = 1.5\n", "f.toml"), [])
    assert "training.seq_len" in message and "1.5" in message
    message = config_error(write(tmp_path, "training = 3\n", "g.toml"), [])
    assert "training" in message and "table" in message
    assert "needs a value" in config_error(None, ["--training.steps"])
    assert "unexpected argument 'stray'" in config_error(None, ["stray"])


def test_range_checks(tmp_path):
    message = config_error(None, ["--training.steps", "-5"])
    assert message.startswith("training.steps: -5 must be > 0")
    message = config_error(write(tmp_path, "[training]\nsteps = -5\n"), [])
    assert "training.steps: -5 must be > 0" in message and str(tmp_path) in message
    assert "training.seq_len" in config_error(None, ["--training.seq_len", "0"])
    assert "metrics.log_freq" in config_error(None, ["--metrics.log_freq", "0"])
    assert "checkpoint.interval" in config_error(None, ["--checkpoint.interval", "0"])
    assert "parallelism.tensor_parallel_degree" in config_error(None, ["--parallelism.tensor_parallel_degree", "0"])
    for bad in ("0", "-2"):
        message = config_error(None, ["--parallelism.data_parallel_shard_degree", bad])
        assert "parallelism.data_parallel_shard_degree" in message and "-1" in message
    assert (
        load_config(None, ["--parallelism.data_parallel_shard_degree", "-1"]).parallelism.data_parallel_shard_degree
        == -1
    )
    assert "training.global_batch_size" in config_error(None, ["--training.global_batch_size", "0"])
    assert load_config(None, ["--training.global_batch_size", "64"]).training.global_batch_size == 64
    assert "checkpoint.keep_latest_k" in config_error(None, ["--checkpoint.keep_latest_k", "-1"])
    assert load_config(None, ["--checkpoint.keep_latest_k", "0"]).checkpoint.keep_latest_k == 0
    assert "optimizer.beta2" in config_error(None, ["--optimizer.beta2", "1.5"])
    message = config_error(None, ["--eval.freq", "0", "--eval.max_examples", "0", "--training.steps", "0"])
    assert message == "training.steps: 0 must be > 0 (from --training.steps) (also wrong: eval.freq, eval.max_examples)"
    # The option's rule is titan-parallel's, checked with the job (tests/test_job_check.py); an int written in TOML is read as the string option.
    path = write(tmp_path, "[activation_checkpoint]\nselective_ac_option = 3\n", "ac.toml")
    assert load_config(path, []).activation_checkpoint.selective_ac_option == "3"


def test_toml_syntax_error_names_file_and_line(tmp_path):
    path = write(tmp_path, "[training]\nsteps = 5\nseq_len = = 3\n")
    message = config_error(path, [])
    assert path in message
    assert "line 3" in message


def test_missing_file_lists_shipped_names(tmp_path):
    missing = str(tmp_path / "nope.toml")
    message = config_error(missing, [])
    assert missing in message
    for name in SHIPPED:
        assert name in message


# ---------------------------------------------------------------- round trip


def test_round_trip_of_defaults(tmp_path):
    cfg = JobConfig()
    assert load_config(write(tmp_path, dump_toml(cfg)), []) == cfg
    assert load_config(write(tmp_path, dump_toml(cfg, with_docs=True), "docs.toml"), []) == cfg


def test_round_trip_of_a_changed_config(tmp_path):
    cfg = JobConfig()
    cfg.job.description = 'quote " backslash \\ newline \n tab \t unicode é ✓'
    cfg.model.flavor = "8B"
    cfg.model.hf_assets_path = "./assets/hf/Llama-3.1-8B"
    cfg.optimizer.name = "Adam"
    cfg.optimizer.lr = 0.1 + 0.2  # not exactly 0.3: the dump must keep every bit
    cfg.optimizer.eps = 1e-12
    cfg.lr_scheduler.decay_ratio = 0.25
    cfg.lr_scheduler.decay_type = "cosine"
    cfg.training.steps = 1234
    cfg.training.global_batch_size = 64
    cfg.training.dataset_path = "/data/c4/*.jsonl"
    cfg.training.enable_cpu_offload = True
    cfg.parallelism.pipeline_parallel_schedule = "ZBVZeroBubble"
    cfg.parallelism.module_fqns_per_model_part = [["tok_embeddings", "layers.0"], ["layers.1", "norm", "output"]]
    cfg.parallelism.pipeline_parallel_layers_per_stage = 4
    cfg.checkpoint.enable = True
    cfg.checkpoint.exclude_from_loading = ["optimizer", "lr_scheduler"]
    cfg.checkpoint.load_step = 0
    cfg.activation_checkpoint.mode = "selective"
    cfg.activation_checkpoint.selective_ac_option = "op"
    cfg.compile.components = ["loss"]
    cfg.metrics.peak_tflops = 989.5
    cfg.metrics.enable_tensorboard = False
    cfg.debug.seed = None  # unset where the default (0) is set
    cfg.validation.local_batch_size = 2
    assert cfg != JobConfig()
    back = load_config(write(tmp_path, dump_toml(cfg)), [])
    assert back == cfg
    assert back.debug.seed is None
    assert back.optimizer.lr == 0.1 + 0.2 and not math.isclose(back.optimizer.lr, 0.3, rel_tol=0, abs_tol=0)


# ---------------------------------------------------------------- shipped configs


def test_every_shipped_config_loads():
    assert set(list_shipped_configs()) == SHIPPED
    configs = {name: load_config(name, []) for name in SHIPPED}
    assert configs["llama3_debugmodel"] == JobConfig()
    assert configs["llama3_10m"].model.flavor == "10M"
    assert configs["llama3_110m"].model.flavor == "110M"
    expected_gpu = {
        # name: (flavor, lr, tp, pp, ac mode)
        "llama3_8b": ("8B", 3e-4, 1, 1, "selective"),
        "llama3_70b": ("70B", 1.5e-4, 8, 1, "full"),
        "llama3_405b": ("405B", 8e-5, 8, 8, "full"),
    }
    for name, (flavor, lr, tp, pp, ac) in expected_gpu.items():
        cfg = configs[name]
        assert cfg.model.flavor == flavor, name
        assert cfg.optimizer.lr == lr, name
        assert cfg.parallelism.tensor_parallel_degree == tp, name
        assert cfg.parallelism.pipeline_parallel_degree == pp, name
        assert cfg.activation_checkpoint.mode == ac, name
        assert cfg.training.seq_len == 8192, name
        assert cfg.training.steps == 1000, name
        assert cfg.lr_scheduler.warmup_steps == 200, name
        assert cfg.training.mixed_precision_param == "bfloat16", name
        assert cfg.training.device == "cuda", name
        assert cfg.compile.enable, name
        assert cfg.model.hf_assets_path == f"./assets/hf/Llama-3.1-{flavor}", name
    assert configs["llama3_8b"].activation_checkpoint.selective_ac_option == "op"
    assert configs["llama3_405b"].parallelism.pipeline_parallel_schedule == "Interleaved1F1B"


TORCHTITAN_DEBUG_TOML = """
# The keys of torchtitan v0.2.2's own debug-model TOMLs (torchtitan/models/llama3/train_configs/debug_model.toml
# and DeepSeek-V3's), their values as shipped there; typed in here.
[job]
dump_folder = "./outputs"
description = "Llama 3 debug training"
print_config = false

[profiling]
enable_profiling = false
save_traces_folder = "profile_trace"
profile_freq = 10
enable_memory_snapshot = false
save_memory_snapshot_folder = "memory_snapshot"

[metrics]
log_freq = 1
disable_color_printing = false
enable_tensorboard = false
save_tb_folder = "tb"
enable_wandb = false

[model]
name = "llama3"
flavor = "debugmodel"
hf_assets_path = "./tests/assets/tokenizer"

[optimizer]
name = "AdamW"
lr = 8e-4
eps = 1e-8

[lr_scheduler]
warmup_steps = 2
decay_ratio = 0.8
decay_type = "linear"
min_lr_factor = 0.0

[training]
local_batch_size = 8
seq_len = 2048
max_norm = 1.0
steps = 10
dataset = "c4_test"

[parallelism]
data_parallel_replicate_degree = 1
data_parallel_shard_degree = -1
fsdp_reshard_after_forward = "default"
tensor_parallel_degree = 1
enable_async_tensor_parallel = false
pipeline_parallel_degree = 1
context_parallel_degree = 1

[checkpoint]
enable = false
folder = "checkpoint"
interval = 10
last_save_model_only = false
export_dtype = "float32"
async_mode = "disabled"

[activation_checkpoint]
mode = "selective"
selective_ac_option = "2"

[compile]
enable = false
components = ["model", "loss"]

[quantize.linear.float8]
enable_fsdp_float8_all_gather = false
precompute_float8_dynamic_scale_for_fsdp = false
filter_fqns = ["output"]

[validation]
enable = false
dataset = "c4_validation"
freq = 5
steps = 10
"""


def test_torchtitans_own_debug_toml_loads_as_written(tmp_path):
    """torchtitan v0.2.2's debug-model TOML, keys and values as it ships them, loads as written (its `job.print_config`
    had failed it); its datasets are read as torchtitan reads them (tests/test_data.py)."""
    cfg = load_config(write(tmp_path, TORCHTITAN_DEBUG_TOML), ["--job.print_config"])
    assert cfg.job.print_config is True and cfg.job.description == "Llama 3 debug training"
    assert (cfg.training.dataset, cfg.validation.dataset) == ("c4_test", "c4_validation")
    assert cfg.float8.filter_fqns == ["output"] and cfg.activation_checkpoint.selective_ac_option == "2"
    # torchtitan keeps Qwen3's MoE flavors in its qwen3 family (its qwen3_moe_debug.toml); Titan in qwen3_moe
    moe = load_config(None, ["--model.name", "qwen3", "--model.flavor", "debugmodel_moe"])
    assert (moe.model.name, moe.model.flavor) == ("qwen3_moe", "debugmodel_moe")
    assert load_config(None, ["--model.name", "qwen3", "--model.flavor", "8B"]).model.name == "qwen3"


def test_shipped_name_resolution(tmp_path, monkeypatch):
    by_name = load_config("llama3_8b", ["--training.steps", "3"])
    assert by_name.model.flavor == "8B" and by_name.training.steps == 3
    assert load_config("llama3_8b.toml", []).model.flavor == "8B"
    # A file path wins over a shipped name.
    monkeypatch.chdir(tmp_path)
    Path("llama3_8b.toml").write_text('[model]\nflavor = "10M"\n')
    assert load_config("llama3_8b.toml", []).model.flavor == "10M"
    assert load_config("llama3_8b", []).model.flavor == "8B"


def test_a_job_size_given_as_a_config_key_names_the_launcher_options():
    """`--gpus` is `titan plan`'s; `titan train` and `titan estimate-memory` take the launcher's options."""
    for flag in ("--gpus", "--gpus-per-node", "--world_size"):
        message = config_error(None, [flag, "8"])
        assert message.endswith("the job's size is set by --nproc-per-node N (processes per node) and --nnodes M"), message
    assert "did you mean 'training.steps'?" in config_error(None, ["--steps", "8"])  # other names keep their hint
