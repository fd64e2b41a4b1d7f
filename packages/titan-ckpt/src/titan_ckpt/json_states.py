"""Non-tensor training state (data loader position, LR schedule, step counters, RNG) as JSON files.

This state is plain data and the same on every rank, so rank 0 writes one
`<name>.json` per stateful object into the step folder. JSON rather than DCP: DCP
would pickle non-tensor values and unpickle them on load, which can run code.
"""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Any, Protocol

import torch

from titan_ckpt.errors import CheckpointError
from titan_ckpt.manifest import write_json_durably


class JsonStateful(Protocol):
    """An object whose `state_dict()` is JSON-able plain data (e.g. `PackedLoader`, `LambdaLR`)."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class TensorStateful(Protocol):
    """An object whose `state_dict()` is tensors by name (plain tensors or DTensors, the live ones: DCP saves them
    resharded and loads into them in place), then given back to `load_state_dict` once filled (e.g. an exponential
    moving average of the weights)."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


def to_json_text(name: str, state: Any) -> str:
    """Serialise a state dict to JSON text, failing with the offending state's name.

    Args:
        name: the state's name in the checkpoint (e.g. "lr_scheduler").
        state: its `state_dict()`.

    Raises:
        CheckpointError: the state holds something JSON cannot represent (a tensor, an object).
    """
    try:
        return json.dumps(state, sort_keys=True)
    except (TypeError, ValueError) as err:
        raise CheckpointError(
            f"the '{name}' state is not plain JSON data ({err}); "
            "its state_dict() must return numbers, strings, lists and dicts"
        ) from None


def write_json_state(folder: Path, name: str, text: str) -> None:
    """Write `folder/<name>.json` durably.

    Args:
        folder: the step folder being written.
        name: the state's name.
        text: what `to_json_text` returned.
    """
    write_json_durably(folder / f"{name}.json", json.loads(text))


def read_json_state(folder: Path, name: str) -> Any:
    """Read `folder/<name>.json`.

    Args:
        folder: the step folder.
        name: the state's name.

    Raises:
        CheckpointError: missing or not JSON.
    """
    path = folder / f"{name}.json"
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(
            f"{path} is missing; pick another checkpoint with load_step, "
            f"or leave '{name}' out with exclude_from_loading",
            arguments=("load_step", "exclude_from_loading"),
        ) from None
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise CheckpointError(
            f"{path} is not valid JSON ({err}); pick another checkpoint with load_step", arguments=("load_step",)
        ) from None


def _encode(state: torch.Tensor) -> str:
    return base64.b64encode(state.cpu().numpy().tobytes()).decode("ascii")


def _decode(text: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8)


def rng_state_dict(device: torch.device) -> dict[str, str]:
    """The torch CPU generator's state, and the current CUDA device's when `device` is CUDA, as base64 text.

    Args:
        device: the device the run computes on.
    """
    state = {"cpu": _encode(torch.get_rng_state())}
    if device.type == "cuda":
        state["cuda"] = _encode(torch.cuda.get_rng_state(device))
    return state


def load_rng_state(state: dict[str, str], device: torch.device) -> None:
    """Restore what `rng_state_dict` returned (a CUDA state is skipped on a CPU run and vice versa).

    Args:
        state: the saved states.
        device: the device the run computes on.
    """
    torch.set_rng_state(_decode(state["cpu"]))
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(_decode(state["cuda"]), device)
