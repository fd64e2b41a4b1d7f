"""`python tests/fork_run.py [--titan] N WORKER [ARGS ...]`: `torchrun --standalone --nproc-per-node N WORKER ARGS ...`,
with the ranks forked from one process that ran the worker's imports once, as `titan train` starts a CPU job
(`titan_core.rank_fork`): a rank's imports (~13 s of CPU on a 2-core AVX2-only AMD EPYC) are paid once per launch, not once per rank.
With `--titan` the agent is `titan train`'s own (`titan_core.launch._run_torchrun`: a rank's error as one line, its
exit code as the launcher's, signals handled as `titan train` handles them), and this process exits with its code.

Each rank runs the worker as `__main__` (its imports are already loaded). A worker ends with
`rank_exit.leave(code)`, which returns here in a forked rank and is `os._exit(code)` in a rank of its own. This
process runs the worker's top level under another name first (its imports and definitions, not its `__main__`
block), and the fork server, forked from it, inherits them; a server that is a new interpreter instead (where
this process could not fork it) runs it when it preloads this module as the agent's `__main__`.
"""

from __future__ import annotations

import os
import runpy
import sys

SCRIPT_ENV = "TITAN_TEST_FORKED_SCRIPT"
"""Set by the agent for the fork server and the ranks: the worker's path."""


def run_worker(script: str, argv: list[str]) -> None:
    """One rank: the worker as `__main__`, with `argv`; its exit code kept."""
    from titan_core.rank_fork import rank_finished, rank_started

    rank_started()
    sys.argv = [script, *argv]
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as e:
        if e.code:
            raise
    rank_finished()


def _load_worker(script: str) -> None:
    sys.path.insert(0, os.path.dirname(script))  # as for a script run by python itself
    runpy.run_path(script, run_name="__fork_preload__")


if __name__ == "__main__":
    titan = sys.argv[1] == "--titan"
    nproc, script, *args = int(sys.argv[1 + titan]), os.path.abspath(sys.argv[2 + titan]), *sys.argv[3 + titan :]
    os.environ[SCRIPT_ENV] = script
    _load_worker(script)  # here: the fork server, forked from this process (rank_fork.start_server), inherits it
    launcher = ["--standalone", f"--nproc-per-node={nproc}"]
    if titan:
        from titan_core.launch import _error_folder, _run_torchrun

        with _error_folder() as folder:
            code = _run_torchrun(launcher, folder, rank=(run_worker, (script, args)))
        sys.exit(code)
    from titan_core.rank_fork import run_elastic

    run_elastic(launcher, run_worker, (script, args), preload=["torch._dynamo"])
elif __name__ == "__mp_main__" and os.environ.get(SCRIPT_ENV):  # the fork server, preloading the agent's __main__
    _load_worker(os.environ[SCRIPT_ENV])
