"""Reading a verified step folder back into a live run: the checks against its manifest, then the model and
optimizer tensors through DCP (resharded to the run's layout), the JSON states and the RNG.

`CheckpointManager` picks the folder and the states to load; these functions do the reading.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn

from titan_ckpt import model_state as ms
from titan_ckpt.dcp_io import SafeFileSystemReader, read_metadata_safely
from titan_ckpt.errors import CheckpointError
from titan_ckpt.json_states import JsonStateful, TensorStateful, load_rng_state, read_json_state
from titan_ckpt.manifest import find_damaged_file
from titan_ckpt.step_folders import list_complete_steps, step_folder

__all__ = ["load_states", "verify_step_folder"]


def load_states(
    folder: Path,
    names: set[str],
    *,
    external: bool,
    model_parts: list[nn.Module],
    optimizers: list[torch.optim.Optimizer],
    states: Mapping[str, JsonStateful],
    device: torch.device,
    pg: dist.ProcessGroup | None,
    load_model_fn: Callable[[Path], Mapping[str, torch.Tensor]] | None,
    tensor_states: Mapping[str, TensorStateful] | None = None,
) -> None:
    """Load the `names` states ("model", "optimizer", "rng", JSON state names) from `folder` into the live objects.

    Args:
        folder: a step folder (or an initial DCP checkpoint) holding at least `names`.
        names: the states to load.
        external: the folder's model weights are in another format (`load_model_fn` reads them).
        model_parts: the model, or this rank's pipeline stages.
        optimizers: one per model part.
        states: the run's JSON states by name.
        device: the device the run computes on (for the RNG state).
        pg: the manager's gloo group.
        load_model_fn: reads full model weights from a folder of another format, or None.
        tensor_states: the run's tensor states by name (their tensors under `<name>.<key>`).
    """
    tensors: dict[str, torch.Tensor] = {}
    part_states = opt_states = None
    if "model" in names and external:
        if load_model_fn is None:
            raise CheckpointError(
                f"{folder} holds its model weights in another format; set load_model_fn to read them, "
                "or pick a DCP checkpoint with load_step",
                arguments=("load_model_fn", "load_step"),
            )
        ms.set_full_model_state(model_parts, lambda: load_model_fn(folder), str(folder), pg)
    elif "model" in names:
        part_states = ms.get_part_states(model_parts)
        tensors.update({k: v for s in part_states for k, v in s.items()})
    if "optimizer" in names:
        opt_states = ms.get_optimizer_states(model_parts, optimizers)
        tensors.update(ms.flatten_optimizer_tensors(opt_states))
    loaded: dict[str, dict[str, torch.Tensor]] = {}
    for name in sorted(names & set(tensor_states or {})):
        loaded[name] = dict((tensor_states or {})[name].state_dict())
        tensors.update({f"{name}.{key}": value for key, value in loaded[name].items()})
    if tensors:
        ms.check_against_metadata(tensors, read_metadata_safely(folder / ".metadata"), str(folder))
        try:
            dcp.load(tensors, storage_reader=SafeFileSystemReader(str(folder)), process_group=pg)
        except Exception as err:  # DCP wraps per-rank failures in CheckpointException
            first = str(err).strip().splitlines()[-1] if str(err).strip() else type(err).__name__
            raise CheckpointError(
                f"{folder}: DCP could not load the checkpoint ({first[:300]}); pick another with load_step",
                arguments=("load_step",),
            ) from err
    if part_states is not None:
        ms.set_part_states(model_parts, part_states)
    if opt_states is not None:
        ms.set_optimizer_states(
            model_parts, optimizers, opt_states, read_json_state(folder, "optimizer")["param_groups"]
        )
    for name, filled in loaded.items():  # DCP filled their tensors in place
        (tensor_states or {})[name].load_state_dict(filled)
    for name in sorted(names & set(states)):
        states[name].load_state_dict(read_json_state(folder, name))
    if "rng" in names:
        load_rng_state(read_json_state(folder, "rng"), device)


def verify_step_folder(
    run_folder: Path, folder: Path, manifest: dict, checksums: bool, pg: dist.ProcessGroup | None
) -> None:
    """Check every file of `folder` against its manifest (split over the ranks); all ranks raise the same
    `CheckpointError`, naming the file and an older complete step of `run_folder` to resume from.

    Args:
        run_folder: the run's checkpoint folder (its complete steps are the alternatives offered).
        folder: the step folder checked.
        manifest: its manifest.
        checksums: check CRC-32s too (else sizes only).
        pg: the manager's gloo group.
    """
    damaged = find_damaged_file(folder, manifest, checksums, pg)
    if damaged is None:
        return
    older = [
        s
        for s in list_complete_steps(run_folder)
        if s < manifest.get("step", -1) and step_folder(run_folder, s) != folder
    ]
    if older:
        fix, arguments = (
            f"resume from an older checkpoint with load_step={older[-1]} (complete: {older})",
            ("load_step",),
        )
    else:
        fix, arguments = (
            "no older complete checkpoint exists here; restore the file, or start afresh in another folder",
            ("folder",),
        )
    raise CheckpointError(f"checkpoint file {folder / damaged[0]} {damaged[1]}; {fix}", arguments=arguments)
