"""The start-up log's kernel lines: which loss, optimizer step and attention kernel a run computes, and why."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from titan_models.document_mask import uses_flex
from titan_parallel.ring_attention import FUSED_DEVICES

if TYPE_CHECKING:
    from titan_core.job import Job
    from titan_core.model_setup import ModelParts

__all__ = ["describe_attention", "describe_loss", "log_kernels"]

logger = logging.getLogger("titan")


def describe_attention(sdpa_why: str, attn_mask_type: str, device: torch.device, ring: str | None = None) -> str:
    """The start-up line's attention kernel: SDPA's order (`sdpa_why`), the block-causal kernel, or ring attention's.

    Args:
        sdpa_why: `titan_parallel.choose_sdpa_backends`'s reason.
        attn_mask_type: `model.attn_mask_type`.
        device: the training device.
        ring: under ring context parallel, its K/V exchange (`parallelism.context_parallel_rotate_method`); None
            without CP or under Ulysses, whose core is the model's own.
    """
    documents = " within each document (model.attn_mask_type)" if attn_mask_type == "block_causal" else ""
    if ring == "rotate":
        cpu = device.type in FUSED_DEVICES
        kernel = "torch's fused CPU attention kernel" if cpu else "fp32 matmuls"
        return f"ring attention, K/V rotated rank to rank: {kernel} per step, merged by log-sum-exp{documents}"
    if ring is not None:
        return f"ring attention, K/V all-gathered: SDPA with an explicit mask{documents}, {sdpa_why}"
    if not documents:
        return sdpa_why
    if uses_flex(device):
        return "FlexAttention, compiled, within each document (model.attn_mask_type; not training.attention_backend)"
    return f"SDPA with a dense mask{documents}, {sdpa_why}"


def describe_loss(fused: bool, head: torch.nn.Module | None, pp_group: dist.ProcessGroup | None = None) -> str:
    """One line for the start-up log: which loss the run computes, and why. Under pipeline parallel the loss is
    the stage holding the output projection's, which rank 0 may not hold: a collective over `pp_group` (every
    rank of it calls this) tells rank 0 that stage's line.

    Args:
        fused: `training.fused_loss`.
        head: this rank's fused output projection + loss (`ModelParts.head`), or None.
        pp_group: the pipeline-parallel group, when there is more than one stage.
    """
    if head is not None:
        rows = getattr(head, "chunk_rows", None)
        size = f"{rows} tokens" if rows else "chunks of at most 1 GiB of fp32 logits"
        line = f"output projection + cross-entropy fused, in {size} (training.fused_loss)"
    elif fused:
        line = "plain cross-entropy on full logits (the output projection is not a plain nn.Linear to fuse)"
    else:
        line = "plain cross-entropy on full logits (training.fused_loss = false)"
    if pp_group is None:
        return line
    lines: list[tuple[bool, str] | None] = [None] * dist.get_world_size(pp_group)
    dist.all_gather_object(lines, (head is not None, line), group=pp_group)
    stages = [entry for entry in lines if entry is not None]
    return next((text for has_head, text in stages if has_head), line) + " on the last pipeline stage"


def log_kernels(
    job: Job,
    model: ModelParts,
    device: torch.device,
    optimizer_kernel: tuple[str, str],
    sdpa_why: str,
    pp_group: dist.ProcessGroup | None,
) -> None:
    """Log the loss, optimizer step and attention kernel lines on rank 0; every rank calls it (a collective under PP).

    Args:
        job: the resolved job.
        model: the built model parts.
        device: the training device.
        optimizer_kernel: `titan_core.optim.resolve_implementation`'s (implementation, reason).
        sdpa_why: `titan_parallel.choose_sdpa_backends`'s reason.
        pp_group: the pipeline-parallel group, when there is more than one stage.
    """
    assert job.dims is not None
    loss_line = describe_loss(job.cfg.training.fused_loss, model.head, pp_group)
    if dist.is_initialized() and dist.get_rank() != 0:
        return
    logger.info("loss: %s", loss_line)
    if model.copies is not None:
        logger.info("optimizer step kernel: master weights (%s)", job.weights_reason)
    else:
        logger.info("optimizer step kernel: %s (%s)", *optimizer_kernel)
    o = job.parallel
    ring = o.cp_rotate_method if job.dims.cp > 1 and o.cp_method == "ring" else None
    logger.info("attention kernel: %s", describe_attention(sdpa_why, job.cfg.model.attn_mask_type, device, ring))
