"""Model definitions for Titan (Llama 3 first), with their parallel plans as data.

`get_model_spec(name)` returns a `ModelSpec` (builder, flavors, plan, FLOP count,
`HFAdapter`); `get_model_args(name, flavor)` returns one named shape.
"""

from titan_models.registry import get_model_args, get_model_spec, register_model_spec
from titan_models.spec import ActivationBytes, ActivationLayout, HFAdapter, ModelSpec

__all__ = ["ActivationBytes", "ActivationLayout", "HFAdapter", "ModelSpec", "get_model_args", "get_model_spec", "register_model_spec"]
