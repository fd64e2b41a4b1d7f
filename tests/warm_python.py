"""The tests' Python runs (`python -m titan_cli train ...`, `python tests/fork_run.py ...`) forked from a warm
interpreter rather than started cold.

A cold `titan train` of one step on the debug model spends ~18 of its ~21 CPU seconds importing torch, Dynamo
(which torch's `DeviceMesh` imports when it slices a mesh), DTensor, DCP and the trainer, and the suite starts
~150 such processes (2-core AVX2-only AMD EPYC, torch 2.15). Each pytest worker instead starts a server the first
time it needs one: an interpreter that imports `PRELOAD` once, then forks a child per run. The child becomes the
run: a process of its own, in a session of its own (a timeout kills the run with everything it started), with the
run's environment, working directory, `sys.argv` and `sys.path[0]`, its standard streams on the caller's files,
running the script or module as `__main__` and ending as that interpreter would, through the interpreter's own
exit (threads joined, `atexit` handlers run, the objects torn down: ~2.5 of a warm run's ~3 CPU seconds when the
run itself is short).

    run([sys.executable, "-m", "titan_cli", "train", ...], env=..., cwd=..., timeout=...)  # as subprocess.run
    proc = start([sys.executable, "tests/fork_run.py", ...], stdout=file, ...)   # a Popen: wait, poll, pid

What differs from a cold interpreter, and so when a run starts cold instead:
- the modules imported before the run starts: a run that uses a module it never imports would work here and
  fail cold. `PRELOAD` is what `titan train` imports before its first step anyway, and tests that start their
  runs cold remain (test_isolated_install's fresh environment, test_faults' signals, the CLI's start-up, ...);
- the interpreter's start-up state: a run whose environment differs from its server's in anything but
  `RUN_TIME_ENV` (read when needed, never at import) gets a server of its own, up to `MAX_SERVERS`, else starts
  cold; so do commands not of the form `sys.executable -m module ...` / `-c code ...` / `script.py ...`, runs
  off Linux, and every run under `TITAN_TEST_COLD=1`;
- the command line (`/proc/PID/cmdline`) is the server's: tests that find processes by it start theirs cold, as do
  tests that check what a command imports (`sys.modules` holds `PRELOAD` from the start).

Only tests use this: `titan train` itself starts cold, as a user's command does, and forks its CPU ranks from
itself (`titan_core.rank_fork`), which is where the idea comes from.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import IO

PRELOAD = ("torch", "torch._dynamo", "torch.distributed.run", "titan_cli.main", "titan_core.launch",
           "titan_core.trainer", "titan_core.rank_fork")  # fmt: skip
RUN_TIME_ENV = ("TORCH_DISTRIBUTED_DEBUG", "TITAN_", "PYTEST_CURRENT_TEST")
"""Variables (or prefixes) a run may set differently from its server: `import torch.distributed` sets c10d's debug
level from the first, which each run sets again from its own (`_take_state`); Titan reads its own when it needs
them, and pytest changes the last for every test."""
MAX_SERVERS = 2
"""Servers per pytest worker, one per start-up environment (the tests' `titan_env()`, and the plain one)."""
START_TIMEOUT = 300.0
_MESSAGE = 1 << 20


def _start_state(env: dict[str, str]) -> frozenset:
    """The part of an environment the interpreter and its imports read at start-up."""
    return frozenset((k, v) for k, v in env.items() if not k.startswith(RUN_TIME_ENV))


class WarmProcess:
    """A run forked by a server: `subprocess.Popen`'s `pid`, `args`, `returncode`, `poll`, `wait`, `send_signal`
    and `kill` (the run's pid is also its session's and process group's)."""

    def __init__(self, server: _Server, cmd: list[str], env: dict[str, str], cwd: str, stdout: int, stderr: int):
        self.args, self.returncode = cmd, None
        self._conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._conn.connect(server.address)
        socket.send_fds(self._conn, [json.dumps({"argv": cmd[1:], "env": env, "cwd": cwd}).encode()], [stdout, stderr])
        self.pid: int = json.loads(self._conn.recv(_MESSAGE))["pid"]

    def wait(self, timeout: float | None = None) -> int:
        global _runs_cpu
        if self.returncode is None:
            self._conn.settimeout(timeout)
            try:
                message = self._conn.recv(_MESSAGE)
            except (TimeoutError, BlockingIOError):  # BlockingIOError: timeout 0
                raise subprocess.TimeoutExpired(self.args, timeout or 0) from None
            done = json.loads(message)
            _runs_cpu += done["cpu"]
            self.returncode = done["code"]
            self._conn.close()
        return self.returncode

    def poll(self) -> int | None:
        with contextlib.suppress(subprocess.TimeoutExpired):
            return self.wait(0)
        return None

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class _Server:
    """A server of one start-up environment (started on first use, ended with the pytest worker)."""

    def __init__(self, env: dict[str, str], cwd: str):
        self.folder = tempfile.mkdtemp(prefix="titan-warm-")
        self.address = os.path.join(self.folder, "socket")
        self.log = open(os.path.join(self.folder, "server.log"), "w+")  # noqa: SIM115 (open for the server's life)
        self.proc = subprocess.Popen([sys.executable, __file__, self.address], env=env, cwd=cwd,
                                     stdin=subprocess.DEVNULL, stdout=self.log, stderr=self.log)  # fmt: skip
        deadline = time.monotonic() + START_TIMEOUT
        while not os.path.exists(self.address + ".ready"):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.log.seek(0)
                why = self.log.read()[-3000:]
                self.close()
                raise RuntimeError(f"the warm Python server did not start:\n{why}")
            time.sleep(0.05)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def close(self) -> None:
        if self.alive():
            self.proc.kill()
            self.proc.wait()
        self.log.close()
        shutil.rmtree(self.folder, ignore_errors=True)


_servers: dict[frozenset, _Server] = {}
_runs_cpu = 0.0  # the finished warm runs' CPU seconds (theirs and their waited-for children's)
_failed = False  # a server did not start: none is tried after


def children_cpu() -> float:
    """CPU seconds of the runs this process had a server run (which `resource.RUSAGE_CHILDREN` does not see)."""
    return _runs_cpu


def _warm_server(cmd: Sequence[str], env: dict[str, str], cwd: str) -> _Server | None:
    """The server to run `cmd` on, started if need be; None where the run must start cold (module docstring)."""
    global _failed
    if sys.platform != "linux" or env.get("TITAN_TEST_COLD") == "1" or len(cmd) < 2 or cmd[0] != sys.executable:
        return None
    if cmd[1].startswith("-") and (cmd[1] not in ("-m", "-c") or len(cmd) < 3):
        return None
    key = _start_state(env)
    server = _servers.get(key)
    if server is not None and not server.alive():  # killed from outside: start another
        _servers.pop(key).close()
        server = None
    if server is None and len(_servers) < MAX_SERVERS and not _failed:
        try:
            server = _servers[key] = _Server(env, cwd)
        except RuntimeError as e:  # the runs start cold, as before this module existed
            _failed = True
            print(f"warm_python: every run starts cold: {e}", file=sys.stderr)
            return None
        atexit.register(server.close)
    return server


def start(cmd: Sequence[str], *, stdout: IO, stderr: IO | None = None, env: dict[str, str] | None = None,
          cwd: str | Path | None = None) -> WarmProcess | subprocess.Popen:  # fmt: skip
    """`subprocess.Popen(cmd, stdin=DEVNULL, stdout=stdout, stderr=stderr or stdout, env=env, cwd=cwd,
    start_new_session=True)`, forked from a warm server where it can be (module docstring)."""
    cmd, env, cwd = [str(c) for c in cmd], dict(os.environ if env is None else env), str(cwd or os.getcwd())
    stderr = stdout if stderr is None else stderr
    server = _warm_server(cmd, env, cwd)
    if server is None:
        return subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=stdout, stderr=stderr, env=env, cwd=cwd,
                                start_new_session=True)  # fmt: skip
    return WarmProcess(server, cmd, env, cwd, stdout.fileno(), stderr.fileno())


def run(cmd: Sequence[str], *, env: dict[str, str] | None = None, cwd: str | Path | None = None,
        timeout: float | None = None, check: bool = False) -> subprocess.CompletedProcess:  # fmt: skip
    """`subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=cwd, timeout=timeout, check=check)`, forked
    from a warm server where it can be (module docstring); in a session of its own, killed with all it started on a
    timeout."""
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        proc = start(cmd, stdout=out, stderr=err, env=env, cwd=cwd)
        try:
            code = proc.wait(timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            code = None
        outputs = []
        for f in (out, err):
            f.seek(0)
            outputs.append(f.read().decode(errors="replace"))
    if code is None:
        raise subprocess.TimeoutExpired(proc.args, timeout or 0, output=outputs[0], stderr=outputs[1])
    done = subprocess.CompletedProcess(proc.args, code, outputs[0], outputs[1])
    if check:
        done.check_returncode()
    return done


# The server ---------------------------------------------------------------------------------------------------------


def _serve(address: str) -> list[str]:
    """Import `PRELOAD`, then fork a child per request until killed, telling each request's caller its child's pid,
    then its exit code and CPU seconds; returns in each child, once it has taken its run's state, with the run's
    command (after the interpreter)."""
    import ctypes

    from titan_core.launch import collector_paused

    ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: end with the pytest worker that started us
    with collector_paused():  # as `titan train` imports
        for module in PRELOAD:
            __import__(module)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(address)
    listener.listen()
    woken, wake = os.pipe()  # SIGCHLD wakes the select below
    os.set_blocking(wake, False)
    signal.set_wakeup_fd(wake)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    running: dict[int, socket.socket] = {}
    Path(address + ".ready").touch()
    while True:
        ready, _, _ = select.select([listener, woken], [], [])
        if woken in ready:
            os.read(woken, 4096)
            _reap(running)
        if listener in ready:
            conn, _ = listener.accept()
            message, fds, _, _ = socket.recv_fds(conn, _MESSAGE, 2)
            request = json.loads(message)
            pid = os.fork()
            if pid == 0:
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                signal.set_wakeup_fd(-1)
                for sock in (listener, conn, *running.values()):
                    sock.close()
                os.close(woken)
                os.close(wake)
                _take_state(request, fds)
                return request["argv"]
            for fd in fds:
                os.close(fd)
            conn.send(json.dumps({"pid": pid}).encode())
            running[pid] = conn


def _reap(running: dict[int, socket.socket]) -> None:
    """Tell the callers of every run that ended its exit code and CPU seconds (its own and its children's)."""
    while running:
        pid, status, usage = os.wait4(-1, os.WNOHANG)
        if pid == 0:
            return
        conn = running.pop(pid)
        with conn, contextlib.suppress(OSError):  # a caller that left no longer listens
            code = os.waitstatus_to_exitcode(status)
            conn.send(json.dumps({"code": code, "cpu": usage.ru_utime + usage.ru_stime}).encode())


def _take_state(request: dict, fds: list[int]) -> None:
    """The run's session, standard streams, environment and working directory."""
    os.setsid()
    stdin = os.open(os.devnull, os.O_RDONLY)
    os.dup2(stdin, 0)
    os.close(stdin)
    os.dup2(fds[0], 1)
    os.dup2(fds[1], 2)
    for fd in set(fds):
        os.close(fd)
    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(request["cwd"])
    sys.modules["torch.distributed"].set_debug_level_from_env()  # as its import did from the server's environment


def _become(argv: list[str]) -> None:
    """Run `argv` (`-m module args...`, `-c code args...` or `script args...`) as this interpreter's `__main__`."""
    import runpy
    import types

    if argv[0] == "-c":
        sys.argv = ["-c", *argv[2:]]
        sys.path[0] = ""
        main = sys.modules["__main__"] = types.ModuleType("__main__")
        exec(compile(argv[1], "<string>", "exec"), main.__dict__)
    elif argv[0] == "-m":
        sys.argv = [argv[1], *argv[2:]]  # run_module puts the module's file first
        sys.path[0] = os.getcwd()
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = list(argv)
        sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))
        runpy.run_path(argv[0], run_name="__main__")


if __name__ == "__main__":
    _become(_serve(sys.argv[1]))
