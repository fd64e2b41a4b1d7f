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
    """

    def __init__(
        self, parts: Iterable[nn.Module], all_names: Iterable[str], blocks: str, pp_mesh: DeviceMesh | None = None
    ):
        self.groups = list(dict.fromkeys(norm_group(name, blocks) for name in all_names))
        index = {group: i for i, group in enumerate(self.groups)}
        self.params: list[list[nn.Parameter]] = [[] for _ in self.groups]
        for part in parts:
            for name, param in part.named_parameters():
                self.params[index[norm_group(name, blocks)]].append(param)
        self.pp_mesh = pp_mesh
        self.grad_norms: torch.Tensor | None = None

    def record_grads(self) -> None:
        """Take the gradients' norms now (a collective on every rank: call it at the same point on all of them)."""
        grads = [[p.grad for p in params if p.grad is not None] for params in self.params]
        self.grad_norms = grouped_norms(grads, pp_mesh=self.pp_mesh)

    def metrics(self) -> dict[str, float]:
        """The parameters' norms now (a collective) and the gradients' last recorded, read on the host (one sync);
        then forgets the gradients' (a step they were not recorded for reports parameters only)."""
        with torch.no_grad():
            params: Sequence[Sequence[torch.Tensor]] = [[p.detach() for p in group] for group in self.params]
            param_norms = grouped_norms(params, pp_mesh=self.pp_mesh)
        values = {f"param_norm/{g}": v for g, v in zip(self.groups, param_norms.tolist(), strict=True)}
        if self.grad_norms is not None:
            values |= {f"grad_norm/{g}": v for g, v in zip(self.groups, self.grad_norms.tolist(), strict=True)}
            self.grad_norms = None
        return values
