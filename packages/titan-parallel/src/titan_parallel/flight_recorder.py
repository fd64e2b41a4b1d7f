"""The flight recorder: each rank's last collectives, dumped as `<folder>/rank_<N>` when one fails.

torch 2.15 records every collective, NCCL's and gloo's, into a per-process ring buffer
(`TORCH_FR_BUFFER_SIZE` entries). NCCL dumps it by itself when a collective times out; gloo
never does, and the dump torch writes for gloo names no process group (its `pg_config` is
`{'': ...}`), which `torchfrtrace` cannot read (`KeyError: ('0', 0)`). `dump_gloo_trace`
writes the gloo file itself, with the groups filled in, so the same analyzer reads both.
"""

from __future__ import annotations

import os
import pickle
from collections.abc import Mapping
from pathlib import Path

import torch
import torch.distributed as dist

# Each setting and its older NCCL alias: a user who set either keeps their value.
_BUFFER_SIZE = ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE")
_DUMP_FILE = ("TORCH_FR_DUMP_TEMP_FILE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE")
_DUMP_ON_TIMEOUT = ("TORCH_FR_DUMP_ON_TIMEOUT", "TORCH_NCCL_DUMP_ON_TIMEOUT")


def flight_recorder_env(buffer_size: int, folder: Path, environ: Mapping[str, str]) -> dict[str, str]:
    """The environment variables that make torch record `buffer_size` collectives and dump them into `folder`.

    A setting the user already made in `environ` (under either of its names) is left out.

    Args:
        buffer_size: entries kept per process; 0 turns the recorder off.
        folder: where the dumps land, one file per rank: `rank_<N>`.
        environ: the environment as it is now.
    """
    wanted = {_BUFFER_SIZE: str(buffer_size), _DUMP_ON_TIMEOUT: "1" if buffer_size > 0 else "0"}
    if buffer_size > 0:
        wanted[_DUMP_FILE] = str(folder / "rank_")
    # Only the new name: torch warns that the NCCL alias is deprecated when it reads it.
    return {names[0]: value for names, value in wanted.items() if not any(n in environ for n in names)}


_SET_HERE: dict[str, str] = {}
"""What `enable_flight_recorder` set, so that a second run in this process is not taken for the user."""


def enable_flight_recorder(buffer_size: int, folder: Path) -> bool:
    """Set the flight recorder's variables (see `flight_recorder_env`) before the process group exists.

    Returns whether the recorder is on, counting a buffer size the user set.

    Args:
        buffer_size: entries kept per process; 0 turns the recorder off.
        folder: where the dumps land, one file per rank: `rank_<N>`.
    """
    users = {name: value for name, value in os.environ.items() if _SET_HERE.get(name) != value}
    wanted = flight_recorder_env(buffer_size, folder, users)
    for name in [n for n, value in _SET_HERE.items() if os.environ.get(n) == value and n not in wanted]:
        del os.environ[name], _SET_HERE[name]  # an earlier run's setting that this run does not make
    os.environ.update(wanted)
    _SET_HERE.update(wanted)
    size = next((os.environ[n] for n in _BUFFER_SIZE if os.environ.get(n)), "2000")  # torch's default
    return int(size) > 0


def recorder_dump_file(rank: int) -> Path | None:
    """Where torch dumps this rank's trace (`TORCH_FR_DUMP_TEMP_FILE` + rank), None when it is unset.

    Args:
        rank: the global rank whose file it is.
    """
    prefix = next((os.environ[n] for n in _DUMP_FILE if os.environ.get(n)), None)
    return Path(f"{prefix}{rank}") if prefix else None


def dump_gloo_trace(rank: int) -> Path | None:
    """Write this process's gloo collectives to `recorder_dump_file(rank)`; returns the file, or None when off.

    Args:
        rank: this process's global rank.
    """
    path = recorder_dump_file(rank)
    dump = getattr(torch._C._distributed_c10d, "_dump_fr_trace", None)  # private: absent from some torch versions
    if path is None or dump is None:
        return None
    trace = pickle.loads(dump(True, True, False))  # torch's own in-memory bytes, not a file
    trace["pg_config"] = {
        pg.group_name: {"name": pg.group_name, "desc": pg.group_desc, "ranks": str(dist.get_process_group_ranks(pg))}
        for pg in dist.distributed_c10d._world.pg_map
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")  # the analyzer never sees half a file
    partial.write_bytes(pickle.dumps(trace))
    partial.replace(path)
    return path
