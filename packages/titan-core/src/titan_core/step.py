"""One training step, for every layout: `StepRunner`.

What a step means is decided here and nowhere else, the same way for one CPU
process and for TP x PP x FSDP x CP on many GPUs:

    zero the gradients
    for each micro-batch (gradient accumulation):
        place it on the device (non-blocking), shard its sequence under CP
        forward + loss + backward: a one-stage schedule without pipeline parallel,
        the pipeline schedule with it (which cuts the micro-batch into pipeline micro-batches)
    [fault_tolerance] torchft's quorum starts with the step; after backward the gradients are
        averaged across the live replica groups (`titan_core.fault_tolerance`)
    clip the gradient norm, taken over the whole model however it is split (with fused AdamW
        the optimizer's kernel divides the gradients as it reads them: no separate pass)
    the run guard's verdict, on the device: `found_inf` (`titan_core.run_guard`)
    [fault_tolerance] torchft's commit vote: a dropped step ends here (no update, no LR step)
    the optimizer step, dropped on the device when `found_inf` is set; the LR schedule;
    the MoE expert biases; float8's gathered-weight scales
    [fault_tolerance] with `semi_sync_method` (DiLoCo), every `sync_steps` steps instead of the per-step
        average and vote: the groups' outer step on their weights (`titan_core.diloco`)

The loss is normalised in exactly one place, `StepLoss` (`titan_core.step_loss`): the sum of
the step's token losses over the rank's token count, which data parallel's average makes the
global batch's mean; with multi-token prediction it adds the depths' weighted mean.

The compute dtype is applied once, the same way on every world size: FSDP2's
mixed-precision policy where the model is FSDP-wrapped (every `dp_mode="fsdp"`
run computing in bf16, one rank included), `torch.autocast` under DDP
(`titan_parallel.precision`). By default the output projection computes the
loss itself, in token chunks (`HeadLoss`, `titan_parallel.linear_cross_entropy`;
vocab-parallel under TP): inside the step the model returns hidden states, and the
full logits never exist. With `training.fused_loss = false` the plain loss runs on
the logits, under TP in `loss_parallel()` on vocab-sharded logits.

A good step reads nothing from the device on the host: no `.item()`, no copy of
a flag. The guard's verdict is a device tensor that the fused optimizer kernels
take as `found_inf` (as `torch.amp.GradScaler` uses them), so a bad step's update
is dropped on the device; the host learns of it at the next poll
(`RunGuard.poll`). The for-loop and foreach kernels have no `found_inf`: with
them the runner reads the verdict on the host each step (one sync), and says so.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch.distributed.tensor import DTensor

from titan_core.step_loss import StepLoss, sequence_loss_sums, shift_labels
from titan_models.document_mask import document_ids
from titan_models.mtp import tokens_ahead
from titan_parallel.attention_backend import sdpa_context
from titan_parallel.context_parallel import shard_sequence
from titan_parallel.fsdp import set_gradient_sync
from titan_parallel.grad_clip import clip_divisor, clip_grad_norm_, grad_norm
from titan_parallel.linear_cross_entropy import hidden_states_out
from titan_parallel.precision import mixed_precision_context

if TYPE_CHECKING:
    from titan_core.diloco import DiLoCo
    from titan_core.ema import WeightEMA
    from titan_core.fault_tolerance import ReplicaGroups
    from titan_core.model_setup import ModelParts
    from titan_core.moe_balance import ExpertLoadBalancer
    from titan_core.run_guard import RunGuard
    from titan_parallel import ParallelMesh

__all__ = ["Batch", "StepResult", "StepRunner"]

logger = logging.getLogger("titan")

Batch = tuple[torch.Tensor, torch.Tensor]  # (inputs, labels), each (local_batch_size, seq_len)


@dataclass
class StepResult:
    """What one step leaves on the device (nothing here has been read by the host).

    Args:
        loss: the step's mean loss on this rank (detached, 0-dim); None on pipeline ranks without
            the last stage.
        grad_norm: the global gradient norm before clipping (the same on every rank).
        found_inf: 1.0 when the guard dropped this step's update on every rank, else 0.0 (0-dim);
            None without a guard.
        committed: False when torchft's commit vote dropped the step (`titan_core.fault_tolerance`): no
            update, no LR step; the loop runs the step again.
        lr: the learning rate this step's update used (the first schedule's, a host float); None without one.
        z_loss: the step's mean z-loss term on this rank (detached, 0-dim; part of `loss`); None without a
            z-loss or off the last pipeline stage.
        mtp_loss: the step's multi-token-prediction cross-entropy of each depth on this rank (detached, `(D,)`;
            not part of `loss`, which is the language-model loss); None without MTP.
    """

    loss: torch.Tensor | None
    grad_norm: torch.Tensor
    found_inf: torch.Tensor | None = None
    committed: bool = True
    lr: float | None = None
    z_loss: torch.Tensor | None = None
    mtp_loss: torch.Tensor | None = None


class StepRunner:
    """Runs one training step (or one evaluation batch) on this rank's model parts, whatever the layout.

    Args:
        model: this rank's model parts, and under pipeline parallel the stages and schedule
            (`titan_core.model_setup.build_model_parts`, built with `loss` as the schedule's loss).
        optimizers: one per model part.
        lr_schedulers: one per optimizer.
        loss: the step's loss (`StepLoss`); its divisor is set here for training.
        mesh: the parallel mesh (the `cp` and `pp` meshes are used).
        device: where the step computes.
        param_dtype: the compute dtype.
        loss_parallel: under TP, the loss runs on vocab-sharded logits (`loss_parallel()`).
        max_norm: gradient clipping norm (<= 0: measure only).
        balancer: the MoE load balancer (token counts, expert biases), or None.
        after_step: called after each applied optimizer step (e.g. float8's scale precompute).
        attention_backends: SDPA kernels in priority order (`titan_parallel.attention_backend`); None: torch's.
        replicas: torchft replica groups (`titan_core.fault_tolerance`): quorum, cross-group gradient average
            and commit vote around the step; None without fault tolerance.
        documents: `(bos_id, eos_id)` of the packed data: attention stays within each document (block-causal,
            `model.attn_mask_type`), the model given each batch's `document_ids`; None: causal attention.
        ema: the moving average of the weights (`titan_core.ema.WeightEMA`), updated after each optimizer step
            with the guard's verdict (a dropped update leaves it unchanged); None without one.
        reduce_every_microbatch: FSDP reduce-scatters each accumulated micro-batch's gradients; False: once per
            step (`titan_parallel.set_gradient_sync`). DDP's and HSDP's all-reduces run once per step either way.
        outer: DiLoCo's outer loop across the replica groups (`titan_core.diloco.DiLoCo`), run after the inner
            optimizer step of every `sync_steps`-th step; None otherwise (then `replicas` syncs every step).
    """

    def __init__(
        self,
        model: ModelParts,
        optimizers: Sequence[torch.optim.Optimizer],
        lr_schedulers: Sequence[torch.optim.lr_scheduler.LRScheduler],
        loss: StepLoss,
        *,
        mesh: ParallelMesh,
        device: torch.device,
        param_dtype: torch.dtype,
        loss_parallel: bool,
        max_norm: float,
        balancer: ExpertLoadBalancer | None = None,
        after_step: Callable[[], None] | None = None,
        attention_backends: Sequence[str] | None = None,
        replicas: ReplicaGroups | None = None,
        documents: tuple[int, int] | None = None,
        ema: WeightEMA | None = None,
        reduce_every_microbatch: bool = True,
        outer: DiLoCo | None = None,
    ):
        self.reduce_every_microbatch = reduce_every_microbatch
        self.outer = outer
        self.model, self.optimizers, self.lr_schedulers = model, list(optimizers), list(lr_schedulers)
        self.loss, self.mesh, self.device = loss, mesh, device
        # FSDP or the compute copies cast to the compute dtype, else autocast
        self.param_dtype, self.fsdp = param_dtype, model.fsdp or model.copies is not None
        self.loss_parallel = loss_parallel and mesh["tp"].size() > 1
        self.cp_mesh = mesh["cp"] if mesh["cp"].size() > 1 else None  # sliced once: slicing reads the mesh
        self.pp_mesh = mesh["pp"] if mesh["pp"].size() > 1 else None
        self.max_norm = max_norm
        self.balancer, self.after_step = balancer, after_step
        self.attention_backends = attention_backends
        self.replicas = replicas
        self.documents = documents
        self.ema = ema
        # Torch's pipeline schedule over this rank's stages, or without pipeline parallel a one-stage schedule
        # with the same interface (`step`, `eval`; stages with `is_first` / `is_last`).
        self.schedule: Any
        self.stages: list[Any]
        if model.schedule is not None:
            self.schedule, self.stages = model.schedule, list(model.stages or [])
            if not hasattr(self.schedule, "eval"):
                setattr(self.schedule, "eval", _no_pipeline_eval)  # noqa: B010  # an older torch
        else:
            self.schedule = OneStageSchedule(model.parts[0], loss)
            self.stages = [self.schedule]
        if balancer is not None:
            loss.aux_layers = [moe for _, moe in balancer.layers]
        # The fused kernels take the guard's verdict on the device; the others need it on the host.
        self.device_drop = all(_takes_found_inf(opt) for opt in self.optimizers)
        # The same kernels divide each gradient by `grad_scale` as they read it: the clip happens there, and the
        # separate in-place pass over every gradient (`clip_grad_norm_`) disappears.
        self.clip_in_optimizer = self.device_drop and max_norm > 0
        self.grad_observer: Callable[[], None] | None = None  # called on every rank after backward, before clipping

    @contextlib.contextmanager
    def forward_context(self) -> Iterator[None]:
        """Where forward and loss run: autocast where FSDP does not cast, loss parallel under TP, SDPA kernel order."""
        with contextlib.ExitStack() as stack:
            stack.enter_context(mixed_precision_context(self.device.type, self.param_dtype, fsdp=self.fsdp))
            stack.enter_context(sdpa_context(self.attention_backends))
            if self.model.head_owner is not None:  # the fused loss applies the output projection
                stack.enter_context(hidden_states_out([self.model.head_owner]))
            if self.loss_parallel:
                from torch.distributed.tensor.parallel import loss_parallel

                stack.enter_context(loss_parallel())
            yield

    def place(
        self, inputs: torch.Tensor, labels: torch.Tensor, *, mtp: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor, dict]:
        """A batch on the device (without waiting for the copy), its sequence sharded under CP, and the model's
        keyword inputs besides the tokens: each position's document under block-causal attention; with `mtp` (a
        training batch) under pipeline or context parallel, each prediction depth's tokens, and under CP its
        targets, taken on the whole sequences."""
        inputs = inputs.to(self.device, non_blocking=True)
        labels = labels.to(self.device, non_blocking=True)
        extra: dict[str, torch.Tensor] = {}
        if self.documents is not None:
            # Of the whole sequence, before CP shards it: Ulysses' attention sees whole sequences. Every pipeline
            # rank holds the batch: each stage gets its micro-batch's slice (torch's schedules split keyword
            # inputs along dim 0 and pass them to every stage's forward), and builds the mask from it.
            extra["document_ids"] = document_ids(inputs, *self.documents)  # (bs, seqlen)
        depths = self.loss.mtp_depths if mtp else 0
        if depths and (self.cp_mesh is not None or self.pp_mesh is not None):
            extra["mtp_tokens"] = tokens_ahead(inputs, depths)  # (bs, D, seqlen): the last stage and CP shards'
        if self.cp_mesh is not None:
            if depths:  # each depth's targets beside the main ones, (bs, 1 + D, seqlen), sharded as the tokens
                labels = torch.stack([labels, *(shift_labels(labels, k) for k in range(1, depths + 1))], dim=1)
                whole = (labels[:, 1:] != -100).sum(dim=(0, 2))  # (D,)
                extra["mtp_tokens"], labels = shard_sequence(
                    extra["mtp_tokens"], labels, cp_mesh=self.cp_mesh, seq_dim=2
                )
                # Depth k's last k positions have no target, all on one CP rank: weigh each rank's mean so that
                # the average over the CP ranks is the mean over the whole sequences' targets.
                here = (labels[:, 1:] != -100).sum(dim=(0, 2))
                self.loss.depth_weights = here * self.cp_mesh.size() / whole.clamp(min=1)
                (inputs,) = shard_sequence(inputs, cp_mesh=self.cp_mesh)
            else:
                inputs, labels = shard_sequence(inputs, labels, cp_mesh=self.cp_mesh)
        return inputs, labels, extra

    def _forward_backward(
        self, inputs: torch.Tensor, labels: torch.Tensor, extra: dict, *, backward: bool
    ) -> torch.Tensor | None:
        """One micro-batch through the schedule (`extra`: the model's keyword inputs besides the tokens): the sum
        of its (divided) losses, None off the last stage."""
        schedule, stages = self.schedule, self.stages
        losses: list[torch.Tensor] | None = [] if any(stage.is_last for stage in stages) else None
        args = (inputs,) if any(stage.is_first for stage in stages) else ()
        target = labels if losses is not None else None
        z_terms, first = self.loss.z_terms, len(self.loss.z_terms)
        mtp_terms, first_mtp = self.loss.mtp_terms, len(self.loss.mtp_terms)
        with self.forward_context():
            if backward:
                if self.loss.mtp_depths:  # the prediction depths run in training only
                    extra = {**extra, "mtp": True}
                schedule.step(*args, target=target, losses=losses, return_outputs=False, **extra)
            else:
                schedule.eval(*args, target=target, losses=losses, **extra)
        if losses is None:
            return None
        # The micro-batches' z-loss and MTP terms are the last ones: torch's first pipeline step calls the loss
        # once more, on uninitialised inputs, to infer the backward's shapes (torch 2.15).
        del z_terms[first : max(first, len(z_terms) - len(losses))]
        del mtp_terms[first_mtp : max(first_mtp, len(mtp_terms) - len(losses))]
        losses = [loss.full_tensor() if isinstance(loss, DTensor) else loss for loss in losses]  # loss parallel
        total = torch.stack([loss.detach() for loss in losses]).sum()  # each already divided by StepLoss
        if len(mtp_terms) > first_mtp:  # report the language-model loss; the MTP part is `mtp_loss`
            depths_mean = torch.stack(mtp_terms[first_mtp:]).mean(dim=-1)  # each call's mean over the depths
            total = total - self.loss.mtp_weight * depths_mean.sum() / self.loss.divisor
        return total

    def step(self, batches: Sequence[Batch], guard: RunGuard | None = None, *, step: int = 0) -> StepResult:
        """Forward and backward over the step's micro-batches, clip, and step the optimizers.

        Args:
            batches: the step's micro-batches, `(inputs, labels)` each `(local_batch_size, seq_len)`; the loss is
                their mean (`StepLoss` divides by their number x the pipeline micro-batches).
            guard: gives the verdict on the device (non-finite loss or grad norm on any rank drops the
                update everywhere); None always applies the update.
            step: the step's number (1-based), for the guard's record of a dropped step.
        """
        for optimizer in self.optimizers:
            optimizer.zero_grad(set_to_none=True)
        self.loss.set_divisor(len(batches) * self.model.n_microbatches)  # a batch-size ramp-up varies it by step
        self.loss.z_terms.clear()
        self.loss.mtp_terms.clear()
        if self.replicas is not None:
            self.replicas.begin_step()  # torchft's quorum, in the background during forward
        total: torch.Tensor | None = None
        accumulate = len(batches) > 1 and self.pp_mesh is None  # torch's schedules do it over pipeline micro-batches
        for i, (inputs, labels) in enumerate(batches):
            if accumulate:  # data parallel synchronises gradients in the last micro-batch's backward
                set_gradient_sync(self.model.parts, i == len(batches) - 1, reduce_scatter=self.reduce_every_microbatch)
            loss = self._forward_backward(*self.place(inputs, labels, mtp=True), backward=True)
            if loss is not None:
                total = loss if total is None else total + loss
        guard_loss = total
        if self.replicas is not None:  # the replicate dimension of HSDP: across the live replica groups
            counts = self.balancer.step_tensors() if self.balancer is not None else []  # MoE: the groups' loads too
            if total is not None and guard is not None:
                # The guard's verdicts (a non-finite loss, a loss spike) on the run's mean loss, the same in every
                # group: on a group's own, one group would drop a step's update that the others apply, and their
                # weights would part.
                guard_loss = total.detach().float().reshape(1).clone()
                counts = [*counts, guard_loss]
            self.replicas.average_gradients(self.model.parameters(), counts)
        shared = self.model.shared
        if shared is not None:  # weights on several pipeline stages: each copy gets the sum of their gradients
            shared.reduce_grads()
        copies = shared.copies if shared is not None else ()  # counted once in the norm
        if self.grad_observer is not None:  # e.g. each block's gradient norm, before clipping
            self.grad_observer()
        if self.clip_in_optimizer:
            norm = grad_norm(self.model.parameters(), pp_mesh=self.pp_mesh, copies=copies)
            divisor: torch.Tensor | None = clip_divisor(norm, self.max_norm)
        else:
            params = self.model.parameters()
            norm, divisor = clip_grad_norm_(params, self.max_norm, pp_mesh=self.pp_mesh, copies=copies), None
        found_inf = guard.observe(guard_loss, norm, step) if guard is not None else None
        if self.replicas is not None and not self.replicas.commit():  # a host round trip, as torchft's own
            if self.balancer is not None:
                self.balancer.reset()  # the dropped step's loads
            return StepResult(total, norm, found_inf, committed=False)
        if self.balancer is not None:  # expert biases move unless found_inf (on the device)
            groups = self.replicas.participants() if self.replicas is not None else 1
            self.balancer.after_backward(found_inf=found_inf, replica_groups=groups)
        if found_inf is None or self.device_drop:
            self._optimizer_step(found_inf, divisor)  # a bad update is dropped inside the fused kernels
            if self.ema is not None:
                self.ema.update(found_inf, step)  # unchanged where the kernels dropped the update
        elif not bool(found_inf.item()):  # foreach / for-loop: the verdict is read on the host (one sync)
            self._optimizer_step(None, divisor)
            if self.ema is not None:
                self.ema.update(step=step)
        if self.outer is not None:  # DiLoCo: the groups' outer step on the weights, and the next sync's start
            if self.outer.starts_at(step):
                for optimizer in self.optimizers:  # the inner gradients are spent: their memory holds the sync's
                    optimizer.zero_grad(set_to_none=True)
            if self.outer.advance(step) and self.after_step is not None:  # float8's scales follow the new weights
                self.after_step()
        lr = float(self.lr_schedulers[0].get_last_lr()[0]) if self.lr_schedulers else None  # before it moves on
        self.lr_step()  # the schedule follows the step counter, dropped steps included
        z_terms = self.loss.z_terms  # one per loss call: the step's mean, as `total` is over its micro-batches
        z_loss = torch.stack(z_terms).sum() / len(z_terms) if z_terms else None
        mtp_terms = self.loss.mtp_terms  # one per micro-batch
        mtp_loss = torch.stack(mtp_terms).mean(dim=0) if mtp_terms else None  # (D,): each depth's over the calls
        return StepResult(total, norm, found_inf, lr=lr, z_loss=z_loss, mtp_loss=mtp_loss)

    def _optimizer_step(self, found_inf: torch.Tensor | None, clip_divisor: torch.Tensor | None = None) -> None:
        # Read by Adam/AdamW's fused step: found_inf drops the update, grad_scale divides the gradients.
        extra = {"found_inf": found_inf, "grad_scale": clip_divisor}
        extra = {name: value for name, value in extra.items() if value is not None}
        for optimizer in self.optimizers:
            for name, value in extra.items():
                setattr(optimizer, name, value)
            try:
                optimizer.step()
            finally:
                for name in extra:
                    delattr(optimizer, name)
        if self.after_step is not None:
            self.after_step()

    def lr_step(self) -> None:
        for scheduler in self.lr_schedulers:
            scheduler.step()

    @torch.no_grad()
    def eval_loss(self, inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor | None:
        """One batch's mean loss on this rank, forward only, under every layout (pipeline included).

        Returns None on pipeline ranks without the last stage.
        """
        with self.loss.divided_by(self.model.n_microbatches):
            return self._forward_backward(*self.place(inputs, labels), backward=False)

    @torch.no_grad()
    def eval_sequence_losses(self, inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor | None:
        """Each sequence's summed token loss, `(batch,)` fp32, forward only, under every layout (pipeline
        included): minus the log-likelihood of its labelled tokens (0 for a sequence with none).

        The loss is called on each sequence alone (`sequence_loss_sums`), so fused, compiled and
        vocab-parallel losses all serve. Under CP each sum covers this rank's sequence shard (add them over
        the cp group). Returns None on pipeline ranks without the last stage.
        """
        mean_fn, sums = self.loss.fn, []

        def record(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
            sums.append(sequence_loss_sums(mean_fn, output, target))  # the last stage's micro-batches, in order
            return sums[-1].sum()

        self.loss.fn = record
        try:
            with self.loss.divided_by(1):
                present = self._forward_backward(*self.place(inputs, labels), backward=False)
        finally:
            self.loss.fn = mean_fn
        return None if present is None else torch.cat(sums)


class OneStageSchedule:
    """The whole model as a one-stage pipeline schedule: `step` runs forward, loss and backward of one
    micro-batch, `eval` forward and loss, with the interface of torch's pipeline schedules, so the
    runner has one code path with and without pipeline parallel.

    Args:
        module: the model (this rank's only part).
        loss_fn: `(logits, labels) -> loss` to backpropagate (`StepLoss`).
    """

    is_first = is_last = True  # it is its own (only) stage

    def __init__(self, module: torch.nn.Module, loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]):
        self.module, self.loss_fn = module, loss_fn

    def step(
        self,
        inputs: torch.Tensor,
        *,
        target: torch.Tensor,
        losses: list[torch.Tensor],
        return_outputs: bool = False,
        **model_kwargs: torch.Tensor,
    ) -> None:
        loss = self.loss_fn(self.module(inputs, **model_kwargs), target)
        loss.backward()
        losses.append(loss)

    def eval(
        self, inputs: torch.Tensor, *, target: torch.Tensor, losses: list[torch.Tensor], **model_kwargs: torch.Tensor
    ) -> None:
        losses.append(self.loss_fn(self.module(inputs, **model_kwargs), target))


def _no_pipeline_eval(*args: object, **kwargs: object) -> None:
    raise RuntimeError(
        f"validation under pipeline parallel needs a torch whose pipeline schedules have eval() "
        f"(this is {torch.__version__}); set validation.enable = false or upgrade torch"
    )


def _takes_found_inf(optimizer: torch.optim.Optimizer) -> bool:
    """Whether `optimizer.step()` honours a `found_inf` attribute: torch's fused Adam and AdamW kernels do
    (they skip the whole update, step counts included, when it is non-zero); foreach and for-loop do not."""
    fused = all(group.get("fused") for group in optimizer.param_groups)
    return fused and isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW))
