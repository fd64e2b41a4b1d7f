"""How fast generation ran, and how close the decode came to the GPU's memory-bandwidth limit.

At batch 1 a decode step reads every weight once to compute one token per sequence,
plus the keys and values cached so far, and does little arithmetic with them: its
floor is `bytes read / peak bandwidth`. The share reported is

    (parameter bytes + KV cache bytes in use) x decode steps/s / peak bytes/s

with every parameter counted once (a tied embedding too) and the KV bytes of the slots
filled at each step (padding included). It counts what must be read, not what the
kernels read: the static step attends over the whole preallocated cache, a
Mixture-of-Experts model reads only its routed experts, and an untied embedding
only the rows of the batch. The peaks are datasheet figures (`peak_memory_bandwidth`).

`DecodeClock` times the prefill and the decode steps apart, waiting for the device
only at those boundaries, never inside a step; the first `warmup_steps` decode steps
(compilation, CUDA graph capture) are timed on their own and left out of the rate.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass

import torch
from torch import nn

# (name word, qualifier word or None, peak bytes/s), matched as whole words on
# `torch.cuda.get_device_name`; rows with a qualifier come before the bare row of the same GPU.
_GPU_BANDWIDTH: list[tuple[str, str | None, float]] = [
    ("H100", "PCIe", 2.0e12),  # H100 PCIe: 2.0 TB/s HBM2e
    ("H100", "NVL", 3.9e12),  # H100 NVL: 3.9 TB/s HBM3
    ("H100", None, 3.35e12),  # H100 SXM ("NVIDIA H100 80GB HBM3"): 3.35 TB/s
    ("H200", None, 4.8e12),  # H200: 4.8 TB/s HBM3e
    ("A100", "80GB", 2.0e12),  # A100 80GB: 2.0 TB/s HBM2e (SXM 2.04, PCIe 1.94)
    ("A100", "40GB", 1.555e12),  # A100 40GB: 1.555 TB/s HBM2
    ("L4", None, 0.3e12),  # L4: 300 GB/s GDDR6
    ("B200", None, 8.0e12),  # B200: 8 TB/s HBM3e
]


def _has_word(name: str, word: str) -> bool:
    """Whether `word` appears in `name` as a whole word (case-insensitive): "GH200" is not "H200"."""
    return re.search(rf"(?<![A-Za-z0-9]){re.escape(word)}(?![A-Za-z0-9])", name, re.IGNORECASE) is not None


def peak_memory_bandwidth(device_name: str) -> float | None:
    """Datasheet peak memory bandwidth in bytes/s of the GPU called `device_name`, or None if unknown.

    Args:
        device_name: as `torch.cuda.get_device_name` reports it, e.g. "NVIDIA H100 80GB HBM3".
    """
    for word, qualifier, peak in _GPU_BANDWIDTH:
        if _has_word(device_name, word) and (qualifier is None or _has_word(device_name, qualifier)):
            return peak
    return None


def parameter_bytes(model: nn.Module) -> int:
    """Bytes of the model's parameters, each counted once (a tied weight too); buffers left out."""
    return sum(p.nbytes for p in model.parameters())


@dataclass(frozen=True)
class DecodeTiming:
    """Where a `generate` call spent its time.

    Args:
        batch_size: sequences generated together.
        prompt_slots: the longest prompt (every prompt is left-padded to it).
        prefill_s: the prompts' forward and the choice of the first token.
        warmup_steps: decode steps timed apart (compilation, CUDA graph capture).
        warmup_s: their seconds.
        steps: decode steps in the rate (one token per sequence each).
        decode_s: their seconds.
        kv_slots: sum over those steps of the cache slots in use per sequence, the new one included.
    """

    batch_size: int
    prompt_slots: int
    prefill_s: float
    warmup_steps: int
    warmup_s: float
    steps: int
    decode_s: float
    kv_slots: int

    @property
    def steps_per_s(self) -> float:
        """Decode steps per second (0 when none was timed)."""
        return self.steps / self.decode_s if self.steps and self.decode_s > 0 else 0.0

    @property
    def tokens_per_s(self) -> float:
        """Decode tokens per second, every sequence of the batch counted (finished ones too)."""
        return self.steps_per_s * self.batch_size

    def bytes_per_step(self, param_bytes: int, kv_bytes_per_token: int) -> float:
        """Mean bytes a decode step must read: every parameter, plus the KV cache of the slots in use."""
        kv = kv_bytes_per_token * self.batch_size * self.kv_slots / self.steps if self.steps else 0.0
        return param_bytes + kv


class DecodeClock:
    """Times a generation: prefill, warm-up steps, then the decode steps of the rate.

    Waits for the device (`torch.cuda.synchronize`) only at the start, after the prefill,
    after the warm-up steps and at the end.

    Args:
        device: the model's device.
        batch_size: sequences generated together.
        prompt_slots: the longest prompt.
        warmup_steps: decode steps to time apart.
    """

    def __init__(self, device: torch.device, batch_size: int, prompt_slots: int, warmup_steps: int):
        self.device, self.batch_size, self.prompt_slots = device, batch_size, prompt_slots
        self.warmup_steps = warmup_steps
        self.marks: list[float] = []
        self.steps = 0

    def _mark(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.marks.append(time.perf_counter())

    def start(self) -> None:
        """Before the prefill."""
        self._mark()

    def prefill_done(self) -> None:
        """After the prefill and the first token."""
        self._mark()

    def before_step(self) -> None:
        """Before each decode step: ends the warm-up after `warmup_steps` of them."""
        if self.steps == self.warmup_steps:
            self._mark()
        self.steps += 1

    def timing(self) -> DecodeTiming:
        """Stop the clock (after the last step) and return the figures."""
        self._mark()
        start, prefilled, *rest = self.marks
        warm_end = rest[0] if len(rest) == 2 else rest[-1]  # no mark when the warm-up took every step
        timed = max(self.steps - self.warmup_steps, 0)
        warmup = self.steps - timed
        # slot count at decode step i (1-based): the prompt, i - 1 earlier decoded tokens, the new one
        kv_slots = sum(self.prompt_slots + i for i in range(warmup + 1, self.steps + 1))
        return DecodeTiming(
            batch_size=self.batch_size,
            prompt_slots=self.prompt_slots,
            prefill_s=prefilled - start,
            warmup_steps=warmup,
            warmup_s=warm_end - prefilled,
            steps=timed,
            decode_s=rest[-1] - warm_end,
            kv_slots=kv_slots,
        )


def speed_summary(timing: DecodeTiming, param_bytes: int, kv_bytes_per_token: int, device: torch.device) -> str:
    """One line: prefill, decode tokens/s, bytes read per step, and on a known GPU the share of its bandwidth.

    Args:
        timing: from `GenerationResult.timing`.
        param_bytes: `parameter_bytes(model)`.
        kv_bytes_per_token: `GenerationResult.kv_bytes_per_token` (0 without a cache).
        device: the model's device; a CUDA device is looked up in `peak_memory_bandwidth`.
    """
    t = timing
    parts = [f"prefill {t.batch_size} x {t.prompt_slots} tokens in {t.prefill_s:.3f} s"]
    if t.warmup_steps:
        parts.append(f"first {t.warmup_steps} decode steps (compile, warm-up) {t.warmup_s:.2f} s")
    if not t.steps:
        parts.append("decode: too few steps to time (raise --max-new-tokens)")
        return "; ".join(parts)
    read = t.bytes_per_step(param_bytes, kv_bytes_per_token)
    achieved = read * t.steps_per_s
    decode = (
        f"decode {t.steps} steps x {t.batch_size} in {t.decode_s:.3f} s: {t.tokens_per_s:.1f} tokens/s, "
        f"{read / 1e9:.3f} GB read per step, {achieved / 1e9:.1f} GB/s"
    )
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        peak = peak_memory_bandwidth(name)
        decode += (
            f" = {100 * achieved / peak:.1f}% of the {peak / 1e12:.2f} TB/s peak of {name}"
            if peak
            else f" (no peak bandwidth known for {name})"
        )
    parts.append(decode)
    return "; ".join(parts)
