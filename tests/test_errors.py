"""Which exceptions `titan train` tells in one line: the packages' own input-error types only.

A wrong config key, a missing file or a missing optional package is one line,
`titan: error: ...`, exit 2; any other exception, a ValueError or ImportError
from a bug included, keeps its traceback.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from titan_ckpt import CheckpointError, CheckpointNotFoundError, detect_format
from titan_core.config import ConfigError, MissingFileError, MissingPackageError, load_config
from titan_core.job import resolve
from titan_core.launch import USER_ERRORS
from titan_models import ModelConfigError, get_model_args
from titan_parallel import ParallelConfigError

from titan_run import REPO, TINY, run_titan, titan_env
import warm_python


def run_main(dump_folder, setup: str, *args: str) -> subprocess.CompletedProcess:
    """`titan_core.launch.main` (one rank, as torchrun starts it) in a fresh process, after the Python in `setup`."""
    argv = [*TINY, "--job.dump_folder", str(dump_folder), *args]
    code = textwrap.dedent(setup) + f"\nimport sys, titan_core.launch\nsys.exit(titan_core.launch.main({argv!r}))\n"
    env = titan_env(debug_detail=False)
    env.pop("TITAN_TRACEBACK", None)
    return warm_python.run([sys.executable, "-c", code], env=env, timeout=300, cwd=REPO)


def test_the_input_error_types_are_also_the_builtin_ones():
    assert set(USER_ERRORS) == {ConfigError, ParallelConfigError, CheckpointError, ModelConfigError}
    assert all(issubclass(error, ValueError) for error in USER_ERRORS)  # library callers' `except ValueError` still works
    assert issubclass(MissingPackageError, ImportError) and issubclass(MissingFileError, FileNotFoundError)
    assert issubclass(CheckpointNotFoundError, CheckpointError) and issubclass(CheckpointNotFoundError, FileNotFoundError)
    with pytest.raises(ModelConfigError, match="model.flavor 'nope'"):
        get_model_args("llama3", "nope")
    with pytest.raises(CheckpointNotFoundError, match="does not exist"):
        detect_format("/nonexistent/checkpoint")


def test_a_missing_dataset_is_one_line_naming_the_key(tmp_path):
    proc = run_titan(tmp_path / "run", *TINY, "--training.dataset_path", "/nonexistent", check=False)
    assert proc.returncode == 2, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if "error" in line.lower()]
    assert errors == [line for line in errors if line.startswith("titan: error: ")] and len(errors) == 1, proc.stderr[-3000:]
    assert errors[0].startswith("titan: error: training.dataset_path: /nonexistent does not exist"), errors[0]
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize("error", ["ValueError('boom')", "ImportError('boom')"])
def test_an_unexpected_error_keeps_its_traceback(tmp_path, error):
    setup = f"""
        import titan_core.trainer

        def train(self):
            raise {error}

        titan_core.trainer.Trainer.train = train
    """
    proc = run_main(tmp_path / "run", setup)
    assert proc.returncode not in (0, 2), proc.stderr[-3000:]
    assert "Traceback" in proc.stderr and f"{error.split('(')[0]}: boom" in proc.stderr, proc.stderr[-3000:]
    assert "titan: error:" not in proc.stderr


def test_a_missing_optional_package_is_one_line(tmp_path):
    (tmp_path / "assets").mkdir()
    (tmp_path / "assets" / "tokenizer.json").write_text("{}")
    setup = "import sys; sys.modules['tokenizers'] = None  # as if the package were not installed"
    proc = run_main(tmp_path / "run", setup, "--model.hf_assets_path", str(tmp_path / "assets"))
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines() == [
        f"titan: error: reading the Hugging Face tokenizer {tmp_path / 'assets' / 'tokenizer.json'} needs the tokenizers "
        "package: pip install 'titan-core[hf]'"
    ], proc.stderr[-3000:]


def test_missing_torchao_is_found_when_the_job_is_resolved(monkeypatch):
    # Before any process starts, rather than as apply_float8's ImportError on the ranks.
    monkeypatch.setitem(sys.modules, "torchao", None)  # `find_spec("torchao")` now says not installed
    with pytest.raises(MissingPackageError) as caught:
        resolve(load_config(None, ["--model.converters", "float8"]), 1)
    assert str(caught.value) == (
        "model.converters = ['float8'] needs torchao, which is not installed; pip install titan-parallel[float8] (torchao)"
    )


def test_a_start_that_cannot_load_the_folders_checkpoint_leaves_the_runs_config(tmp_path):
    """Another model pointed at a run folder: one line, and the folder's config.toml is still its run's (titan
    generate / convert read the model from it)."""
    run = tmp_path / "run"
    run_titan(run, *TINY, "--training.steps", "2", "--checkpoint.enable", "true")
    before = (run / "config.toml").read_bytes()
    qwen3 = ("--model.name", "qwen3", "--model.flavor", "debugmodel")
    proc = run_titan(run, *TINY, "--training.steps", "4", "--checkpoint.enable", "true", *qwen3, check=False)
    assert proc.returncode == 2, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("titan: error: ")]
    assert len(errors) == 1, proc.stderr[-3000:]
    assert errors[0].startswith(f"titan: error: job.dump_folder {run} holds the checkpoints of a llama3/debugmodel "
                                "run (its config.toml), and this run is qwen3/debugmodel: choose another "
                                "job.dump_folder"), errors[0]  # fmt: skip
    assert "it was saved from another model" in errors[0]  # and titan_ckpt's own words, which tensor is missing
    assert (run / "config.toml").read_bytes() == before
    assert sorted(p.name for p in run.iterdir()) == ["checkpoint", "config.toml", "metrics.jsonl"]


def test_forked_cpu_ranks_report_a_bug_with_its_traceback(tmp_path):
    """`titan train --nproc-per-node 2` on CPU forks its ranks from a server that imported the launching script
    (titan_core.rank_fork): a bug raised on rank 1 only reaches the user as from a rank of its own, traceback and
    exit code 1. (An input error on forked ranks is one line and exit 2: test_job_check's
    `test_an_error_on_the_ranks_reaches_the_user_as_one_line`.)"""
    script = tmp_path / "launch_two.py"
    script.write_text(textwrap.dedent("""
        import os, sys
        import titan_core.trainer

        def train(self):
            if os.environ["RANK"] == "1":
                raise ValueError("boom")

        titan_core.trainer.Trainer.train = train  # in the fork server too: it imports this script

        if __name__ == "__main__":
            from titan_core.launch import launch
            sys.exit(launch(sys.argv[1:], nproc_per_node=2))
    """))
    env = titan_env(debug_detail=False)
    env.pop("TITAN_TRACEBACK", None)
    proc = warm_python.run([sys.executable, str(script), *TINY, "--job.dump_folder", str(tmp_path / "run")],
                           env=env, timeout=300)  # fmt: skip
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "Traceback" in proc.stderr and "ValueError: boom" in proc.stderr, proc.stderr[-3000:]


def test_the_fork_server_started_before_the_check_serves_the_ranks_or_is_killed(tmp_path):
    """`titan train` starts its CPU ranks' fork server before the job check (`rank_fork.server_started_early`), so
    that it imports the trainer meanwhile: the ranks are then forked from that server, and a launch that ends
    before forking (a failed check) kills it rather than waiting for its imports, leaving no process behind. The
    server is forked from the launching process, which named it; a launcher with another thread running starts it
    as a new interpreter instead (a lock that thread holds would stay held in the fork), which ignores the job's
    signals as the forked one does."""
    (tmp_path / "entry_mod.py").write_text(textwrap.dedent("""
        import os

        def rank(out):
            with open(out, "w") as f:
                f.write(str(os.getppid()))

        def rank_with_signals(out):
            import signal
            from titan_core.rank_fork import rank_started

            rank_started()
            with open(out, "w") as f:
                f.write(f"{os.getppid()} {signal.getsignal(signal.SIGTERM).name}")
    """))
    (tmp_path / "slow_mod.py").write_text("import time\ntime.sleep(120)\n")
    script = tmp_path / "early.py"
    script.write_text(textwrap.dedent(f"""
        import os, signal, sys, threading, time
        from multiprocessing import forkserver
        sys.path.insert(0, {str(tmp_path)!r})
        import entry_mod
        from titan_core.rank_fork import run_elastic, server_started_early

        if __name__ == "__main__":
            with server_started_early(["entry_mod"]):
                server = forkserver._forkserver._forkserver_pid
                run_elastic(["--standalone", "--nproc-per-node=1"], entry_mod.rank, ({str(tmp_path / "ppid")!r},),
                            preload=["entry_mod"])
                with open(f"/proc/{{server}}/comm") as f:
                    print(f.read().strip())
            # Another thread running: the server is a new interpreter (rank_fork._forkable), and serves all the same.
            threading.Thread(target=time.sleep, args=(600,), daemon=True).start()
            with server_started_early(["entry_mod"]):
                spawned = forkserver._forkserver._forkserver_pid
                while True:  # SIGTERM, as a scheduler sends every process of the job, once the server ignores it
                    with open(f"/proc/{{spawned}}/status") as f:
                        ignored = int(next(line for line in f if line.startswith("SigIgn:")).split()[1], 16)
                    if ignored >> (signal.SIGTERM - 1) & 1:
                        break
                    time.sleep(0.01)
                os.kill(spawned, signal.SIGTERM)
                run_elastic(["--standalone", "--nproc-per-node=1"], entry_mod.rank_with_signals,
                            ({str(tmp_path / "ppid2")!r},), preload=["entry_mod"])
                with open(f"/proc/{{spawned}}/cmdline", "rb") as f:
                    new_interpreter = b"multiprocessing.forkserver" in f.read()
                with open(f"/proc/{{spawned}}/comm") as f:
                    print(spawned, new_interpreter, f.read().strip())
            started = time.perf_counter()
            with server_started_early(["slow_mod"]):
                slow = forkserver._forkserver._forkserver_pid
            print(server, slow, time.perf_counter() - started)
    """))
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120,
                          env=titan_env(debug_detail=False))  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    name, spawned, is_new_interpreter, spawned_name, server, slow, seconds = proc.stdout.split()
    assert (tmp_path / "ppid").read_text() == server  # the rank was forked from the server started early
    assert name == "titan-forksrv"  # itself forked from this process (rank_fork.start_server), not a new interpreter
    # The new interpreter outlived its SIGTERM (rank_fork.JOB_SIGNALS) and served the rank, which has SIGTERM's
    # default handling back.
    assert is_new_interpreter == "True" and spawned_name == "titan-forksrv"
    assert (tmp_path / "ppid2").read_text() == f"{spawned} SIG_DFL"
    assert float(seconds) < 10  # not the 120 s its import takes
    assert not Path(f"/proc/{slow}").exists()
