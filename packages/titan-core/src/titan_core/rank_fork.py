"""Starting a node's ranks on CPU by forking them from one process that has imported what a rank needs.

torchrun starts each rank as an interpreter of its own, and each pays the imports a rank needs (torch, DTensor,
DCP with sympy, Dynamo, the trainer): ~13 s of CPU on a 2-core AVX2-only AMD EPYC, torch 2.15, before its first
step. On CPU the ranks share the machine's cores, so N ranks pay that N times over on the same cores.
`run_elastic(..., entry=f)` instead runs torchrun's elastic agent with a function entrypoint and
multiprocessing's `forkserver` start method: one server process imports `preload` (and the launching script)
once, and each rank is forked from it (a restart under `--max-restarts` forks again from the same server).
Rendezvous, the ranks' environment (`RANK`, `WORLD_SIZE`, `MASTER_ADDR`, ...), signal forwarding, restarts and
failure reports are the agent's, as under torchrun.

`titan train` forks its ranks this way for jobs on CPU, with the server started before its job check
(`server_started_early`), so that the server's imports and the check run side by side. On CUDA each rank still
starts an interpreter of its own: forking is safe there only while the server has not initialised CUDA, which
nothing in Titan's imports does, but that path has not been run on a GPU yet.

Why not torch's own `torch.multiprocessing.start_processes(start_method="forkserver")` alone: it gives neither
the rendezvous nor the elastic agent's restarts and signal handling, which `titan train` keeps; this module only
chooses the agent's start method and the server's preload, and ends the server with the launch.
"""

from __future__ import annotations

import contextlib
import ctypes
import multiprocessing
import os
import signal
import sys
import threading
import uuid
from collections.abc import Callable, Iterator, Sequence
from typing import Any

LEAVE_AFTER_SECONDS = 2.0
"""How long a forked rank that finished waits for the agent to let it go before it leaves by itself (below)."""


def run_elastic(
    torchrun_args: Sequence[str], entry: Callable[..., Any], entry_args: Sequence[Any] = (), preload: Sequence[str] = ()
) -> None:
    """Run torchrun's elastic agent in this process with `entry(*entry_args)` as every rank, each forked from a
    server that imported `preload` and this process's `__main__` script once; raises as torchrun's `run` does
    (`ChildFailedError` for a failed rank, `SignalException` for a signal to this process).

    Args:
        torchrun_args: torchrun's launcher options (`--standalone`, `--nproc-per-node=N`, `--max-restarts=N`,
            ...), without a script or its arguments.
        entry: the ranks' function, importable by its module and name; its return value is ignored, and
            `sys.exit(code)` sets the rank's exit code.
        entry_args: `entry`'s arguments (picklable).
        preload: modules the server imports before forking the first rank.
    """
    from torch.distributed.launcher.api import elastic_launch
    from torch.distributed.run import config_from_args, parse_args

    global _early_used
    args = parse_args([*torchrun_args, "--start-method=forkserver", "--no-python", entry.__qualname__])
    if args.standalone:  # as torchrun's `run` does
        args.rdzv_backend, args.rdzv_endpoint, args.rdzv_id = "c10d", "localhost:0", str(uuid.uuid4())
    config, _, _ = config_from_args(args)  # also sets OMP_NUM_THREADS=1 for N > 1, before the server starts
    modules = ["__main__", *preload]
    early = _early_preload == modules  # `server_started_early` with these modules: its server serves the ranks
    _early_used = _early_used or early
    with contextlib.nullcontext() if early else _fork_server(modules):
        elastic_launch(config, entry)(*entry_args)


_early_preload: list[str] | None = None
"""The modules of the server `server_started_early` started, while its block runs."""
_early_used = False
"""Whether `run_elastic` forked ranks from that server."""


@contextlib.contextmanager
def server_started_early(preload: Sequence[str]) -> Iterator[None]:
    """Start the fork server for a `run_elastic` call to come now, so that it imports `preload` while this process
    does other work (`titan train` checks the job meanwhile: ~6 s of a ~13 s import on a 2-core AVX2-only AMD EPYC,
    torch 2.15); `run_elastic` with the same `preload` inside the block forks its ranks from it.

    The server inherits this process's environment as it is when the block starts: whatever the ranks read from
    it must be set before. Ended with the block; killed first if no rank was forked from it (a failed check must
    not wait for the server's imports to finish).

    Args:
        preload: modules the server imports, as `run_elastic`'s `preload`.
    """
    from multiprocessing import forkserver

    global _early_preload, _early_used
    modules = ["__main__", *preload]
    with _fork_server(modules):
        forkserver.ensure_running()  # spawns the server and returns; the server imports on its own
        _early_preload, _early_used = modules, False
        try:
            yield
        finally:
            server = getattr(forkserver, "_forkserver", None)
            pid = getattr(server, "_forkserver_pid", None)
            if not _early_used and pid is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            _early_preload, _early_used = None, False


@contextlib.contextmanager
def _fork_server(preload: list[str]) -> Iterator[None]:
    """multiprocessing's fork server preloading `preload`, started afresh for this launch (by the agent's first
    fork) and ended with it: a later launch in this process gets a server with its environment and modules."""
    from multiprocessing import forkserver

    server = getattr(forkserver, "_forkserver", None)  # the module's one server, which the context uses
    stop = getattr(server, "_stop", None)
    if stop is not None:
        stop()  # one left by another user of this process would have another preload and environment
    previous = getattr(server, "_preload_modules", ["__main__"])
    multiprocessing.get_context("forkserver").set_forkserver_preload(preload)
    try:
        yield
    finally:
        if stop is not None:
            stop()
        multiprocessing.get_context("forkserver").set_forkserver_preload(previous)


def rank_started() -> None:
    """Called first thing in a forked rank: names the process `titan-rank<RANK>` (`ps -o comm`, `top`,
    /proc/PID/comm, `pkill -x`; its command line is the fork server's) where Linux allows."""
    name = f"titan-rank{os.environ.get('RANK', 0)}"
    with contextlib.suppress(OSError, AttributeError):  # no prctl: not Linux
        ctypes.CDLL(None, use_errno=True).prctl(15, name.encode()[:15], 0, 0, 0)  # 15 = PR_SET_NAME


def rank_finished() -> None:
    """Called last in a forked rank that succeeded: leave `LEAVE_AFTER_SECONDS` after returning.

    The agent's function workers wait, once their return value is handed over, until the agent has read every
    rank's; an agent that is shutting down on a signal (SIGTERM to `titan train`) never does, and would kill
    ranks that saved and stopped cleanly only after its shutdown timeout. The value is handed over at once and
    read by the agent after the rank left, so leaving by ourselves loses nothing.
    """

    def leave() -> None:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)  # as when the agent lets it go: no interpreter teardown, which gloo's threads can abort

    timer = threading.Timer(LEAVE_AFTER_SECONDS, leave)
    timer.daemon = True
    timer.start()
