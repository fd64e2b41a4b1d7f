"""Which kernel `F.scaled_dot_product_attention` runs: an order of SDPA backends, chosen once.

"auto" puts cuDNN first on Hopper and newer (compute capability >= 9.0): on an H100
(torch 2.11, cuDNN 9.19) its causal forward + backward ran 1.48x FlashAttention-2 at
the Llama 3.2 1B shape (batch 4, seq 2048, 32/8 heads of 64) and 1.84x at the 8B shape
(seq 8192, heads of 128), grouped-query heads passed natively (benchmarks/attention_backends.py,
figures in docs/performance.md). Then flash, memory-efficient and math, so inputs cuDNN
does not take still run. Before Hopper, flash comes first. On other devices torch's own
choice is kept. Naming one backend pins it: torch then fails with "No available kernel"
where that backend cannot take the inputs ("No viable backend"), rather than silently running another.

The order is applied with `torch.nn.attention.sdpa_kernel(..., set_priority=True)`
around the forward (and backward) of each step (`sdpa_context`), as torchtitan does;
the model code is untouched.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Literal

import torch

__all__ = ["AttentionBackend", "ATTENTION_BACKENDS", "choose_sdpa_backends", "sdpa_context"]

AttentionBackend = Literal["auto", "cudnn", "flash", "efficient", "math"]
ATTENTION_BACKENDS: tuple[str, ...] = ("auto", "cudnn", "flash", "efficient", "math")


def _backend(name: str):
    from torch.nn.attention import SDPBackend

    return {
        "cudnn": SDPBackend.CUDNN_ATTENTION,
        "flash": SDPBackend.FLASH_ATTENTION,
        "efficient": SDPBackend.EFFICIENT_ATTENTION,
        "math": SDPBackend.MATH,
    }[name]


def choose_sdpa_backends(choice: str, device: torch.device) -> tuple[tuple[str, ...] | None, str]:
    """The SDPA backends to allow, in priority order, and why.

    Args:
        choice: "auto", or one backend to pin ("cudnn", "flash", "efficient", "math").
        device: the training device.

    Returns:
        (names in priority order, or None to keep torch's own choice; a one-line reason).

    Raises:
        ValueError: an unknown `choice` (the message names the choices).
    """
    if choice not in ATTENTION_BACKENDS:
        raise ValueError(f"attention backend {choice!r} is not one of {', '.join(ATTENTION_BACKENDS)}")
    if choice != "auto":
        return (choice,), f"{choice} (pinned)"
    if device.type != "cuda":
        return None, f"torch's default order (no preference on {device.type})"
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) >= (9, 0):
        order = ("cudnn", "flash", "efficient", "math")
        why = (
            f"cuDNN first on compute capability {major}.{minor} (Hopper+: 1.5-1.8x FlashAttention-2 at training shapes)"
        )
    else:
        order = ("flash", "cudnn", "efficient", "math")
        why = f"FlashAttention-2 first on compute capability {major}.{minor}"
    return order, why


def sdpa_context(backends: Sequence[str] | None) -> contextlib.AbstractContextManager:
    """A context in which SDPA tries `backends` in order.

    Args:
        backends: names in priority order (`choose_sdpa_backends`); None or empty: torch's default, no context.
    """
    if not backends:
        return contextlib.nullcontext()
    from torch.nn.attention import sdpa_kernel

    return sdpa_kernel([_backend(name) for name in backends], set_priority=True)
