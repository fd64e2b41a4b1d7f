"""Launching a training job: check it, start its processes, report a failure as one line.

`titan train` calls `launch`: it checks the whole job in this process
(`titan_core.job_check`), then trains here for one process or starts N under
torchrun's elastic agent (run in this process, so that a failed rank is reported
by its message rather than by the launcher's traceback). Each started process
runs `python -m titan_core.launch [--config X] [--section.key value ...]`, i.e.
`main`, which torchrun users may also start themselves:
`torchrun --nproc-per-node N -m titan_core.launch ...`.

A config or input error on any rank reaches the user as one line,
`titan: error: ...`, naming the config keys; `TITAN_TRACEBACK=1` shows the
traceback instead. Other exceptions keep their traceback.
"""

from __future__ import annotations

import logging
import os
import sys
import tempfile
from pathlib import Path

from titan_core.config import ConfigError, dump_toml, load_config

# Errors that mean "the input is wrong": shown as one line, no traceback
# (set TITAN_TRACEBACK=1 to see it). The libraries' ParallelConfigError and
# CheckpointError are ValueErrors; their argument names become config keys.
USER_ERRORS = (ConfigError, ValueError, FileNotFoundError, ImportError)

ERROR_DIR_ENV = "TITAN_ERROR_DIR"
"""Set by `launch` for the processes it starts: each rank that fails on a user error writes its line there."""


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
    """INFO on rank 0, warnings only on the other ranks."""
    rank = int(os.environ.get("RANK", 0))
    logging.basicConfig(
        level=logging.INFO if rank == 0 else logging.WARNING,
        format="%(asctime)s %(message)s" if rank == 0 else f"[rank{rank}] %(asctime)s %(message)s",
        datefmt="%H:%M:%S",
    )


def error_line(error: BaseException) -> str:
    """The one line a user error is reported as: library argument names become config keys."""
    if getattr(error, "arguments", ()):
        from titan_core.job_check import as_config_error

        error = as_config_error(error)
    return f"titan: error: {error}"


def main(argv: list[str] | None = None) -> int:
    """Train in this process (one rank of the job) with the config from `argv`; returns an exit code."""
    argv = sys.argv[1:] if argv is None else argv
    try:
        config, print_config, overrides = split_args(argv)
        cfg = load_config(config, overrides)
        if print_config:
            print(dump_toml(cfg), end="")
            return 0
        setup_logging()
        from titan_core.trainer import Trainer  # torch is imported here, not for --print-config

        Trainer(cfg).train()
    except USER_ERRORS as e:
        if os.environ.get("TITAN_TRACEBACK"):
            raise
        _report_rank_error(error_line(e))
        return 2
    finally:
        if "titan_parallel.distributed" in sys.modules:
            sys.modules["titan_parallel.distributed"].shutdown_distributed()
    return 0


def _report_rank_error(line: str) -> None:
    """Under `launch`, leave the line for the launcher to print once; else print it (every rank: the
    failing one need not be rank 0, and torchrun stops the others)."""
    folder = os.environ.get(ERROR_DIR_ENV)
    rank = int(os.environ.get("RANK", 0))
    if folder:
        Path(folder, f"rank{rank}.txt").write_text(line + "\n")
    else:
        print(line if rank == 0 else f"{line} (rank {rank})", file=sys.stderr)


def check_job_here(argv: list[str], world_size: int | None) -> int:
    """Check the whole job in this process; print one line and return 2 when it cannot run, else 0."""
    try:
        config, _, overrides = split_args(argv)
        from titan_core.job_check import check_job

        check_job(load_config(config, overrides), world_size)
    except USER_ERRORS as e:
        if os.environ.get("TITAN_TRACEBACK"):
            raise
        print(error_line(e), file=sys.stderr)
        return 2
    return 0


def launch(argv: list[str], *, nproc_per_node: int = 1, nnodes: str = "1", rdzv_endpoint: str | None = None) -> int:
    """Check the job, then train: in this process for one, else under torchrun's elastic agent.

    Args:
        argv: the config arguments (`--config X`, `--section.key value`, `--print-config`).
        nproc_per_node: processes on this node.
        nnodes: nodes in the job, or a `MIN:MAX` range (elastic; the world size is then checked per process).
        rdzv_endpoint: `host:port` of the c10d rendezvous, for multi-node jobs.

    Returns:
        The exit code: 0, 2 for a config or input error (one line printed), else the failed rank's.
    """
    if nproc_per_node < 1:
        print("titan: error: --nproc-per-node must be >= 1", file=sys.stderr)
        return 2
    if nnodes != "1" and not rdzv_endpoint:
        print("titan: error: --nnodes > 1 needs --rdzv-endpoint host:port", file=sys.stderr)
        return 2
    if "--print-config" in argv or (nproc_per_node == 1 and nnodes == "1"):
        return main(argv)  # one process: the trainer checks the job first thing
    world_size = nproc_per_node * int(nnodes) if nnodes.isdigit() else None
    if code := check_job_here(argv, world_size):
        return code
    launcher = [f"--nproc-per-node={nproc_per_node}", f"--nnodes={nnodes}"]
    launcher += ["--rdzv-backend=c10d", f"--rdzv-endpoint={rdzv_endpoint}"] if rdzv_endpoint else ["--standalone"]
    return _run_torchrun([*launcher, "--module", "titan_core.launch", *argv])


def _run_torchrun(args: list[str]) -> int:
    """Run torchrun's elastic agent in this process; a rank's user error becomes one line."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    # The agent logs each failed rank and its own progress; Titan reports failures itself (below).
    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
    with tempfile.TemporaryDirectory(prefix="titan-errors-") as folder:
        os.environ[ERROR_DIR_ENV] = folder
        try:
            run(parse_args(args))
        except ChildFailedError as failed:
            lines = [p.read_text().strip() for p in sorted(Path(folder).glob("rank*.txt"), key=_rank_of)]
            if lines:
                print(lines[0], file=sys.stderr)
                return 2
            print(f"titan: error: {failed.format_msg()}", file=sys.stderr)
            _, first = failed.get_first_failure()
            return first.exitcode if first.exitcode > 0 else 1
        except SignalException as stopped:  # Ctrl-C or a scheduler's SIGTERM: the agent stopped the ranks
            print(f"titan: stopped by {stopped.sigval.name}", file=sys.stderr)
            return 128 + stopped.sigval.value
        finally:
            os.environ.pop(ERROR_DIR_ENV, None)
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
