"""A run survives what a month on a cluster brings: preemption signals, a SIGKILLed rank, a NaN.

Every test is a real 2-process gloo run. Preemption and the lost rank are compared, step
by step, with one uninterrupted run of the same config: from the checkpoint on, the
losses must be exactly equal (fp32, same seed, deterministic CPU kernels).
"""

from __future__ import annotations

import json
import re
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from titan_run import REPO, TINY, read_metrics, run_titan, titan_env
import warm_python

STEPS = 20
RUN = [*TINY, "--training.steps", str(STEPS), "--training.local_batch_size", "2", "--checkpoint.enable", "true"]


def last_loss_per_step(folder: Path) -> dict[int, float]:
    """step -> loss of its last record (a restarted or resumed run logs some steps twice)."""
    return {r["step"]: r["loss/global_avg"] for r in read_metrics(folder)}


def start_titan(folder: Path, *args: str, nproc: int = 2) -> warm_python.WarmProcess | subprocess.Popen:
    """`titan train` in the background (forked from a warm interpreter: tests/warm_python.py), its stdout and stderr
    into files beside `folder` (`finish` reads them): a pipe no one reads while the test waits for steps could fill
    and stall the run."""
    cmd = [sys.executable, "-m", "titan_cli", "train", "--nproc-per-node", str(nproc), "--job.dump_folder", str(folder), *args]
    folder.parent.mkdir(parents=True, exist_ok=True)
    files = [tempfile.NamedTemporaryFile("w", prefix=f"{folder.name}-", suffix=f".{kind}", dir=folder.parent, delete=False)
             for kind in ("out", "err")]  # fmt: skip
    with files[0] as stdout, files[1] as stderr:
        proc = warm_python.start(cmd, stdout=stdout, stderr=stderr, env=titan_env(), cwd=REPO)
    proc.logs = [Path(f.name) for f in files]  # type: ignore[attr-defined]
    return proc


def finish(proc: subprocess.Popen, timeout: float) -> tuple[str, str]:
    """Wait for a `start_titan` run to end (killed after `timeout` s: its return code is then -9); its stdout and
    stderr."""
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    out, err = proc.logs  # type: ignore[attr-defined]
    return out.read_text(), err.read_text()


def wait_for_steps(folder: Path, n: int, proc: subprocess.Popen, timeout: float = 400) -> None:
    """Until metrics.jsonl holds `n` records (or the run ended, which fails the test). The timeout is for a hang, not
    for speed: on CI's 2 cores, beside the other worker's 4-process launches, a run's first 8 steps once took over
    120 s (its start-up alone is ~18 s on an idle 2-core AVX2-only AMD EPYC)."""
    deadline = time.monotonic() + timeout
    metrics = folder / "metrics.jsonl"
    while time.monotonic() < deadline:
        if metrics.is_file() and len(metrics.read_text().splitlines()) >= n:
            return
        assert proc.poll() is None, f"the run ended before step {n}:\n{finish(proc, 0)[1][-3000:]}"
        time.sleep(0.02)
    logged = len(metrics.read_text().splitlines()) if metrics.is_file() else 0
    raise AssertionError(f"no step {n} within {timeout} s ({logged} logged); its output:\n{finish(proc, 0)[1][-3000:]}")


def processes_under(agent_pid: int) -> dict[str, int]:
    """Name (`/proc/PID/comm`) -> pid of the processes under the `titan train` process: on CPU its ranks'
    fork server (titan_core.rank_fork), `titan-forksrv`, and the ranks forked from it, `titan-rank<RANK>`."""
    found, todo = {}, [agent_pid]
    while todo:
        pid = todo.pop()
        try:
            todo += [int(child) for child in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
            found[Path(f"/proc/{pid}/comm").read_text().strip()] = pid
        except FileNotFoundError:
            continue
    return found


def rank_pids(agent_pid: int) -> dict[int, int]:
    """RANK -> pid of the training processes under the `titan train` process (`processes_under`)."""
    return {int(name.removeprefix("titan-rank")): pid for name, pid in processes_under(agent_pid).items()
            if name.startswith("titan-rank")}  # fmt: skip


def steps_saved(folder: Path) -> list[int]:
    return sorted(int(p.name.removeprefix("step-")) for p in (folder / "checkpoint").glob("step-*") if p.name[5:].isdigit())


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict[int, float]:
    """The uninterrupted run's loss at every step."""
    folder = tmp_path_factory.mktemp("reference")
    run_titan(folder, *RUN, "--checkpoint.interval", "1000", nproc=2)
    return last_loss_per_step(folder)


def test_preemption_signals_save_exit_0_and_resume_exactly(tmp_path, reference):
    """SIGTERM to `titan train` (forwarded by the agent) and to its ranks' fork server, then SIGUSR1 to one rank
    only (Slurm's pre-kill signal): each time the ranks finish the step, save it, exit 0 within seconds; the
    next start resumes, and the stitched run equals the uninterrupted one."""
    folder = tmp_path / "run"
    args = [*RUN, "--checkpoint.interval", "1000"]  # no periodic save: only the signal saves

    proc = start_titan(folder, *args)
    wait_for_steps(folder, 3, proc)
    sent = time.monotonic()
    # The fork server too, as `pkill -f "titan train"` or a scheduler signalling every process of the job would:
    # it must outlive the ranks, which report their exit codes through it (rank_fork.JOB_SIGNALS).
    os.kill(processes_under(proc.pid)["titan-forksrv"], signal.SIGTERM)
    proc.send_signal(signal.SIGTERM)
    _, stderr = finish(proc, 90)
    took = time.monotonic() - sent
    assert proc.returncode == 0, stderr[-3000:]
    first_stop = max(last_loss_per_step(folder))
    assert f"titan: stopped by SIGTERM after step {first_stop}; its checkpoint is saved" in stderr
    assert steps_saved(folder) == [first_stop] and first_stop < STEPS
    assert took < 30, f"the ranks took {took:.1f} s to save and exit after SIGTERM"

    proc = start_titan(folder, *args)
    wait_for_steps(folder, first_stop + 3, proc)
    os.kill(rank_pids(proc.pid)[1], signal.SIGUSR1)  # one rank only: the ranks agree in their next step
    _, stderr = finish(proc, 90)
    assert proc.returncode == 0, stderr[-3000:]
    second_stop = max(last_loss_per_step(folder))
    assert f"titan: stopped by a stop signal sent to another rank after step {second_stop}" in stderr
    assert first_stop < second_stop < STEPS and steps_saved(folder)[-1] == second_stop

    proc = start_titan(folder, *args)
    _, stderr = finish(proc, 600)
    assert proc.returncode == 0, stderr[-3000:]
    stitched = last_loss_per_step(folder)
    assert sorted(stitched) == list(range(1, STEPS + 1))
    assert stitched == reference


def test_sigkilled_rank_restarts_and_resumes_exactly(tmp_path, reference):
    """`--max-restarts 1`: SIGKILL rank 1 mid-run; the agent restarts both ranks, they resume from
    the newest checkpoint, and every step from there on equals the uninterrupted run."""
    folder = tmp_path / "run"
    proc = start_titan(folder, *RUN, "--checkpoint.interval", "3", "--max-restarts", "1")
    wait_for_steps(folder, 8, proc)
    os.kill(rank_pids(proc.pid)[1], signal.SIGKILL)
    killed_after = max(last_loss_per_step(folder))
    stdout, stderr = finish(proc, 600)
    assert proc.returncode == 0, stderr[-3000:]
    assert "restart 1 of 1 (titan train --max-restarts): resumed from step" in stdout + stderr
    resumed_from = int(re.search(r"resumed from step (\d+)", stdout + stderr).group(1))
    assert resumed_from % 3 == 0 and resumed_from <= killed_after + 1
    assert last_loss_per_step(folder) == reference
    # one trajectory: each step logged once; what the killed processes logged past the checkpoint is set aside
    steps = [r["step"] for r in read_metrics(folder) if "loss/global_avg" in r]
    assert steps == sorted(set(steps)) == list(range(1, len(steps) + 1))
    aside = folder / "metrics.superseded.jsonl"
    set_aside = [json.loads(line)["step"] for line in aside.read_text().splitlines()] if aside.exists() else []
    assert all(step > resumed_from for step in set_aside), (resumed_from, set_aside)


def run_nonfinite(folder: Path, bad_step: int, *args: str) -> subprocess.CompletedProcess:
    """The NaN-injecting worker on 2 ranks under `titan train`'s own launcher (one-line errors), forked as `titan
    train` forks a CPU job's ranks."""
    cmd = [sys.executable, "tests/fork_run.py", "--titan", "2", "tests/workers/nonfinite_worker.py", str(bad_step), "1", "--job.dump_folder", str(folder), *TINY, "--training.steps", "8",
           "--checkpoint.enable", "true", "--checkpoint.interval", "2", *args]
    return warm_python.run(cmd, cwd=REPO, env=titan_env(), timeout=300)


def state_checks(stdout: str) -> list[dict]:
    return [json.loads(line.removeprefix("STATE-CHECK ")) for line in stdout.splitlines() if line.startswith("STATE-CHECK ")]


def test_nonfinite_stop_names_the_step_and_keeps_the_last_checkpoint(tmp_path):
    proc = run_nonfinite(tmp_path, 5)
    assert proc.returncode == 3, proc.stderr[-3000:]
    lines = [line for line in proc.stderr.splitlines() if line.startswith("titan:")]
    assert len(lines) == 1, proc.stderr[-3000:]
    assert lines[0].startswith("titan: error: step 5: the loss (on another rank) and the grad norm (nan) are not finite")
    assert "training.on_nonfinite='stop'" in lines[0] and "step-4 is intact" in lines[0]
    assert "Traceback" not in proc.stderr
    assert steps_saved(tmp_path) == [2, 4]
    assert not list((tmp_path / "checkpoint").glob("*.tmp"))
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2, 3, 4]


def test_nonfinite_skip_step_drops_the_update(tmp_path):
    """With the foreach kernels, which cannot drop an update on the device: the verdict is read on the host."""
    proc = run_nonfinite(tmp_path, 5, "--training.on_nonfinite", "skip_step", "--optimizer.implementation", "foreach")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert state_checks(proc.stdout) == [{"kind": "skipped", "step": 5, "same_as_previous": True}]
    records = {r["step"]: r for r in read_metrics(tmp_path)}
    assert sorted(records) == list(range(1, 9))
    assert records[5]["optim/skipped_steps"] == 1 and records[8]["optim/skipped_steps"] == 1
    assert all(records[s]["loss/global_avg"] == records[s]["loss/global_avg"] for s in (6, 7, 8))  # finite again


def test_nonfinite_rollback_restores_the_checkpoint_and_goes_on(tmp_path):
    proc = run_nonfinite(tmp_path, 5, "--training.on_nonfinite", "rollback")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert state_checks(proc.stdout) == [{"kind": "rollback", "from": 5, "to": 4, "same_as_restored": True}]
    assert "rolled back to step-4; training goes on with the data after step 5" in proc.stdout + proc.stderr
    steps = [r["step"] for r in read_metrics(tmp_path)]
    assert steps == [1, 2, 3, 4, 5, 6, 7, 8]  # the dropped step 5 is not logged; 5 is redone on the next batch
    data = json.loads((tmp_path / "checkpoint" / "step-8" / "dataloader.json").read_text())
    # One batch more than 8 steps: the rolled-back step's batch was consumed and not trained on again.
    assert data["samples_consumed"] == 9 * 2 * 8
