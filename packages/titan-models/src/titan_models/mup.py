"""The maximal update parametrization (muP): hyperparameters tuned on a narrow model that hold on a wide one.

Under the standard parametrization the best learning rate shrinks as the model widens, so every width needs
its own sweep. muP (Yang et al., "Tensor Programs V", 2022) rescales initialisation, multipliers and
per-layer learning rates with the width multiplier `m = dim / base_dim` so that every layer's update moves
its activations by the same amount at any width: tune at `base_dim`, train at `m x base_dim` with the same
settings. This follows the table of "The Practitioner's Guide to the Maximal Update Parameterization"
(Cerebras and EleutherAI, 2024) for a pre-norm decoder trained with Adam:

    embedding      init std as tuned              forward x `embedding_multiplier`   Adam lr x 1
    block matrices init std as tuned / sqrt(m)    -                                  Adam lr x 1 / m
    attention      scores q.k x sqrt(base_head_dim) / head_dim (1/d_head at any head width)
    output         init std `base_dim ** -0.5`    input x `output_multiplier / m`    Adam lr x 1
    norms          ones                           -                                  Adam lr x 1

At `m = 1` with `base_head_dim = head_dim` and multipliers 1 this is the model's standard parametrization
exactly (the tests check bit-identical training). The learning-rate side (`1 / m` for the blocks' matrices)
belongs to the optimizer, which titan-core builds; the model holds the rest. Embeddings must be untied (the
embedding and the output scale differently). Hugging Face's architectures have no multipliers: the adapters
fold them into the weights (`fold_into_weights`), which changes no output.

Why not the `mup` package: it swaps modules (`MuReadout`), rescales weights after construction and needs base
shapes saved to a file; here the model is built on the meta device, sharded and initialised in place, so the
multipliers live in the model's own forward and init.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from titan_models.errors import ModelConfigError

__all__ = ["MuP", "check_mup", "fold_into_weights"]


@dataclass(frozen=True)
class MuP:
    """muP's base shape and multipliers, held in a dense model's `ModelArgs.mup`.

    Args:
        base_dim: the width (`dim`) the hyperparameters were tuned at.
        base_head_dim: the head width of the tuned model (widening by heads keeps it: the model's own).
        embedding_multiplier: scales the token embeddings in the forward (the guide's alpha_input).
        output_multiplier: scales the logits, divided by the width multiplier (the guide's alpha_output).
    """

    base_dim: int
    base_head_dim: int
    embedding_multiplier: float = 1.0
    output_multiplier: float = 1.0

    def width_multiplier(self, dim: int) -> float:
        """`m = dim / base_dim`.

        Args:
            dim: the model's width.
        """
        return dim / self.base_dim

    def hidden_init_scale(self, dim: int) -> float:
        """Factor on the init std of the blocks' matrices: `1 / sqrt(m)`.

        Args:
            dim: the model's width.
        """
        return self.width_multiplier(dim) ** -0.5

    def readout_scale(self, dim: int) -> float:
        """Factor on the final hidden states before the output projection: `output_multiplier / m`.

        Args:
            dim: the model's width.
        """
        return self.output_multiplier / self.width_multiplier(dim)

    def output_init_std(self) -> float:
        """Init std of the output projection: `base_dim ** -0.5`, the standard one at the base width."""
        return self.base_dim**-0.5

    def query_scale(self, head_dim: int) -> float:
        """Factor on the queries so that attention scores scale as `1 / head_dim`: `sqrt(base_head_dim / head_dim)`.

        The attention kernels divide by `sqrt(head_dim)`; the queries carry the rest, so every attention
        backend (context parallel, the KV cache) runs unchanged.

        Args:
            head_dim: the model's head width.
        """
        return (self.base_head_dim / head_dim) ** 0.5


def check_mup(mup: MuP, *, tied: bool, moe: bool) -> None:
    """Refuse a model muP does not cover here.

    Args:
        mup: the settings.
        tied: the model ties its embedding and output weights.
        moe: the model has Mixture-of-Experts layers.

    Raises:
        ModelConfigError: tied embeddings, MoE layers, or a base shape that is not positive.
    """
    if mup.base_dim <= 0 or mup.base_head_dim <= 0:
        raise ModelConfigError(
            f"MuP.base_dim={mup.base_dim} and base_head_dim={mup.base_head_dim} must be positive widths"
        )
    if tied:
        raise ModelConfigError(
            "muP needs untied embeddings (the embedding and the output scale differently with width); "
            "set tie_word_embeddings=False"
        )
    if moe:
        raise ModelConfigError("muP here covers dense models; the experts' and router's scaling is not built")
    if mup.embedding_multiplier <= 0 or mup.output_multiplier <= 0:
        raise ModelConfigError(f"MuP multipliers must be positive, got {mup}")


def fold_into_weights(
    state_dict: dict[str, torch.Tensor], mup: MuP, *, dim: int, head_dim: int, query_key: str, unfold: bool = False
) -> dict[str, torch.Tensor]:
    """The same function without multipliers: each one multiplied into the weight it follows (or divided out).

    The embedding multiplier goes into `tok_embeddings.weight`, the readout scale into `output.weight`, the query
    scale into the tensor whose output is the query before RoPE (`query_key`: Llama's `wq` rows, Qwen3's
    `q_norm` weight, as QK-norm would undo a scaled `wq`); RoPE is linear, so the product is exact up to rounding.
    Works on part of a state dict (one tensor at a time); other tensors pass through unchanged.

    Args:
        state_dict: Titan names.
        mup: the model's settings.
        dim: the model's width.
        head_dim: the model's head width.
        query_key: the suffix of the query tensors' names, e.g. "attention.wq.weight".
        unfold: divide instead (a folded export read back into a muP model).
    """
    factors = {
        "tok_embeddings.weight": mup.embedding_multiplier,
        "output.weight": mup.readout_scale(dim),
    }
    query = mup.query_scale(head_dim)
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state_dict.items():
        factor = factors.get(name, query if name.endswith("." + query_key) else 1.0)
        if factor != 1.0:
            scaled = tensor.double() / factor if unfold else tensor.double() * factor
            tensor = scaled.to(tensor.dtype)
        out[name] = tensor
    return out
