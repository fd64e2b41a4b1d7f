"""The moving average of the weights (`[ema]`): the average in every checkpoint follows its recurrence from the
checkpointed weights; 2 FSDP ranks stopped at step 2 and resumed on 1 rank hold the average of one uninterrupted
process; a resume from a checkpoint without an average starts it from the loaded weights; a dropped update leaves
it unchanged; `titan convert --ema` writes it, and refuses in one line where there is none."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from titan_ckpt.dcp_files import read_dcp_state_dict, read_dcp_tensor_shapes
from titan_cli.main import app
from titan_core.ema import WeightEMA
from typer.testing import CliRunner

import warm_python
from titan_run import FORK_RUN, REPO, TINY, losses, run_titan, run_titan_all, titan_env

DECAY = 0.5  # large moves: a wrong term shows at once
RUN = [*TINY, "--training.steps", "4", "--training.global_batch_size", "4", "--ema.enable", "true",
       "--ema.decay", str(DECAY), "--checkpoint.enable", "--checkpoint.interval", "1", "--checkpoint.keep_latest_k", "0"]  # fmt: skip
WORKER = REPO / "tests" / "workers" / "ckpt_train.py"


def averages(step_folder: Path, with_weights: bool = False) -> dict[str, torch.Tensor]:
    names = [n for n in read_dcp_tensor_shapes(step_folder) if n.startswith("ema.")]
    return read_dcp_state_dict(step_folder, names + ([n[4:] for n in names] if with_weights else []))


def test_the_average_follows_its_recurrence_and_skips_a_dropped_update():
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    ema = WeightEMA([model], decay=0.75)
    start = {k: v.clone() for k, v in ema.state_dict().items()}
    with torch.no_grad():
        model.weight.add_(1.0)
    ema.update(found_inf=torch.tensor(1.0))  # the guard dropped this step's update: no move
    torch.testing.assert_close(ema.state_dict()["weight"], start["weight"], rtol=0, atol=0)
    ema.update(found_inf=torch.tensor(0.0))
    moved = 0.75 * start["weight"] + 0.25 * model.weight.detach()
    torch.testing.assert_close(ema.state_dict()["weight"], moved)
    ema.update()  # no guard: always moves
    torch.testing.assert_close(ema.state_dict()["weight"], 0.75 * moved + 0.25 * model.weight.detach())
    with pytest.raises(ValueError, match="decay=1.0"):
        WeightEMA([model], decay=1.0)


def test_the_job_check_takes_it_with_replica_groups():
    """A torchft replica group that rejoins recovers the average with the weights (tests/test_torchft.py)."""
    pytest.importorskip("torchft")
    from titan_core.config import load_config
    from titan_core.job import resolve

    cfg = load_config(None, ["--ema.enable", "true", "--fault_tolerance.enable", "true",
                             "--fault_tolerance.lighthouse", "http://localhost:29510"])  # fmt: skip
    assert resolve(cfg, 1).cfg.ema.enable


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    """`reference`: 4 steps in one process; `resharded`: 2 FSDP ranks to step 2, then 1 rank to step 4;
    `late`: 2 steps without an average, then 2 with one."""
    root = tmp_path_factory.mktemp("ema")
    run_titan(root / "reference", *RUN, "--training.local_batch_size", "4")
    cmd = [sys.executable, str(FORK_RUN), "2", str(WORKER), "stop-after-step", "2", *RUN,
           "--training.local_batch_size", "2", "--job.dump_folder", str(root / "resharded")]  # fmt: skip
    proc = warm_python.run(cmd, env=titan_env(), cwd=REPO, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    run_titan(root / "resharded", *RUN, "--training.local_batch_size", "4")
    run_titan(root / "warmup", *RUN, "--training.local_batch_size", "4", "--ema.warmup", "true", "--ema.decay", "0.9")
    run_titan(root / "late", *RUN, "--training.local_batch_size", "4", "--ema.enable", "false", "--training.steps", "2")
    resumed = run_titan(root / "late", *RUN, "--training.local_batch_size", "4")
    (root / "late.log").write_text(resumed.stdout + resumed.stderr)
    return root


def test_every_checkpoints_average_follows_from_the_weights(runs):
    folder = runs / "reference" / "checkpoint"
    for step in (2, 3, 4):
        previous, now = averages(folder / f"step-{step - 1}"), averages(folder / f"step-{step}", with_weights=True)
        assert len(previous) == len(now) // 2 > 10
        for name, value in previous.items():  # ema_t = d ema_{t-1} + (1 - d) weights_t, in fp32
            expected = DECAY * value.double() + (1 - DECAY) * now[name[4:]].double()
            torch.testing.assert_close(now[name].double(), expected, rtol=0, atol=1e-6)
    first = averages(folder / "step-1", with_weights=True)  # half way between the initial and the trained weights
    assert all(not torch.equal(first[n], first[n[4:]]) for n in first if n.startswith("ema.") and n.endswith("wq.weight"))


def test_a_warmed_up_decay_follows_tensorflows_ramp(runs):
    folder = runs / "warmup" / "checkpoint"
    decays = {1: 2 / 11, 2: 3 / 12, 3: 4 / 13, 4: 5 / 14}  # min(0.9, (1 + t) / (10 + t)): below 0.9 until step 80
    assert [WeightEMA([torch.nn.Linear(1, 1)], 0.9, warmup=True).decay_at(t) for t in (1, 4, 80, 1000)] == [
        decays[1], decays[4], 0.9, 0.9]  # fmt: skip
    for step in (2, 3, 4):
        previous, now = averages(folder / f"step-{step - 1}"), averages(folder / f"step-{step}", with_weights=True)
        for name, value in previous.items():
            expected = decays[step] * value.double() + (1 - decays[step]) * now[name[4:]].double()
            torch.testing.assert_close(now[name].double(), expected, rtol=0, atol=1e-6)
    assert losses(runs / "warmup") == losses(runs / "reference")  # the average never feeds back into training


def test_resharded_and_resumed_average_is_one_processs(runs):
    assert losses(runs / "resharded")[-2:] == pytest.approx(losses(runs / "reference")[-2:], abs=2e-5)
    ours = averages(runs / "resharded" / "checkpoint" / "step-4")
    theirs = averages(runs / "reference" / "checkpoint" / "step-4", with_weights=True)
    assert ours.keys() == {n for n in theirs if n.startswith("ema.")}
    for name in ours:  # as the weights of the two runs agree (fp32 over 4 Adam steps); an average restarted at
        # the resume, or not resharded, would be off by the weights' moves (the largest is printed)
        torch.testing.assert_close(ours[name], theirs[name], rtol=1e-4, atol=1e-5)
    moved = max((theirs[n] - theirs[n[4:]]).abs().max().item() for n in ours)
    assert moved > 10 * 1e-5, moved  # 3.8e-4 here: 38x the tolerance


def test_an_average_started_on_resume_starts_from_the_loaded_weights(runs):
    folder = runs / "late" / "checkpoint"
    assert not averages(folder / "step-2")  # saved without an average
    weights = read_dcp_state_dict(folder / "step-2", [n[4:] for n in averages(folder / "step-3")])
    step3 = averages(folder / "step-3", with_weights=True)
    for name, value in weights.items():  # ema_3 = d weights_2 + (1 - d) weights_3
        expected = DECAY * value.double() + (1 - DECAY) * step3[name].double()
        torch.testing.assert_close(step3[f"ema.{name}"].double(), expected, rtol=0, atol=1e-6)
    assert "holds no ema state" in (runs / "late.log").read_text()  # said, not silently fresh


def test_convert_writes_the_average_and_refuses_where_there_is_none(runs, tmp_path):
    cli, step = CliRunner(), runs / "reference" / "checkpoint" / "step-4"
    result = cli.invoke(app, ["convert", str(step), str(tmp_path / "ema.pt"), "--to", "torch", "--ema"])
    assert result.exit_code == 0, result.output
    written = torch.load(tmp_path / "ema.pt", weights_only=True)
    saved = averages(step)
    assert written.keys() == {n[4:] for n in saved}
    assert all(torch.equal(written[n[4:]], saved[n]) for n in saved)
    result = cli.invoke(app, ["convert", str(runs / "late" / "checkpoint" / "step-2"), str(tmp_path / "x.pt"),
                              "--to", "torch", "--ema"])  # fmt: skip
    assert result.exit_code == 2 and "holds no moving average of the weights" in result.output
    assert not (tmp_path / "x.pt").exists()
    result = cli.invoke(app, ["convert", str(step), str(tmp_path / "y.pt"), "--to", "torch", "--anchors"])
    assert result.exit_code == 2 and "holds no DiLoCo anchors" in result.output  # a run without DiLoCo
    result = cli.invoke(app, ["convert", str(step), str(tmp_path / "z.pt"), "--to", "torch", "--ema", "--anchors"])
    assert result.exit_code == 2 and "--ema and --anchors each choose the weights to write" in result.output


VALIDATED = [*TINY, "--training.steps", "4", "--training.global_batch_size", "4", "--ema.enable", "true",
             "--validation.enable", "true", "--validation.freq", "2", "--validation.steps", "2"]  # fmt: skip


@pytest.fixture(scope="module")
def validated(tmp_path_factory) -> Path:
    """`ema.validation` runs: decay 0 (the average is the weights), decay 0.5 with and without it, the same on 2
    FSDP ranks, and a run whose weights are the exported average of the decay-0.5 run's step 4."""
    root = tmp_path_factory.mktemp("ema_validation")
    one = ["--training.local_batch_size", "4"]
    run_titan_all({
        root / "decay0": [*VALIDATED, *one, "--ema.decay", "0", "--ema.validation", "true"],
        root / "half": [*VALIDATED, *one, "--ema.decay", "0.5", "--ema.validation", "true",
                        "--checkpoint.enable", "--checkpoint.interval", "4"],
        root / "half_unscored": [*VALIDATED, *one, "--ema.decay", "0.5"],
    })  # fmt: skip
    fsdp = [*VALIDATED, "--training.local_batch_size", "2", "--ema.decay", "0.5"]
    run_titan_all({root / "half_fsdp": [*fsdp, "--ema.validation", "true"], root / "half_fsdp_unscored": fsdp}, nproc=2)
    result = CliRunner().invoke(app, ["convert", str(root / "half" / "checkpoint" / "step-4"), str(root / "ema_dcp"),
                                      "--to", "dcp", "--ema"])  # fmt: skip
    assert result.exit_code == 0, result.output
    # One step at a learning rate of 1e-12 from the exported average: its validation scores the average's weights.
    run_titan(root / "from_average", *VALIDATED, *one, "--training.steps", "1", "--optimizer.lr", "1e-12",
              "--lr_scheduler.warmup_steps", "0", "--checkpoint.enable", "--checkpoint.initial_load_path",
              str(root / "ema_dcp"))  # fmt: skip
    return root


def scores(folder: Path, key: str) -> list[float]:
    from titan_run import read_metrics

    return [r[key] for r in read_metrics(folder) if key in r]


def test_validation_scores_the_average_and_training_goes_on_untouched(validated):
    # decay 0: the average is the weights, and so are its scores
    assert scores(validated / "decay0", "validation_ema/loss") == scores(validated / "decay0", "validation/loss")
    half, unscored = validated / "half", validated / "half_unscored"
    assert len(scores(half, "validation_ema/loss")) == 2 and not scores(unscored, "validation_ema/loss")
    # swapping the average in and the weights back changes nothing of the run (bit for bit)
    assert losses(half) == losses(unscored)
    assert scores(half, "validation/loss") == scores(unscored, "validation/loss")
    ema_score = scores(half, "validation_ema/loss")[-1]
    assert abs(ema_score - scores(half, "validation/loss")[-1]) > 1e-3  # decay 0.5 averages other weights
    # the exported average, loaded as a model's weights, scores what the run scored it
    assert scores(validated / "from_average", "validation/loss")[0] == pytest.approx(ema_score, abs=1e-5)
    # 2 FSDP ranks: the same scores, and training untouched by them (FSDP's gathered weights are freed around
    # each swap: a module that keeps them after its forward scored half trained weights without that, 7e-5 off)
    assert scores(validated / "half_fsdp", "validation_ema/loss") == pytest.approx(
        scores(half, "validation_ema/loss"), abs=2e-5
    )
    assert losses(validated / "half_fsdp") == losses(validated / "half_fsdp_unscored")
