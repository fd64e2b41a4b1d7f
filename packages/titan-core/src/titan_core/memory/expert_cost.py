"""Expert parallel's share of the step-time model (`titan_core.memory.step_cost`): the all-to-all that sends
each token's expert slots to the ranks holding those experts and brings the results back.

Tensor parallel splits the experts' hidden dim (`TPStyle.MOE_INPUT`), so a MoE layer's compute divides over
the TP ranks as a dense feed-forward's does (each TP rank routes the same tokens: the router, `experts x dim`
per token, is the only part it repeats, left out), and so do the experts' weights.

With `Layout.ep_spans_tp` (`expert_tensor_parallel_degree = 1`) the TP ranks join expert parallel instead:
each routes its own `1 / tp` of the sequence shard to whole experts, so its all-to-alls carry `1 / tp` of the
slots, and the `ep` group is `dp_shard_in_ep x cp x tp`, consecutive ranks; the ranks holding the same experts
are `ep` apart.

Pure arithmetic, no torch; `step_cost` imports this module, so this one reads its `Layout`,
`Workload` and `Cluster` by attribute only. Under expert parallel the mesh is
`(pp, dp_replicate, dp_shard_mod_ep, dp_shard_in_ep, cp, tp)` (`titan_parallel.mesh`): an `ep`
group is `dp_shard_in_ep x cp`, ranks `tp` apart; the ranks that hold the same experts, which
FSDP shards them over, are `dp_shard_mod_ep`, `tp x ep` apart.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from titan_core.memory.step_cost import Cluster, Layout, Workload


@dataclass(frozen=True)
class MoEWork:
    """The Mixture-of-Experts layers of a model, as plain numbers (`Workload.moe`; all 0 for a dense model).

    Args:
        expert_params: parameters of the routed experts of every MoE layer: what expert parallel splits.
        num_experts: routed experts per MoE layer.
        top_k: experts each token is routed to.
        layers: MoE blocks.
        shared: whether the layers have shared experts (under `Layout.ep_spans_tp` those still take TP's
            all-gather and reduce-scatter).
    """

    expert_params: int = 0
    num_experts: int = 0
    top_k: int = 0
    layers: int = 0
    shared: bool = False


EP_EXPOSED = 1.0
"""Share of expert parallel's all-to-alls on the critical path: the experts wait for the dispatch and the rest of
the block for the combine; Titan does not overlap them with other work (as DeepEP's or DualPipe's kernels do)."""

ALL_TO_ALLS_PER_LAYER = {"none": 4, "op": 6, "full": 6, "budget": 4}
"""All-to-alls per MoE layer and micro-batch: dispatch and combine forward, their reverses backward, and under
activation checkpointing the recomputed forward's two again (selective "op" keeps no all-to-all output:
`titan_parallel.activation_checkpoint._SAVE_OPS` lists none, so its recompute runs both exchanges again). A memory
budget recomputes inside the compiled pieces only, and the exchanges run eager between them: none again."""


def ep_group_strides(layout: Layout) -> dict[str, tuple[int, int]]:
    """(stride, size) of expert parallel's groups on the mesh (see the module docstring).

    "ep": the ranks one all-to-all spans; "experts": the ranks holding the same experts, which FSDP
    shards the experts over (`dp_shard x cp / ep`; the whole FSDP group without expert parallel).
    """
    t = layout
    if t.ep_spans_tp:
        return {"ep": (1, t.ep), "experts": (t.ep, t.expert_holders)}
    return {"ep": (t.tp, t.ep), "experts": (t.tp * t.ep, t.dp_shard * t.cp // t.ep)}


def members_per_node(stride: int, size: int, gpus_per_node: int) -> int:
    """Ranks of one group (`size` ranks `stride` apart) that share a node with each member, itself included.

    The whole group when its span (`stride x size` consecutive ranks) fits in and divides a node; else
    `gpus_per_node / stride` when whole nodes tile the group, and 1 when they do not (a group that
    straddles nodes unevenly is costed by its worst member).
    """
    span = stride * size
    if size <= 1 or (span <= gpus_per_node and gpus_per_node % span == 0):
        return size
    if stride < gpus_per_node and gpus_per_node % stride == 0 and span % gpus_per_node == 0:
        return gpus_per_node // stride
    return 1


def all_to_all_seconds(n: int, local: int, nbytes: float, intra_bw: float, inter_bw: float) -> float:
    """Time of an all-to-all over `n` ranks in which each rank sends `nbytes` in all, `1 / n` of it to each rank.

    What goes to itself does not move; to the `local - 1` other ranks on its node it goes over NVLink,
    to the `n - local` ranks on other nodes over its NIC, both at once: the slower of the two.

    Args:
        n: ranks in the group.
        local: ranks of the group on each member's node, itself included (`members_per_node`).
        nbytes: bytes each rank sends (its whole buffer, its own share included).
        intra_bw: NVLink bandwidth per GPU (bytes/s).
        inter_bw: network bandwidth per GPU (bytes/s).
    """
    if n <= 1:
        return 0.0
    return max((local - 1) / n * nbytes / intra_bw, (n - local) / n * nbytes / inter_bw)


def ep_all_to_all_seconds(layout: Layout, work: Workload, cluster: Cluster) -> tuple[float, str]:
    """Seconds per step of expert parallel's all-to-alls on one rank, and the link: 'NVLink' or 'network'.

    Each MoE layer of the rank's stages, for each of its token slots (`seqs x seq_len / cp` tokens per step,
    `top_k` slots each: the MoE input is the whole sequence shard, replicated over TP; `1 / tp` of it when the TP
    ranks join expert parallel), sends a `dim`-wide row in the activation dtype on each all-to-all
    (`ALL_TO_ALLS_PER_LAYER`), at `EP_EXPOSED`.

    Args:
        layout: the degrees (`ep`, `tp`, `cp`, `dp`, `pp`), batch split and checkpointing.
        work: the model (`moe.layers`, `moe.top_k`, `dim`, `act_bytes`) and batch.
        cluster: the GPUs and links.
    """
    t, w, c = layout, work, cluster
    if t.ep <= 1 or w.moe.layers == 0:
        return 0.0, "NVLink"
    stride, size = ep_group_strides(t)["ep"]
    local = members_per_node(stride, size, c.gpus_per_node)
    seqs = w.global_batch / t.dp  # sequences each data-parallel rank runs per step
    routed = seqs * w.seq_len / t.cp / (t.tp if t.ep_spans_tp else 1)  # tokens a MoE layer routes on the rank
    nbytes = routed * w.moe.top_k * w.dim * w.act_bytes  # (slots, dim) rows per all-to-all
    one = all_to_all_seconds(t.ep, local, nbytes, c.intra_node_bw, c.inter_node_bw)
    seconds = EP_EXPOSED * ALL_TO_ALLS_PER_LAYER[t.ac] * w.moe.layers / t.pp * one
    return seconds, "NVLink" if local == t.ep else "network"
