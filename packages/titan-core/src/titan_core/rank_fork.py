"""Starting a node's ranks on CPU by forking them from one process that has imported what a rank needs.

torchrun starts each rank as an interpreter of its own, and each pays the imports a rank needs (torch, DTensor,
DCP with sympy, Dynamo, the trainer): ~13 s of CPU on a 2-core AVX2-only AMD EPYC, torch 2.15, before its first
step. On CPU the ranks share the machine's cores, so N ranks pay that N times over on the same cores.
`run_elastic(..., entry=f)` instead runs torchrun's elastic agent with a function entrypoint and
multiprocessing's `forkserver` start method: one server process imports `preload` (and the launching script)
once, and each rank is forked from it (a restart under `--max-restarts` forks again from the same server).
The server itself is forked from the launching process where that is safe (`start_server`), so that what the
launcher imported already, torch above all (the agent needs it), is not imported again: a 2-rank `titan train`
of one step took 17.8-18.6 s and 20-21 CPU-s against 22.7-24.0 s and 30-33 CPU-s with the server a new
interpreter (2-core AVX2-only AMD EPYC, torch 2.15).
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
import traceback
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
        if not early:
            start_server()  # before the agent starts its threads: forked from here where it can be
        elastic_launch(config, entry)(*entry_args)


_early_preload: list[str] | None = None
"""The modules of the server `server_started_early` started, while its block runs."""
_early_used = False
"""Whether `run_elastic` forked ranks from that server."""


@contextlib.contextmanager
def server_started_early(preload: Sequence[str]) -> Iterator[None]:
    """Start the fork server for a `run_elastic` call to come now, so that it imports `preload` while this process
    does other work (`titan train` checks the job meanwhile); `run_elastic` with the same `preload` inside the
    block forks its ranks from it.

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
        start_server()  # returns at once; the server imports on its own
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


def start_server() -> None:
    """Start multiprocessing's fork server for the preload set by `_fork_server`, forked from this process where
    that is safe (`_forkable`): the modules this process imported already (torch, which the agent needs here too:
    ~5 s of CPU on a 2-core AVX2-only AMD EPYC, torch 2.15) are not imported a second time by the server, which
    imports only the rest of its preload. Elsewhere the server is a new interpreter, as multiprocessing starts it,
    which calls `become_server` first as a forked server does.

    The server runs multiprocessing's own server loop (`forkserver.main`, with the arguments multiprocessing
    passes it), after closing every file descriptor but the standard streams and the ones passed to it, as a new
    interpreter would start with; it ends by `os._exit`, never returning into this process's code.
    """
    from multiprocessing import forkserver, util

    spawn = util.spawnv_passfds

    def fork_instead(path: Any, args: Sequence[Any], passfds: Sequence[int]) -> int:
        if "multiprocessing.forkserver import main" not in args[-1]:
            return spawn(path, args, passfds)
        if not _forkable():  # a new interpreter, which becomes the server as a forked one does before its loop
            return spawn(path, [*args[:-1], f"{SPAWNED_SERVER_PRELUDE}; {args[-1]}"], passfds)
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid:
            return pid
        code = 1
        try:
            keep = sorted({0, 1, 2, *passfds})
            for low, high in zip(keep, [*keep[1:], os.sysconf("SC_OPEN_MAX")], strict=True):
                os.closerange(low + 1, high)
            # This copy's lock: the launcher's `ensure_running` holds the original.
            forkserver._forkserver._lock = threading.Lock()  # type: ignore[attr-defined]
            become_server()
            exec(args[-1], {"__name__": "__mp_forkserver__"})  # noqa: S102  multiprocessing's command, as `-c` runs it
            code = 0
        except SystemExit as end:  # the server's loop ends so when the last client is gone
            code = end.code if isinstance(end.code, int) else 0
        except BaseException:
            traceback.print_exc()
        finally:
            os._exit(code)

    util.spawnv_passfds = fork_instead
    try:
        forkserver.ensure_running()
    finally:
        util.spawnv_passfds = spawn


JOB_SIGNALS = (signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGQUIT)
"""Signals the server ignores. A forked server's command line is the launcher's, so `pkill -f "titan train"`
signals it too, and a scheduler signals every process of a job step, a new interpreter's server included: a server
killed by one leaves the agent unable to learn its ranks' exit codes, and it takes them for dead (code 255) and
ends the job before they saved."""
_launcher_signals: dict[int, Any] = {}
"""In the server and its ranks: the handling of `JOB_SIGNALS` the server started with (the launcher's, where the
server was forked from it; the default, in a new interpreter)."""
SPAWNED_SERVER_PRELUDE = "from titan_core.rank_fork import become_server; become_server()"
"""Run first by a server started as a new interpreter, before multiprocessing's own server code."""


def become_server() -> None:
    """Called first in the fork server (forked or a new interpreter): ignore `JOB_SIGNALS`, keeping the handling
    they had for the ranks to take back (`rank_started`), and name the process `titan-forksrv` (else `ps` shows a
    second `titan train` where the server was forked from the launcher)."""
    for sig in JOB_SIGNALS:
        previous = signal.signal(sig, signal.SIG_IGN)
        _launcher_signals[sig] = signal.SIG_DFL if previous is None else previous  # None: set outside Python
    _name_process("titan-forksrv")


def _forkable() -> bool:
    """Whether this process can fork the server: Linux, on its main thread, with no other thread (a lock another
    thread holds at the fork stays held in the child, and GNU OpenMP's workers do not survive it), on a host
    without an NVIDIA driver (where a device query may have initialised the driver in this process; not run on a
    GPU host yet) and CUDA not initialised."""
    if threading.current_thread() is not threading.main_thread() or os.path.exists("/dev/nvidiactl"):
        return False
    try:
        if len(os.listdir("/proc/self/task")) != 1:
            return False
    except OSError:  # not Linux
        return False
    torch = sys.modules.get("torch")
    return torch is None or not torch.cuda.is_initialized()


def rank_started() -> None:
    """Called first thing in a forked rank: restores the launcher's handling of the signals the server ignores
    (`JOB_SIGNALS`) and names the process `titan-rank<RANK>` (`ps -o comm`, `top`,
    /proc/PID/comm, `pkill -x`; its command line is the fork server's, which is the launcher's where the server
    was forked from it) where Linux allows."""
    _name_process(f"titan-rank{os.environ.get('RANK', 0)}")
    for sig, handler in _launcher_signals.items():  # what a server forked from the launcher ignores (JOB_SIGNALS)
        signal.signal(sig, handler)


def _name_process(name: str) -> None:
    """This process's name as `ps -o comm`, `top` and /proc/PID/comm show it (15 bytes at most), where Linux allows."""
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
