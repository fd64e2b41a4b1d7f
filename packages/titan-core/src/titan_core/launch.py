"""Launching a training job: check it, start its processes, report a failure as one line.

`titan train` calls `launch`: it resolves the whole job in this process
(`titan_core.job`), then trains here for one process or starts N under
torchrun's elastic agent (run in this process, so that a failed rank is reported
by its message rather than by the launcher's traceback). On CUDA each started
process runs `python -m titan_core.launch [--config X] [--section.key value ...]`,
i.e. `main`, which torchrun users may also start themselves:
`torchrun --nproc-per-node N -m titan_core.launch ...`. On CPU the ranks are
forked from one process that imported the trainer once (`forked_rank`,
`titan_core.rank_fork`), each named `titan-rank<RANK>`.

A config or input error on any rank reaches the user as one line,
`titan: error: ...`, naming the config keys, and so does a run stopped by a
non-finite loss (`training.on_nonfinite`); `TITAN_TRACEBACK=1` shows the
traceback instead. Other exceptions keep their traceback.

Faults: SIGTERM or SIGUSR1 (to the launcher, which forwards it, or to the ranks)
makes the ranks finish the step, save a checkpoint and exit 0 (`titan_core.run_guard`);
`--max-restarts N` lets the agent restart every rank after one dies, and the ranks
resume from the newest checkpoint.
"""

from __future__ import annotations

import contextlib
import gc
import json
import logging
import os
import sys
import tempfile
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path

from titan_ckpt.errors import CheckpointError
from titan_core.config import ConfigError, dump_toml, load_config
from titan_core.log_filters import drop_torch_noise
from titan_models.errors import ModelConfigError
from titan_parallel.layout import ParallelConfigError

# Errors that mean "the input is wrong": shown as one line, no traceback (set
# TITAN_TRACEBACK=1 to see it). Each is the raising package's own type for the inputs
# it checks (a missing file or optional package is a ConfigError / CheckpointError that
# is also a FileNotFoundError / ImportError); ParallelConfigError's and CheckpointError's
# argument names become config keys. Any other exception, a plain ValueError or
# ImportError included, is a bug and keeps its traceback. Importing these costs no torch.
USER_ERRORS = (ConfigError, ParallelConfigError, CheckpointError, ModelConfigError)

ERROR_DIR_ENV = "TITAN_ERROR_DIR"
"""Set by `launch` for the processes it starts: each rank that fails on a user error writes its line there."""
STOPPED_FILE = "stopped.txt"
"""Rank 0 writes it into the error folder when a stop signal ended the run after a save."""
STOP_GRACE_SECONDS = 120
"""After forwarding SIGTERM/SIGUSR1, the agent waits this long for the ranks to save and exit, then kills them."""
EXIT_USER_ERROR, EXIT_NONFINITE, EXIT_COLLECTIVE = 2, 3, 4
RANK_PRELOAD = ("titan_core.rank_preload",)
"""What the process CPU ranks are forked from imports once (`forked_rank`)."""


def split_args(argv: list[str]) -> tuple[str | None, bool, list[str]]:
    """Pull `--config/-c FILE` and `--print-config` out of `argv`; the rest are overrides."""
    config, print_config, rest = None, False, []
    it = iter(argv)
    for arg in it:
        if arg in ("--config", "-c", "--job.config_file"):
            config = next(it, None)
            if config is None:
                raise ConfigError(f"{arg} needs a value: a TOML file or a shipped config name")
        elif arg.startswith(("--config=", "--job.config_file=")):
            config = arg.split("=", 1)[1]
        elif arg == "--print-config":
            print_config = True
        else:
            rest.append(arg)
    return config, print_config, rest


def setup_logging() -> None:
    """INFO on rank 0, warnings only on the other ranks; `TORCH_NOISE` left out."""
    rank = int(os.environ.get("RANK", 0))
    logging.basicConfig(
        level=logging.INFO if rank == 0 else logging.WARNING,
        format="%(asctime)s %(message)s" if rank == 0 else f"[rank{rank}] %(asctime)s %(message)s",
        datefmt="%H:%M:%S",
    )
    drop_torch_noise()


def error_line(error: BaseException) -> str:
    """The one line a user error is reported as; a library error also names the config keys of its arguments."""
    if getattr(error, "arguments", ()):
        from titan_core.job import config_error

        error = config_error(error)  # looked up in the table of the library that raised it
    return f"titan: error: {error}"


def main(argv: list[str] | None = None) -> int:
    """Train in this process (one rank of the job) with the config from `argv`; returns an exit code:
    0 (done, or stopped by SIGTERM/SIGUSR1 after saving), 2 (config or input error), 3 (non-finite
    loss or grad norm under `training.on_nonfinite`), 4 (a collective timed out or lost a rank)."""
    argv = sys.argv[1:] if argv is None else argv
    frozen_by_caller = gc.get_freeze_count() > 0  # a caller that froze its objects unfreezes them itself
    try:
        config, print_config, overrides = split_args(argv)
        cfg = load_config(config, overrides)
        if print_config:
            print(dump_toml(cfg), end="")
            return 0
        setup_logging()
        with collector_paused(freeze=True):  # unfrozen below
            from titan_core.trainer import Trainer  # torch is imported here, not for --print-config

        trainer = Trainer(cfg)
        trainer.train()
        if trainer.stopped_by:
            _report_stop(trainer.stopped_by, trainer.state.step, saved=cfg.checkpoint.enable)
    except USER_ERRORS as e:
        if os.environ.get("TITAN_TRACEBACK"):
            raise
        _report_rank_error(error_line(e), EXIT_USER_ERROR)
        return EXIT_USER_ERROR
    except Exception as e:
        code = _fault_exit_code(e)
        if code is None or os.environ.get("TITAN_TRACEBACK"):
            raise  # a bug keeps its traceback
        _report_rank_error(f"titan: error: {e}", code)
        return code
    finally:
        if "titan_parallel.distributed" in sys.modules:
            sys.modules["titan_parallel.distributed"].shutdown_distributed()
        if not frozen_by_caller:  # before the interpreter's teardown: else triton's bindings report them as leaked
            gc.unfreeze()
    return 0


@contextlib.contextmanager
def collector_paused(freeze: bool = False) -> Iterator[None]:
    """Python's cyclic garbage collector off while the block imports (torch, DCP, DTensor, sympy: thousands of
    modules and ~350,000 objects, none of them garbage).

    With the collector on, each of its full passes during the imports walks every object made so far: ~0.9 s of
    a rank's ~13 s of imports, and ~0.8 s more in the passes that follow while the trainer is built and trains
    (a 2-core AVX2-only AMD EPYC, torch 2.15, Python 3.11). Frozen (`gc.freeze`), the modules' objects, which
    live as long as the process, are left out of every later pass: the collector's time over a whole tiny run
    goes from ~1.75 s to 0.03 s.

    Args:
        freeze: freeze what is alive after the block (`gc.freeze`); call `gc.unfreeze()` before the process
            ends normally, else triton's bindings report the frozen objects as leaked at exit.
    """
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if freeze:
            gc.freeze()
        if was_enabled:
            gc.enable()


def _fault_exit_code(error: Exception) -> int | None:
    """The exit code of a run fault told in one line (a non-finite loss, a hung or lost rank); None for a bug."""
    run_guard, comm_watch = sys.modules.get("titan_core.run_guard"), sys.modules.get("titan_parallel.comm_watch")
    if run_guard is not None and isinstance(error, run_guard.NonFiniteError):
        return EXIT_NONFINITE
    if comm_watch is not None and isinstance(error, comm_watch.CollectiveError):
        return EXIT_COLLECTIVE
    return None


def _report_rank_error(line: str, code: int) -> None:
    """Under `launch`, leave the line for the launcher to print once; else print it (every rank: the
    failing one need not be rank 0, and torchrun stops the others)."""
    folder = os.environ.get(ERROR_DIR_ENV)
    rank = int(os.environ.get("RANK", 0))
    if folder:
        Path(folder, f"rank{rank}.json").write_text(json.dumps({"code": code, "line": line}))
    else:
        print(line if rank == 0 else f"{line} (rank {rank})", file=sys.stderr)


def _report_stop(signal_name: str, step: int, *, saved: bool) -> None:
    """Rank 0 says once that the run stopped early on a signal, and how it goes on."""
    if int(os.environ.get("RANK", 0)) != 0:
        return
    how = (
        "its checkpoint is saved: start the same command again to resume"
        if saved
        else "nothing saved (checkpoint.enable is off)"
    )
    line = f"titan: stopped by {signal_name} after step {step}; {how}"
    folder = os.environ.get(ERROR_DIR_ENV)
    if folder:
        Path(folder, STOPPED_FILE).write_text(line + "\n")
    else:
        print(line, file=sys.stderr)


def check_job_here(argv: list[str], world_size: int | None, *, max_restarts: int = 0) -> tuple[int, str]:
    """Check the whole job in this process; print one line and return (2, "") when it cannot run, else 0 and the
    device type the job runs on ("cpu" / "cuda")."""
    try:
        config, _, overrides = split_args(argv)
        with collector_paused():
            from titan_core.job import resolve

        cfg = load_config(config, overrides)
        job = resolve(cfg, world_size)
    except USER_ERRORS as e:
        if os.environ.get("TITAN_TRACEBACK"):
            raise
        print(error_line(e), file=sys.stderr)
        return EXIT_USER_ERROR, ""
    if max_restarts and not cfg.checkpoint.enable:
        print("titan: warning: --max-restarts without checkpoint.enable restarts from step 0", file=sys.stderr)
    return 0, job.device_type


def launch(
    argv: list[str],
    *,
    nproc_per_node: int = 1,
    nnodes: str = "1",
    rdzv_endpoint: str | None = None,
    max_restarts: int = 0,
) -> int:
    """Check the job, then train: in this process for one, else under torchrun's elastic agent (on CPU its ranks
    are forked from a process that imported the trainer and the calling script, which must then keep its own
    call of `launch` under `if __name__ == "__main__":`, as multiprocessing requires).

    Args:
        argv: the config arguments (`--config X`, `--section.key value`, `--print-config`).
        nproc_per_node: processes on this node.
        nnodes: nodes in the job, or a `MIN:MAX` range (elastic; the world size is then checked per process).
        rdzv_endpoint: `host:port` of the c10d rendezvous, for multi-node jobs.
        max_restarts: times the agent restarts every rank after one fails (the ranks resume from the
            newest checkpoint); > 0 runs even one process under the agent.

    Returns:
        The exit code: 0 (also after SIGTERM/SIGUSR1 once the ranks saved), 2 for a config or input
        error (one line printed), 3 for a non-finite loss, 4 for a hung or lost rank, else the failed rank's.
    """
    if nproc_per_node < 1:
        print("titan: error: --nproc-per-node must be >= 1", file=sys.stderr)
        return EXIT_USER_ERROR
    if max_restarts < 0:
        print("titan: error: --max-restarts must be >= 0", file=sys.stderr)
        return EXIT_USER_ERROR
    if nnodes != "1" and not rdzv_endpoint:
        print("titan: error: --nnodes > 1 needs --rdzv-endpoint host:port", file=sys.stderr)
        return EXIT_USER_ERROR
    if "--print-config" in argv or (nproc_per_node == 1 and nnodes == "1" and max_restarts == 0):
        return main(argv)  # one process: the trainer checks the job first thing
    world_size = nproc_per_node * int(nnodes) if nnodes.isdigit() else None
    # The environment the ranks inherit is set before the fork server starts (below), which copies it.
    if max_restarts:
        # torch 2.15's agent keeps one TCPStore across restarts without a per-attempt key prefix: the
        # restarted ranks' gloo then dials the dead ranks' old addresses ("connectFullMesh failed ...
        # Connection refused"). Opting out of the shared store gives each attempt a fresh store.
        os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    if nproc_per_node > 1:  # torchrun's own default, set here to spare its 7-line banner saying so
        os.environ.setdefault("OMP_NUM_THREADS", "1")
    with _error_folder() as folder, _fork_server_during_check():
        code, device_type = check_job_here(argv, world_size, max_restarts=max_restarts)
        if code:
            return code
        launcher = [f"--nproc-per-node={nproc_per_node}", f"--nnodes={nnodes}", f"--max-restarts={max_restarts}"]
        launcher += ["--rdzv-backend=c10d", f"--rdzv-endpoint={rdzv_endpoint}"] if rdzv_endpoint else ["--standalone"]
        if device_type == "cpu":  # ranks forked from one process that imported the trainer (titan_core.rank_fork)
            return _run_torchrun(launcher, folder, rank=(forked_rank, (argv,)))
        return _run_torchrun([*launcher, "--module", "titan_core.launch", *argv], folder)


@contextlib.contextmanager
def _error_folder() -> Iterator[Path]:
    """A temporary folder where the ranks report a user error or a stop (`_report_rank_error`, `_report_stop`),
    named to them by `ERROR_DIR_ENV` while the block runs."""
    with tempfile.TemporaryDirectory(prefix="titan-errors-") as folder:
        os.environ[ERROR_DIR_ENV] = folder
        try:
            yield Path(folder)
        finally:
            os.environ.pop(ERROR_DIR_ENV, None)


def _fork_server_during_check() -> contextlib.AbstractContextManager[None]:
    """The CPU ranks' fork server, started before the job check so that it imports the trainer meanwhile
    (`titan_core.rank_fork.server_started_early`), and after this process imported torch, which the server then
    inherits rather than imports again (`rank_fork.start_server`); nothing on a host with an NVIDIA driver, whose
    jobs start their ranks as processes of their own."""
    if os.path.exists("/dev/nvidiactl"):
        return contextlib.nullcontext()
    with collector_paused():  # the check and the agent need torch here too: the server, forked now, inherits it
        import torch  # noqa: F401
    from titan_core.rank_fork import server_started_early

    return server_started_early(RANK_PRELOAD)


def forked_rank(argv: list[str]) -> None:
    """One rank of a CPU job, forked by `launch`'s agent from a process that imported the trainer: `main(argv)`,
    with the exit code and output an interpreter of its own would have.

    Args:
        argv: the config arguments, as for `main`.
    """
    from titan_core.rank_fork import rank_finished, rank_started

    rank_started()
    try:
        code = main(argv)
    except Exception:
        traceback.print_exc()  # a bug keeps its traceback, on the rank's stderr
        sys.exit(1)
    if code:
        sys.exit(code)
    rank_finished()


def _agent_signal_args() -> list[str]:
    """Make the agent forward SIGUSR1 too (Slurm's pre-kill signal) and wait `STOP_GRACE_SECONDS`
    for the ranks to save before it kills them (torch >= 2.9 flags; older ones read the env)."""
    from torch.distributed.run import get_args_parser

    known = get_args_parser()._option_string_actions
    signals = "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1"
    args = []
    if "--signals-to-handle" in known:
        args.append(f"--signals-to-handle={signals}")
    else:
        os.environ.setdefault("TORCHELASTIC_SIGNALS_TO_HANDLE", signals)
    if "--shutdown-timeout" in known:
        args.append(f"--shutdown-timeout={STOP_GRACE_SECONDS}")
    return args


def _run_torchrun(args: list[str], folder: Path, rank: tuple[Callable[..., None], tuple] | None = None) -> int:
    """Run torchrun's elastic agent in this process; a rank's user error, reported in `folder` (`_error_folder`),
    becomes one line. With `rank`, an (entry, entry_args) pair such as `(forked_rank, (argv,))`, `args` are the
    launcher's options only, and each rank is `entry(*entry_args)`, forked from a process that imported the
    trainer once (`titan_core.rank_fork`)."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    # The agent logs each failed rank and its own progress; Titan reports failures itself (below).
    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
    stopped_file = Path(folder, STOPPED_FILE)
    try:
        if rank is None:
            run(parse_args([*_agent_signal_args(), *args]))
        else:
            from titan_core.rank_fork import run_elastic

            run_elastic([*_agent_signal_args(), *args], *rank, preload=RANK_PRELOAD)
    except ChildFailedError as failed:
        reports = [json.loads(p.read_text()) for p in sorted(Path(folder).glob("rank*.json"), key=_rank_of)]
        if reports:
            print(reports[0]["line"], file=sys.stderr)
            return reports[0]["code"]
        print(f"titan: error: {failed.format_msg()}", file=sys.stderr)
        _, first = failed.get_first_failure()
        return first.exitcode if first.exitcode > 0 else 1
    except SignalException as stopped:  # Ctrl-C or a scheduler's signal: the agent forwarded it to the ranks
        if not stopped_file.is_file():  # ... which did not save and stop (else: below, exit 0)
            print(f"titan: stopped by {stopped.sigval.name}", file=sys.stderr)
            return 128 + stopped.sigval.value
    if stopped_file.is_file():  # rank 0 saved and stopped on a signal (to the agent, or to the ranks themselves)
        print(stopped_file.read_text().strip(), file=sys.stderr)
    return 0


def _rank_of(path: Path) -> int:
    return int(path.stem.removeprefix("rank"))


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # Leave without running interpreter teardown: gloo's threads can abort it
    # ("terminate called without an active exception") on multi-rank runs.
    os._exit(code)
