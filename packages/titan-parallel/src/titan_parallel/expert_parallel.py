"""Expert parallel: the experts of each Mixture-of-Experts layer split over the `ep` mesh.

Rank r of an `ep`-rank group holds experts `r * E/ep ... (r + 1) * E/ep - 1` (dim 0 of the
stacked weights `w1`, `w2`, `w3` becomes `Shard(0)` on the `ep` mesh, so checkpoints keep
the full expert tensors and reshard across degrees). The model's MoE layer calls its
experts with the token slots already sorted by expert and the count per expert; here that
call is wrapped (`distribute_module`'s input and output functions):

    dispatch: counts per (destination rank, local expert) by one all-to-all, then the
              token slots by one all-to-all (`all_to_all_single_autograd`: backward runs
              the reverse exchange), regrouped from (source rank, expert) to (expert, source)
    compute:  the local experts on what arrived (one grouped matmul per weight)
    combine:  the inverse regrouping and the reverse all-to-all, back in the caller's order

Routing stays on the rank that owns the tokens, so each layer's `tokens_per_expert` counts
that rank's tokens, the same as without expert parallel. With tensor parallel too
(`TPStyle.MOE_INPUT`), every TP rank routes the same all-gathered tokens and runs them through
its slice of each expert's hidden dim: the experts are 2-D DTensors on the `(ep, tp)` mesh,
`(Shard(0), Shard(hidden))`, and each `ep` group is the ranks of one TP coordinate, which
exchange the same tokens as their TP peers do (each rank's results are its slice's partial sums,
which the MoE's TP style reduce-scatters).

When the TP ranks join expert parallel instead (`ParallelDims.etp=1`, torchtitan's ETP=1), the `ep` mesh
spans them and the experts stay whole: each TP rank routes its own sequence shard's tokens and exchanges
them over that larger group (`tensor_parallel.MoETokenParallel`).

Written here because torch has no expert-parallel style (torchtitan's is its own too).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed._functional_collectives import all_to_all_single_autograd
from torch.distributed.device_mesh import DeviceMesh

from titan_parallel.layout import ParallelConfigError
from titan_parallel.modules import get_submodule_or_none, iter_blocks
from titan_parallel.plan import ModelPlan, TPStyle
from titan_parallel.tensor_parallel_layout import MOE_TP_SPLITS

if TYPE_CHECKING:
    from titan_parallel.mesh import ParallelMesh

EXPERT_WEIGHTS = ("w1", "w2", "w3")


def moe_modules(model: nn.Module, plan: ModelPlan) -> list[nn.Module]:
    """The Mixture-of-Experts modules of `model`'s blocks (`plan.moe`), in forward order.

    Args:
        model: the model or pipeline stage.
        plan: its plan; `plan.moe` names the MoE module inside a block (None: a dense model).
    """
    if plan.moe is None:
        return []
    found = (get_submodule_or_none(block, plan.moe) for block in iter_blocks(model, plan))
    return [m for m in found if m is not None]


def check_ep(model: nn.Module, plan: ModelPlan, ep: int) -> None:
    """Raise `ParallelConfigError` (arguments `("ep",)`) unless `model`'s experts split `ep` ways.

    Args:
        model: the model (meta is fine).
        plan: its plan; `plan.moe` names the MoE modules.
        ep: the expert-parallel degree.
    """
    if ep == 1:
        return
    layers = moe_modules(model, plan)
    if not layers and plan.moe is None:
        raise ParallelConfigError(
            f"ep={ep} but model {type(model).__name__} has no Mixture-of-Experts layers (ModelPlan.moe); set ep=1",
            arguments=("ep",),
        )
    for moe in layers:
        experts = moe.get_submodule("experts").get_parameter("w1").shape[0]
        if experts % ep:
            raise ParallelConfigError(
                f"ep={ep} does not divide the {experts} experts of each MoE layer; choose a divisor", arguments=("ep",)
            )


class ExpertDispatch:
    """The input and output functions that send one `GroupedExperts` call's token slots to the
    ranks holding their experts and bring the results back (see the module docstring).

    Args:
        ep_mesh: the expert-parallel mesh (1-D, or `(ep, tp)`: the exchange runs over dim 0); rank r
            of it holds the r-th block of experts.
    """

    def __init__(self, ep_mesh: DeviceMesh):
        self.group = ep_mesh.get_group(0)
        self.ep = ep_mesh.size(0)
        self._pending: list[tuple[list[int], list[int], torch.Tensor]] = []

    def dispatch(self, module: nn.Module, inputs: tuple[torch.Tensor, torch.Tensor], mesh: DeviceMesh):
        x, counts = inputs  # x: (slots, dim) grouped by global expert; counts: (experts,) int64
        send = counts.view(self.ep, -1)  # (ep, local experts): slots for each rank's experts
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send, group=self.group)  # recv[s, j]: slots from rank s for local expert j
        send_splits, recv_splits = send.sum(dim=1).tolist(), recv.sum(dim=1).tolist()
        arrived = all_to_all_single_autograd(
            x, recv_splits, send_splits, self.group
        )  # (arrived, dim), by (source, expert)
        order = _source_major_to_expert_major(recv, sum(recv_splits))
        self._pending.append((send_splits, recv_splits, order))
        return arrived[order], recv.sum(dim=0)  # grouped by local expert; (local experts,) counts

    def combine(self, module: nn.Module, out: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
        send_splits, recv_splits, order = self._pending.pop()
        back = out[order.argsort()]  # (arrived, dim), by (source, expert) again
        return all_to_all_single_autograd(back, send_splits, recv_splits, self.group)


def _source_major_to_expert_major(recv: torch.Tensor, total: int) -> torch.Tensor:
    """Row order that regroups slots laid out by (source rank, local expert) into (local expert, source rank).

    Args:
        recv: `(sources, local experts)` slot counts.
        total: their sum (known on the host already: no extra synchronisation).
    """
    flat = recv.flatten()
    starts = (torch.cumsum(flat, 0) - flat).view_as(recv)  # where each (source, expert) chunk starts on arrival
    sizes, firsts = recv.t().flatten(), starts.t().flatten()  # the chunks in (expert, source) order
    # Row i of chunk c (in the new order) comes from arrival row firsts[c] + i.
    shift = torch.repeat_interleave(firsts - (torch.cumsum(sizes, 0) - sizes), sizes, output_size=total)
    return shift + torch.arange(total, device=recv.device)


def experts_split_by_tp(plan: ModelPlan) -> bool:
    """Whether tensor parallel splits the experts' hidden dim (the plan marks the MoE `TPStyle.MOE_INPUT`).

    Args:
        plan: the model's plan.
    """
    return plan.moe is not None and (plan.moe, TPStyle.MOE_INPUT) in plan.block_tp


def ep_tp_mesh(ep_mesh: DeviceMesh, tp_mesh: DeviceMesh) -> DeviceMesh:
    """The 2-D `(ep, tp)` mesh of experts split by expert and, over `tp_mesh`, by hidden dim.

    Args:
        ep_mesh: the 1-D expert-parallel mesh (`mesh["ep"]`).
        tp_mesh: the 1-D tensor-parallel mesh (`mesh["tp"]`), of the same root mesh.
    """
    concatenate = getattr(DeviceMesh, "_concatenate", None)
    if concatenate is not None:
        return concatenate([ep_mesh, tp_mesh])
    root = ep_mesh._get_root_mesh()  # torch without `_concatenate`: slice the root by the dims' names
    return root[(ep_mesh.mesh_dim_names or ("ep",))[0], (tp_mesh.mesh_dim_names or ("tp",))[0]]


def apply_ep(model: nn.Module, plan: ModelPlan, ep_mesh: DeviceMesh) -> nn.Module:
    """Split every MoE layer's experts over `ep_mesh` in place (`Shard(0)`) and route their calls
    through all-to-alls. Call before FSDP and tensor parallel. Works on the meta device.

    Args:
        model: the model or pipeline stage.
        plan: its plan (`plan.moe` names the MoE modules).
        ep_mesh: the 1-D expert-parallel mesh, `mesh["ep"]`; or, when tensor parallel splits the experts'
            hidden dim too (`experts_split_by_tp`), the 2-D `(ep, tp)` mesh of `ep_tp_mesh`: the weights
            become `(Shard(0), Shard(hidden))` and the tokens are exchanged over dim 0.
    """
    check_ep(model, plan, ep_mesh.size(0))
    from torch.distributed.tensor import Shard, distribute_module, distribute_tensor  # here: `check_ep` stays light

    def partition(name: str, module: nn.Module, device_mesh: DeviceMesh) -> None:
        for weight_name in EXPERT_WEIGHTS:
            weight = getattr(module, weight_name, None)
            if weight is not None:
                placements = [Shard(0)]
                if device_mesh.ndim == 2:
                    placements.append(Shard(MOE_TP_SPLITS[f"experts.{weight_name}"]))
                module.register_parameter(weight_name, nn.Parameter(distribute_tensor(weight, device_mesh, placements)))

    for moe in moe_modules(model, plan):
        exchange = ExpertDispatch(ep_mesh)
        # torch types distribute_module's input_fn/output_fn as returning None; they return the new inputs/outputs
        distribute_module(
            moe.get_submodule("experts"),
            ep_mesh,
            partition,
            input_fn=exchange.dispatch,
            output_fn=exchange.combine,  # type: ignore[arg-type]
        )
    return model


def set_sequence_group(model: nn.Module, plan: ModelPlan, group: dist.ProcessGroup) -> None:
    """Give every MoE layer with a `sequence_group` attribute `group`: the ranks holding the other parts of the
    sequences it routes (per-sequence statistics such as the auxiliary balance loss count them all).

    Args:
        model: the model or pipeline stage.
        plan: its plan (`plan.moe` names the MoE modules).
        group: the process group, e.g. the `cp x tp` ranks when the TP ranks route their own tokens.
    """
    for moe in moe_modules(model, plan):
        if hasattr(moe, "sequence_group"):
            cast(Any, moe).sequence_group = group


def routing_mesh(mesh: ParallelMesh) -> DeviceMesh:
    """The ranks that route different tokens, whose MoE token counts sum to the global batch's: `dp_cp`, and
    the TP ranks too when they join expert parallel (`dp_cp_tp`; else every TP rank routes the same tokens).

    Args:
        mesh: the job's mesh (`ParallelDims.build_mesh`).
    """
    return mesh["dp_cp_tp"] if mesh.dims.ep_spans_tp else mesh["dp_cp"]


def is_expert_parallel(module: nn.Module) -> bool:
    """Whether a `GroupedExperts` already has its weights split (by `apply_ep`).

    Args:
        module: the experts module.
    """
    from torch.distributed.tensor import DTensor

    return any(isinstance(getattr(module, name, None), DTensor) for name in EXPERT_WEIGHTS)
