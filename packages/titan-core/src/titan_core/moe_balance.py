"""Load balancing of Mixture-of-Experts layers: global token counts, expert-bias update, metrics.

Each MoE layer counts the token slots its router sent to each expert (`tokens_per_expert`).
After a step's backward, `ExpertLoadBalancer.after_backward` sums those counts over every
data-parallel and context-parallel rank (one all-reduce for all layers), so each layer
sees the load of the whole global batch, as one process would. Then, for a step that
updates the model, each layer's `expert_bias` moves by `load_balance_coeff` towards even
load (DeepSeek-V3's auxiliary-loss-free balancing):

    bias += coeff * sign(mean(load) - load),  re-centred to mean 0

The bias only changes which experts are chosen, never the weights of their outputs.

Across torchft replica groups (`fault_tolerance.enable`, per step) the counts are averaged with the gradients
(`step_tensors`) and scaled back to sums, so every group's biases move as one process's would; with DiLoCo each
group's biases follow its own tokens between syncs, and each sync averages them (`titan_core.diloco`).

A layer with a balance loss or a router z-loss (`MoEArgs.aux_loss_coeff`, `router_z_loss_coeff`)
also holds the step's weighted values (`MoE.aux_losses`); they travel in the same all-reduce,
averaged over the group, and the logs show their sums over layers as `moe/aux_loss` and
`moe/router_z_loss`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

import torch
import torch.distributed as dist
import torch.nn as nn

from titan_parallel.modules import get_submodule_or_none
from titan_parallel.plan import ModelPlan

if TYPE_CHECKING:
    from titan_models.moe import MoE


class ExpertLoadBalancer:
    """Reads and resets every MoE layer's token counts once per step.

    Args:
        parts: this rank's model parts (pipeline stages).
        plan: the model's plan (`plan.blocks`, `plan.moe`).
        group: the ranks that route different tokens, which the counts are summed over
            (`titan_parallel.expert_parallel.routing_mesh`: data x context parallel; tensor-parallel peers
            route the same tokens and are left out, unless they join expert parallel, `etp=1`).
        pp_group: under pipeline parallel, the pipeline's process group: `metrics` gathers every
            stage's layers (call it on every rank).
    """

    def __init__(
        self,
        parts: list[nn.Module],
        plan: ModelPlan,
        group: dist.ProcessGroup | None,
        pp_group: dist.ProcessGroup | None = None,
    ):
        self.group = group
        self.pp_group = pp_group if plan.moe is not None else None  # a dense model gathers nothing
        self.layers: list[tuple[str, MoE]] = []  # (block name, MoE module), in forward order
        for part in parts if plan.moe is not None else ():
            container = get_submodule_or_none(part, plan.blocks)
            for name, block in container.named_children() if container is not None else ():
                moe = get_submodule_or_none(block, plan.moe or "")
                if moe is not None:
                    self.layers.append((name, cast("MoE", moe)))
        self.last_counts: torch.Tensor | None = None  # (layers, experts) global counts of the last step
        # which auxiliary losses the layers add: (balance loss, router z-loss)
        self.aux_on = (
            any(moe.args.aux_loss_coeff > 0 for _, moe in self.layers),
            any(moe.args.router_z_loss_coeff > 0 for _, moe in self.layers),
        )
        self.last_aux: torch.Tensor | None = None  # (layers, 2) the last step's, averaged over the group

    def step_tensors(self) -> list[torch.Tensor]:
        """This rank's counts of the step (and auxiliary losses), in place: what torchft's replica groups average
        with the gradients before `after_backward` (`replica_groups`)."""
        aux = any(self.aux_on)
        return [t for _, moe in self.layers for t in (moe.tokens_per_expert, *((moe.aux_losses,) if aux else ()))]

    @torch.no_grad()
    def after_backward(self, found_inf: torch.Tensor | None = None, replica_groups: int = 1) -> None:
        """Sum this step's counts over the group, update the biases unless the step's update is dropped, reset.

        Args:
            found_inf: the run guard's verdict on the device (1.0: the update is dropped, the biases stay);
                None: update. Read on the device only, so a good step waits for nothing.
            replica_groups: the torchft replica groups `step_tensors` were averaged over this step (their mean
                times this is their sum); 1: none.
        """
        if not self.layers:
            return
        counts = torch.stack([moe.tokens_per_expert for _, moe in self.layers])  # (layers, experts)
        if replica_groups > 1:  # whole tokens again: the mean over the groups, rounded after the product
            counts = counts.mul_(replica_groups).round_()
        aux = any(self.aux_on)
        if aux:  # two more columns, in the same all-reduce
            counts = torch.cat([counts, torch.stack([moe.aux_losses for _, moe in self.layers])], dim=1)
        ranks = dist.get_world_size(self.group) if self.group is not None else 1
        if ranks > 1:
            dist.all_reduce(counts, group=self.group)
        if aux:
            counts, self.last_aux = counts[:, :-2], counts[:, -2:] / ranks
            for _, moe in self.layers:
                moe.aux_losses.zero_()
        for (_, moe), load in zip(self.layers, counts, strict=True):
            coeff = moe.args.load_balance_coeff
            if coeff is not None:
                delta = coeff * torch.sign(load.mean() - load)
                delta = delta - delta.mean()
                moe.expert_bias.add_(delta if found_inf is None else delta * (1 - found_inf))
            moe.tokens_per_expert.zero_()
        self.last_counts = counts

    @torch.no_grad()
    def reset(self) -> None:
        """Forget counts gathered outside training (e.g. by a validation pass)."""
        for _, moe in self.layers:
            moe.tokens_per_expert.zero_()
            moe.aux_losses.zero_()

    def metrics(self) -> dict[str, object]:
        """The last step's load, for the logs (every stage's layers under pipeline parallel).

        `moe/max_load`: over all layers, the busiest expert's tokens over the mean (1 = even);
        `moe/layer{L}/max_load`, `moe/layer{L}/min_load`: per layer, busiest and idlest expert over the
        mean; `moe/tokens_per_expert`: `{layer: [tokens of each expert]}` (metrics.jsonl only);
        `moe/aux_loss` and `moe/router_z_loss`, with a balance loss or router z-loss: its weighted value summed
        over the layers (the step's mean over micro-batches and ranks), what it adds to the training objective
        beside `loss/global_avg`.
        """
        counts: dict[str, list[int]] = {}
        aux: dict[str, list[float]] = {}
        if self.last_counts is not None:
            counts = {
                name: [int(c) for c in row]
                for (name, _), row in zip(self.layers, self.last_counts.tolist(), strict=True)
            }
        if self.last_aux is not None:
            aux = {name: pair for (name, _), pair in zip(self.layers, self.last_aux.tolist(), strict=True)}
        aux_on = self.aux_on
        if self.pp_group is not None and dist.get_world_size(self.pp_group) > 1:
            stages: list[tuple[dict[str, list[int]], dict[str, list[float]], tuple[bool, bool]]] = [
                ({}, {}, (False, False)) for _ in range(dist.get_world_size(self.pp_group))
            ]
            dist.all_gather_object(stages, (counts, aux, aux_on), group=self.pp_group)
            counts = {name: row for stage, _, _ in stages for name, row in stage.items()}
            aux = {name: pair for _, stage, _ in stages for name, pair in stage.items()}
            aux_on = (any(on[0] for _, _, on in stages), any(on[1] for _, _, on in stages))
        if not counts:
            return {}
        counts = dict(sorted(counts.items(), key=lambda item: int(item[0]) if item[0].isdigit() else item[0]))
        loads: dict[str, float] = {}
        for name, row in counts.items():
            mean = max(sum(row) / len(row), 1e-9)
            loads[f"moe/layer{name}/max_load"] = max(row) / mean
            loads[f"moe/layer{name}/min_load"] = min(row) / mean
        return {
            **loads,
            "moe/max_load": max(v for k, v in loads.items() if k.endswith("/max_load")),
            "moe/tokens_per_expert": counts,
            **({"moe/aux_loss": sum(pair[0] for pair in aux.values())} if aux_on[0] and aux else {}),
            **({"moe/router_z_loss": sum(pair[1] for pair in aux.values())} if aux_on[1] and aux else {}),
        }
