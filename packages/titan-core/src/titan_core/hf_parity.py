"""The parity check behind `titan convert`: transformers' logits on a Hugging Face folder against Titan's on
the same weights, both in float32 on the same random tokens.

A conversion that touches Hugging Face is only renamed into place once this check passes
(`titan_core.convert.convert_checkpoint`); without transformers installed it is skipped and says so.
"""

from __future__ import annotations

import importlib.util
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from titan_ckpt.dtypes import cast_floating
from titan_ckpt.hf_safetensors import read_hf_config

PARITY_TOKENS = 256
"""Sequence length of the parity check."""
PARITY_MAX_KL = 1e-4
"""Mean KL(HF || Titan) per token above which the parity check fails (fp32 on both sides
with identical weights gives ~1e-10)."""


@dataclass(frozen=True)
class ParityReport:
    """Outcome of comparing Hugging Face logits with Titan's on the same weights.

    Args:
        max_abs_diff: largest absolute logit difference; None when skipped.
        kl: mean per-token KL(HF || Titan); None when skipped.
        n_tokens: sequence length compared.
        skipped: why no check ran, or None.
    """

    max_abs_diff: float | None
    kl: float | None
    n_tokens: int
    skipped: str | None = None

    @property
    def passed(self) -> bool:
        """True when skipped or when the logits agree (finite, KL within `PARITY_MAX_KL`)."""
        if self.skipped is not None:
            return True
        assert self.max_abs_diff is not None and self.kl is not None  # None only when skipped
        return math.isfinite(self.max_abs_diff) and math.isfinite(self.kl) and self.kl <= PARITY_MAX_KL

    def describe(self) -> str:
        """One line: `parity: max_abs_diff=1.2e-06 kl=3.4e-13 tokens=256 ...` or why it was skipped."""
        if self.skipped is not None:
            return f"parity: skipped ({self.skipped})"
        verdict = "ok" if self.passed else f"FAILED, kl above {PARITY_MAX_KL:g}"
        return (
            f"parity: max_abs_diff={self.max_abs_diff:.3e} kl={self.kl:.3e} tokens={self.n_tokens} "
            f"({verdict}; transformers on the HF files vs Titan on the Titan weights, float32)"
        )


class ParityError(RuntimeError):
    """The converted weights do not reproduce the source's logits."""


@torch.no_grad()
def check_hf_parity(
    hf_folder: Path,
    titan_state_dict: dict[str, torch.Tensor],
    args: Any,
    build: Callable[[Any], torch.nn.Module],
    hf_architecture: str,
    round_to: torch.dtype | None = None,
    n_tokens: int = PARITY_TOKENS,
) -> ParityReport:
    """Logits of transformers' model on `hf_folder` vs Titan's model on `titan_state_dict`,
    both in float32 on the same random tokens.

    Args:
        hf_folder: a Hugging Face checkpoint folder.
        titan_state_dict: Titan-named weights.
        args: the model's args.
        build: the model builder (`ModelSpec.build`).
        hf_architecture: transformers class name, e.g. "LlamaForCausalLM".
        round_to: round both sides' weights to this dtype first, so a conversion that
            changes dtype is compared on equal weights; None compares them as stored.
        n_tokens: sequence length (capped at the model's `max_seq_len`).

    Returns:
        The report; `skipped` says why when transformers is not installed.
    """
    try:
        import transformers
    except ImportError:
        return ParityReport(None, None, 0, skipped="transformers is not installed; `pip install transformers` to check")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    n_tokens = min(n_tokens, args.max_seq_len)
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, args.vocab_size, (1, n_tokens), generator=generator).to(device)  # (1, seqlen)

    dtype_kwarg = "dtype" if int(transformers.__version__.split(".")[0]) >= 5 else "torch_dtype"
    kwargs: dict[str, Any] = {dtype_kwarg: torch.float32}
    if read_hf_config(hf_folder).get("quantization_config"):  # block FP8: transformers' dequantization is the reference
        if importlib.util.find_spec("accelerate") is None or not hasattr(transformers, "FineGrainedFP8Config"):
            why = "transformers reads an FP8 checkpoint with accelerate (`pip install accelerate`) from version 4.50"
            return ParityReport(None, None, 0, skipped=f"{why}; install both to check")
        kwargs["quantization_config"] = transformers.FineGrainedFP8Config(dequantize=True)
    hf_class = getattr(transformers, hf_architecture)
    hf_logging = transformers.utils.logging
    bar_was_on = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # a "Loading weights" bar per check is noise in `titan convert`'s output
    try:
        hf_model = hf_class.from_pretrained(hf_folder, local_files_only=True, **kwargs)
    except (ValueError, RuntimeError) as err:  # transformers 5 reports a failed weight conversion as RuntimeError
        if "quantization_config" not in kwargs:
            raise
        # transformers' FP8 op takes the block from the scale grid and refuses partial blocks (DeepSeek-V3's
        # 576-row kv_a_proj_with_mqa), which Titan reads (titan_ckpt.hf_fp8): no reference to compare with
        first = str(err).splitlines()[0] if str(err) else type(err).__name__
        return ParityReport(None, None, 0, skipped=f"transformers could not dequantize these FP8 weights: {first}")
    finally:
        if bar_was_on:
            hf_logging.enable_progress_bar()
    hf_model = hf_model.to(device).eval()
    if round_to is not None:
        for param in hf_model.parameters():
            param.copy_(param.to(round_to))
    hf_logits = hf_model(tokens).logits.double()  # (1, seqlen, vocab)
    del hf_model

    with torch.device(device):  # a plain build: its default init is cheap, unlike init_weights' truncated normals
        model = build(args)
    model.load_state_dict(cast_floating(titan_state_dict, round_to), strict=True)
    titan_logits = model.eval()(tokens).double()  # (1, seqlen, vocab)
    del model

    log_p, log_q = hf_logits.log_softmax(-1), titan_logits.log_softmax(-1)
    kl = (log_p.exp() * (log_p - log_q)).sum(-1).mean().item()
    return ParityReport((hf_logits - titan_logits).abs().max().item(), kl, n_tokens)
