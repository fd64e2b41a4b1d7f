"""Checkpoints in real training runs: resume equality, kill -9 (during training and during an
async save), a truncated shard, load_step / exclude_from_loading, resharding 2 -> 4 -> 1 ranks,
keep_latest_k, a bf16 model-only last save, and a seed checkpoint started on 2 FSDP ranks.

Every run is the same tiny job (debugmodel, fp32, seq_len 32, global batch 4, 6 steps,
warmup 2 then linear decay, so the LR differs at every step); the uninterrupted one-process
run is the reference. Runs are real processes (`python -m titan_core.launch` for one rank,
`titan train` for several, the hook worker's ranks forked as `titan train` forks them); crashes are SIGKILLs sent to the run's process group at points that
tests/workers/ckpt_train.py makes deterministic.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
import torch

from titan_run import FORK_RUN, REPO
import warm_python

WORKER = REPO / "tests" / "workers" / "ckpt_train.py"
STEPS = 6
GLOBAL_BATCH = 4
TINY = [
    "--training.steps", str(STEPS),
    "--training.seq_len", "32",
    "--training.mixed_precision_param", "float32",
    "--lr_scheduler.warmup_steps", "2",
    "--metrics.log_freq", "1",
    "--metrics.enable_tensorboard", "false",
    "--metrics.peak_tflops", "1",
    "--checkpoint.enable",
    "--checkpoint.interval", "2",
    "--checkpoint.keep_latest_k", "0",
]  # fmt: skip


def env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def command(run: Path, args: tuple[str, ...], nproc: int, hook: tuple[str, int] | None) -> list[str]:
    """`python -m titan_core.launch` for one rank, `titan train` for several (or the hook worker, its ranks forked
    as `titan train` forks them: tests/fork_run.py)."""
    if hook:
        target = [str(WORKER), hook[0], str(hook[1])]
        launcher = [sys.executable] if nproc == 1 else [sys.executable, str(FORK_RUN), str(nproc)]
    else:
        target = ["-m", "titan_core.launch"] if nproc == 1 else ["-m", "titan_cli", "train", "--nproc-per-node", str(nproc)]
        launcher = [sys.executable]
    batch = ["--training.local_batch_size", str(GLOBAL_BATCH // nproc)]
    return [*launcher, *target, *TINY, *batch, "--job.dump_folder", str(run), *args]


def start(run: Path, *args: str, nproc: int = 1, hook: tuple[str, int] | None = None) -> warm_python.WarmProcess | subprocess.Popen:
    """Start a training job in its own session and process group, its output in `run`/train-N.log (forked from a warm
    interpreter: tests/warm_python.py)."""
    run.mkdir(parents=True, exist_ok=True)
    log = run / f"train-{len(list(run.glob('train-*.log')))}.log"
    with open(log, "w") as out:
        proc = warm_python.start(command(run, args, nproc, hook), stdout=out, env=env(), cwd=REPO)
    proc.log = log
    return proc


def finish(proc: subprocess.Popen, ok: bool = True) -> str:
    """Wait for a job; returns its output. With `ok`, fail the test on a non-zero exit."""
    try:
        code = proc.wait(timeout=300)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        raise
    output = proc.log.read_text()
    if ok and code != 0:
        raise AssertionError(f"{proc.args} failed ({code}):\n{output[-4000:]}")
    return output


def train(run: Path, *args: str, nproc: int = 1, hook: tuple[str, int] | None = None) -> str:
    """Run a training job to its end (it must succeed); returns its output."""
    return finish(start(run, *args, nproc=nproc, hook=hook))


def kill_at_hang(proc: subprocess.Popen, run: Path) -> None:
    """Wait until a hook job reports its crash point (`run`/HANG), then SIGKILL its process group."""
    deadline = time.monotonic() + 300
    while not (run / "HANG").exists():
        assert proc.poll() is None, f"run ended ({proc.returncode}) before the crash point:\n{proc.log.read_text()[-3000:]}"
        assert time.monotonic() < deadline, "crash point not reached in 300 s"
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)
    assert proc.wait(timeout=60) == -signal.SIGKILL


def losses(run: Path) -> dict[int, float]:
    """Step -> loss from metrics.jsonl; a step logged again after a resume keeps its last value."""
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss/global_avg"] for r in records}


def logged_steps(run: Path) -> list[int]:
    return [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]


def ckpt(run: Path, step: int) -> Path:
    return run / "checkpoint" / f"step-{step}"


def read_json(run: Path, step: int, name: str) -> dict:
    return json.loads((ckpt(run, step) / f"{name}.json").read_text())


def complete_steps(run: Path) -> list[int]:
    return sorted(int(p.parent.name.removeprefix("step-")) for p in (run / "checkpoint").glob("step-*/manifest.json"))


def dcp_tensors(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a DCP folder, read with torch's own reader in this one process."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    metadata = dcp.FileSystemReader(str(folder)).read_metadata()
    out = {
        k: torch.empty(m.size, dtype=m.properties.dtype)
        for k, m in metadata.state_dict_metadata.items()
        if isinstance(m, TensorStorageMetadata)
    }
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(out, checkpoint_id=str(folder), no_dist=True)
    return out


def copy_run(src: Path, dst: Path) -> Path:
    """A copy of a run folder's checkpoints (metrics start empty)."""
    shutil.copytree(src / "checkpoint", dst / "checkpoint")
    return dst


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    """The uninterrupted one-process run, checkpoints at steps 2, 4, 6 (all kept)."""
    run = tmp_path_factory.mktemp("reference")
    train(run)
    assert logged_steps(run) == [1, 2, 3, 4, 5, 6]
    assert complete_steps(run) == [2, 4, 6]
    return run


def test_kill_9_during_training_and_during_async_save_then_resume(reference, tmp_path):
    """Two independent one-process jobs, run side by side:

    A checkpoints every 3 steps and is killed after step 4: step-3 stays the newest.
    B saves in the background every 2 steps and is killed while step 4's writer is between its
    data file and the manifest: step-2 stays the newest, step-4.tmp is left behind. B resumes
    with keep_latest_k = 2 and a bf16 model-only last save.
    """
    a, b = tmp_path / "a", tmp_path / "b"
    a_args = ("--checkpoint.interval", "3")
    b_args = ("--checkpoint.async_mode", "async")
    crashing = [(start(a, *a_args, hook=("hang-after-step", 4)), a), (start(b, *b_args, hook=("hang-in-async-write", 4)), b)]
    for proc, run in crashing:
        kill_at_hang(proc, run)
    assert complete_steps(a) == [3] and not list((a / "checkpoint").glob("*.tmp"))
    assert read_json(a, 3, "train_state") == {"step": 3, "tokens_seen": 3 * GLOBAL_BATCH * 32}
    assert complete_steps(b) == [2]
    unfinished = b / "checkpoint" / "step-4.tmp"
    assert (unfinished / "__0_0.distcp").is_file() and not (unfinished / "manifest.json").exists()

    export = ("--checkpoint.keep_latest_k", "2", "--checkpoint.last_save_model_only", "--checkpoint.export_dtype", "bfloat16")
    resumed = [start(a, *a_args), start(b, *b_args, *export)]  # fresh processes in the same run folders
    a_out, _ = (finish(proc) for proc in resumed)

    # A: continued from step 3 and matches the uninterrupted run bit for bit (data order, LR, optimizer).
    assert "loaded" in a_out and "step-3" in a_out
    assert logged_steps(a) == [1, 2, 3, 4, 5, 6]  # step 4 ran again after the resume: logged once
    assert "held 1 record past step 3 (step 4)" in a_out  # the killed process's step 4 was set aside
    assert [json.loads(line)["step"] for line in (a / "metrics.superseded.jsonl").read_text().splitlines()] == [4]
    assert losses(a) == losses(reference)
    assert read_json(a, 6, "dataloader") == read_json(reference, 6, "dataloader")

    # B: the unfinished folder is gone, the losses are exact (step 2 was written while training went on).
    assert not unfinished.exists()
    assert losses(b) == losses(reference)
    assert complete_steps(b) == [4, 6]  # keep_latest_k = 2 removed step-2
    manifest = json.loads((ckpt(b, 6) / "manifest.json").read_text())
    assert manifest["model_only"] is True and "optimizer" not in manifest["contents"]
    exported, full = dcp_tensors(ckpt(b, 6)), dcp_tensors(ckpt(reference, 6))
    model_keys = {k for k in full if not k.startswith("optimizer.")}
    assert set(exported) == model_keys and len(model_keys) > 10
    for key, value in exported.items():
        assert value.dtype == torch.bfloat16, key
        assert torch.equal(value, full[key].to(torch.bfloat16)), key
    assert any(k.startswith("optimizer.") for k in dcp_tensors(ckpt(b, 4)))  # not the last step: a full save


def test_truncated_shard_is_detected_and_named(reference, tmp_path):
    run = copy_run(reference, tmp_path / "run")
    shard = ckpt(run, 6) / "__0_0.distcp"
    with open(shard, "r+b") as f:
        f.truncate(shard.stat().st_size // 2)
    proc = start(run)
    output = finish(proc, ok=False)
    assert proc.returncode == 2
    error = output.strip().splitlines()[-1]
    assert error.startswith("titan: error: checkpoint file") and str(shard) in error, error
    # titan-ckpt's own argument, then its config key by lookup
    assert "truncated" in error and "load_step=4" in error and "(load_step set by checkpoint.load_step)" in error, error


def test_load_step_and_exclude_from_loading(reference, tmp_path):
    run = copy_run(reference, tmp_path / "run")
    train(run, "--checkpoint.load_step", "2", "--checkpoint.exclude_from_loading", '["dataloader", "lr_scheduler"]')
    assert logged_steps(run) == [3, 4, 5, 6]  # resumed at step 2 although step-4 and step-6 exist
    # The model came from step 2: a trained model, not a fresh one, sees the stream's first batch.
    assert losses(run)[3] < losses(reference)[1] - 0.5
    # The data restarted at the stream's start: after 4 steps here it stands where the reference stood after 4.
    assert read_json(run, 6, "dataloader") == read_json(reference, 4, "dataloader")
    assert read_json(run, 6, "dataloader")["samples_consumed"] == 4 * GLOBAL_BATCH
    assert read_json(run, 4, "dataloader") == read_json(reference, 2, "dataloader")  # step-4 was rewritten
    assert read_json(run, 6, "lr_scheduler")["last_epoch"] == 4  # a fresh schedule, stepped 4 times
    assert read_json(run, 6, "train_state")["step"] == 6


def test_a_load_only_run_resumes_and_saves_nothing_and_a_first_step_save(reference, tmp_path):
    run = copy_run(reference, tmp_path / "run")
    for step in (4, 6):
        shutil.rmtree(ckpt(run, step))  # the run stands at step 2
    out = train(run, "--checkpoint.load_only")
    assert "checkpoint.load_only: loaded, and no checkpoint will be saved" in out
    assert logged_steps(run) == [3, 4, 5, 6] and complete_steps(run) == [2]  # steps 4 and 6 not saved again
    assert losses(run) == {step: losses(reference)[step] for step in (3, 4, 5, 6)}  # it went on as the reference did
    first = tmp_path / "first"
    train(first, "--checkpoint.enable_first_step_checkpoint", "--training.steps", "3")
    assert complete_steps(first) == [1, 2, 3]  # step 1, the interval's step 2 and the last


def test_reshard_2_to_4_to_1_ranks_keeps_losses_and_data_position(reference, tmp_path):
    run = tmp_path / "run"
    train(run, "--checkpoint.async_mode", "async", nproc=2, hook=("stop-after-step", 2))
    resumed = [train(run, nproc=4, hook=("stop-after-step", 4)), train(run)]
    assert complete_steps(run) == [2, 4, 6]
    # The same config: its optimizer settings are the checkpoint's (titan_core.checkpointing.ConfigSettings).
    assert not any("optimizer settings apply" in out for out in resumed), resumed[0][-3000:]
    assert not any("whose steps took" in out for out in resumed)  # the same global batch on 2, 4 and 1 ranks
    assert [json.loads((ckpt(run, s) / "manifest.json").read_text())["world_size"] for s in (2, 4, 6)] == [2, 4, 1]
    assert logged_steps(run) == [1, 2, 3, 4, 5, 6]
    ref = losses(reference)
    assert max(abs(ref[s] - loss) for s, loss in losses(run).items()) < 1e-5
    for step in (2, 4, 6):  # the global sample stream went on where it stopped: nothing repeated or skipped
        assert read_json(run, step, "dataloader")["samples_consumed"] == step * GLOBAL_BATCH
        assert read_json(run, step, "dataloader") == read_json(reference, step, "dataloader")
    # Started again once finished: it says so, trains nothing and writes nothing.
    out = train(run)
    assert "the run stands at step 6, training.steps is 6: nothing left to train" in out, out[-3000:]
    assert logged_steps(run) == [1, 2, 3, 4, 5, 6] and complete_steps(run) == [2, 4, 6]


def test_seed_checkpoint_then_fsdp_2_ranks_start_from_it(reference, tmp_path):
    from titan_core.data import PackedLoader, build_source, build_tokenizer
    from titan_models import get_model_args, get_model_spec

    run = tmp_path / "run"
    train(run, "--checkpoint.create_seed_checkpoint", "--debug.seed", "7")
    assert complete_steps(run) == [0] and not (run / "metrics.jsonl").exists()
    assert json.loads((ckpt(run, 0) / "manifest.json").read_text())["contents"] == ["model"]
    # The seed checkpoint holds the model as initialised from seed 7, full and unsharded.
    model = get_model_spec("llama3").build(get_model_args("llama3", "debugmodel"))
    torch.manual_seed(7)
    model.init_weights()  # the documented init: every parameter drawn from the seed, in init_weights' order
    expected = model.state_dict()
    seed = dcp_tensors(ckpt(run, 0))
    assert set(seed) == set(expected)
    assert all(torch.equal(seed[k], expected[k]) for k in expected)

    # Two FSDP ranks (seeded 0) start from it: their first loss is the seed-7 model's on the first batch.
    train(run, "--training.steps", "2", "--lr_scheduler.warmup_steps", "1", nproc=2)
    inputs, labels = next(iter(PackedLoader(build_source("stdlib", None, "text"), build_tokenizer(None), seq_len=32, local_batch_size=4)))
    with torch.no_grad():
        first = torch.nn.functional.cross_entropy(model(inputs).flatten(0, 1), labels.flatten()).item()
    assert abs(losses(run)[1] - first) < 1e-5
    assert abs(losses(reference)[1] - first) > 1e-3  # the seed-0 model's loss differs: the weights came from step-0


def test_resume_across_pipeline_tensor_and_data_parallel_layouts(reference, tmp_path):
    """Saved by 2 pipeline stages, resumed by 2 tensor-parallel ranks, finished by 2 FSDP ranks."""
    run = tmp_path / "run"
    whole_batch = ("--training.local_batch_size", str(GLOBAL_BATCH))  # pp and tp ranks read the same batch
    train(run, *whole_batch, "--parallelism.pipeline_parallel_degree", "2", nproc=2, hook=("stop-after-step", 2))
    train(run, *whole_batch, "--parallelism.tensor_parallel_degree", "2", nproc=2, hook=("stop-after-step", 4))
    train(run, nproc=2)
    assert complete_steps(run) == [2, 4, 6]
    assert logged_steps(run) == [1, 2, 3, 4, 5, 6]
    ref = losses(reference)
    assert max(abs(ref[s] - loss) for s, loss in losses(run).items()) < 2e-5
    for step in (2, 4, 6):
        assert read_json(run, step, "dataloader") == read_json(reference, step, "dataloader")
