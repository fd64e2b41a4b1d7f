"""The trainer: one code path from one CPU process to N GPUs.

`Trainer(cfg)` builds everything in a fixed order (process group -> mesh ->
tokenizer and data -> model on meta -> parallelize -> materialise -> optimizer
-> checkpoint -> step runner) and `Trainer.train()` runs the loop. What one
step means lives in `titan_core.step.StepRunner`; the loop here never asks
which parallelisms are on. The whole job config stops here: every package
below gets the plain arguments it uses. `docs/architecture.md` walks through it.
"""

from __future__ import annotations

import functools
import logging
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
import torch.distributed as dist

from titan_ckpt import CheckpointError
from titan_core.checkpointing import (
    another_models_checkpoint,
    another_optimizers_checkpoint,
    build_checkpointer,
    hf_checkpoint_hooks,
)
from titan_core.config import JobConfig, dump_toml
from titan_core.data import build_loader, build_tokenizer
from titan_core.diloco import build_diloco
from titan_core.downstream_eval import DownstreamEvaluator, load_tasks
from titan_core.ema import WeightEMA
from titan_core.fault_tolerance import build_replica_groups
from titan_core.gc_control import PeriodicGC, resolve_gc_freq
from titan_core.job import resolve
from titan_core.job.host_memory import check_host_memory, host_memory_available
from titan_core.kernel_lines import log_kernels
from titan_core.loss_spike import InjectedSpike, LossSpikePolicy
from titan_core.lr_schedule import build_lr_scheduler, schedule_steps
from titan_core.metrics import MetricsLogger, ThroughputMeter, device_peak_flops, memory_stats
from titan_core.metrics.layer_norms import LayerNorms
from titan_core.metrics.peak_flops import raise_cpu_peak
from titan_core.metrics.wandb_sink import WandbOptions
from titan_core.model_setup import build_model_parts, loss_compiled_for
from titan_core.model_source import HF_RUN_CONFIG
from titan_core.moe_balance import ExpertLoadBalancer
from titan_core.optim import build_optimizer, resolve_implementation
from titan_core.profiling import build_profiler
from titan_core.run_banner import run_banner
from titan_core.run_evals import build_downstream_eval, build_validator, ema_validation
from titan_core.run_guard import NonFinitePolicy, RunGuard
from titan_core.start_notes import build_notes, log_notes, resume_notes
from titan_core.step import Batch, StepResult, StepRunner
from titan_core.step_loss import HeadLoss, StepLoss, cross_entropy_loss
from titan_core.train_state import TrainState, set_determinism
from titan_core.validation import Validator
from titan_parallel.attention_backend import choose_sdpa_backends
from titan_parallel.comm_watch import CommWatch
from titan_parallel.distributed import init_distributed, resolve_device
from titan_parallel.expert_parallel import routing_mesh

logger = logging.getLogger("titan")


class Trainer:
    """Builds a run from a `JobConfig` and trains it.

    Args:
        cfg: the resolved job config.
        host_memory_check: on the CPU, refuse a model whose states alone exceed this machine's free memory
            (`titan_core.job.host_memory`); off for a trainer built on fake tensors (the traced estimate).
    """

    def __init__(self, cfg: JobConfig, *, host_memory_check: bool = True):
        t = cfg.training
        self.device = resolve_device(t.device)
        self.rank, self.world_size = init_distributed(
            self.device,
            cfg.comm.init_timeout_seconds,
            trace_buf_size=cfg.comm.trace_buf_size,
            trace_folder=Path(cfg.job.dump_folder) / "comm_traces",
        )
        self.tokenizer = build_tokenizer(cfg.model.hf_assets_path)
        # Every rule of a valid job, once more in this rank (for `torchrun -m titan_core.launch` users); from here
        # on everything is built from the frozen job alone.
        job = self.job = resolve(cfg, self.world_size, tokenizer_vocab_size=self.tokenizer.vocab_size)
        assert job.dims is not None and job.global_batch is not None and job.accum_steps is not None  # world size known
        assert job.batch_ramp is not None
        self.cfg, self.dims, self.spec, self.model_args = job.cfg, job.dims, job.spec, job.model_args
        self.accum_steps = job.accum_steps  # micro-batches per step at the full batch
        self.batch_ramp = job.batch_ramp  # each step's batch: `training.batch_size_rampup_*` (titan_core.batch_ramp)
        self.options = job.parallel
        self.mesh = self.dims.build_mesh(self.device.type)
        self.seed = set_determinism(cfg.debug.seed, cfg.debug.deterministic, cfg.debug.deterministic_warn_only)
        self.run_folder = Path(cfg.job.dump_folder)
        # [fault_tolerance]: this job is one torchft replica group, reading its own slice of the data
        self.replicas = build_replica_groups(
            cfg.fault_tolerance,
            rank=self.rank,
            world_size=self.world_size,
            same_init=cfg.debug.seed is not None,
            device_type=self.device.type,
        )
        dp_rank, dp_world = self.mesh["dp"].get_local_rank(), self.dims.dp
        if self.replicas is not None:
            dp_rank, dp_world = self.replicas.data_slice(dp_rank, dp_world)
        # [eval] tasks read now, with the data: a wrong task file fails before the model is built
        self.eval_tasks = load_tasks(cfg.eval.tasks, cfg.eval.max_examples) if cfg.eval.enable else []
        self.loader = build_loader(  # token shards (`titan tokenize`), a weighted mix, or on-the-fly tokenization
            t.dataset,
            t.dataset_path,
            t.dataset_text_field,
            self.tokenizer,
            seq_len=t.seq_len,
            local_batch_size=t.local_batch_size,
            dp_rank=dp_rank,
            dp_world=dp_world,
            prefetch=t.prefetch_batches,
            shuffle=t.shuffle,
            shuffle_seed=t.shuffle_seed,
            mix=t.dataset_mix,
            mix_phases=[(self._first_sample(p.step, dp_world), p.weights) for p in t.dataset_mix_phases],
        )
        log_notes(build_notes(job, self.batch_ramp), self.rank)  # the dtype, a widened vocab, a shortened warmup, ...
        self.n_params = self.spec.count_params(self.model_args)
        self.n_active_params = self.spec.active_params(self.model_args)
        if host_memory_check and job.device_type == "cpu":  # refused before allocating, not OOM-killed later
            d, local_processes = self.dims, int(os.environ.get("LOCAL_WORLD_SIZE", 1))
            shards = d.dp_shard * d.cp * d.tp * d.pp
            check_host_memory(self.n_params, cfg.optimizer.name, shards, local_processes, host_memory_available())
        self.loss = StepLoss(cross_entropy_loss)  # normalised in one place; the runner sets its divisor
        self.loss.mtp_depths = getattr(self.model_args, "n_mtp_layers", 0)  # `mtp.layers`, set by the job check
        self.loss.mtp_weight = cfg.mtp.loss_weight
        loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = cross_entropy_loss
        if t.z_loss_weight:
            loss_fn = functools.partial(cross_entropy_loss, z_loss=t.z_loss_weight, z_loss_out=self.loss.z_terms)
        if loss_compiled_for(job):
            loss_fn = torch.compile(loss_fn, backend=self.options.compile_backend or "inductor")  # compile.backend
        elif cfg.compile.enable and "loss" in cfg.compile.components and self.rank == 0:
            logger.info("compile: the loss runs eager under loss parallel (the blocks are compiled)")
        self.loss.fn = loss_fn
        self.model = build_model_parts(job, self.mesh, self.device, self.seed, loss_fn=self.loss)
        if self.model.head is not None:  # the output projection computes the loss, in token chunks
            self.loss.fn = HeadLoss(self.model.head)
            self.model.head.z_loss_out = self.loss.z_terms  # type: ignore[assignment]
        optimizer_kernel = resolve_implementation(cfg.optimizer.implementation, self.device.type)
        attention, sdpa_why = choose_sdpa_backends(t.attention_backend, self.device)
        pp_group = self.mesh["pp"].get_group() if self.dims.pp > 1 else None
        log_kernels(job, self.model, self.device, optimizer_kernel, sdpa_why, pp_group)
        # One optimizer and LR schedule per model part (pipeline stage), so that
        # checkpoints key optimizer state by the full model's parameter names.
        self.optimizers = [
            build_optimizer(
                part.named_parameters(),
                job.optimizer,
                device_type=self.device.type,
                plan=self.spec.plan,
                copies=self.model.copies,
            )
            for part in self.model.parts
        ]
        for part, optimizer in enumerate(self.optimizers):  # Muon's rule, the weight decay exclusions: once
            description = getattr(optimizer, "description", "")
            if self.rank == 0 and description:
                logger.info("optimizer %s, part %d: %s", cfg.optimizer.name, part, description)
        lr_steps, lr_steps_key = schedule_steps(cfg)
        self.lr_schedulers = [
            build_lr_scheduler(
                optimizer,
                steps=lr_steps,
                warmup_steps=job.warmup_steps,
                decay_ratio=cfg.lr_scheduler.decay_ratio,
                decay_type=cfg.lr_scheduler.decay_type,
                min_lr_factor=cfg.lr_scheduler.min_lr_factor,
                steps_key=lr_steps_key,
            )
            for optimizer in self.optimizers
        ]
        self.state = TrainState()
        self.ema = WeightEMA(self.model.parts, cfg.ema.decay, cfg.ema.warmup) if cfg.ema.enable else None  # [ema]
        if self.replicas is not None:  # what a restarted group recovers live from a peer
            self.replicas.register(self.model.parts, self.optimizers, self.lr_schedulers, self.state, self.loader)
            if self.ema is not None:  # and the moving average of the weights
                self.replicas.add_state("ema", self.ema.state_dict())
        self.outer = build_diloco(
            cfg.fault_tolerance,
            self.model.parts,
            self.replicas,
            self.spec.plan.blocks,
            t.steps,
            n_blocks=self.model_args.n_layers,
            pp_mesh=self.mesh["pp"] if self.dims.pp > 1 else None,
        )
        # [checkpoint] saves/restores model, optimizer, LR, data position, train state, RNG
        # (titan_core.checkpointing)
        self.checkpointer = build_checkpointer(
            job.checkpoint,
            model_parts=self.model.parts,
            optimizers=self.optimizers,
            lr_schedulers=self.lr_schedulers,
            dataloader=self.loader,
            train_state=self.state,
            device=self.device,
            **hf_checkpoint_hooks(cfg.checkpoint, cfg.model, self.model_args, job.hf_source, rank=self.rank),
            ema=self.ema,
            diloco=self.outer,
            diloco_window=self.outer.window if self.outer is not None else None,
        )
        # Mixture-of-Experts layers: global tokens per expert each step, expert-bias update, load metrics
        self.balancer = ExpertLoadBalancer(
            self.model.parts,
            self.spec.plan,
            routing_mesh(self.mesh).get_group(),
            pp_group=pp_group,
        )
        # One step, for every layout: forward context, loss normalisation, micro-batches, clip, optimizer
        documents = (self.tokenizer.bos_id, self.tokenizer.eos_id)  # where block-causal attention cuts the batch
        self.runner = StepRunner(
            self.model,
            self.optimizers,
            self.lr_schedulers,
            self.loss,
            mesh=self.mesh,
            device=self.device,
            param_dtype=self.options.param_dtype,
            loss_parallel=self.options.loss_parallel,
            max_norm=t.max_norm,
            attention_backends=attention,
            balancer=self.balancer,
            after_step=self._float8_after_step(),
            replicas=self.replicas if self.outer is None else None,  # DiLoCo syncs every sync_steps instead
            outer=self.outer,
            documents=documents if cfg.model.attn_mask_type == "block_causal" else None,
            ema=self.ema,
            reduce_every_microbatch=cfg.parallelism.fsdp_reduce_every_microbatch,
        )
        self.layer_norms = None  # metrics.per_layer_norms / _updates: each block's gradient, weight and update norms
        if cfg.metrics.per_layer_norms or cfg.metrics.per_layer_updates:
            self.layer_norms = LayerNorms(
                self.model.parts,
                [name for name, _ in job.meta_model().named_parameters()],
                self.spec.plan.blocks,
                pp_mesh=self.mesh["pp"] if self.dims.pp > 1 else None,
                updates=cfg.metrics.per_layer_updates,
                copies=self.model.shared.copies if self.model.shared is not None else (),
            )
        # training.on_nonfinite, applied at each poll of the run's guard that found dropped updates
        self.nonfinite = NonFinitePolicy(t.on_nonfinite, t.max_nonfinite_in_a_row, self.checkpointer, rank=self.rank)
        # training.on_loss_spike: found on the device by the guard, applied at its polls (titan_core.loss_spike)
        self.spikes = LossSpikePolicy(
            t.on_loss_spike,
            t.loss_spike_factor,
            t.loss_spike_warmup_steps,
            t.max_loss_spikes_in_a_row,
            self.checkpointer,
            self.loader,
            batches=self.batch_ramp,
            rank=self.rank,
        )
        if cfg.debug.inject_loss_spike_step is not None and self.rank == self.world_size - 1:
            self.loss.fn = InjectedSpike(
                self.loss.fn, cfg.debug.inject_loss_spike_step, lambda: self.state.step + 1, lambda: self.loss.divisor
            )
        self.stopped_by: str | None = None  # the stop signal that ended `train()` early, if one did

    def build_validator(self) -> Validator | None:
        """[validation] for this run (`titan_core.run_evals.build_validator`); None without it."""
        return build_validator(
            self.cfg,
            self.tokenizer,
            mesh=self.mesh,
            dp=self.dims.dp,
            pp=self.dims.pp,
            eval_loss=self.runner.eval_loss,
            parts=self.model.parts,
            device=self.device,
        )

    def build_downstream_eval(self) -> DownstreamEvaluator | None:
        """[eval] for this run (`titan_core.run_evals.build_downstream_eval`); None without it."""
        return build_downstream_eval(
            self.cfg,
            self.tokenizer,
            mesh=self.mesh,
            dp=self.dims.dp,
            pp=self.dims.pp,
            sequence_losses=self.runner.eval_sequence_losses,
            parts=self.model.parts,
            device=self.device,
            rank=self.rank,
            tasks=self.eval_tasks,
        )

    def _float8_after_step(self):
        """[float8] after each optimizer step: every float8-gathered weight's scale in one all-reduce."""
        float8 = self.job.converters.float8
        if float8 is None or not float8.precompute_float8_dynamic_scale_for_fsdp:
            return None
        from titan_parallel.float8 import precompute_float8_scales

        return lambda: precompute_float8_scales(self.model.parts)

    def train_step(self, batches: Sequence[Batch], guard: RunGuard | None = None) -> StepResult:
        """One step of the run (`titan_core.step.StepRunner.step`), numbered after the last finished one.

        Args:
            batches: the step's micro-batches, `(inputs, labels)` each `(local_batch_size, seq_len)`.
            guard: drops the update on the device when the loss or grad norm is not finite; None: always step.
        """
        return self.runner.step(batches, guard, step=self.state.step + 1)

    def _reduce_loss(self, loss: torch.Tensor | None) -> tuple[float, float]:
        """Global average and max of the step loss over the data- and context-parallel ranks (a CP rank's loss is
        that of its share of each sequence), from the last pipeline stage."""
        avg = loss.detach().clone() if loss is not None else torch.zeros((), device=self.device)
        mx = loss.detach().clone() if loss is not None else torch.full((), -float("inf"), device=self.device)
        group = self.mesh["dp_cp"].get_group()
        dist.all_reduce(avg, op=dist.ReduceOp.SUM, group=group)
        dist.all_reduce(mx, op=dist.ReduceOp.MAX, group=group)
        if self.dims.pp > 1:  # only the last stage's ranks hold a loss; the others contribute 0 / -inf
            dist.all_reduce(avg, op=dist.ReduceOp.SUM, group=self.mesh["pp"].get_group())
            dist.all_reduce(mx, op=dist.ReduceOp.MAX, group=self.mesh["pp"].get_group())
        return avg.item() / self.mesh["dp_cp"].size(), mx.item()

    def _first_sample(self, step: int, dp_world: int) -> int:
        """The global sample the loader reads first at `step`: the micro-batch rounds before it (a batch ramp
        grows them) x the samples one round takes from the loader."""
        rounds = self.batch_ramp.samples_through(step - 1) // self.batch_ramp.per_round
        return rounds * dp_world * self.cfg.training.local_batch_size

    def _mtp_values(self, per_depth: torch.Tensor | None) -> dict[str, float]:
        """`loss/mtp` (the depths' mean cross-entropy) and, with several depths, `loss/mtp_<k>` each, averaged over
        the data- and context-parallel ranks, from the last pipeline stage (the others hold None)."""
        depths = self.cfg.mtp.layers
        total = per_depth.detach().clone() if per_depth is not None else torch.zeros(depths, device=self.device)
        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=self.mesh["dp_cp"].get_group())
        if self.dims.pp > 1:  # only the last stage's ranks hold them; the others contribute 0
            dist.all_reduce(total, op=dist.ReduceOp.SUM, group=self.mesh["pp"].get_group())
        means = (total / self.mesh["dp_cp"].size()).tolist()
        each = {f"loss/mtp_{k}": v for k, v in enumerate(means, start=1)} if len(means) > 1 else {}
        return {"loss/mtp": sum(means) / len(means), **each}

    def _step_values(self, result: StepResult, data_wait_s: float, meter: ThroughputMeter) -> dict[str, object]:
        """A log step's figures: the only place the loop reads device values (after the step is queued)."""
        avg, mx = self._reduce_loss(result.loss)
        z_loss = {"loss/z_loss": self._reduce_loss(result.z_loss)[0]} if self.cfg.training.z_loss_weight else {}
        mtp = self._mtp_values(result.mtp_loss) if self.cfg.mtp.layers else {}
        return {
            "loss/global_avg": avg,
            "loss/global_max": mx,
            **z_loss,  # the part of loss/global_avg the z-loss adds
            **mtp,  # the prediction depths' mean cross-entropy (not part of loss/global_avg)
            "optim/grad_norm": result.grad_norm.item(),
            "optim/lr": result.lr,  # the step's own, not the next one's
            **({"optim/skipped_steps": self.nonfinite.skipped} if self.nonfinite.skipped else {}),
            **self.spikes.metrics(),
            **self.loader.metrics(),  # host ints: data/epoch, or each mixed source's tokens and epoch
            "time/data_wait_ms": 1000 * data_wait_s,
            **self.balancer.metrics(),
            **(self.layer_norms.metrics() if self.layer_norms is not None else {}),
            **(self.replicas.metrics() if self.replicas is not None else {}),
            **(self.outer.metrics() if self.outer is not None else {}),  # DiLoCo: the last sync's wait and norm
            **meter.read(),
            **memory_stats(self.device),
        }

    def _save_and_stop(self, signal_name: str | None) -> None:
        """A stop signal reached some rank: save this step's full state, so that the next start resumes."""
        self.stopped_by = signal_name or "a stop signal sent to another rank"
        started = time.perf_counter()
        self.checkpointer.save(self.state.step, force=True)  # [checkpoint] skipped if this step is already saved
        self.checkpointer.wait()
        if self.rank == 0:
            took, ckpt = time.perf_counter() - started, self.cfg.checkpoint
            if not ckpt.enable or ckpt.load_only:
                saved = (
                    "nothing saved (" + ("checkpoint.load_only" if ckpt.enable else "checkpoint.enable is off") + ")"
                )
            else:
                saved = (
                    f"checkpoint step-{self.state.step} saved ({took:.1f} s); start the same command again to resume"
                )
            logger.info("stopped by %s after step %d: %s", self.stopped_by, self.state.step, saved)

    def _write_config(self) -> None:
        """Rank 0 writes the resolved config as the run folder's `config.toml`, whole or not at all; a run started
        from Hugging Face weights also keeps their `config.json` (as `hf_config.json`): its shape is the model's,
        which `titan convert` and `titan generate` read from the run folder."""
        if self.rank != 0:
            return
        files = {"config.toml": dump_toml(self.cfg)}
        if self.job.hf_source is not None:
            files[HF_RUN_CONFIG] = (Path(self.job.hf_source) / "config.json").read_text()
        for name, text in files.items():
            staged = self.run_folder / f"{name}.tmp"
            staged.write_text(text)
            staged.replace(self.run_folder / name)

    def train(self) -> list[float]:
        """Run `training.steps` steps; returns the global-average loss of each logged step."""
        cfg, t = self.cfg, self.cfg.training
        if self.rank == 0:
            self.run_folder.mkdir(parents=True, exist_ok=True)
        if cfg.checkpoint.create_seed_checkpoint:  # [checkpoint] seed mode: save the initialised model as step-0
            self._write_config()
            self.checkpointer.save_seed()
            return []
        # [checkpoint] resume: newest complete step-N (or load_step / initial_load_path), on the config's
        # optimizer settings and LR schedule
        try:
            resumed = self.checkpointer.load()
        except CheckpointError as e:
            folder, o = self.job.checkpoint.folder, cfg.optimizer
            told = another_models_checkpoint(e, self.run_folder, folder, cfg.model.name, cfg.model.flavor)
            told = told or another_optimizers_checkpoint(self.run_folder, folder, o.name, o.weight_decay_exclude)
            if told is None:
                raise
            raise told from e
        if self.ema is not None and not self.ema.loaded:  # [ema] from the weights training starts from
            self.ema.restart()
        if self.outer is not None and not self.outer.loaded:  # DiLoCo anchors at the weights training starts from
            self.outer.restart()
        self._write_config()  # after the load: a start that cannot resume this folder leaves its run's config
        log_notes(resume_notes(self.job, self.state, self.batch_ramp, resumed), self.rank)
        if self.replicas is not None:  # torchft's step follows the run's
            self.replicas.resume_at(self.state.step)
        flops_per_token = self.spec.flops_per_token(self.model_args, t.seq_len)
        peak = device_peak_flops(self.device, self.options.param_dtype, cfg.metrics.peak_tflops)
        metrics = MetricsLogger(
            self.run_folder / cfg.metrics.save_tb_folder if cfg.metrics.enable_tensorboard else None,
            enable_tensorboard=cfg.metrics.enable_tensorboard,
            rank=self.rank,
            total_steps=t.steps,
            color=not cfg.metrics.disable_color_printing,
            jsonl_path=self.run_folder / "metrics.jsonl",
            config_toml=dump_toml(cfg),
            wandb=WandbOptions.from_config(cfg, self.run_folder) if cfg.metrics.enable_wandb else None,
            start_step=self.state.step,
        )
        if self.rank == 0:
            logger.info("%s", run_banner(self.job))  # model, data, batch, dtype, layout (+ job.description)
            if cfg.job.print_config:
                logger.info("config (job.print_config), as the run folder's config.toml:\n%s", dump_toml(cfg).rstrip())
        losses: list[float] = []
        meter = ThroughputMeter(
            flops_per_token=flops_per_token,
            peak_flops=peak,
            non_data_parallel_size=self.dims.tp * self.dims.cp * self.dims.pp,
            # A CPU peak measured while the machine was busy can be beaten: measure again then.
            raise_peak=(lambda achieved: raise_cpu_peak(self.options.param_dtype, achieved))
            if self.device.type == "cpu" and cfg.metrics.peak_tflops is None
            else None,
        )
        data = iter(self.loader)
        profiler = build_profiler(cfg.profiling, self.run_folder, self.rank, self.device)
        validator = self.build_validator()
        evaluator = self.build_downstream_eval()  # [eval] multiple-choice tasks (titan_core.downstream_eval)
        # Non-finite values, loss spikes and stop signals, agreed by every rank each step on the device, read at polls.
        guard = RunGuard(self.device, spike=self.spikes.detector(self.device))
        if self.replicas is not None and guard.spike is not None:  # a recovering group takes the running average too
            self.replicas.add_state("loss_spike", {"status": guard.spike.status})
        watch = CommWatch(  # collective timeouts (init, then train after the first step) and who hung
            self.rank,
            self.world_size,
            init_timeout_s=cfg.comm.init_timeout_seconds,
            train_timeout_s=cfg.comm.train_timeout_seconds,
            stack_folder=self.run_folder / "comm_stacks",
            gloo_trace=self.device.type == "cpu" and cfg.comm.trace_buf_size > 0,
        )
        data_wait_s, steps_since_log = 0.0, 0
        gc_freq, gc_why = resolve_gc_freq(t.gc_freq, self.device.type)
        if gc_freq and self.rank == 0:
            logger.info("garbage collection: Python's automatic collector off, every %d steps (%s)", gc_freq, gc_why)
        collector = PeriodicGC(gc_freq)  # [training] gc_freq: every rank collects at the same steps
        with guard:  # outside the try: a SIGTERM while a failure is explained below only sets the flag
            try:
                while self.state.step < t.steps and not guard.stop_requested:
                    started = time.perf_counter()
                    batches = [next(data) for _ in range(self.batch_ramp.accum_steps(self.state.step + 1))]
                    data_wait_s += time.perf_counter() - started
                    if self.layer_norms is not None:  # the gradients' norms on the steps that log them
                        upcoming = self.state.step + 1
                        logs = upcoming % cfg.metrics.log_freq == 0 or upcoming == t.steps
                        self.runner.grad_observer = self.layer_norms.record_grads if logs else None
                    result = self.train_step(batches, guard)
                    if not result.committed:
                        continue  # [fault_tolerance] a group left or joined mid-step: run it again
                    self.state.step += 1
                    step = self.state.step
                    watch.step_done(step)  # after this process's first step: the train timeout
                    tokens = self.batch_ramp.global_batch(step) * t.seq_len
                    self.state.tokens_seen += tokens
                    steps_since_log += 1
                    meter.add_tokens(tokens // self.dims.dp)
                    log_step = step % cfg.metrics.log_freq == 0 or step == t.steps
                    save_step = self.checkpointer.due(step, last_step=step == t.steps)
                    if log_step or save_step or guard.poll_due(step):  # the host reads the guard (a sync)
                        report = guard.poll()
                        outcome = self.nonfinite.after_poll(report, step)
                        if outcome != "rolled back":
                            outcome = self.spikes.after_poll(report.spikes, step)
                        if outcome == "rolled back":
                            if self.replicas is not None:  # every group rolled back: torchft's step follows, and a
                                self.replicas.resume_at(self.state.step)  # group that went further back heals
                            continue  # the step counter is the checkpoint's now
                    metrics.update_progress(step)
                    self.checkpointer.save(step, last_step=step == t.steps)  # [checkpoint]
                    if profiler is not None:
                        profiler.step(step)
                    collector.step(step)
                    if log_step or guard.stop_requested:
                        values = self._step_values(result, data_wait_s / steps_since_log, meter)
                        if self.batch_ramp.steps:  # the logged step's batch, while and after it grows
                            values["data/global_batch"] = self.batch_ramp.global_batch(step)
                        data_wait_s, steps_since_log = 0.0, 0
                        losses.append(float(values["loss/global_avg"]))  # type: ignore[arg-type]  # a float
                        metrics.log(step, values)
                    if validator is not None and (step % cfg.validation.freq == 0 or step == t.steps):
                        ema_values = ema_validation(
                            validator,
                            self.ema,
                            enabled=cfg.ema.validation,
                            parts=self.model.parts,
                            copies=self.model.copies,
                            refresh=self.runner.after_step,
                        )
                        metrics.log(step, {**validator.metrics(), **ema_values})
                        self.balancer.reset()  # validation's routing is not training load
                        meter.reset()  # validation time is not training throughput
                    if evaluator is not None and (step % cfg.eval.freq == 0 or step == t.steps):
                        metrics.log(step, evaluator.evaluate())
                        self.balancer.reset()
                        meter.reset()
                if guard.stop_requested and self.state.step < t.steps:
                    self._save_and_stop(guard.signal_received)
            except RuntimeError as error:  # a collective timed out or lost a peer: raise naming the rank at fault
                watch.explain(error, self.state.step + 1)
                raise
            finally:
                collector.close()
                watch.close()
                if profiler is not None:
                    profiler.close()
                self.checkpointer.close()  # [checkpoint] waits for a background save
                metrics.close()
                self.loader.close()  # stops a prefetch thread
                if self.replicas is not None:
                    self.replicas.close()
        return losses
