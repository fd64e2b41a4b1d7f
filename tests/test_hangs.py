"""Hangs become errors: a rank that stalls or dies ends a real 2-process job, named (issue #11).

Both jobs run at once, each under torchrun's elastic agent in a process of its own the way
`titan train` runs it (`titan_core.launch._run_torchrun`, the ranks forked), with tests/workers/stall_rank.py as
the rank's program.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from titan_parallel.flight_recorder import flight_recorder_env

from titan_run import REPO, TINY, titan_env

WORKER = REPO / "tests" / "workers" / "stall_rank.py"
FORK_RUN = REPO / "tests" / "fork_run.py"  # titan train's launcher, the ranks forked as it forks a CPU job's
TIMEOUT_S = 5


def start_job(run: Path, mode: str) -> subprocess.Popen:
    """Two ranks; rank 1 stalls or dies at the start of step 3 (step 1 set the train timeout)."""
    args = [*TINY, "--training.steps", "5", "--comm.train_timeout_seconds", str(TIMEOUT_S), "--job.dump_folder", f"{run}"]
    cmd = [sys.executable, str(FORK_RUN), "--titan", "2", str(WORKER), mode, "1", "3", *args]
    # No TORCH_DISTRIBUTED_DEBUG=DETAIL: its checks run on a helper group that keeps the init timeout.
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=titan_env(debug_detail=False), cwd=REPO)


def torch_older_than(major: int, minor: int) -> bool:
    import torch

    return tuple(int(part) for part in torch.__version__.split(".")[:2]) < (major, minor)


def job_code(job: subprocess.Popen) -> int:
    return job.returncode


def watch(job: subprocess.Popen) -> Callable[[Path], tuple[str, float]]:
    """Wait for `job` in a thread from now on, noting when it ends (not when the test gets to it); the returned
    `finish(run)` gives the job's output and the seconds from the fault to the job's end."""
    ended: list[tuple[str, float]] = []  # (output, end time), once the job ends

    def wait() -> None:
        out, _ = job.communicate(timeout=240)
        ended.append((out, time.time()))

    thread = threading.Thread(target=wait, daemon=True)
    thread.start()

    def finish(run: Path) -> tuple[str, float]:
        thread.join(timeout=250)
        assert ended, "the job did not end within 240 s"
        out, end = ended[0]
        assert job.returncode != 0, out[-4000:]
        assert (run / "FAULT").exists(), f"the job ended before the fault:\n{out[-4000:]}"
        return out, end - float((run / "FAULT").read_text())

    return finish


def test_stalled_and_dead_rank_end_the_job_naming_it(tmp_path):
    stall_run, die_run = tmp_path / "stall", tmp_path / "die"
    stall, die = start_job(stall_run, "stall"), start_job(die_run, "die")
    finish_stall, finish_die = watch(stall), watch(die)  # each job's end is noted when it happens
    out, took = finish_stall(stall_run)
    # The timeout, the other rank's grace to report and the stuck rank's own exit, with room for a busy machine.
    assert took < TIMEOUT_S + 25, (took, out[-4000:])
    assert job_code(stall) == 4, out[-4000:]  # `titan train`'s exit code for a hung or lost rank, told in one line
    assert f"titan: error: a collective timed out after {TIMEOUT_S} s in step 3 on rank 0" in out, out[-4000:]
    assert "rank 1 is stuck or dead: it finished step 2" in out and "it is alive" in out, out[-4000:]
    assert "[rank 1] leaving: a collective failed on rank 0" in out, out[-4000:]
    # The stuck rank's stack shows where it is stuck; both ranks dumped their flight recorder.
    assert "in train_step_with_fault" in (stall_run / "comm_stacks" / "rank_1.txt").read_text()
    traces = stall_run / "comm_traces"
    assert sorted(p.name for p in traces.iterdir()) == ["rank_0", "rank_1"]
    analyzer = subprocess.run([sys.executable, "-m", "torch.distributed.flight_recorder.fr_trace", str(traces)],
                              capture_output=True, text=True, timeout=120)
    if torch_older_than(2, 12):  # 2.11's analyser reads NCCL traces only (gloo's from pytorch/pytorch#180268)
        assert "gloo != 'nccl' or 'xccl'" in analyzer.stderr, analyzer.stderr[-3000:]
    else:
        assert "group info: 0:default_pg" in analyzer.stdout + analyzer.stderr, analyzer.stderr[-3000:]

    out, took = finish_die(die_run)
    assert took < 20, (took, out[-4000:])
    # The surviving rank's report names the dead one.
    assert job_code(die) == 4, out[-4000:]
    assert "titan: error: a collective lost its connection to a peer (a rank died?) in step 3 on rank 0" in out, out[-4000:]
    assert "rank 1 is stuck or dead: it finished step 2" in out, out[-4000:]


def test_flight_recorder_env_goes_to_the_run_folder_unless_the_user_set_it(tmp_path):
    folder = tmp_path / "comm_traces"
    assert flight_recorder_env(20000, folder, {}) == {
        "TORCH_FR_BUFFER_SIZE": "20000",
        "TORCH_FR_DUMP_ON_TIMEOUT": "1",
        "TORCH_FR_DUMP_TEMP_FILE": f"{folder}/rank_",
    }
    # 0 turns it off; a value the user set (under either name) stays.
    assert flight_recorder_env(0, folder, {}) == {"TORCH_FR_BUFFER_SIZE": "0", "TORCH_FR_DUMP_ON_TIMEOUT": "0"}
    user = {"TORCH_NCCL_TRACE_BUFFER_SIZE": "5", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": "/x/", "TORCH_FR_DUMP_ON_TIMEOUT": "0"}
    assert flight_recorder_env(20000, folder, user) == {}


def test_a_second_run_in_the_process_dumps_into_its_own_folder(tmp_path, monkeypatch):
    from titan_parallel import flight_recorder

    monkeypatch.setattr(os, "environ", {"TORCH_FR_DUMP_ON_TIMEOUT": "0"})  # the user's
    monkeypatch.setattr(flight_recorder, "_SET_HERE", {})
    assert flight_recorder.enable_flight_recorder(100, tmp_path / "a")
    assert flight_recorder.enable_flight_recorder(200, tmp_path / "b")
    assert os.environ == {"TORCH_FR_DUMP_ON_TIMEOUT": "0", "TORCH_FR_BUFFER_SIZE": "200",
                          "TORCH_FR_DUMP_TEMP_FILE": f"{tmp_path}/b/rank_"}
    assert flight_recorder.recorder_dump_file(3) == tmp_path / "b" / "rank_3"
    assert not flight_recorder.enable_flight_recorder(0, tmp_path / "c")
    assert os.environ == {"TORCH_FR_DUMP_ON_TIMEOUT": "0", "TORCH_FR_BUFFER_SIZE": "0"}


@pytest.mark.parametrize("message, failure", [
    ("[gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 5000ms for recv operation to complete", True),
    ("[gloo/transport/tcp/pair.cc:561] Connection closed by peer [127.0.0.1]:38601", True),
    ("[Rank 0]: Ranks 1 failed to pass monitoredBarrier in 30000 ms", True),
    ("CUDA out of memory", False),
])
def test_collective_failures_are_recognised(message, failure):
    from titan_parallel.comm_watch import is_collective_failure

    assert is_collective_failure(RuntimeError(message)) is failure
