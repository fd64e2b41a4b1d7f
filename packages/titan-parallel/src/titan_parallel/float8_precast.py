"""Float8 weights cast once per optimizer step, not in every forward, recompute and backward.

torchao's tensorwise `Float8Linear` casts its high-precision weight to float8 where it needs
it: in the forward, again in an activation-checkpoint recompute, and again in the backward for
the input gradient. Each cast reads the weight twice (its amax, then the cast) and writes the
float8 bytes. When FSDP all-gathers in float8 the gathered weight already is float8 and torchao
skips those casts; on one GPU with master weights (`titan_parallel.master_weights`) nothing
gathers, so every step paid them three times over.

`PrecastFloat8Weights` keeps one float8 copy (e4m3, one scale) of every tensorwise
`Float8Linear` weight, recast when the compute copies change (after an optimizer step, a
checkpoint load): every amax in one multi-tensor kernel, then one cast per weight. The linears
then hand torchao that copy, wrapped as the `Float8TrainingTensor` its matmul takes as "already
cast" (as FSDP's float8 all-gather does), and gradients flow to the weight unchanged. The
values are the ones torchao would compute from the same bf16 copy (its amax, its float64
scale, its saturation), so the training is the same bit for bit (`tests/test_master_weights.py`).

Titan keeps this because torchao's precomputed scales exist only for FSDP's float8 all-gather
(`precompute_float8_dynamic_scale_for_fsdp`); it uses torchao's own tensor and matmul.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from titan_parallel.float8 import import_torchao, is_tensorwise_float8
from titan_parallel.float8_matmul import E4M3, amax_to_scale, cast_to_float8
from titan_parallel.master_weights import ComputeCopies

__all__ = ["PrecastFloat8Weights"]


class _AlreadyCast(torch.autograd.Function):
    """The weight's float8 copy as torchao's `Float8TrainingTensor`; its gradient goes to the weight as is."""

    @staticmethod
    def forward(ctx: Any, weight: torch.Tensor, data: torch.Tensor, scale: torch.Tensor, mm_config: Any) -> Any:
        from torchao.float8.float8_training_tensor import Float8TrainingTensor, GemmInputRole

        return Float8TrainingTensor(data, scale, weight.dtype, mm_config, GemmInputRole.WEIGHT)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        return grad, None, None, None


def _precast_forward(self: nn.Module, input: torch.Tensor) -> torch.Tensor:
    """torchao's `Float8Linear.forward` with the weight's float8 copy in place of the weight."""
    from torchao.float8.float8_linear import matmul_with_hp_or_float8_args

    weight = _AlreadyCast.apply(self.weight, self.float8_weight, self.float8_scale, self.linear_mm_config)
    output = matmul_with_hp_or_float8_args.apply(input, weight.t(), self.linear_mm_config, self.config)
    if self.bias is not None:
        output = output + self.bias.to(output.dtype)
    return output


class PrecastFloat8Weights:
    """One float8 copy of every tensorwise `Float8Linear` weight of `parts`, recast when `copies` change.

    Build it after `ComputeCopies` (its forward pre-hook must run first, to put the copies in place).

    Args:
        parts: the model parts `copies` serves (float8 linears converted by `apply_float8`).
        copies: the parts' compute copies (`titan_parallel.master_weights`).
        compiled: cast each weight in one Inductor kernel (CUDA); else eager, in blocks.
    """

    def __init__(self, parts: Sequence[nn.Module], copies: ComputeCopies, *, compiled: bool = False):
        import_torchao("torchao.float8")
        self.copies, self.compiled = copies, compiled
        self.linears: list[nn.Linear] = [
            m
            for part in parts
            for m in part.modules()
            if isinstance(m, nn.Linear) and is_tensorwise_float8(m) and not isinstance(m.weight, DTensor)
        ]
        self.data = [torch.empty_like(m.weight, dtype=E4M3) for m in self.linears]
        self.scales = [torch.ones((), device=m.weight.device) for m in self.linears]
        for m, data, scale in zip(self.linears, self.data, self.scales, strict=True):
            m.register_buffer("float8_weight", data, persistent=False)
            m.register_buffer("float8_scale", scale, persistent=False)
            m.forward = _precast_forward.__get__(m)  # type: ignore[method-assign]
        self._generation: int | None = None
        for part in parts:
            part.register_forward_pre_hook(lambda *_: self.refresh())

    def refresh(self) -> None:
        """Recast every weight if the compute copies changed since the last cast."""
        self.copies.use_copies()  # cast the compute copies, as torchao would (a no-op inside a forward)
        if self._generation == self.copies.generation or not self.linears:
            return
        with torch.no_grad():
            weights = [m.weight for m in self.linears]
            amaxes = torch.stack([a.float() for a in torch._foreach_norm(weights, float("inf"))])
            scales = amax_to_scale(amaxes, E4M3)
            torch._foreach_copy_(self.scales, list(scales.unbind()))
            for weight, data, scale in zip(weights, self.data, self.scales, strict=True):
                cast_to_float8(weight, scale, E4M3, compiled=self.compiled, out=data)
        self._generation = self.copies.generation
