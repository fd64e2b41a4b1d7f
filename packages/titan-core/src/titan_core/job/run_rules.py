"""The rules about how a run trains rather than how it is laid out: checkpoints, profiling, metrics, the LR
schedule, the data and its mixture phases, the attention mask, torchft's replica groups, master weights, weight
decay, the z-loss and the moving average. Part of `titan_core.job.rules.RULES`, which runs them after every layout
rule.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import inspect
import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from titan_core.config.errors import ConfigError, MissingPackageError

if TYPE_CHECKING:
    from titan_core.job.rules import Draft

if TYPE_CHECKING:
    from titan_core.config.schema import JobConfig

__all__ = [
    "attention_mask",
    "checkpoint",
    "data",
    "ema",
    "fault_tolerance",
    "lr_schedule",
    "master_weights",
    "master_weights_config_blockers",
    "metrics",
    "profiling",
    "validation_set_names",
    "weight_decay",
    "z_loss",
]


def fault_tolerance(d: Draft) -> None:
    """[fault_tolerance]: torchft installed, a lighthouse, replica_id < group_size; DiLoCo's fragments that divide
    `sync_steps` and the blocks, a sync delay below the steps between syncs, one seed for every group, no outer
    settings with local SGD; no rollback between DiLoCo's syncs (one group would go back alone)."""
    ft = d.cfg.fault_tolerance
    if not ft.enable:
        if ft.semi_sync_method != "none":
            raise ConfigError(
                f"fault_tolerance.semi_sync_method = '{ft.semi_sync_method}' synchronises torchft replica groups: "
                "set fault_tolerance.enable = true (with its group_size, replica_id and lighthouse)"
            )
        return
    if ft.num_fragments > 1 and ft.semi_sync_method == "none":
        raise ConfigError(
            f"fault_tolerance.num_fragments={ft.num_fragments} cuts the model for semi_sync_method 'diloco' or "
            "'local_sgd'; set one, or num_fragments = 1"
        )
    for key in ("fragment_sync_delay", "fragment_update_alpha", "sync_dtype"):
        if key in ft.model_fields_set and getattr(ft, key) not in (0, "float32") and ft.semi_sync_method == "none":
            raise ConfigError(
                f"fault_tolerance.{key} shapes the syncs of semi_sync_method 'diloco' or 'local_sgd'; set one, "
                f"or leave {key} unset"
            )
    if ft.sync_steps % ft.num_fragments:
        raise ConfigError(
            f"fault_tolerance.sync_steps={ft.sync_steps} is not a multiple of fault_tolerance.num_fragments="
            f"{ft.num_fragments}: each fragment syncs every sync_steps steps, one every sync_steps / num_fragments"
        )
    if ft.fragment_sync_delay >= ft.sync_steps // ft.num_fragments:
        raise ConfigError(
            f"fault_tolerance.fragment_sync_delay={ft.fragment_sync_delay} must be below sync_steps / num_fragments = "
            f"{ft.sync_steps // ft.num_fragments}, the steps between two syncs (a fragment's all-reduce ends before "
            "the next one starts)"
        )
    if ft.num_fragments > d.model_args.n_layers:
        raise ConfigError(
            f"fault_tolerance.num_fragments={ft.num_fragments} exceeds the model's {d.model_args.n_layers} blocks; "
            "a fragment holds one block at least"
        )
    if ft.semi_sync_method != "none" and d.cfg.debug.seed is None:
        raise ConfigError(
            f"fault_tolerance.semi_sync_method = '{ft.semi_sync_method}' averages the groups' weight changes from one "
            "start: every group must initialise the same weights; set debug.seed (the same in every group)"
        )
    if ft.semi_sync_method == "local_sgd":
        for key in sorted({"outer_lr", "outer_momentum"} & ft.model_fields_set):
            raise ConfigError(
                f"fault_tolerance.{key} is DiLoCo's; semi_sync_method = 'local_sgd' averages the weights (outer lr 1, "
                "no momentum): set semi_sync_method = 'diloco' or leave it unset"
            )
    from titan_core.fault_tolerance import MISSING_TORCHFT

    if importlib.util.find_spec("torchft") is None:
        raise MissingPackageError(MISSING_TORCHFT)
    if ft.replica_id >= ft.group_size:
        raise ConfigError(
            f"fault_tolerance.replica_id={ft.replica_id} must be below fault_tolerance.group_size={ft.group_size}; "
            "number the replica groups 0 .. group_size - 1"
        )
    if ft.min_replica_size > ft.group_size:
        raise ConfigError(
            f"fault_tolerance.min_replica_size={ft.min_replica_size} exceeds fault_tolerance.group_size="
            f"{ft.group_size}: no step could commit; lower it"
        )
    if not ft.lighthouse and not os.environ.get("TORCHFT_LIGHTHOUSE"):
        raise ConfigError(
            "fault_tolerance.lighthouse is empty and $TORCHFT_LIGHTHOUSE unset: start `titan lighthouse` and set "
            "fault_tolerance.lighthouse to the address it prints"
        )
    if ft.process_group == "nccl" and d.device_type != "cuda":
        raise ConfigError(
            f"fault_tolerance.process_group = 'nccl' carries CUDA tensors; this run trains on {d.device_type}: "
            "set it to 'gloo' or 'auto'"
        )
    for key, skip in (("on_nonfinite", "skip_step"), ("on_loss_spike", "skip")):
        if getattr(d.cfg.training, key) == "rollback" and ft.semi_sync_method != "none":
            raise ConfigError(
                f"training.{key} = 'rollback' would reload one group's checkpoint between the syncs of "
                f"fault_tolerance.semi_sync_method = '{ft.semi_sync_method}' (its next sync heals it back); "
                f"set training.{key} = '{skip}'"
            )


def master_weights(d: Draft) -> None:
    """`optimizer.master_weights`: on one data-parallel rank, fp32 masters with bf16 copies the Adam/AdamW step
    writes replace FSDP ('auto': on CUDA, where one Triton kernel writes both); 'on' is refused where it cannot."""
    from titan_parallel import master_weights_blockers

    cfg, dims, choice = d.cfg, d.dims, d.cfg.optimizer.master_weights
    if choice == "off" or dims is None:
        return
    model_parallel = dims.tp * dims.cp * dims.pp * dims.ep > 1
    blockers = master_weights_blockers(
        dims.dp_replicate * dims.dp_shard, model_parallel, d.parallel.param_dtype, d.parallel.cpu_offload,
        d.accum_steps or 1,
    )  # fmt: skip
    blockers += master_weights_config_blockers(cfg)
    if choice == "on" and blockers:
        raise ConfigError(f"optimizer.master_weights = 'on' cannot train this job: {blockers[0]}; set 'auto' or 'off'")
    if choice == "auto" and (blockers or d.device_type != "cuda"):
        return
    d.parallel = dataclasses.replace(d.parallel, master_weights=True)
    why = "as configured" if choice == "on" else "auto: one CUDA rank, where one kernel writes masters and copies"
    d.weights_reason = f"fp32 masters whose bf16 copies the step writes, no FSDP; {why}"


def master_weights_config_blockers(cfg: JobConfig) -> list[str]:
    """What in `cfg`, beside the layout (`titan_parallel.master_weights_blockers`), keeps master weights off."""
    blockers = []
    if cfg.optimizer.name not in ("Adam", "AdamW"):
        blockers.append(f"optimizer.name = {cfg.optimizer.name!r} has no master-weight step (Adam and AdamW do)")
    if cfg.parallelism.dp_mode == "ddp":
        blockers.append("parallelism.dp_mode = 'ddp' computes in bf16 through autocast")
    if cfg.fault_tolerance.enable and cfg.fault_tolerance.semi_sync_method == "none":  # DiLoCo averages weights
        blockers.append("fault_tolerance.enable averages gradients over replica groups")
    return blockers


def checkpoint(d: Draft) -> None:
    """[checkpoint] keys (and 'rollback' of training.on_nonfinite / on_loss_spike) that need checkpoint.enable;
    no save asked of a load-only run; a seed checkpoint on one process; a Hugging Face export of the model only,
    from an unpipelined model; milestones at saved steps."""
    ckpt = d.cfg.checkpoint
    if ckpt.keep_interval % ckpt.interval:
        raise ConfigError(
            f"checkpoint.keep_interval={ckpt.keep_interval} is not a multiple of checkpoint.interval={ckpt.interval}: "
            "only those steps are saved; make it one (or 0 for no milestones)"
        )
    if not ckpt.enable:
        for key in ("create_seed_checkpoint", "initial_load_path", "last_save_in_hf", "initial_load_in_hf",
                    "load_only", "enable_first_step_checkpoint"):  # fmt: skip
            if getattr(ckpt, key):
                raise ConfigError(f"checkpoint.{key} is set but checkpoint.enable is false; add --checkpoint.enable")
    if ckpt.load_only:
        for key in ("create_seed_checkpoint", "last_save_in_hf", "enable_first_step_checkpoint"):
            if getattr(ckpt, key):
                raise ConfigError(
                    f"checkpoint.load_only saves nothing, but checkpoint.{key} asks for a save; unset one"
                )
    if ckpt.create_seed_checkpoint and d.world_size not in (None, 1):
        raise ConfigError(
            f"checkpoint.create_seed_checkpoint runs on one process, not {d.world_size}; "
            "launch it with --nproc-per-node 1"
        )
    if ckpt.last_save_in_hf and not ckpt.last_save_model_only:
        raise ConfigError(
            "checkpoint.last_save_in_hf saves model weights only; also set checkpoint.last_save_model_only = true"
        )
    if d.cfg.training.on_nonfinite == "rollback" and not ckpt.enable:
        raise ConfigError(
            "training.on_nonfinite = 'rollback' reloads the newest checkpoint; add --checkpoint.enable true"
        )
    if d.cfg.training.on_loss_spike == "rollback" and not ckpt.enable:
        raise ConfigError(
            "training.on_loss_spike = 'rollback' reloads the newest checkpoint; add --checkpoint.enable true"
        )
    if ckpt.last_save_in_hf and d.cfg.parallelism.pipeline_parallel_degree > 1:
        raise ConfigError(
            "checkpoint.last_save_in_hf does not gather pipeline stages yet; save in DCP and run "
            "`titan convert <run>/checkpoint/step-N OUT --to hf`"
        )


def profiling(d: Draft) -> None:
    """A trace's window holds its warm-up and traced steps; memory snapshots record CUDA's allocator."""
    pr = d.cfg.profiling
    window = pr.profiler_warmup + pr.profiler_active
    if pr.enable_profiling and pr.profile_freq < window:
        raise ConfigError(
            f"profiling.profile_freq={pr.profile_freq} is shorter than profiling.profiler_warmup="
            f"{pr.profiler_warmup} + profiling.profiler_active={pr.profiler_active}: each trace's window holds its "
            f"warm-up and traced steps; set profile_freq >= {window}"
        )
    if pr.enable_memory_snapshot and d.device_type != "cuda":
        raise ConfigError(
            "profiling.enable_memory_snapshot records the CUDA caching allocator and needs a CUDA device; "
            "set it to false on CPU"
        )


def metrics(d: Draft) -> None:
    """`metrics.enable_wandb` needs the optional wandb package (`titan-core[wandb]`)."""
    if d.cfg.metrics.enable_wandb:
        from titan_core.metrics.wandb_sink import require_wandb

        require_wandb()


def lr_schedule(d: Draft) -> None:
    """A set `lr_scheduler.warmup_steps` fits in the schedule (`lr_scheduler.total_steps`, else `training.steps`);
    unset, it is 10 or the whole of a shorter schedule."""
    from titan_core.lr_schedule import resolve_warmup, schedule_steps

    d.warmup_steps, d.warmup_note = resolve_warmup(d.cfg.lr_scheduler.warmup_steps, *schedule_steps(d.cfg))


def ema(d: Draft) -> None:
    """`ema.validation` scores the moving average of the weights in the validation passes: it needs both."""
    e = d.cfg.ema
    if e.validation and not (e.enable and d.cfg.validation.enable):
        missing = " and ".join(
            k for k, on in (("ema.enable", e.enable), ("validation.enable", d.cfg.validation.enable)) if not on
        )
        raise ConfigError(
            f"ema.validation = true scores the averaged weights in the validation passes; set {missing} = true"
        )


def z_loss(d: Draft) -> None:
    """`training.z_loss_weight` under tensor parallel's loss parallel needs the fused loss: the plain loss there is
    torch's `loss_parallel` cross-entropy on vocab-sharded logits, which has no z-loss."""
    t = d.cfg.training
    if t.z_loss_weight and d.dims is not None and d.dims.tp > 1 and d.parallel.loss_parallel and not t.fused_loss:
        raise ConfigError(
            "training.z_loss_weight under tensor parallel needs training.fused_loss = true (the plain loss is torch's "
            "loss-parallel cross-entropy, without a z-loss), or parallelism.disable_loss_parallel = true"
        )


def weight_decay(d: Draft) -> None:
    """Each pattern of `optimizer.weight_decay_exclude` matches a parameter of the model (a typo would leave
    decaying what it meant to exempt)."""
    from titan_core.weight_decay import unmatched

    patterns = d.cfg.optimizer.weight_decay_exclude
    if not patterns:
        return
    names = [name for name, _ in d.meta_model().named_parameters()]
    missing = unmatched(names, patterns)
    if missing:
        examples = ", ".join(dict.fromkeys([names[0], *(n for n in names if "norm" in n)][:3]))
        verb = "matches" if len(missing) == 1 else "match"
        raise ConfigError(
            f"optimizer.weight_decay_exclude: {', '.join(repr(p) for p in missing)} {verb} no parameter of "
            f"{d.cfg.model.name} {d.cfg.model.flavor} (its names look like {examples}); fix or remove the pattern"
        )


def data(d: Draft) -> None:
    """`training.dataset_mix` names every source itself: `training.dataset` / `dataset_path` stay at their defaults;
    its phases name its sources. `eval.enable` needs `eval.tasks`."""
    t = d.cfg.training
    if d.cfg.eval.enable and not d.cfg.eval.tasks:
        raise ConfigError(
            "eval.enable is set but eval.tasks is empty; list JSONL files of multiple-choice examples "
            "(docs/evaluation.md) or set eval.enable to false"
        )
    v = d.cfg.validation
    if v.sets and (v.dataset_path or v.dataset != "stdlib"):
        given = f"validation.dataset_path={v.dataset_path}" if v.dataset_path else f"validation.dataset={v.dataset}"
        raise ConfigError(
            f"validation.sets and {given} are both set; add that data to validation.sets as {{path = ...}} and "
            f"unset {given.split('=')[0]}"
        )
    names = validation_set_names(v.sets)
    if len(set(names)) < len(names):
        twice = sorted({n for n in names if names.count(n) > 1})
        raise ConfigError(
            f"validation.sets: the name {twice[0]!r} labels two sets; give each set a name of its own (name = ...)"
        )
    if t.dataset_mix and (t.dataset_path or t.dataset != "stdlib"):
        given = f"training.dataset_path={t.dataset_path}" if t.dataset_path else f"training.dataset={t.dataset}"
        raise ConfigError(
            f"training.dataset_mix and {given} are both set; the mix names its sources: "
            f"add that data to training.dataset_mix as {{path = ..., weight = ...}} and unset {given.split('=')[0]}"
        )
    _mix_phases(t)


def _mix_phases(t: Any) -> None:
    """`training.dataset_mix_phases`: with a mix, at increasing steps within the run, naming its sources."""
    phases = t.dataset_mix_phases
    if not phases:
        return
    if not t.dataset_mix:
        raise ConfigError(
            "training.dataset_mix_phases needs training.dataset_mix: the phases give its sources other weights; "
            "list the sources in training.dataset_mix or unset training.dataset_mix_phases"
        )
    from titan_core.data.mix_schedule import phase_shares
    from titan_core.data.mix_sources import default_name

    names = [entry.name or default_name(entry.path) for entry in t.dataset_mix]
    previous = 1
    for i, phase in enumerate(phases):
        key = f"training.dataset_mix_phases[{i}]"
        if not previous < phase.step <= t.steps:
            raise ConfigError(
                f"{key}.step={phase.step}: phases start at increasing steps after step {previous} and at most "
                f"training.steps={t.steps}; fix the step or drop the phase"
            )
        previous = phase.step
        unknown = sorted(set(phase.weights) - set(names))
        if unknown:
            raise ConfigError(
                f"{key}.weights names {', '.join(repr(n) for n in unknown)}, not a source of training.dataset_mix "
                f"(its names: {', '.join(names)}); use those names (or set name = '...' on a source)"
            )
        phase_shares([phase.weights.get(name, 0.0) for name in names], f"{key}.weights")


def validation_set_names(sets: Sequence[Any]) -> list[str]:
    """Each `validation.sets` entry's label: its `name`, else its folder or file name."""
    from titan_core.data.mix_sources import default_name

    return [entry.name or default_name(entry.path) for entry in sets]


def attention_mask(d: Draft) -> None:
    """`model.attn_mask_type = 'block_causal'` needs a model whose forward takes `document_ids`."""
    if d.cfg.model.attn_mask_type != "block_causal":
        return
    forward = type(d.meta_model()).forward
    if "document_ids" not in inspect.signature(forward).parameters:
        raise ConfigError(
            f"model.attn_mask_type = 'block_causal': model.name '{d.cfg.model.name}' ({forward.__qualname__}) takes "
            "no document_ids; set attn_mask_type to 'causal' or give its forward a document_ids argument "
            "(titan_models.document_mask)"
        )
