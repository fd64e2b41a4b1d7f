"""torchtitan's config keys: every key of torchtitan v0.2.2's `JobConfig` (its last TOML-configured release; the list
below is typed in from its torchtitan/config/job_config.py) is either a Titan key of the same name (or one of the
spellings `titan_core.config.aliases` reads), or fails in one line naming it and what to do instead; and
docs/torchtitan.md lists exactly those."""

from __future__ import annotations

import re

import pytest
from titan_run import REPO

from titan_core.config import ConfigError, load_config
from titan_core.config.aliases import KEY_ALIASES
from titan_core.config.keys import list_keys
from titan_core.config.torchtitan_keys import TORCHTITAN_ONLY, torchtitan_only

TORCHTITAN_KEYS = (
    "job.config_file", "job.dump_folder", "job.description", "job.print_config", "job.save_config_file",
    "job.custom_config_module", "profiling.enable_profiling", "profiling.save_traces_folder",
    "profiling.profile_freq", "profiling.profiler_active", "profiling.profiler_warmup",
    "profiling.enable_memory_snapshot", "profiling.save_memory_snapshot_folder", "metrics.log_freq",
    "metrics.enable_tensorboard", "metrics.disable_color_printing", "metrics.save_tb_folder",
    "metrics.save_for_all_ranks", "metrics.enable_wandb", "model.name", "model.flavor", "model.hf_assets_path",
    "model.tokenizer_path", "model.converters", "model.print_after_conversion", "optimizer.name", "optimizer.lr",
    "optimizer.beta1", "optimizer.beta2", "optimizer.eps", "optimizer.weight_decay", "optimizer.implementation",
    "optimizer.early_step_in_backward", "lr_scheduler.warmup_steps", "lr_scheduler.total_steps",
    "lr_scheduler.decay_ratio", "lr_scheduler.decay_type", "lr_scheduler.min_lr_factor", "training.dataset",
    "training.dataset_path", "training.local_batch_size", "training.global_batch_size", "training.seq_len",
    "training.max_norm", "training.steps", "training.enable_cpu_offload", "training.dtype",
    "training.mixed_precision_param", "training.mixed_precision_reduce", "training.gc_freq", "training.gc_debug",
    "training.dataloader", "parallelism.data_parallel_replicate_degree", "parallelism.data_parallel_shard_degree",
    "parallelism.fsdp_reshard_after_forward", "parallelism.tensor_parallel_degree",
    "parallelism.disable_loss_parallel", "parallelism.enable_async_tensor_parallel",
    "parallelism.pipeline_parallel_degree", "parallelism.module_fqns_per_model_part",
    "parallelism.pipeline_parallel_first_stage_less_layers", "parallelism.pipeline_parallel_last_stage_less_layers",
    "parallelism.pipeline_parallel_layers_per_stage", "parallelism.pipeline_parallel_schedule",
    "parallelism.pipeline_parallel_schedule_csv", "parallelism.pipeline_parallel_microbatch_size",
    "parallelism.pipeline_parallel_expert_parallel_overlap", "parallelism.context_parallel_degree",
    "parallelism.context_parallel_load_balancer", "parallelism.context_parallel_rotate_method",
    "parallelism.expert_parallel_degree", "parallelism.expert_tensor_parallel_degree",
    "parallelism.expert_parallel_comm_backend", "checkpoint.enable", "checkpoint.enable_ft_dataloader_checkpoints",
    "checkpoint.folder", "checkpoint.interval", "checkpoint.initial_load_path",
    "checkpoint.initial_load_model_only", "checkpoint.initial_load_in_hf",
    "checkpoint.initial_load_in_hf_quantized", "checkpoint.last_save_model_only", "checkpoint.last_save_in_hf",
    "checkpoint.export_dtype", "checkpoint.async_mode", "checkpoint.keep_latest_k", "checkpoint.load_step",
    "checkpoint.exclude_from_loading", "checkpoint.enable_first_step_checkpoint",
    "checkpoint.create_seed_checkpoint", "checkpoint.load_only", "activation_checkpoint.mode",
    "activation_checkpoint.selective_ac_option",
    "activation_checkpoint.per_op_sac_force_recompute_mm_shapes_by_fqns", "activation_checkpoint.early_stop",
    "activation_checkpoint.memory_budget", "activation_checkpoint.visualize_memory_budget_pareto",
    "activation_checkpoint.preserve_rng_state", "activation_checkpoint.determinism_check",
    "activation_checkpoint.debug", "compile.enable", "compile.components", "compile.backend", "quantize.linear",
    "quantize.grouped_mm", "comm.init_timeout_seconds", "comm.train_timeout_seconds", "comm.trace_buf_size",
    "comm.save_traces_folder", "comm.save_traces_file_prefix", "comm.mode", "memory_estimation.enable",
    "memory_estimation.disable_fake_mode", "fault_tolerance.enable", "fault_tolerance.process_group",
    "fault_tolerance.process_group_timeout_ms", "fault_tolerance.replica_id", "fault_tolerance.group_size",
    "fault_tolerance.min_replica_size", "fault_tolerance.semi_sync_method", "experimental.custom_import",
    "experimental.custom_args_module", "validation.enable", "validation.dataset", "validation.dataset_path",
    "validation.local_batch_size", "validation.seq_len", "validation.freq", "validation.steps",
    "validation.dataloader", "debug.seed", "debug.deterministic", "debug.deterministic_warn_only",
    "debug.moe_force_load_balance",
)
"""torchtitan v0.2.2's keys, section by section as its JobConfig declares them."""

QUANTIZE = ("quantize.linear", "quantize.grouped_mm")  # tables of tables: tests/test_config_aliases.py reads them


def test_every_torchtitan_key_is_titans_or_named_with_what_to_do():
    assert len(TORCHTITAN_KEYS) == 134
    titan = set(list_keys())
    for key in TORCHTITAN_KEYS:
        if key in QUANTIZE:
            continue
        if torchtitan_only(key) is None:
            assert key in titan or key in KEY_ALIASES, f"{key}: neither Titan's nor in TORCHTITAN_ONLY"
            continue
        assert key not in titan, f"{key} is a Titan key too: drop it from TORCHTITAN_ONLY"
        with pytest.raises(ConfigError) as caught:
            load_config(None, [f"--{key}", "1"])
        message = str(caught.value)
        assert "\n" not in message and f"'{key}'" in message and "is torchtitan's" in message, message
    # nothing in the table that torchtitan does not have
    assert all(any(k == name or k.startswith(f"{name}.") for k in TORCHTITAN_KEYS) for name in TORCHTITAN_ONLY)


def test_a_torchtitan_section_titan_lacks_is_named_in_a_file(tmp_path):
    path = tmp_path / "job.toml"
    path.write_text('[memory_estimation]\nenable = true\n\n[training]\nsteps = 3\n')
    with pytest.raises(ConfigError) as caught:
        load_config(str(path), [])
    assert str(caught.value) == (
        f"config section 'memory_estimation' in {path} is torchtitan's, with no Titan equivalent: "
        "`titan estimate-memory` (and the check before every run) estimate memory; remove the section"
    )


def test_docs_list_exactly_the_keys_titan_lacks():
    text = (REPO / "docs" / "torchtitan.md").read_text()
    section = text.split("## Keys Titan does not have", 1)[1].split("\n## ", 1)[0]
    listed = re.findall(r"^\| `([a-z_.]+)` \|", section, re.M)
    assert sorted(listed) == sorted(TORCHTITAN_ONLY)
