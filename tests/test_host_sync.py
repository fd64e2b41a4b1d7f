"""A good training step reads no device value on the host.

Real 2-process runs of `tests/workers/host_sync_worker.py`: the real `Trainer` and
`RunGuard` run 4 steps with every host read of a tensor counted (`item`, `tolist`,
`__float__`, `__bool__`, copies to the CPU, ...), and on CUDA under
`torch.cuda.set_sync_debug_mode("error")`. Step 3's loss is NaN on one rank: its update
is dropped on the device on every rank (the model is unchanged) without a host read,
and the guard's next poll reports step 3.
"""

from __future__ import annotations

import json
import sys

import pytest
import torch

from titan_run import FORK_RUN, REPO, titan_env
import warm_python

ARGS = ["--training.seq_len", "32", "--training.mixed_precision_param", "float32", "--metrics.enable_tensorboard",
        "false", "--debug.seed", "7"]


def host_reads(tmp_path, *args: str) -> dict:
    cmd = [sys.executable, str(FORK_RUN), "2", "tests/workers/host_sync_worker.py", *ARGS, "--job.dump_folder", str(tmp_path), *args]
    proc = warm_python.run(cmd, cwd=REPO, env=titan_env(), timeout=300)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("HOST-SYNC ")]
    assert proc.returncode == 0 and lines, proc.stdout[-2000:] + proc.stderr[-3000:]
    return json.loads(lines[0].removeprefix("HOST-SYNC "))


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device"))]


@pytest.mark.parametrize("device", DEVICES)
def test_fsdp_step_reads_nothing_on_the_host_and_drops_a_nan_update_on_the_device(tmp_path, device):
    result = host_reads(tmp_path, "--training.device", device, "--training.local_batch_size", "2")
    assert result["reads"] == [0, 0, 0, 0], result["where"]
    assert result["unchanged"] and result["dropped"] == 1 and result["first_bad_step"] == 3


def test_pipeline_step_reads_nothing_on_the_host_after_its_first(tmp_path):
    """torch's pipeline schedule reads shapes once, when its first step sets the stages up."""
    result = host_reads(tmp_path, "--parallelism.pipeline_parallel_degree", "2", "--training.local_batch_size", "4",
                        "--training.global_batch_size", "8")
    assert result["reads"][1:] == [0, 0, 0], result["where"]
    assert result["unchanged"] and result["dropped"] == 1 and result["first_bad_step"] == 3
