"""An exponential moving average of the weights (`[ema]`): `ema = decay * ema + (1 - decay) * weights` after every
applied optimizer step, in fp32, sharded as the parameters are (FSDP, TP, EP, pipeline stages: each rank averages
its own shards, no communication).

Torch has `torch.optim.swa_utils.AveragedModel`, which keeps a second copy of the whole module (deep-copied, so on
FSDP or TP a second set of DTensor wrappers and hooks) and updates it one parameter at a time; here the average is a
plain dict of tensors beside the parameters, updated in one multi-tensor `lerp` on the local shards, and checkpointed
through `titan_ckpt`'s tensor states (`ema.<name>` in every checkpoint, model-only saves included, resharded on
load like the weights).

It starts from the weights training starts from (the initialised model, or the checkpoint's weights when a
checkpoint without an average is loaded) and skips a step whose update the run guard dropped (`found_inf`, on the
device: no host sync). With `warmup` the decay ramps up as `min(decay, (1 + step) / (10 + step))`
(TensorFlow's `ExponentialMovingAverage(num_updates=step)`), so the average of a short run is not mostly the
initial weights (whose share after t steps is the product of the decays: 0.999^t without it).
`titan convert --ema` exports the average instead of the weights; `swapped()` puts it in the model for a while
(validation on the averaged weights, `ema.validation`), and the weights back exactly.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from titan_parallel import canonical_name

__all__ = ["WeightEMA"]


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


class WeightEMA:
    """The moving average of this rank's parameters, by their model names (wrappers stripped).

    Args:
        parts: this rank's model parts (the model, or its pipeline stages), initialised.
        decay: the average's decay per step, in [0, 1).
        warmup: ramp the decay up with the step number (`decay_at`).
    """

    def __init__(self, parts: Iterable[nn.Module], decay: float, warmup: bool = False):
        if not 0.0 <= decay < 1.0:
            raise ValueError(f"WeightEMA decay={decay} must be in [0, 1)")
        self.decay, self.warmup = decay, warmup
        self.params = {canonical_name(name): p for part in parts for name, p in part.named_parameters()}
        with torch.no_grad():  # fp32 whatever the weights' dtype; DTensors keep their placements
            self.average = {name: p.detach().float().clone() for name, p in self.params.items()}
        self.loaded = False  # whether a checkpoint's average was loaded (else it restarts from the weights)
        self._pairs = [(_local(self.average[name]), _local(p)) for name, p in self.params.items()]

    def decay_at(self, step: int) -> float:
        """The decay applied after step `step` (1-based): `decay`, or with `warmup` `min(decay, (1+step) / (10+step))`.

        Args:
            step: the training step just taken.
        """
        return min(self.decay, (1 + step) / (10 + step)) if self.warmup else self.decay

    @torch.no_grad()
    def update(self, found_inf: torch.Tensor | None = None, step: int = 0) -> None:
        """Move the average toward the weights just updated; a step whose update was dropped (`found_inf` 1, on the
        device) leaves it unchanged.

        Args:
            found_inf: the run guard's verdict on the device (1: the update was dropped), or None.
            step: the training step just taken (1-based), for the warm-up.
        """
        averages = [a for a, _ in self._pairs]
        weights = [p if p.dtype == torch.float32 else p.float() for _, p in self._pairs]
        decay = self.decay_at(step)
        if found_inf is None:
            torch._foreach_lerp_(averages, weights, 1.0 - decay)
        else:
            weight = (1.0 - decay) * (1.0 - found_inf.float())  # 0 on a dropped step
            torch._foreach_lerp_(averages, weights, [weight] * len(averages))

    @torch.no_grad()
    def restart(self) -> None:
        """Set the average to the weights (after a checkpoint without one was loaded)."""
        torch._foreach_copy_([a for a, _ in self._pairs], [p.float() for _, p in self._pairs])

    @contextmanager
    def swapped(
        self, *, prepare: Callable[[], None] | None = None, refresh: Callable[[], None] | None = None
    ) -> Iterator[None]:
        """Inside the block the model's parameters hold the average (cast to their dtype); after it, the weights
        they held, bit for bit. Costs one more copy of this rank's parameter shards meanwhile.

        Args:
            prepare: called before each write, so that the parameters hold what the optimizer updates and no
                derived copy outlives them (the fp32 masters in place of the compute copies; FSDP's all-gathered
                parameters freed, which a module that keeps them after its forward would otherwise reuse).
            refresh: called after each write, for state derived from the weights (float8's precomputed scales).
        """
        params = [p for _, p in self._pairs]
        if prepare is not None:
            prepare()
        with torch.no_grad():
            kept = [p.clone() for p in params]
            torch._foreach_copy_(params, [a for a, _ in self._pairs])
        if refresh is not None:
            refresh()
        try:
            yield
        finally:
            if prepare is not None:
                prepare()
            with torch.no_grad():
                torch._foreach_copy_(params, kept)
            if refresh is not None:
                refresh()

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The live averages (`titan_ckpt.TensorStateful`): saved as they are, loaded into in place."""
        return self.average

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        for name, value in state.items():
            if value is not self.average[name]:
                self.average[name].copy_(value)
        self.loaded = True
