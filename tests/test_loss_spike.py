"""`training.on_loss_spike`: a spike found on the device from the guard's one all-reduce (no host read),
and real runs that go on past an injected spike (`debug.inject_loss_spike_step`, the last rank's
loss times 10): 'skip' on 2 ranks leaves the weights exactly as the step before, 'rollback' reloads
the checkpoint and skips the batches since it.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch
from titan_run import TINY, read_metrics, run_titan
from workers.host_sync_worker import counting

from titan_core.loss_spike import SpikeDetector
from titan_core.run_guard import RunGuard


def test_the_detector_flags_a_spike_after_warmup_on_the_device(world_of_one):
    cpu = torch.device("cpu")
    guard = RunGuard(cpu, spike=SpikeDetector(2.0, 3, cpu))
    losses = [9.0, 30.0, 6.0, 5.5, 5.0, 40.0, 41.0, 5.2, float("nan"), 4.9]  # step 2: before warm-up
    verdicts, sites = [], []
    with counting(sites):
        for step, loss in enumerate(losses, start=1):
            verdicts.append(guard.observe(torch.tensor(loss), torch.tensor(1.0), step))
    assert sites == []  # nothing read on the host in the steps
    assert [float(v) for v in verdicts] == [0, 0, 0, 0, 0, 1, 1, 0, 1, 0]  # spikes and the NaN drop the update
    report = guard.poll()
    assert report.dropped == 1 and report.first_bad_step == 9  # the NaN, for training.on_nonfinite
    spikes = report.spikes
    assert (spikes.spikes, spikes.step, spikes.loss, spikes.in_a_row) == (2, 6, 40.0, 2)
    assert 6.0 < spikes.average < 13.0  # the running average of the 5 accepted steps (30 included), not of 40
    assert guard.poll().spikes.spikes == 0  # counted afresh


def dcp_tensors(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a DCP checkpoint folder (model and optimizer), read in this process."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    metadata = dcp.FileSystemReader(str(folder)).read_metadata()
    out = {
        k: torch.empty(m.size, dtype=m.properties.dtype)
        for k, m in metadata.state_dict_metadata.items()
        if isinstance(m, TensorStorageMetadata)
    }
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(out, checkpoint_id=str(folder), no_dist=True)
    return out


SPIKE = [
    "--training.loss_spike_warmup_steps",
    "2",
    "--debug.inject_loss_spike_step",
    "5",
    "--checkpoint.enable",
    "--checkpoint.keep_latest_k",
    "0",
    "--training.local_batch_size",
    "2",
]


def test_skip_on_two_ranks_goes_on_and_the_weights_skip_the_batch(tmp_path):
    proc = run_titan(
        tmp_path,
        *TINY,
        *SPIKE,
        "--training.steps",
        "6",
        "--checkpoint.interval",
        "1",
        "--training.on_loss_spike",
        "skip",
        nproc=2,
    )
    out = proc.stdout + proc.stderr
    line = next(line for line in out.splitlines() if "x its running average" in line)
    assert (
        "step 5: loss " in line
        and "(training.loss_spike_factor=2.0); batch: global samples 16-19 of StdlibSource(" in line
    )
    assert line.endswith("update skipped (training.on_loss_spike='skip')")
    records = {r["step"]: r for r in read_metrics(tmp_path)}
    assert sorted(records) == [1, 2, 3, 4, 5, 6] and records[5]["loss/spikes"] == 1 and "loss/spikes" not in records[4]
    assert records[5]["loss/global_avg"] > 3 * records[4]["loss/global_avg"]  # (l + 10 l) / 2 on 2 ranks
    before, spiked, after = (dcp_tensors(tmp_path / "checkpoint" / f"step-{s}") for s in (4, 5, 6))
    assert before.keys() == spiked.keys() and len(before) > 10
    assert all(torch.equal(before[k], spiked[k]) for k in before)  # model and optimizer: step 5 changed nothing
    assert not all(torch.equal(spiked[k], after[k]) for k in spiked)  # step 6 trained again


def test_rollback_reloads_the_checkpoint_and_skips_the_batches_since(tmp_path):
    notes = tmp_path / "notes"
    notes.mkdir()
    for i in range(4):
        (notes / f"{i}.txt").write_text(f"note {i}: " + "the rain in spain stays mainly in the plain. " * 20)
    mix = json.dumps([{"path": "stdlib", "weight": 0.5}, {"path": str(notes), "weight": 0.5}])
    proc = run_titan(
        tmp_path / "run",
        *TINY,
        *SPIKE,
        "--training.steps",
        "8",
        "--checkpoint.interval",
        "2",
        "--training.on_loss_spike",
        "rollback",
        "--training.dataset_mix",
        mix,
    )
    out = proc.stdout + proc.stderr
    line = next(line for line in out.splitlines() if "x its running average" in line)
    assert "step 5: loss " in line and "batch: stdlib 1, notes 1 samples (global samples 8-9)" in line, line
    assert line.endswith(
        "rolled back to step-4; training goes on with the data after step 5 (the batches of steps 5-5 are skipped)"
    )
    assert [r["step"] for r in read_metrics(tmp_path / "run")] == [1, 2, 3, 4, 5, 6, 7, 8]
    data = json.loads((tmp_path / "run" / "checkpoint" / "step-8" / "dataloader.json").read_text())
    assert data["samples_consumed"] == 9 * 2  # one batch more than 8 steps: the spiked one was not trained again
    assert data["sources"][1]["stream"]["samples_consumed"] == 9  # the notes' half of the 18 samples
