"""Each block's gradient and parameter norms (`metrics.per_layer_norms`): which layer a loss spike or a growing
gradient norm comes from.

The parameters are grouped by where they sit in the model: each block of `plan.blocks` (`layers.3`), and each
other top-level module (`tok_embeddings`, `norm`, `output`); names are the model's own, wrappers stripped
(`titan_parallel.canonical_name`). The group list comes from the whole model (built on the meta device), so every
rank holds the same list in the same order whatever its pipeline stage, and `titan_parallel.grouped_norms` takes
all of a kind's norms in one all-reduce per mesh dim.

The gradients' norms are recorded inside the step, after the backward and before clipping (`StepRunner`'s
`grad_observer`, set on log steps only: no cost on the others), as device tensors; the parameters' after the
update, when the step's values are read. Logged as `grad_norm/<group>` and `param_norm/<group>` (TensorBoard,
metrics.jsonl, W&B; not on the console line).

With `metrics.per_layer_updates` the weights are also copied where the gradients' norms are taken (this rank's
shards, on log steps only) and the step's update is measured against them when the step's values are read:
`update_norm/<group>` (`||w_after - w_before||`) and `update_ratio/<group>` (that over `||w_after||`), the
quantity muP keeps alike across widths and a quick sign of a layer that has stopped learning or is updated far
too hard (1e-3 per step is the usual rule of thumb under Adam).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from titan_parallel import canonical_name, grouped_norms

__all__ = ["LayerNorms", "norm_group"]


def norm_group(name: str, blocks: str) -> str:
    """The group of parameter `name` (wrappers stripped): `<blocks>.<index>` inside a block, else its top-level module.

    Args:
        name: a parameter's name in the model.
        blocks: the blocks' container (`ModelPlan.blocks`, e.g. "layers").
    """
    parts = canonical_name(name).split(".")
    if parts[0] == blocks and len(parts) > 2:
        return f"{blocks}.{parts[1]}"
    return parts[0]


class LayerNorms:
    """Per-group gradient and parameter L2 norms of this rank's model parts, global over every layout.

    Args:
        parts: this rank's model parts (pipeline stages, or the one model).
        all_names: every parameter name of the whole model, in its order (from a meta-device build).
        blocks: the blocks' container name (`ModelPlan.blocks`).
        pp_mesh: the pipeline mesh when the model is pipelined, else None.
        updates: also measure each step's update (`metrics.per_layer_updates`).
        copies: parameters copying a weight another stage counts (`SharedWeights.copies`): skipped.
    """

    def __init__(
        self,
        parts: Iterable[nn.Module],
        all_names: Iterable[str],
        blocks: str,
        pp_mesh: DeviceMesh | None = None,
        updates: bool = False,
        copies: Iterable[nn.Parameter] = (),
    ):
        self.groups = list(dict.fromkeys(norm_group(name, blocks) for name in all_names))
        index = {group: i for i, group in enumerate(self.groups)}
        self.params: list[list[nn.Parameter]] = [[] for _ in self.groups]
        skip = {id(p) for p in copies}
        for part in parts:
            for name, param in part.named_parameters():
                if id(param) in skip:
                    continue
                self.params[index[norm_group(name, blocks)]].append(param)
        self.pp_mesh = pp_mesh
        self.grad_norms: torch.Tensor | None = None
        self.updates = updates
        self.before: list[list[torch.Tensor]] | None = None  # the weights before the step, when updates are measured

    def record_grads(self) -> None:
        """Take the gradients' norms now (a collective on every rank: call it at the same point on all of them), and
        with `updates` copy the weights the optimizer is about to change."""
        grads = [[p.grad for p in params if p.grad is not None] for params in self.params]
        self.grad_norms = grouped_norms(grads, pp_mesh=self.pp_mesh)
        if self.updates:
            with torch.no_grad():
                self.before = [[p.detach().clone() for p in params] for params in self.params]

    def metrics(self) -> dict[str, float]:
        """The parameters' norms now (a collective) and the gradients' last recorded, read on the host (one sync);
        then forgets the gradients' (a step they were not recorded for reports parameters only)."""
        with torch.no_grad():
            params: Sequence[Sequence[torch.Tensor]] = [[p.detach() for p in group] for group in self.params]
            param_norms = grouped_norms(params, pp_mesh=self.pp_mesh)
        values = {f"param_norm/{g}": v for g, v in zip(self.groups, param_norms.tolist(), strict=True)}
        if self.before is not None:
            with torch.no_grad():
                deltas = [
                    [p.detach() - old for p, old in zip(group, before, strict=True)]
                    for group, before in zip(self.params, self.before, strict=True)
                ]
                update_norms = grouped_norms(deltas, pp_mesh=self.pp_mesh).tolist()
            self.before = None
            for g, update, weight in zip(self.groups, update_norms, param_norms.tolist(), strict=True):
                values[f"update_norm/{g}"] = update
                values[f"update_ratio/{g}"] = update / weight if weight > 0 else 0.0
        if self.grad_norms is not None:
            values |= {f"grad_norm/{g}": v for g, v in zip(self.groups, self.grad_norms.tolist(), strict=True)}
            self.grad_norms = None
        return values
