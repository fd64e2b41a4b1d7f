"""How a model may be split, stated as data.

A model states its plan once, as a `ModelPlan`; every `apply_*` function in
titan-parallel reads it. A new model adds a table, not a copy of `apply_fsdp`.

Module paths are dotted paths relative to the module the table applies to:
`ModelPlan.tp` is relative to the root module, `ModelPlan.block_tp` relative to
each repeated block (the children of `ModelPlan.blocks`).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


class TPStyle(enum.StrEnum):
    """How one module is split by tensor parallel (with sequence parallel).

    Activations between blocks are sharded on the sequence dim, `Shard(1)`;
    inside a block they are replicated after `*_INPUT` and sharded on the
    hidden dim between a colwise and a rowwise linear.
    """

    EMBEDDING = "embedding"
    """`nn.Embedding` sharded on the vocab dim (rowwise); input tokens `Replicate()`, output `Shard(1)`."""
    COLWISE = "colwise"
    """`nn.Linear` sharded on its output features; output `Shard(-1)`."""
    ROWWISE = "rowwise"
    """`nn.Linear` sharded on its input features; output reduce-scattered to `Shard(1)`."""
    NORM = "norm"
    """A norm run on the sequence-sharded activation, weight replicated (sequence parallel)."""
    BLOCK_INPUT = "block_input"
    """A sub-block (attention, feed-forward) whose first positional input is all-gathered
    from `Shard(1)` to `Replicate()`."""
    OUTPUT = "output"
    """The final projection to the vocab: colwise; `Shard(-1)` logits under loss parallel, else `Replicate()`."""
    HEAD_NORM = "head_norm"
    """A norm applied to each head of head-sharded activations `(bs, seqlen, heads/tp, head_dim)` (QK-norm):
    weight replicated, input and output plain local tensors, weight gradients summed over the TP ranks."""
    REPLICATED = "replicated"
    """A module run whole on every TP rank (e.g. MLA's low-rank down-projections and their norms): weights
    `Replicate()` DTensors, a plain input taken as `Replicate()`, output a plain local tensor. The gradient
    of its output must come back whole (a colwise linear after it sums it over the TP ranks)."""
    SUM_GRAD = "sum_grad"
    """An identity on a replicated tensor that each TP rank uses for its own heads only (MLA's rotated key,
    shared by all heads): forward unchanged, gradient summed over the TP ranks."""
    TOKENWISE = "tokenwise"
    """A module that treats each token alone (multi-token prediction's input projection: norms, a concatenation,
    a linear) run on this rank's sequence shard: weights `Replicate()`, input `Shard(1)` (local or DTensor), output
    a plain local `Shard(1)` tensor; the weights' gradients, partial on each rank, are summed over the TP ranks."""
    MOE_INPUT = "moe_input"
    """A Mixture-of-Experts module whose routed and shared experts are split on their hidden dim
    (`tensor_parallel_layout.MOE_TP_SPLITS`), its router run whole on every TP rank: its input all-gathered
    from `Shard(1)`, its partial output reduce-scattered back (`tensor_parallel.MoETensorParallel`)."""


@dataclass(frozen=True)
class ModelPlan:
    """Everything titan-parallel needs to know about a model's structure.

    Args:
        blocks: path of the container (`nn.ModuleDict` keyed "0".."n-1") holding
            the repeated blocks. Each block is one FSDP unit, one activation
            checkpoint unit, one compile region, and the unit pipeline stages are
            cut from.
        tp: (module path, style) for modules outside the blocks.
        block_tp: (module path, style) inside each block.
        pp_first: modules that live only on the first pipeline stage (embeddings).
        pp_last: modules that live only on the last pipeline stage (final norm, output).
        attention: path, inside each block, of the module computing
            `softmax(q k^T) v` from `(q, k, v)` each `(bs, n_heads, seqlen, head_dim)`;
            context parallel swaps it for ring attention.
        head_counts: (module path inside a block, attribute names) of head counts
            that tensor parallel divides by its degree, e.g. `("attention", ("n_heads", "n_kv_heads"))`.
        fsdp_root_units: modules outside the blocks wrapped as their own FSDP
            unit (e.g. embeddings, the output projection), in forward order.
        moe: path, inside a block, of its Mixture-of-Experts module (blocks without it are dense).
            Its `experts` child holds the stacked expert weights `w1`, `w2`, `w3` (dim 0: the expert),
            which expert parallel splits; its `tokens_per_expert` and `expert_bias` buffers are
            what load balancing reads and updates. If it has a `sequence_group` attribute, context
            parallel sets it to the CP process group (the ranks holding the rest of each sequence).
        shared_input_linears: groups of `nn.Linear` paths inside each block that the block's forward calls
            one after another on the same input, in this order (e.g. `("attention.wq", "attention.wk",
            "attention.wv")`); inference may compute each group as one matmul over the concatenated weights.
            A group whose modules a block lacks (a MoE block's feed-forward) is skipped there.
    """

    blocks: str
    tp: tuple[tuple[str, TPStyle], ...] = ()
    block_tp: tuple[tuple[str, TPStyle], ...] = ()
    pp_first: tuple[str, ...] = ()
    pp_last: tuple[str, ...] = ()
    attention: str | None = None
    head_counts: tuple[tuple[str, tuple[str, ...]], ...] = field(default=())
    fsdp_root_units: tuple[str, ...] = ()
    moe: str | None = None
    shared_input_linears: tuple[tuple[str, ...], ...] = ()
