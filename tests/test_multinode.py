"""Multi-node on loopback: two `titan train` agents ("nodes" of 2 processes each) meet at a c10d
rendezvous and train to the same losses as 4 processes on one node; the Slurm example parses."""

from __future__ import annotations

import shutil
import socket
import subprocess
import sys

import pytest

from titan_run import REPO, TINY, losses, read_metrics, run_titan, titan_env
import warm_python

SBATCH = REPO / "examples" / "slurm" / "train_multinode.sbatch"

# FSDP 2 x TP 2: the TP pairs are ranks {0, 1} and {2, 3}, i.e. within a node; FSDP crosses the nodes.
LAYOUT = [
    *TINY,
    "--training.steps", "4",
    "--training.local_batch_size", "2",
    "--parallelism.data_parallel_shard_degree", "2",
    "--parallelism.tensor_parallel_degree", "2",
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_nodes_on_loopback_match_one_node(tmp_path):
    one_node = tmp_path / "one-node"
    run_titan(one_node, *LAYOUT, nproc=4, timeout=300)

    # Both agents write into one run folder, as on a cluster's shared filesystem: only global rank 0 writes.
    shared = tmp_path / "two-nodes"
    endpoint = f"127.0.0.1:{free_port()}"
    cmd = [sys.executable, "-m", "titan_cli", "train", "--nnodes", "2", "--nproc-per-node", "2",
           "--rdzv-endpoint", endpoint, "--job.dump_folder", str(shared), *LAYOUT]
    agents = []
    for node in range(2):
        log = open(tmp_path / f"node{node}.log", "w")
        agents.append((warm_python.start(cmd, stdout=log, env=titan_env(), cwd=REPO), log))
    try:
        codes = [agent.wait(timeout=300) for agent, _ in agents]
    finally:
        for agent, log in agents:
            if agent.poll() is None:
                agent.kill()
            log.close()
    logs = [(tmp_path / f"node{node}.log").read_text() for node in range(2)]
    assert codes == [0, 0], "\n".join(text[-3000:] for text in logs)

    # fp32, same seed, same global ranks reading the same shares, same gloo collectives over 4 ranks:
    # the node boundary changes only which agent started a process, so the losses are bit for bit equal.
    assert len(losses(shared)) == 4
    assert losses(shared) == losses(one_node)
    assert [r["loss/global_max"] for r in read_metrics(shared)] == [r["loss/global_max"] for r in read_metrics(one_node)]
    assert sum("4 processes" in text for text in logs) == 1  # one startup line: global rank 0's, on one node


@pytest.mark.skipif(shutil.which("bash") is None, reason="no bash")
def test_sbatch_example_is_valid_bash():
    proc = subprocess.run(["bash", "-n", str(SBATCH)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    text = SBATCH.read_text()
    for line in ("#SBATCH --nodes=", "#SBATCH --ntasks-per-node=1", "--rdzv-endpoint", "--nnodes"):
        assert line in text, line
