"""Multi-token prediction (DeepSeek-V3 section 2.2), the pieces every family shares.

Depth `k` combines the main model's last hidden state at position `i` (before the final norm), through depth
`k - 1`, with the embedding of token `i + k` (`MTPInput`: `eh_proj(cat(enorm(emb), hnorm(h)))`), runs one more of
the family's blocks and its own final norm (`head_norm`), and predicts token `i + k + 1` through the shared
`output`. A family's depth block is `class MTPBlock(MTPDepth, TransformerBlock)`: entries `n_layers ..` of
`layers`, so every parallel wrapping that splits a block splits them too. Only `forward(..., mtp=True)` runs them
(training, `run_depths`), and the output then holds the main rows and each depth's, stacked on the batch dim.
DeepSeek-V3 trains them with its Mixture-of-Experts blocks; Llama 3 and Qwen3 with theirs (as Xiaomi's MiMo and
Qwen3-Next do).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn

from titan_parallel.plan import TPStyle

if TYPE_CHECKING:
    from torch.nn.attention.flex_attention import BlockMask

__all__ = [
    "MTPInput",
    "MTPDepth",
    "MTP_TP",
    "depth_extra_params",
    "embed_with_depths",
    "run_depths",
    "check_depth_tokens",
    "tokens_ahead",
]

MTP_TP = (("input_proj", TPStyle.TOKENWISE), ("head_norm", TPStyle.NORM))
"""A depth's entries of a plan's `block_tp`: its input projection runs token by token on each rank's sequence
shard with its weights replicated (`TOKENWISE`), its head norm as the final norm (sequence parallel)."""


def depth_extra_params(dim: int) -> int:
    """Parameters a depth has beyond its block's: `eh_proj` (2 dim -> dim) and the norms `enorm`, `hnorm`, `head_norm`.

    Args:
        dim: the model's width.
    """
    return 2 * dim * dim + 3 * dim


class MTPInput(nn.Module):
    """A multi-token-prediction depth's input: `eh_proj(cat(enorm(emb), hnorm(h)))`, token by token.

    Args:
        dim: the model's width.
        norm_eps: epsilon of its RMSNorms.
    """

    def __init__(self, dim: int, norm_eps: float):
        super().__init__()
        self.enorm = nn.RMSNorm(dim, eps=norm_eps)
        self.hnorm = nn.RMSNorm(dim, eps=norm_eps)
        self.eh_proj = nn.Linear(2 * dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Args:
        x: `(bs, seqlen, 2 * dim)`: the embeddings of the tokens `k` ahead, then the previous depth's hidden states.
        """
        emb, h = x.chunk(2, dim=-1)
        return self.eh_proj(torch.cat([self.enorm(emb), self.hnorm(h)], dim=-1))


class MTPDepth:
    """Turns a family's block into one multi-token-prediction depth: put it first in the bases
    (`class MTPBlock(MTPDepth, TransformerBlock)`); the block is built and initialised as the family's, then
    `input_proj` and `head_norm` are added (`eh_proj` at std 0.02 times the block's `init_scale`, muP's, if any).

    Args:
        layer_id: its index in `layers` (`n_layers + depth - 1`); depth-scales the block's output-side init.
        args: the model's shape (`dim`, `norm_eps` and what the block reads).
    """

    input_proj: MTPInput
    head_norm: nn.RMSNorm
    input_width: int
    """The last dim of its input (a block's is `dim`), for callers that build one (the memory estimator)."""

    def __init__(self, layer_id: int, args: Any):
        super().__init__(layer_id, args)  # type: ignore[call-arg]  # the family's block
        self.input_proj = MTPInput(args.dim, args.norm_eps)
        self.head_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.input_width = 2 * args.dim

    def forward(
        self,
        x: torch.Tensor,
        rope_cache: torch.Tensor,
        positions: torch.Tensor | None = None,
        mask: torch.Tensor | BlockMask | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Args:
            x: `(bs, seqlen, 2 * dim)`, see `MTPInput.forward`.
            rope_cache, positions, mask: as the block's.

        Returns:
            `(h, head_norm(h))`, each `(bs, seqlen, dim)`: `h` feeds the next depth, the other the output.
        """
        h = super().forward(self.input_proj(x), rope_cache, positions, mask)  # type: ignore[misc]
        return h, self.head_norm(h)

    def init_weights(self, *args: Any) -> None:
        """The block's `init_weights` (with its arguments, e.g. the MoE buffers' device), then the depth's own:
        norms ones, `eh_proj` truncated normal at std 0.02 times the block's `init_scale`."""
        super().init_weights(*args)  # type: ignore[misc]
        for norm in (self.input_proj.enorm, self.input_proj.hnorm, self.head_norm):
            norm.reset_parameters()
        std = 0.02 * getattr(self, "init_scale", 1.0)
        nn.init.trunc_normal_(self.input_proj.eh_proj.weight, mean=0.0, std=std, a=-3 * std, b=3 * std)


def check_depth_tokens(tokens: torch.Tensor | None, ahead: torch.Tensor | None, tok_embeddings: nn.Module | None):
    """Refuse multi-token prediction without the embedding, or without token ids to take each depth's from."""
    if tok_embeddings is None or (ahead is None and (tokens is None or tokens.dim() != 2)):
        raise ValueError(
            "multi-token prediction needs tok_embeddings and the token ids: on a pipeline stage after the first or a "
            "context-parallel shard, pass mtp_tokens and give the stage a copy of tok_embeddings "
            "(module_names_per_stage)"
        )


def tokens_ahead(tokens: torch.Tensor, depths: int) -> torch.Tensor:
    """Each depth's input tokens: depth `k`'s are the ids `k` ahead (wrapped around at the end: those positions'
    targets are -100). Take them on whole sequences, before anything cuts them.

    Args:
        tokens: `(bs, seqlen)` token ids.
        depths: the depths run.

    Returns:
        `(bs, depths, seqlen)`.
    """
    return torch.stack([tokens.roll(-k, dims=1) for k in range(1, depths + 1)], dim=1)


def embed_with_depths(
    tok_embeddings: Callable[[torch.Tensor], torch.Tensor],
    tokens: torch.Tensor | None,
    depths: int,
    ahead: torch.Tensor | None = None,
):
    """The embeddings of the main rows and of each depth's tokens, in one lookup.

    Args:
        tok_embeddings: the model's embedding.
        tokens: `(bs, seqlen)` token ids of the main rows; None where the main rows are hidden states already (the
            last pipeline stage).
        depths: the depths run.
        ahead: `tokens_ahead` of the whole sequences, `(bs, depths, seqlen)` (the shard's positions under context
            parallel); None: taken from `tokens`.

    Returns:
        `1 + depths` tensors `(bs, seqlen, dim)`, the main rows' first (None without `tokens`).
    """
    rows = list((ahead if ahead is not None else tokens_ahead(cast(torch.Tensor, tokens), depths)).unbind(1))
    if tokens is not None:
        rows.insert(0, tokens)
    embedded = tok_embeddings(torch.cat(rows, dim=0)).chunk(len(rows), dim=0)
    return embedded if tokens is not None else (None, *embedded)


def run_depths(
    layers: nn.ModuleDict,
    n_layers: int,
    embedded: tuple[torch.Tensor, ...] | list[torch.Tensor],
    h: torch.Tensor,
    out: torch.Tensor,
    *block_args: Any,
    readout: float = 1.0,
) -> torch.Tensor:
    """Run the depths after the main blocks and stack their head inputs under the main rows'.

    Args:
        layers: the model's blocks, the depths `n_layers ..` among them.
        n_layers: the main blocks.
        embedded: `embed_with_depths`' result.
        h: the main model's last hidden states (before the final norm).
        out: the main rows' head input (after the final norm and any readout factor).
        block_args: what each block takes after its input (the RoPE table, positions, mask).
        readout: a factor on each depth's head input, as on the main rows' (muP's readout multiplier).

    Returns:
        `(bs * (1 + depths), seqlen, dim)`.
    """
    heads = [out]
    for k in range(1, len(embedded)):
        h, head_in = layers[str(n_layers + k - 1)](torch.cat([embedded[k], h], dim=-1), *block_args)
        heads.append(head_in * readout if readout != 1.0 else head_in)
    return torch.cat(heads, dim=0)
