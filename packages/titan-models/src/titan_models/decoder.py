"""The forward every family's `Transformer` runs: embedding, the main blocks, final norm, the multi-token-prediction
depths when asked, output. One function, so Llama 3, Qwen3 and DeepSeek-V3 stay the same model around their blocks.

A pipeline stage holds only some of the modules (`tok_embeddings`, `norm` or `output` None, entries of `layers`
deleted): the forward skips what is missing. With multi-token prediction the last stage holds the depths and a
copy of `tok_embeddings` (`titan_parallel.SharedWeights` keeps it equal to the first stage's) and embeds the
tokens ahead from `mtp_tokens`, as a context-parallel shard does. muP's embedding and readout multipliers
(`ModelArgs.mup`, where a family has it) are applied here, the readout on the output's input so a fused loss
applies it too.
"""

from __future__ import annotations

from typing import Any

import torch

from titan_models.document_mask import block_causal_mask
from titan_models.mtp import check_depth_tokens, embed_with_depths, run_depths

__all__ = ["decoder_forward"]


def decoder_forward(
    model: Any,
    tokens: torch.Tensor,
    positions: torch.Tensor | None = None,
    document_ids: torch.Tensor | None = None,
    mtp: bool = False,
    mtp_tokens: torch.Tensor | None = None,
) -> torch.Tensor:
    """A family's `Transformer.forward` (see there for the arguments and the result).

    Args:
        model: the `Transformer` (its `args`, `tok_embeddings`, `layers`, `norm`, `output`, `rope_cache`,
            `skip_output`).
        tokens: `(bs, seqlen)` token ids, or `(bs, seqlen, dim)` hidden states on a stage after the first.
        positions: absolute positions for RoPE; None means `arange(seqlen)`.
        document_ids: `(bs, seqlen)` document of each position (block-causal attention); None: causal.
        mtp: also run the multi-token-prediction depths (`titan_models.mtp`).
        mtp_tokens: `(bs, n_mtp_layers, seqlen)` each depth's input tokens (`titan_models.mtp.tokens_ahead` of the
            whole sequences), where the forward cannot take them from `tokens`: the last pipeline stage (hidden
            states in; it holds the depths and a copy of `tok_embeddings`), a context-parallel shard.
    """
    args = model.args
    seqlen = tokens.shape[1]
    if positions is None and seqlen > args.max_seq_len:
        raise ValueError(
            f"sequence length {seqlen} exceeds ModelArgs.max_seq_len={args.max_seq_len}; "
            "shorten the sequence or raise max_seq_len"
        )
    mup, main_layers = getattr(args, "mup", None), args.n_layers
    depths = args.n_mtp_layers if mtp and str(main_layers) in model.layers else 0  # the stage holding the depths
    ids = not tokens.is_floating_point()  # token ids (the first stage), else hidden states from the previous one
    embedded: Any = ()
    if depths:  # one lookup for the main rows and each depth's tokens k ahead (wrapped: their targets are -100)
        check_depth_tokens(tokens if ids else None, mtp_tokens, model.tok_embeddings)
        embedded = embed_with_depths(model.tok_embeddings, tokens if ids else None, depths, mtp_tokens)
    if ids:
        h = embedded[0] if depths else model.tok_embeddings(tokens)  # (bs, seqlen, dim)
        if mup is not None and mup.embedding_multiplier != 1.0:
            h = h * mup.embedding_multiplier
    else:
        h = tokens
    if mup is not None and mup.embedding_multiplier != 1.0:
        embedded = [e * mup.embedding_multiplier if e is not None else None for e in embedded]
    mask = block_causal_mask(document_ids) if document_ids is not None else None  # shared by every block
    for key, layer in model.layers.items():
        if int(key) < main_layers:
            h = layer(h, model.rope_cache, positions, mask)
    out = h
    readout = mup.readout_scale(args.dim) if mup is not None else 1.0
    if model.norm is not None:
        out = model.norm(h)
        if mup is not None:
            out = out * readout
    if depths:
        out = run_depths(
            model.layers, main_layers, embedded, h, out, model.rope_cache, positions, mask, readout=readout
        )
    if model.output is None or model.skip_output:
        return out  # (bs, seqlen, dim): a stage without the output, or the loss applies it
    return model.output(out)  # (bs, seqlen, vocab_size)
