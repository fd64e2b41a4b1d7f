"""torchtitan's config keys that Titan has no key for, each with what to do instead (docs/torchtitan.md).

torchtitan v0.2.2 (its last TOML-configured release) has 134 keys. Titan reads all but
these under the same names (`model.tokenizer_path` and the `quantize.*` spellings through
`titan_core.config.aliases`). A TOML file written for torchtitan that sets one of these
fails in one line naming it and the fix, rather than the generic "unknown config key".
Their defaults in torchtitan change nothing Titan does, so a file that leaves them out runs.
"""

from __future__ import annotations

REMOVE = "remove it"
FLIGHT_RECORDER = f"Titan's flight recorder dumps into the run folder (comm.trace_buf_size); {REMOVE}"
CHECKPOINT_OPTION = f"a torch.utils.checkpoint option Titan does not pass on; {REMOVE}"

TORCHTITAN_ONLY: dict[str, str] = {
    # [job]
    "job.config_file": "give the file as `titan train --config FILE`",
    "job.save_config_file": "Titan writes the resolved config to the run folder's config.toml (job.print_config "
    f"also logs it); {REMOVE}",
    "job.custom_config_module": "Titan's config has no extension hook: set Titan's own keys; " + REMOVE,
    "experimental": "Titan's config has no extension hook; a model of your own is registered with "
    "titan_models.register_model_spec in your launcher (docs/models.md); remove the section",
    # [model], [optimizer], [training], [validation]
    "model.print_after_conversion": f"`titan params` lists every parameter of the converted model; {REMOVE}",
    "optimizer.early_step_in_backward": f"Titan steps the optimizer after the backward; {REMOVE}",
    "training.dtype": "Titan trains fp32 parameters with training.mixed_precision_param as the compute dtype (bf16 "
    f"where native), not pure-bf16 parameters and optimizer states; {REMOVE}",
    "training.gc_debug": f"training.gc_freq = 1 collects garbage at every step; {REMOVE}",
    "training.dataloader": "Titan's loaders tokenize in the step or read token shards in a thread "
    f"(training.prefetch_batches); {REMOVE}",
    "validation.dataloader": f"Titan's validation loaders are built as training's; {REMOVE}",
    # [parallelism], [activation_checkpoint], [comm]
    "parallelism.pipeline_parallel_expert_parallel_overlap": "Titan's pipeline schedules do not overlap expert "
    f"parallel's all-to-alls; {REMOVE}",
    "parallelism.context_parallel_load_balancer": "Titan's context parallel always balances causal attention by "
    f"its head-tail layout (2 x cp chunks per sequence); {REMOVE}",
    "parallelism.expert_parallel_comm_backend": "Titan's expert parallel exchanges tokens with torch's all-to-all "
    f"(no DeepEP); {REMOVE}",
    "activation_checkpoint.per_op_sac_force_recompute_mm_shapes_by_fqns": "Titan's selective 'op' policy keeps "
    f"the same ops in every block; {REMOVE}",
    "activation_checkpoint.early_stop": CHECKPOINT_OPTION,
    "activation_checkpoint.preserve_rng_state": "Titan's models have no dropout, so recompute needs no RNG state; "
    + REMOVE,
    "activation_checkpoint.determinism_check": CHECKPOINT_OPTION,
    "activation_checkpoint.debug": CHECKPOINT_OPTION,
    "activation_checkpoint.visualize_memory_budget_pareto": "`titan plan --compile.enable true` ranks memory "
    f"budgets by their measured recompute; {REMOVE}",
    "comm.mode": "Titan checks a layout without GPUs with `titan estimate-memory` and `titan plan` (fake process "
    f"groups); {REMOVE}",
    "comm.save_traces_folder": FLIGHT_RECORDER,
    "comm.save_traces_file_prefix": FLIGHT_RECORDER,
    # [checkpoint], [fault_tolerance], [metrics], [memory_estimation]
    "checkpoint.enable_ft_dataloader_checkpoints": f"Titan's checkpoints always hold the data position; {REMOVE}",
    "checkpoint.initial_load_in_hf_quantized": "Titan dequantizes block-FP8 Hugging Face checkpoints (DeepSeek-V3's) "
    f"whenever it reads them; {REMOVE}",
    "fault_tolerance.process_group_timeout_ms": "set fault_tolerance.timeout_seconds (in seconds) instead",
    "metrics.save_for_all_ranks": f"Titan logs the global figures of all ranks once; {REMOVE}",
    "memory_estimation": "`titan estimate-memory` (and the check before every run) estimate memory; remove the section",
}
"""torchtitan key (or section) -> what to do in Titan, for the one-line error."""


def torchtitan_only(dotted: str) -> str | None:
    """What to do instead of the torchtitan key or section `dotted` (or a key under such a section); None where it
    is not one of `TORCHTITAN_ONLY`.

    Args:
        dotted: the unknown key or section.
    """
    for name, fix in TORCHTITAN_ONLY.items():
        if dotted == name or dotted.startswith(f"{name}."):
            return fix
    return None
