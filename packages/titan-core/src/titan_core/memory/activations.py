"""The analytic tier's inputs: how a rank runs the model (`ActivationLayout`) and what it keeps for backward,
per token (`ActivationBytes`), as `titan_core.memory.eager_saved` measures it on fake tensors (and
`compiled_saved` from the compiled graph)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ActivationLayout:
    """How one rank runs the model, as far as the bytes its activations take depend on it.

    Args:
        compute_bytes: bytes per element of the compute dtype (2 for bf16, 4 for fp32).
        tp: tensor parallel degree (with sequence parallel: norms and residuals split the sequence).
        cp: context parallel degree (the rank's tokens are `seq_len / cp` of each sequence).
        cp_rotate_method: "allgather" or "rotate" (how ring attention exchanges K/V).
        cp_method: "ring" or "ulysses" (context parallel's attention; `cp_rotate_method` is ring's).
        seq_len: tokens per (full) sequence.
        device_type: "cuda" or "cpu" (kernels differ in what they save, e.g. RMSNorm).
        loss_parallel: under TP, whether the loss runs on vocab-sharded logits.
        block_causal: attention within each packed document (`model.attn_mask_type`): the blocks are measured
            under the model's dense mask where it builds one (off CUDA; FlexAttention's `BlockMask` on CUDA is
            a few integers per tile, and its kernel keeps what causal attention keeps).
        ep_spans_tp: under TP, the TP ranks join expert parallel (`etp=1`): each MoE layer routes the rank's own
            sequence shard to whole experts, rather than the all-gathered tokens to its slices of them.
    """

    compute_bytes: int = 2
    tp: int = 1
    cp: int = 1
    cp_rotate_method: str = "allgather"
    cp_method: str = "ring"
    seq_len: int = 2048
    device_type: str = "cuda"
    loss_parallel: bool = True
    block_causal: bool = False
    ep_spans_tp: bool = False


@dataclass(frozen=True)
class ActivationBytes:
    """Bytes one rank keeps for backward, per token it processes (`seq_len / cp` of each sequence).

    Args:
        block: one block, nothing recomputed.
        block_op: one block under selective "op" activation checkpointing (outputs of matmuls and attention kept).
        block_input: one block's input: all that full activation checkpointing keeps.
        block_backward: one block's backward (nothing recomputed) at its peak, beyond what the block kept: the
            gradients of its activations, the incoming one included, net of the saved tensors freed by then.
        head: the final norm and the output projection's input (the logits are `logits`).
        logits: the plain loss over the vocab at its peak (forward or backward), beyond `logits_saved`:
            the logits, their fp32 copy and gradients.
        logits_saved: what the loss keeps for backward (the log-softmax output).
        logits_grad: the gradient of the logits the loss's backward hands the output projection.
        block_budget: one compiled block under `activation_checkpoint.mode = 'memory_budget'`, as the compiler's
            partitioner cuts it at the run's budget (`titan_core.memory.compiled_saved`); None where not measured
            (`block` then bounds it).
        per_block: where a model's blocks differ (DeepSeek-V3's dense and Mixture-of-Experts blocks),
            each block's own figures by layer index, whose `block*` fields apply to that block; the
            `block*` fields above are then each the smallest over the blocks (a lower bound). Empty:
            every block is as above.
    """

    block: int
    block_op: int
    block_input: int
    block_backward: int
    head: int
    logits: int
    logits_saved: int
    logits_grad: int
    per_block: tuple[ActivationBytes, ...] = ()
    block_budget: int | None = None
