"""bf16 training on one data-parallel rank without FSDP: fp32 master weights, bf16 compute copies the optimizer writes.

FSDP2 on a one-rank mesh computes in bf16 by copying: every step it casts each fp32 weight into
an all-gather buffer, "gathers" it over one rank, copies it out, and on the way back casts each
bf16 gradient into an fp32 reduce buffer and copies it out again: 9-12% of a 1B or 8B-shaped
step on an H100 (docs/performance.md). Here the same numbers come without the copies:

- `ComputeCopies` keeps a bf16 copy of every parameter. From a forward until the next optimizer
  step each parameter's `.data` is its copy, so the model computes in bf16 exactly as under
  FSDP's `MixedPrecisionPolicy` (bf16 weights, activations and residual stream) and autograd
  leaves each gradient in the dtype its backward computed it in: bf16 from the matmuls, fp32
  where an op reduces in fp32 (RMSNorm's weight), as FSDP keeps them (it sets the gathered
  parameters' `grad_dtype` to fp32, here it is None: no cast either way). Otherwise
  (`state_dict`, checkpoints, the optimizer) the parameters are the fp32 masters.
- `MasterAdam` / `MasterAdamW` step the masters from those gradients and write the copies in the
  same pass: on CUDA one Triton kernel (`titan_parallel.adam_kernel`, 28 bytes per weight as
  torch's fused step), elsewhere torch's fused kernel on fp32 casts of the gradients plus a cast
  back. Both take `found_inf` and `grad_scale` as torch's fused Adam does.

Gradients stay bf16 between backward and step, so micro-batches cannot accumulate in fp32: the
mode is for one micro-batch per step (`master_weights_blockers` says what else it needs).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch
import torch.nn as nn

__all__ = ["ComputeCopies", "MasterAdam", "MasterAdamW", "master_weights_blockers"]


def master_weights_blockers(
    data_parallel_ranks: int, model_parallel: bool, param_dtype: torch.dtype, cpu_offload: bool, accum_steps: int
) -> list[str]:
    """Why fp32 masters with optimizer-written compute copies cannot train this layout (empty: they can).

    Args:
        data_parallel_ranks: ranks the gradients are averaged over.
        model_parallel: tensor, context, expert or pipeline parallel splits the model (DTensor parameters
            or stages whose micro-batches accumulate).
        param_dtype: the compute dtype.
        cpu_offload: parameters and optimizer state live on the CPU (FSDP's offload).
        accum_steps: micro-batches whose gradients one step sums.
    """
    blockers = []
    if param_dtype == torch.float32:
        blockers.append("the compute dtype is float32: there is nothing to copy")
    if data_parallel_ranks > 1:
        blockers.append(f"{data_parallel_ranks} data-parallel ranks need FSDP or DDP to reduce gradients")
    if model_parallel:
        blockers.append("tensor / context / expert / pipeline parallel split the parameters or the batch")
    if cpu_offload:
        blockers.append("CPU offload is FSDP's")
    if accum_steps > 1:
        blockers.append(f"{accum_steps} micro-batches per step would sum their gradients in bf16")
    return blockers


class ComputeCopies:
    """A compute-dtype copy of every parameter of `parts`, swapped in for forward and backward.

    The parameters hold their fp32 masters until a forward of one of `parts` starts; from then until
    `use_masters()` (the optimizer step, `state_dict`, `load_state_dict`) they hold the copies. A copy
    is refreshed from its master when a write through the parameter changed the master (init, a
    checkpoint load); the optimizer writes the copies itself and says so with `written()`.

    Args:
        parts: the modules trained (each with plain, non-DTensor parameters).
        dtype: the compute dtype, e.g. torch.bfloat16.
    """

    def __init__(self, parts: Sequence[nn.Module], dtype: torch.dtype):
        from torch.distributed.tensor import DTensor  # here: `master_weights_blockers` (a job check) stays light

        params: dict[int, nn.Parameter] = {}
        for part in parts:
            for name, p in part.named_parameters():
                if isinstance(p, DTensor):
                    raise ValueError(f"ComputeCopies needs plain parameters; {name} is a DTensor")
                params.setdefault(id(p), p)
        self.params = list(params.values())
        for p in self.params:
            if hasattr(p, "grad_dtype"):  # torch 2.10+; before, autograd casts every gradient to the copy's dtype
                p.grad_dtype = None  # keep each gradient in the dtype its backward produced (fp32 for norm weights)
        self.index = {id(p): i for i, p in enumerate(self.params)}
        self.masters = [p.data for p in self.params]
        self.copies = [torch.empty_like(m, dtype=dtype) for m in self.masters]
        self.dtype = dtype
        self.computing = False
        self.generation = 0
        """How many times the copies were written (each optimizer step, each refresh from the masters)."""
        self._versions: list[int] | None = None  # the parameters' versions when the copies were last written
        for part in parts:
            part.register_forward_pre_hook(lambda *_: self.use_copies())
            part.register_state_dict_pre_hook(lambda *_: self.use_masters())
            part.register_load_state_dict_pre_hook(lambda *_: self.use_masters())

    def use_copies(self) -> None:
        """The parameters hold the copies (refreshed first if a master changed through its parameter)."""
        if self.computing:
            return
        if self._versions != [p._version for p in self.params]:
            with torch.no_grad():
                torch._foreach_copy_(self.copies, self.masters)
            self.written()
        for p, copy in zip(self.params, self.copies, strict=True):
            p.data = copy
        self.computing = True

    def use_masters(self) -> None:
        """The parameters hold the fp32 masters (their gradients, if any, stay in the compute dtype)."""
        if not self.computing:
            return
        for p, master in zip(self.params, self.masters, strict=True):
            p.data = master
        self.computing = False

    def written(self) -> None:
        """The copies equal the masters now (the optimizer wrote both)."""
        self._versions = [p._version for p in self.params]
        self.generation += 1


class _MasterStep:
    """The step shared by `MasterAdam` and `MasterAdamW` (torch's Adam / AdamW with their own step)."""

    copies: ComputeCopies
    param_groups: list[dict[str, Any]]
    state: Any
    _kernels: dict[tuple[int, torch.dtype], Any]
    _triton: bool

    def _bind(self, copies: ComputeCopies) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                if id(p) not in copies.index:
                    raise ValueError("every parameter the optimizer steps must be one of ComputeCopies' parameters")
            if group.get("amsgrad") or group.get("maximize"):
                raise ValueError("MasterAdam / MasterAdamW step without amsgrad and maximize")
        self.copies, self._kernels, self._triton = copies, {}, _has_triton()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """torch's, with the masters in the parameters first: torch casts the moments to each parameter's dtype."""
        self.copies.use_masters()
        super().load_state_dict(state_dict)  # type: ignore[misc]  # torch.optim.Adam's, next in the MRO

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:  # noqa: D401  # torch's signature
        """Step the masters from the gradients and write the copies; `found_inf` / `grad_scale` attributes
        act as in torch's fused Adam (skip the whole update / divide every gradient)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.copies.use_masters()
        found_inf: torch.Tensor | None = getattr(self, "found_inf", None)
        grad_scale: torch.Tensor | None = getattr(self, "grad_scale", None)
        copies = self.copies
        for index, group in enumerate(self.param_groups):
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            for p in params:
                if not self.state[p]:
                    self.state[p]["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
                    self.state[p]["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    self.state[p]["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            states = [self.state[p] for p in params]
            grads = [p.grad for p in params]
            masters = [copies.masters[copies.index[id(p)]] for p in params]
            outs = [copies.copies[copies.index[id(p)]] for p in params]
            steps = [s["step"] for s in states]
            torch._foreach_add_(steps, 1)
            beta1, beta2 = group["betas"]
            hyper = {
                "lr": float(group["lr"]),
                "beta1": float(beta1),
                "beta2": float(beta2),
                "eps": group["eps"],
                "weight_decay": group["weight_decay"],
            }
            decoupled = bool(group.get("decoupled_weight_decay", False))
            exp_avgs, exp_avg_sqs = [s["exp_avg"] for s in states], [s["exp_avg_sq"] for s in states]
            by_dtype: dict[torch.dtype, list[int]] = {}  # bf16 gradients, and fp32 ones (norms, DCP's state init)
            for i, g in enumerate(grads):
                by_dtype.setdefault(g.dtype, []).append(i)
            for grad_dtype, picked in by_dtype.items():
                lists = [[xs[i] for i in picked] for xs in (grads, masters, exp_avgs, exp_avg_sqs, outs, steps)]
                self._step_tensors(index, grad_dtype, *lists, decoupled=decoupled, hyper=hyper,
                                   grad_scale=grad_scale, found_inf=found_inf)  # fmt: skip
            if found_inf is not None:
                torch._foreach_sub_(steps, [found_inf] * len(steps))
        copies.written()
        return loss

    def _step_tensors(
        self,
        index: int,
        grad_dtype: torch.dtype,
        grads: list[torch.Tensor],
        masters: list[torch.Tensor],
        exp_avgs: list[torch.Tensor],
        exp_avg_sqs: list[torch.Tensor],
        outs: list[torch.Tensor],
        steps: list[torch.Tensor],
        *,
        decoupled: bool,
        hyper: dict[str, Any],
        grad_scale: torch.Tensor | None,
        found_inf: torch.Tensor | None,
    ) -> None:
        """The update of one param group's tensors whose gradients share `grad_dtype`."""
        if masters[0].device.type == "cuda" and self._triton:
            numels = [m.numel() for m in masters]
            kernel = self._kernels.get((index, grad_dtype))
            if kernel is None or kernel.sizes != numels:  # built once; again if a parameter had no gradient
                from titan_parallel.adam_kernel import AdamKernel

                kernel = self._kernels[(index, grad_dtype)] = AdamKernel(numels, masters[0].device)
            kernel(grads, masters, exp_avgs, exp_avg_sqs, outs, steps, decoupled=decoupled,
                   grad_scale=grad_scale, found_inf=found_inf, **hyper)  # fmt: skip
            return
        fp32_grads = grads if grad_dtype == torch.float32 else [g.float() for g in grads]
        fused = torch._fused_adamw_ if decoupled else torch._fused_adam_
        fused(masters, fp32_grads, exp_avgs, exp_avg_sqs, [], steps, amsgrad=False, maximize=False,
              grad_scale=grad_scale, found_inf=found_inf, **hyper)  # fmt: skip
        torch._foreach_copy_(outs, masters)


def _has_triton() -> bool:
    import importlib.util

    return importlib.util.find_spec("triton") is not None


class MasterAdamW(_MasterStep, torch.optim.AdamW):
    """torch's AdamW (same state, same state dict) stepping `copies`' fp32 masters from compute-dtype
    gradients and writing the copies in the same pass.

    Args:
        params: the parameters, or param-group dicts (as torch's AdamW), all of them `copies`' parameters.
        copies: the model's `ComputeCopies`.
        **kwargs: torch.optim.AdamW's hyperparameters (lr, betas, eps, weight_decay).
    """

    def __init__(self, params: Iterable[Any], copies: ComputeCopies, **kwargs: Any):
        torch.optim.AdamW.__init__(self, params, fused=True, **kwargs)
        self._bind(copies)


class MasterAdam(_MasterStep, torch.optim.Adam):
    """`MasterAdamW` with torch's Adam (L2 weight decay added to the gradient).

    Args:
        params: the parameters, or param-group dicts, all of them `copies`' parameters.
        copies: the model's `ComputeCopies`.
        **kwargs: torch.optim.Adam's hyperparameters.
    """

    def __init__(self, params: Iterable[Any], copies: ComputeCopies, **kwargs: Any):
        torch.optim.Adam.__init__(self, params, fused=True, **kwargs)
        self._bind(copies)
