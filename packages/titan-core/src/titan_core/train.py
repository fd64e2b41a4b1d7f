"""Entry point of one training process: `python -m titan_core.train [--config X] [--section.key value ...]`.

`titan train` calls `main` in-process for one process, and starts N of these
under torchrun for more; `torchrun --nproc-per-node N -m titan_core.train ...`
works as well.
"""

from __future__ import annotations

import logging
import os
import sys

from titan_core.config import ConfigError, check_combinations, dump_toml, load_config

# Errors that mean "the input is wrong": shown as one line, no traceback
# (set TITAN_TRACEBACK=1 to see it).
USER_ERRORS = (ConfigError, ValueError, FileNotFoundError, ImportError)


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


def check_before_launch(argv: list[str]) -> int:
    """Load and check the config in the launching process, before torchrun starts N of them.

    Returns 0 when the config is valid, else prints one line and returns 2: a wrong key or
    combination is reported once, not by N processes followed by torchrun's traceback.
    """
    try:
        config, _, overrides = split_args(argv)
        check_combinations(load_config(config, overrides))
    except ConfigError as e:
        if os.environ.get("TITAN_TRACEBACK"):
            raise
        print(f"titan: error: {e}", file=sys.stderr)
        return 2
    return 0


def main(argv: list[str] | None = None) -> int:
    """Train with the config from `argv`; returns a process exit code."""
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
        if int(os.environ.get("RANK", 0)) == 0:
            print(f"titan: error: {e}", file=sys.stderr)
        return 2
    finally:
        if "titan_parallel.distributed" in sys.modules:
            sys.modules["titan_parallel.distributed"].shutdown_distributed()
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # Leave without running interpreter teardown: gloo's threads can abort it
    # ("terminate called without an active exception") on multi-rank runs.
    os._exit(code)
