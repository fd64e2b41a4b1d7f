"""How long one optimizer step of a layout takes, by an explicit cost model: what `titan plan` ranks by.

Pure arithmetic, no torch: the planner scores tens of thousands of layouts with it.
Every figure it assumes is a named constant below, and the `titan plan` section of
`docs/memory.md` writes out each formula and where each figure comes from. The
terms, per rank and per optimizer step:

- compute: `flops_per_token x tokens / gpus / (peak x MFU_EFFICIENCY)`;
- recompute: activation checkpointing's extra forward (full: +1/3 of the training
  FLOPs; selective "op": the matmuls it does not keep, `Workload.op_recompute_flops_per_token`;
  a compiled block's memory budget: what its partitioned backward graph recomputes, measured,
  `Workload.budget_recompute`);
- tp, cp, pp_p2p: tensor parallel's all-gathers / reduce-scatters of activations,
  context parallel's exchanges (ring: K/V gathered or passed round; Ulysses: q, k, v
  and the output by all-to-all) and the pipeline's activation sends, times the share
  of each on the critical path (`TP_EXPOSED`, `CP_EXPOSED`, `PP_P2P_EXPOSED`);
- ep: expert parallel's all-to-alls (`titan_core.memory.expert_cost`);
- bubble: the pipeline's idle share of a step (`bubble_fraction`);
- fsdp: parameter all-gathers and gradient reduce-scatters (and HSDP's all-reduce; a MoE's
  experts over the ranks holding the same experts), of which `FSDP_OVERLAP` hides behind
  compute as long as compute is longer;
- offload, optimizer: CPU offload's host <-> device copies, and the optimizer step (AdamW's element-wise
  work; under Muon also its Newton-Schulz matmuls, `optimizer_seconds`, and the all-to-alls that bring each
  matrix to its owner and back, `muon_exchange_seconds`).

A collective's time is the ring algorithm's `(n - 1) / n x bytes / bandwidth`: at
NVLink bandwidth when its group lies inside one node, else at the per-GPU network
bandwidth. The mesh is `(pp, dp_replicate, dp_shard, cp, tp)`, tp innermost, so a
dimension's group holds ranks `stride` apart (`group_strides`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from titan_core.memory.expert_cost import (
    MoEWork,
    all_to_all_seconds,
    ep_all_to_all_seconds,
    ep_group_strides,
    members_per_node,
)
from titan_parallel.layout import ulysses_kv_repeats

MFU_EFFICIENCY = 0.45
"""Share of the GPU's dense bf16 peak the matmuls reach when nothing waits on communication. torchtitan's
H100 benchmarks (2024-12) reach 39% end to end for Llama 3.1 8B FSDP on 8 GPUs with compile, selective AC
and exposed FSDP traffic included (6,667 tokens/s/GPU x 57.9 GFLOP/token / 989 TFLOP/s)."""

NVLINK_BYTES_PER_S = 360e9
"""Bus bandwidth per GPU of a ring collective inside a node: H100 SXM NVLink 4 carries 450 GB/s each way
(900 GB/s both ways); NCCL's all-gather / reduce-scatter reach about 80% of it on large messages."""

NETWORK_BYTES_PER_S = 45e9
"""Bus bandwidth per GPU across nodes: one 400 Gb/s (50 GB/s) InfiniBand NDR or RoCE NIC per GPU, of which
NCCL's rings reach about 90%."""

PCIE_BYTES_PER_S = 25e9
"""Host <-> GPU bandwidth per GPU under CPU offload: PCIe Gen5 x16 (~50 GB/s achieved each way), halved
because two GPUs share one PCIe switch's uplink on an HGX H100 board."""

HOST_ADAM_BYTES_PER_S = 25e9
"""Host memory bandwidth per GPU for the CPU AdamW step under offload: ~200 GB/s for a two-socket host,
shared by its 8 GPUs' optimizer steps."""

HBM_BYTES_PER_S = 3.35e12
"""GPU memory bandwidth for the (memory-bound) AdamW step: H100 SXM HBM3."""

ADAM_BYTES_PER_PARAM = 28
"""Bytes AdamW moves per parameter: it reads the fp32 parameter, gradient and two moments (16) and writes
the parameter and the moments (12)."""

MUON_BYTES_PER_PARAM = 36
"""Bytes Muon's element-wise work moves per parameter of its shard (`titan_core.muon`), in fp32: the momentum
update reads the gradient and the momentum and writes the momentum (12), the Nesterov lerp reads both and
writes the update (12), and the step reads the parameter and the orthogonalised update and writes the
parameter (12)."""

ONE_RANK_COPY_BYTES_PER_PARAM = 10
"""Bytes FSDP moves per parameter for each all-gather or reduce-scatter of a one-rank shard group, which are
copies and casts, not collectives: the gather reads the fp32 shard and writes its bf16 copy and the gathered
buffer (~10 bytes), the reduce copies the bf16 gradient out and casts it to fp32 (~10). On one H100 (1B,
torch 2.11, two gathers and one reduce per step) the profile showed 15.4 ms of such copies, ~11 ms at this
rate: a per-micro-step cost, which is what makes a larger micro-batch faster on one GPU."""

FSDP_OVERLAP = 0.8
"""Share of FSDP's all-gathers / reduce-scatters hidden behind compute by prefetching. The first all-gather of
the forward and the last reduce-scatter of the backward cannot hide, and the collectives' kernels slow the
matmuls they overlap; traffic longer than the compute is exposed in full beyond it."""

TP_EXPOSED = 0.9
"""Share of tensor parallel's collectives on the critical path: each matmul waits for its all-gather and each
reduce-scatter waits for its matmul (async TP, which the planner does not turn on, would hide most of it)."""

CP_EXPOSED = {"allgather": 1.0, "rotate": 0.5, "ulysses": 1.0}
"""Share of context parallel's exchange exposed: ring's 'allgather' waits for the whole K/V before attention;
'rotate' passes shards around the ring while attending to the previous one; Ulysses' all-to-alls sit between
the q/k/v projections and attention, and between attention and `wo`, with nothing to overlap."""

PP_P2P_EXPOSED = 0.5
"""Share of the pipeline's activation sends exposed: sends are asynchronous; a stage waits only for a receive
that has not landed when it is free for the next micro-batch."""

ZERO_BUBBLE_RESIDUAL = 0.1
"""The share of 1F1B's bubble that zero-bubble schedules leave: they fill it with deferred weight-gradient work
(ZB-V reaches ~0 with enough micro-batches; the warm-up's first forwards cannot be filled)."""

BUBBLE_KINDS = {
    "GPipe": "flush",
    "1F1B": "flush",
    "Interleaved1F1B": "interleaved",
    "InterleavedZeroBubble": "zero",
    "ZBVZeroBubble": "zero",
    "DualPipeV": "zero",
}
"""How each pipeline schedule's bubble is modelled (see `bubble_fraction`)."""


@dataclass(frozen=True)
class Cluster:
    """The GPUs a job runs on.

    Args:
        gpus: GPUs in the job.
        gpus_per_node: GPUs that share one NVLink domain.
        peak_flops: dense bf16 peak FLOP/s of one GPU.
        intra_node_bw: bus bandwidth per GPU (bytes/s) of a collective inside a node.
        inter_node_bw: bus bandwidth per GPU (bytes/s) of a collective across nodes.
        mfu: share of `peak_flops` the matmuls reach.
    """

    gpus: int
    gpus_per_node: int
    peak_flops: float
    intra_node_bw: float = NVLINK_BYTES_PER_S
    inter_node_bw: float = NETWORK_BYTES_PER_S
    mfu: float = MFU_EFFICIENCY


@dataclass(frozen=True)
class Workload:
    """The model and batch a step processes, as plain numbers.

    Args:
        n_params: parameters of the whole model.
        n_layers: transformer blocks.
        dim: width of the residual stream.
        kv_dim: width of K (= of V): kv heads x head dim.
        flops_per_token: training FLOPs (forward + backward) per token at `seq_len`.
        op_recompute_flops_per_token: FLOPs per token that selective "op" checkpointing recomputes.
        seq_len: tokens per sequence.
        global_batch: sequences per optimizer step.
        gather_bytes: bytes per parameter FSDP all-gathers (2 for bf16).
        reduce_bytes: bytes per gradient element FSDP reduces (4 for float32).
        act_bytes: bytes per activation element (2 for bf16).
        fsdp_reshard: `parallelism.fsdp_reshard_after_forward`: "default", "always" or "never".
        cp_rotate_method: "allgather" or "rotate" (ring's K/V exchange).
        cp_method: "ring" or "ulysses" (context parallel's attention).
        q_dim: width of Q (= of the attention output): heads x head dim; 0 = `dim`.
        kv_heads: key/value heads (Ulysses repeats them where cp does not divide a rank's); 0 = no repeats.
        moe: the Mixture-of-Experts layers' numbers (`MoEWork()`, all 0, for a dense model).
        master_weights: `optimizer.master_weights` is not "off" and nothing but the layout keeps it off (Adam /
            AdamW, FSDP mode, no fault tolerance): a layout `master_weights_blockers` passes then makes no copies.
        muon_params: parameters Muon steps (`optimizer.name = "Muon"`: the blocks' matrices and the stacked
            experts, so every routed expert's, `titan_core.muon_groups.RULE`); 0 = AdamW steps every parameter.
        muon_ns_flops: FLOPs of one Newton-Schulz orthogonalisation of every Muon matrix (each once).
        muon_exchange_bytes: bytes per element Muon's matrices travel in to and from their owners (its
            Newton-Schulz dtype: 2 for bf16).
        budget_recompute: `(tp, budget, FLOPs per token)`: what compiled blocks recompute at each
            `activation_checkpoint.memory_budget` and tensor parallel degree, over all TP ranks
            (`titan_core.memory.plan_model.budget_recompute`); () where the compiled blocks are not measured (the
            planner then searches no budget; it searches one only at the degrees measured).
    """

    n_params: int
    n_layers: int
    dim: int
    kv_dim: int
    flops_per_token: float
    op_recompute_flops_per_token: float
    seq_len: int
    global_batch: int
    gather_bytes: int = 2
    reduce_bytes: int = 4
    act_bytes: int = 2
    fsdp_reshard: str = "default"
    cp_rotate_method: str = "allgather"
    cp_method: str = "ring"
    q_dim: int = 0
    kv_heads: int = 0
    moe: MoEWork = MoEWork()
    master_weights: bool = False
    muon_params: int = 0
    muon_ns_flops: float = 0.0
    muon_exchange_bytes: int = 2
    budget_recompute: tuple[tuple[int, float, float], ...] = ()


@dataclass(frozen=True)
class Layout:
    """One way to run a job: what `titan plan` searches over.

    Args:
        dp_replicate: HSDP replicas.
        dp_shard: FSDP shards.
        cp: context parallel degree.
        tp: tensor parallel degree.
        pp: pipeline parallel degree.
        schedule: pipeline schedule (read when pp > 1).
        stages_per_rank: pipeline stages on each rank (2 for interleaved and V schedules).
        local_batch: sequences per data-parallel rank per micro-step.
        microbatch: sequences per pipeline micro-batch (= local_batch without pipeline parallel).
        accum: gradient-accumulation steps per optimizer step.
        ac: activation checkpointing: "none", "op" (selective op), "full", or "budget" (compiled blocks' memory
            budget, `memory_budget`).
        offload: CPU offload of parameters, gradients and optimizer states.
        ep: expert parallel degree: experts split over `ep` ranks carved from dp_shard x cp (no more GPUs).
        ep_spans_tp: the TP ranks join expert parallel (`parallelism.expert_tensor_parallel_degree = 1`): `ep` is
            carved from dp_shard x cp x tp, and each routed expert stays whole rather than split over TP.
        memory_budget: the compiled blocks' activation memory budget, with `ac` "budget".
    """

    dp_replicate: int = 1
    dp_shard: int = 1
    cp: int = 1
    tp: int = 1
    pp: int = 1
    schedule: str = "1F1B"
    stages_per_rank: int = 1
    local_batch: int = 1
    microbatch: int = 1
    accum: int = 1
    ac: str = "none"
    offload: bool = False
    ep: int = 1
    ep_spans_tp: bool = False
    memory_budget: float | None = None

    @property
    def ac_name(self) -> str:
        """`ac` as the planner's table shows it: 'none', 'op', 'full' or e.g. 'budget 0.5'."""
        return f"budget {self.memory_budget:g}" if self.ac == "budget" else self.ac

    @property
    def dp(self) -> int:
        """Data-parallel degree: batches read per micro-step."""
        return self.dp_replicate * self.dp_shard

    @property
    def microbatches(self) -> int:
        """Pipeline micro-batches per micro-step (1 without pipeline parallel)."""
        return self.local_batch // self.microbatch if self.pp > 1 else 1

    @property
    def etp(self) -> int:
        """How many ways TP splits each routed expert (`parallelism.expert_tensor_parallel_degree`): `tp`, or 1 when
        the TP ranks join expert parallel."""
        return 1 if self.ep_spans_tp else self.tp

    @property
    def expert_split(self) -> int:
        """How many ways a MoE layer's routed experts are split before FSDP: `ep x etp`."""
        return self.ep * self.etp

    @property
    def expert_holders(self) -> int:
        """Ranks holding the same experts, which FSDP shards them over (`dp_shard_mod_ep`): `dp_shard x cp x tp`
        over `ep x etp`, i.e. `dp_shard x cp / ep`, x tp when the TP ranks join; the FSDP group without EP."""
        return self.dp_shard * self.cp * self.tp // self.expert_split

    def describe(self) -> str:
        """The degrees above 1, e.g. 'dp_shard=8 tp=8 pp=8 ep=8' ('ep=16 etp=1' when the TP ranks join EP)."""
        names = ("dp_replicate", "dp_shard", "cp", "tp", "pp", "ep")
        text = " ".join(f"{n}={getattr(self, n)}" for n in names if getattr(self, n) > 1) or "1 GPU"
        return text + (" etp=1" if self.ep_spans_tp else "")


@dataclass
class StepCost:
    """Seconds one optimizer step takes, by term.

    Args:
        terms: seconds per term (compute, recompute, tp, cp, pp_p2p, ep, bubble, fsdp, offload, optimizer).
        notes: the link each communication term ran over ("NVLink" or "network"), e.g. {"tp": "NVLink"}.
    """

    terms: dict[str, float] = field(default_factory=dict)
    notes: dict[str, str] = field(default_factory=dict)

    @property
    def seconds(self) -> float:
        """The step time: the sum of the terms."""
        return sum(self.terms.values())

    def dominant(self, n: int = 3) -> str:
        """The `n` largest terms of 1% of the step or more, e.g. 'compute 71%, tp 12% (NVLink), bubble 9%'."""
        total = self.seconds or 1.0
        top = sorted(((v, k) for k, v in self.terms.items() if v / total >= 0.005), reverse=True)[:n]
        return ", ".join(f"{k} {v / total:.0%}" + (f" ({self.notes[k]})" if k in self.notes else "") for v, k in top)


def ring_seconds(n: int, nbytes: float, bandwidth: float) -> float:
    """Time of a ring all-gather or reduce-scatter over `n` ranks whose whole (unsharded) buffer is `nbytes`.

    Each rank sends and receives `(n - 1) / n` of the buffer; an all-reduce is two of these.

    Args:
        n: ranks in the group.
        nbytes: size of the gathered result (or of the reduce-scatter's input).
        bandwidth: bus bandwidth per GPU (bytes/s) of the slowest link of the ring.
    """
    return 0.0 if n <= 1 else (n - 1) / n * nbytes / bandwidth


def group_strides(layout: Layout) -> dict[str, tuple[int, int]]:
    """(stride, size) of each communication group on the mesh `(pp, dp_replicate, dp_shard, cp, tp)`.

    "fsdp" is the flattened (dp_shard, cp) group FSDP shards over; "replicate" is HSDP's; "muon" is the
    (dp_shard, cp, tp) group a block's matrix is split over, which Muon's exchange spans.
    """
    t = layout
    return {
        "tp": (1, t.tp),
        "cp": (t.tp, t.cp),
        "fsdp": (t.tp, t.dp_shard * t.cp),
        "replicate": (t.dp_shard * t.cp * t.tp, t.dp_replicate),
        "pp": (t.dp_replicate * t.dp_shard * t.cp * t.tp, t.pp),
        "muon": (1, t.dp_shard * t.cp * t.tp),
    }


def within_node(stride: int, size: int, gpus_per_node: int) -> bool:
    """Whether every group of `size` ranks `stride` apart lies inside one node of `gpus_per_node` GPUs.

    A group spans `stride x size` consecutive ranks; it stays in one node when that span is at
    most a node and divides it (otherwise some groups straddle two nodes).
    """
    span = stride * size
    return size <= 1 or (span <= gpus_per_node and gpus_per_node % span == 0)


def group_bandwidth(name: str, layout: Layout, cluster: Cluster) -> tuple[float, str]:
    """Bus bandwidth per GPU (bytes/s) of group `name` (a key of `group_strides` or `ep_group_strides`), and 'NVLink'
    or 'network'."""
    stride, size = {**group_strides(layout), **ep_group_strides(layout)}[name]
    if within_node(stride, size, cluster.gpus_per_node):
        return cluster.intra_node_bw, "NVLink"
    return cluster.inter_node_bw, "network"


def bubble_fraction(schedule: str, pp: int, microbatches: int, stages_per_rank: int = 1) -> float:
    """Share of a pipeline run each rank is idle.

    flush (GPipe, 1F1B): `(pp - 1) / (m + pp - 1)`: m micro-batches plus pp - 1 slots to fill and drain;
    interleaved: `(pp - 1) / (v m + pp - 1)`, v stages per rank (Megatron-LM: the bubble shrinks v times);
    zero-bubble: `ZERO_BUBBLE_RESIDUAL` x the flush fraction.

    Args:
        schedule: a key of `BUBBLE_KINDS`.
        pp: pipeline degree.
        microbatches: micro-batches per pipeline run (m).
        stages_per_rank: v.
    """
    if pp <= 1:
        return 0.0
    kind = BUBBLE_KINDS[schedule]
    if kind == "interleaved":
        return (pp - 1) / (stages_per_rank * microbatches + pp - 1)
    flush = (pp - 1) / (microbatches + pp - 1)
    return flush * (ZERO_BUBBLE_RESIDUAL if kind == "zero" else 1.0)


def recompute_flops_per_token(layout: Layout, work: Workload) -> float:
    """FLOPs per token activation checkpointing adds: full = the forward again (1/3 of the training FLOPs); a
    memory budget what `work.budget_recompute` measured at it and the layout's TP degree (one it did not measure as
    full AC, the most any budget recomputes)."""
    if layout.ac == "budget":
        measured = {(tp, budget): flops for tp, budget, flops in work.budget_recompute}
        return measured.get((layout.tp, layout.memory_budget or 0.0), work.flops_per_token / 3)
    return {"none": 0.0, "op": work.op_recompute_flops_per_token, "full": work.flops_per_token / 3}[layout.ac]


def tp_collectives_per_block(ac: str) -> int:
    """Sequence-parallel collectives per block per micro-batch: 2 all-gathers + 2 reduce-scatters forward, as
    many backward, and the recomputed forward's again (full), or its 2 all-gathers ("op" keeps reduce-scatters).
    A compiled block's memory budget recomputes none: its children's backward graphs hold the same collectives at
    every budget (the 8B's block at TP 2 and 8, budgets 0.25 to 0.75, `plan_model.budget_recompute`'s traces)."""
    return 8 + {"none": 0, "budget": 0, "op": 2, "full": 4}[ac]


def cp_seconds(layout: Layout, work: Workload, cluster: Cluster, notes: dict[str, str]) -> float:
    """Seconds per step and per block of context parallel's exchanges on one rank (exposed share only).

    Per block and pass (forward, backward, and the recomputed forward under AC: neither the ring's gathers nor
    Ulysses' all-to-alls are kept by selective "op"), on the rank's `seqs x seq_len / cp` tokens per step, heads
    split by tp:

    - ring: K and V of whole sequences, `2 b seqs seq_len kv_dim / tp`, gathered (or passed round) forward,
      their gradients reduce-scattered (passed back) backward: a ring collective over cp;
    - Ulysses: every rank sends its tokens' q, k, v and output rows, `b seqs seq_len / cp (2 q_dim + 2 kv_dim r)
      / tp` (r = `ulysses_kv_repeats`), by all-to-all over cp; backward the same reversed.

    Args:
        layout: the degrees (`cp`, `tp`, `dp`) and checkpointing.
        work: the model's widths and the batch.
        cluster: the GPUs and links.
        notes: the cost's link notes; "cp" is set to the link the exchange runs over.
    """
    t, w, c = layout, work, cluster
    seqs = w.global_batch / t.dp
    passes = 2 if t.ac == "none" else 3
    stride, size = group_strides(t)["cp"]
    if w.cp_method == "ulysses":
        repeats = ulysses_kv_repeats(w.kv_heads // t.tp, t.cp) if w.kv_heads else 1
        rows = w.act_bytes * seqs * w.seq_len / t.cp * (2 * (w.q_dim or w.dim) + 2 * w.kv_dim * repeats) / t.tp
        local = members_per_node(stride, size, c.gpus_per_node)
        notes["cp"] = "NVLink" if local == t.cp else "network"
        one = all_to_all_seconds(t.cp, local, rows, c.intra_node_bw, c.inter_node_bw)
        return CP_EXPOSED["ulysses"] * passes * one
    kv = 2 * w.act_bytes * seqs * w.seq_len * w.kv_dim / t.tp
    bw, notes["cp"] = group_bandwidth("cp", t, c)
    return CP_EXPOSED[w.cp_rotate_method] * passes * ring_seconds(t.cp, kv, bw)


def _master_weights_apply(t: Layout) -> bool:
    """Whether the layout trains 16-bit through master weights rather than one-rank FSDP (the job rule's test)."""
    import torch

    from titan_parallel.master_weights import master_weights_blockers

    model_parallel = t.tp * t.cp * t.pp * t.ep > 1
    return not master_weights_blockers(t.dp_replicate * t.dp_shard, model_parallel, torch.bfloat16, t.offload, t.accum)


def optimizer_seconds(t: Layout, w: Workload, c: Cluster, shard_params: float) -> float:
    """The optimizer step: memory-bound element-wise work on the rank's shard (AdamW's, or Muon's for its
    share), and under Muon the Newton-Schulz matmuls of the matrices the rank owns. Each matrix is
    orthogonalised whole on one rank of the group that shards it (`titan_parallel.matrix_owners`), so the
    FLOPs spread over every GPU but the HSDP replicas, which repeat each other's (docs/optimizers.md).
    The exchange that brings each owner its matrix is `muon_exchange_seconds`.

    Args:
        t: the layout.
        w: the model and batch.
        c: the GPUs.
        shard_params: parameters of the rank's shard.
    """
    bandwidth = HOST_ADAM_BYTES_PER_S if t.offload else HBM_BYTES_PER_S
    if not w.muon_params:
        return ADAM_BYTES_PER_PARAM * shard_params / bandwidth
    muon_share = w.muon_params / w.n_params  # the rank's shard holds the model's mix, near enough
    elementwise = (ADAM_BYTES_PER_PARAM * (1 - muon_share) + MUON_BYTES_PER_PARAM * muon_share) * shard_params
    newton_schulz = w.muon_ns_flops / (c.gpus / t.dp_replicate) / (c.peak_flops * c.mfu)
    return elementwise / bandwidth + newton_schulz


def muon_exchange_seconds(t: Layout, w: Workload, bandwidth: Callable[[str, str], float]) -> float:
    """Muon's two all-to-alls per group and step (`titan_parallel.matrix_owners`), not overlapped with anything.

    In each, a rank sends `(W - 1) / W` of its pieces of the matrices of a `W`-rank group to their owners (and
    gets back as much): the blocks' matrices over dp_shard x cp x tp ("muon"); the stacked experts over the
    ranks holding pieces of the same experts: their hidden dim split over tp (`TPStyle.MOE_INPUT`), and under
    expert parallel their rows (FSDP's `Shard(1)`) over the ranks holding the same experts ("experts").
    Without expert parallel FSDP splits the stacks by expert (`Shard(0)`), so only TP's pieces move. Either
    way a rank holds `1 / (dp_shard x cp x tp)` of the experts of its stage.

    Args:
        t: the layout.
        w: the model and batch (`muon_params` 0: AdamW, no exchange).
        bandwidth: `(group, term) -> bytes/s` of a group of `group_strides` or `ep_group_strides`.
    """
    if not w.muon_params:
        return 0.0
    b = w.muon_exchange_bytes
    dense = (w.muon_params - w.moe.expert_params) / t.pp  # every expert is Muon's (`muon_groups.RULE`)
    group = t.dp_shard * t.cp * t.tp
    seconds = 2 * ring_seconds(group, b * dense / group, bandwidth("muon", "optimizer")) if group > 1 else 0.0
    holders = t.expert_holders if t.ep > 1 else 1
    pieces = w.moe.expert_params / (t.pp * t.dp_shard * t.cp * t.tp)
    if pieces and holders * t.etp > 1:  # whole experts (etp = 1): only the holders' FSDP rows move
        link = bandwidth("experts", "optimizer") if holders > 1 else bandwidth("tp", "optimizer")
        seconds += 2 * ring_seconds(holders * t.etp, b * pieces, link)
    return seconds


def estimate_step_cost(layout: Layout, work: Workload, cluster: Cluster) -> StepCost:
    """Seconds per optimizer step of `layout`, by term (see the module docstring).

    Args:
        layout: the degrees, schedule, batch split, checkpointing and offload.
        work: the model and batch.
        cluster: the GPUs and links.
    """
    t, w, c = layout, work, cluster
    cost = StepCost()

    def bandwidth(group: str, term: str) -> float:
        """`group`'s bandwidth; notes the link `term` ran over (the network if any of its groups leaves the node)."""
        bw, where = group_bandwidth(group, t, c)
        if cost.notes.get(term) != "network":
            cost.notes[term] = where
        return bw

    tokens = w.global_batch * w.seq_len  # per step, all ranks
    rate = c.peak_flops * c.mfu
    compute = w.flops_per_token * tokens / c.gpus / rate
    recompute = recompute_flops_per_token(t, w) * tokens / c.gpus / rate
    seqs = w.global_batch / t.dp  # sequences each data-parallel rank (its cp x tp x pp group) runs per step
    layers = w.n_layers / t.pp  # blocks per pipeline rank

    tp = cp = pp_p2p = 0.0
    if t.tp > 1:  # each collective moves the step's whole (seqs, seq_len / cp, dim) activation
        act = w.act_bytes * seqs * w.seq_len / t.cp * w.dim
        # With the TP ranks in the ep group a MoE layer without shared experts has no TP collective: half its block's
        tp_blocks = layers - (w.moe.layers / t.pp / 2 if t.ep_spans_tp and not w.moe.shared else 0)
        tp = TP_EXPOSED * tp_collectives_per_block(t.ac) * tp_blocks * ring_seconds(t.tp, act, bandwidth("tp", "tp"))
    if t.cp > 1:
        cp = cp_seconds(t, w, c, cost.notes) * layers
    if t.pp > 1:  # each micro-batch crosses each of a rank's stage boundaries, forward and backward
        act = w.act_bytes * t.microbatch * w.seq_len / t.cp * w.dim / t.tp  # (mbs, seq / cp / tp, dim) under SP
        sends = 2 * t.stages_per_rank * seqs / t.microbatch
        pp_p2p = PP_P2P_EXPOSED * sends * act / bandwidth("pp", "pp_p2p")
    ep, ep_link = ep_all_to_all_seconds(t, w, c)
    if t.ep > 1:
        cost.notes["ep"] = ep_link
    busy = compute + recompute + tp + cp + pp_p2p + ep
    f = bubble_fraction(t.schedule, t.pp, t.microbatches, t.stages_per_rank)
    bubble = busy * f / (1 - f)  # idle = f of (busy + idle)

    shard = t.dp_shard * t.cp
    rank_params = (w.n_params - w.moe.expert_params) / (t.tp * t.pp)  # what its FSDP group shards, experts aside
    rank_experts = w.moe.expert_params / (t.expert_split * t.pp)  # its E / ep experts (or their TP slices)
    # "default": no reshard under PP, nor on a one-rank shard group (titan_parallel.fsdp)
    reshard = {"always": True, "never": False, "default": t.pp == 1 and shard > 1}[w.fsdp_reshard]
    gathers = t.accum * (2 * t.microbatches if reshard else 1)  # unresharded weights stay gathered over a run
    reduces = t.accum  # each micro-step reduce-scatters (under PP once per run, after its last micro-batch)
    fsdp = 0.0
    if shard > 1:
        bw = bandwidth("fsdp", "fsdp")
        fsdp += gathers * ring_seconds(shard, w.gather_bytes * rank_params, bw)
        fsdp += reduces * ring_seconds(shard, w.reduce_bytes * rank_params, bw)
    # One rank: FSDP's gathers and reduces are copies and casts (the bf16 compute copy) on the compute stream,
    # hidden behind nothing; none where the optimizer writes the copies (`titan_parallel.master_weights`).
    one_rank_copies = 0.0
    if shard == 1 and w.gather_bytes < 4 and not (w.master_weights and _master_weights_apply(t)):
        one_rank_copies = (gathers + reduces) * ONE_RANK_COPY_BYTES_PER_PARAM * rank_params / HBM_BYTES_PER_S
    holders = t.expert_holders  # the ranks FSDP shards the rank's experts over
    if rank_experts and holders > 1:
        bw = bandwidth("experts", "fsdp")
        fsdp += gathers * ring_seconds(holders, w.gather_bytes * rank_experts, bw)
        fsdp += reduces * ring_seconds(holders, w.reduce_bytes * rank_experts, bw)
    expert_shard = rank_experts / holders  # the experts' share of a rank's shard
    if t.dp_replicate > 1:  # HSDP: all-reduce (= reduce-scatter + all-gather) of each gradient shard
        bw = bandwidth("replicate", "fsdp")
        grads = w.reduce_bytes * rank_params / shard + w.reduce_bytes * expert_shard
        fsdp += reduces * 2 * ring_seconds(t.dp_replicate, grads, bw)
    window = compute + recompute
    fsdp_exposed = max((1 - FSDP_OVERLAP) * fsdp, fsdp - window) + one_rank_copies

    shard_params = rank_params / shard + expert_shard
    offload = 0.0
    if t.offload:  # fp32 shards copied in before each all-gather, gradients out after each reduce-scatter
        pcie = (gathers + reduces) * 4 * shard_params / PCIE_BYTES_PER_S
        offload = max((1 - FSDP_OVERLAP) * pcie, pcie - window)
    optimizer = optimizer_seconds(t, w, c, shard_params) + muon_exchange_seconds(t, w, bandwidth)

    cost.terms = {
        "compute": compute,
        "recompute": recompute,
        "tp": tp,
        "cp": cp,
        "pp_p2p": pp_p2p,
        "ep": ep,
        "bubble": bubble,
        "fsdp": fsdp_exposed,
        "offload": offload,
        "optimizer": optimizer,
    }
    return cost


def tokens_per_second_per_gpu(cost: StepCost, work: Workload, cluster: Cluster) -> float:
    """Training throughput per GPU: `global_batch x seq_len / step time / gpus`."""
    return work.global_batch * work.seq_len / cost.seconds / cluster.gpus
