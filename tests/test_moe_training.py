"""A DeepSeek-V3-shaped MoE, end to end on CPU processes: trained with expert parallel and resharded
across expert-parallel degrees (EP 2 on 2 ranks -> 1 rank) with the losses of one uninterrupted process
(EP 4 and the other layouts are rows of the parity matrix);
its checkpoint converts to Hugging Face and back with transformers' parity check; `titan generate`
samples from both and agrees; the logs carry the experts' load."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from titan_run import FORK_RUN, REPO, losses, read_metrics, run_titan, titan_env
import warm_python

WORKER = REPO / "tests" / "workers" / "ckpt_train.py"
GLOBAL_BATCH = 4
RUN = [
    "--model.name", "deepseek_v3", "--model.flavor", "debugmodel",
    "--training.steps", "6", "--training.seq_len", "32", "--training.mixed_precision_param", "float32",
    "--lr_scheduler.warmup_steps", "2", "--metrics.log_freq", "1", "--metrics.enable_tensorboard", "false",
    "--metrics.peak_tflops", "1", "--debug.seed", "7",
    "--checkpoint.enable", "--checkpoint.interval", "2", "--checkpoint.keep_latest_k", "0",
    # ST-MoE's router z-loss and DeepSeek-V3's sequence-wise balance loss (its paper's 1e-4) on top of the
    # expert-bias balancing, under full AC (whose recompute must not count twice)
    "--moe.router_z_loss_coeff", "0.01", "--moe.aux_loss_coeff", "1e-4", "--activation_checkpoint.mode", "full",
]  # fmt: skip
EP = "--parallelism.expert_parallel_degree"


def train_until(run: Path, stop_after: int, nproc: int, *args: str) -> None:
    """Train with `nproc` ranks from the newest checkpoint; every rank exits after step `stop_after`."""
    batch = ["--training.local_batch_size", str(GLOBAL_BATCH // nproc)]
    cmd = [sys.executable, str(FORK_RUN), str(nproc), str(WORKER), "stop-after-step", str(stop_after), *RUN, *batch, "--job.dump_folder", str(run), *args]
    proc = warm_python.run(cmd, env=titan_env(), cwd=REPO, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


def titan(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = warm_python.run([sys.executable, "-m", "titan_cli", *args], env=titan_env(False), cwd=REPO, timeout=600)
    assert not check or proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> tuple[Path, Path]:
    """(the uninterrupted one-process run, the run trained 4 steps on 2 ranks at EP 2, then 2 on 1 rank)."""
    reference = tmp_path_factory.mktemp("reference")
    run_titan(reference, *RUN, "--training.local_batch_size", str(GLOBAL_BATCH))
    resharded = tmp_path_factory.mktemp("resharded")
    train_until(resharded, 4, 2, EP, "2")
    run_titan(resharded, *RUN, "--training.local_batch_size", str(GLOBAL_BATCH))
    return reference, resharded


def test_checkpoints_reshard_across_expert_parallel_degrees(runs):
    reference, resharded = runs
    by_step = {r["step"]: r["loss/global_avg"] for r in read_metrics(resharded)}  # a resumed step keeps its last value
    ref = losses(reference)
    assert sorted(by_step) == [1, 2, 3, 4, 5, 6]
    assert max(abs(by_step[s] - ref[s - 1]) for s in by_step) < 2e-5
    worlds = [json.loads((resharded / "checkpoint" / f"step-{s}" / "manifest.json").read_text())["world_size"] for s in (2, 4, 6)]
    assert worlds == [2, 2, 1]
    # The experts are stored whole (all 8 of them) although each of the 2 ranks that wrote them held 4,
    # and the expert biases moved (aux-loss-free balancing ran) identically to the one-process run's.
    from titan_ckpt.dcp_files import read_dcp_state_dict, read_dcp_tensor_shapes

    step4 = resharded / "checkpoint" / "step-4"
    shapes = read_dcp_tensor_shapes(step4)
    w1 = next(name for name in shapes if name.endswith("moe.experts.w1"))
    assert shapes[w1][0][0] == 8  # (shape, dtype): dim 0 holds every expert
    bias = next(name for name in shapes if name.endswith("moe.expert_bias"))
    ours, theirs = read_dcp_state_dict(step4, [bias]), read_dcp_state_dict(reference / "checkpoint" / "step-4", [bias])
    assert ours[bias].abs().sum() > 0
    torch.testing.assert_close(ours[bias], theirs[bias], atol=0, rtol=0)


def test_load_balance_metrics_are_logged(runs):
    reference, resharded = runs
    for folder in runs:
        record = read_metrics(folder)[-1]
        counts = record["moe/tokens_per_expert"]  # {block: [slots per expert]}, summed over the global batch
        assert counts and all(len(c) == 8 for c in counts.values())
        # every token reaches top_k = 2 experts, counted once although full AC runs each block's forward twice
        assert all(sum(c) == GLOBAL_BATCH * 32 * 2 for c in counts.values())
        busiest = max(max(c) / (sum(c) / len(c)) for c in counts.values())
        assert record["moe/max_load"] == pytest.approx(busiest)
    # The router z-loss (summed over the 3 MoE blocks, averaged over the ranks' tokens) is the one process's at every
    # step, steps 1-4 from 2 ranks at EP 2. At the start the router's logits are small (init std 0.02), so each
    # block's logsumexp is near log(8 experts): 3 x 0.01 x log(8)^2 = 0.130; the z-loss pulls it down from there.
    ref = {r["step"]: r["moe/router_z_loss"] for r in read_metrics(reference)}
    ours = {r["step"]: r["moe/router_z_loss"] for r in read_metrics(resharded)}
    assert sorted(ours) == sorted(ref) == [1, 2, 3, 4, 5, 6]
    assert all(ours[s] == pytest.approx(ref[s], rel=1e-5) for s in ref), (ours, ref)
    assert ref[1] == pytest.approx(3 * 0.01 * math.log(8) ** 2, rel=0.05) and ref[6] < ref[1]
    # The balance loss likewise: 1 per block at perfect balance (1.08 measured), at most experts / top_k = 4.
    ref = {r["step"]: r["moe/aux_loss"] for r in read_metrics(reference)}
    ours = {r["step"]: r["moe/aux_loss"] for r in read_metrics(resharded)}
    assert all(ours[s] == pytest.approx(ref[s], rel=1e-5) for s in ref), (ours, ref)
    assert all(1.5e-4 <= v <= 12e-4 for v in ref.values()), ref


def test_trained_moe_converts_to_hf_and_back_and_generates(runs, tmp_path):
    _, resharded = runs
    step = resharded / "checkpoint" / "step-6"
    hf, back = tmp_path / "hf", tmp_path / "dcp"
    for src, dst, to in ((step, hf, "hf"), (hf, back, "dcp")):  # the check fails the command when logits differ
        out = titan("convert", str(src), str(dst), "--to", to, "--model-name", "deepseek_v3").stdout
        assert "parity: max_abs_diff=" in out and "(ok;" in out, out
    greedy = ["--prompt", "def main(", "--max-new-tokens", "12", "--temperature", "0"]
    from_run = titan("generate", str(resharded), *greedy).stdout
    from_hf = titan("generate", str(hf), *greedy, "--model-name", "deepseek_v3").stdout
    assert from_run.strip() and from_run == from_hf


def test_forced_balance_loads_every_expert_equally_under_expert_parallel(tmp_path):
    """`debug.moe_force_load_balance` (torchtitan's key) on 2 ranks at EP 2: every step's slots are spread evenly
    over the 8 experts of each of the 3 MoE blocks (`moe/max_load` 1.0), and the run says so at start."""
    run = tmp_path / "forced"
    args = [arg for arg in RUN if arg not in ("--checkpoint.enable",)]
    proc = run_titan(run, *args, "--checkpoint.enable", "false", "--training.steps", "3",
                     "--training.local_batch_size", str(GLOBAL_BATCH // 2), EP, "2",
                     "--debug.moe_force_load_balance", nproc=2)  # fmt: skip
    assert "debug.moe_force_load_balance: MoE tokens are routed round-robin" in proc.stdout + proc.stderr
    records = read_metrics(run)
    assert [r["step"] for r in records] == [1, 2, 3]
    for record in records:
        assert record["moe/max_load"] == 1.0
        counts = record["moe/tokens_per_expert"]
        assert len(counts) == 3 and all(c == [GLOBAL_BATCH * 32 * 2 / 8] * 8 for c in counts.values()), counts
