"""Running `titan train` for real from the tests: one process or N under torchrun."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

import warm_python

REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = REPO.parent / "shared" / "data"
TRAIN_RUNS = REPO / "tests" / "workers" / "train_runs.py"
FORK_RUN = REPO / "tests" / "fork_run.py"
"""`python FORK_RUN N WORKER ARGS ...`: torchrun's `--standalone --nproc-per-node N`, the ranks forked (tests/fork_run.py)."""

# A tiny, fast, exactly reproducible run: fp32, fixed seed, every step logged.
TINY = [
    "--training.seq_len", "32",
    "--training.steps", "10",
    "--training.mixed_precision_param", "float32",
    "--lr_scheduler.warmup_steps", "2",
    "--metrics.log_freq", "1",
    "--metrics.enable_tensorboard", "false",
    "--metrics.peak_tflops", "1",
    "--debug.seed", "7",
]


def _detail_runs_functional_collectives() -> bool:
    """Whether torch's functional collectives (DTensor's redistribution: TP, CP) run under TORCH_DISTRIBUTED_DEBUG=DETAIL
    on gloo. torch 2.11's DETAIL wrapper sends them to coalesced all-gather / reduce-scatter ops gloo lacks ("Backend
    gloo does not support reduce_scatter_tensor_coalesced"; the same runs pass without DETAIL); 2.15's does not.
    2.12-2.14 were not tried and keep DETAIL."""
    major, minor = (int(part) for part in version("torch").split(".")[:2])
    return (major, minor) >= (2, 12)


DEBUG_DETAIL = {"TORCH_DISTRIBUTED_DEBUG": "DETAIL"} if _detail_runs_functional_collectives() else {}
"""The environment that makes a mismatched collective fail instead of returning garbage, where torch allows it."""


def titan_env(debug_detail: bool = True) -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    if debug_detail:  # a mismatched collective fails instead of returning garbage
        env.update(DEBUG_DETAIL)
    env["PYTHONUNBUFFERED"] = "1"
    return env


def run_titan(
    dump_folder: Path, *args: str, nproc: int = 1, check: bool = True, timeout: float = 600, debug_detail: bool = True,
    env: dict[str, str | None] | None = None,
) -> subprocess.CompletedProcess:
    """Run `titan train` (N processes via `--nproc-per-node`) with `args`, into `dump_folder`; `env` adds variables
    (a None value removes one)."""
    cmd = [sys.executable, "-m", "titan_cli", "train", "--nproc-per-node", str(nproc),
           "--job.dump_folder", str(dump_folder), *args]
    env = {k: v for k, v in {**titan_env(debug_detail), **(env or {})}.items() if v is not None}
    proc = warm_python.run(cmd, env=env, timeout=timeout, cwd=REPO)
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}")
    return proc


def run_titan_shared(runs: dict[Path, list[str]], nproc: int = 1, debug_detail: bool = True) -> set[Path]:
    """Train several runs (folder -> `titan train` arguments) one after another in one launch of `nproc` processes
    (tests/workers/train_runs.py: the imports' start-up, most of a tiny run's time, paid once);
    returns the folders of the runs that finished. The launch ends at the first run that fails (or after 180 s
    a run on average): the folders of the runs that did not finish are removed, for the caller to run each alone
    (`run_titan`), which reports the error. The launch's output is left in `jobs-<first>.log`."""
    if not runs:
        return set()
    first = next(iter(runs))
    jobs_file = first.parent / f"jobs-{first.name}.json"
    jobs_file.write_text(json.dumps([{"folder": str(folder), "args": list(args)} for folder, args in runs.items()]))
    with open(jobs_file.with_suffix(".log"), "w") as log:
        proc = warm_python.start([sys.executable, TRAIN_RUNS, nproc, jobs_file], stdout=log, env=titan_env(debug_detail),
                                 cwd=REPO)  # fmt: skip
    try:
        proc.wait(timeout=180 * len(runs))
    except subprocess.TimeoutExpired:  # a hang: end every process of the launch (its own session)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    done = {folder for folder in runs if (folder / "DONE").is_file()}
    for folder in runs.keys() - done:
        shutil.rmtree(folder, ignore_errors=True)
    return done


def run_titan_all(runs: dict[Path, list[str]], nproc: int = 1, debug_detail: bool = True) -> None:
    """Train every run (folder -> `titan train` arguments): in one launch (`run_titan_shared`), then each that did
    not finish there alone (`run_titan`), which raises with its error. Each folder keeps its log in train.log."""
    done = run_titan_shared(runs, nproc, debug_detail)
    for folder, args in runs.items():
        if folder not in done:
            proc = run_titan(folder, *args, nproc=nproc, debug_detail=debug_detail)
            (folder / "train.log").write_text(proc.stdout + proc.stderr)


def read_metrics(dump_folder: Path) -> list[dict]:
    """The per-step records the trainer wrote to `metrics.jsonl`."""
    lines = (dump_folder / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def losses(dump_folder: Path) -> list[float]:
    return [r["loss/global_avg"] for r in read_metrics(dump_folder) if "loss/global_avg" in r]


def validation_losses(dump_folder: Path) -> list[float]:
    return [r["validation/loss"] for r in read_metrics(dump_folder) if "validation/loss" in r]


class ListSource:
    """Documents from a list, re-iterable (a `DocumentSource`)."""

    def __init__(self, docs):
        self.docs = docs

    def __iter__(self):
        return iter(self.docs)

    def skip(self, n_docs):
        return iter(self.docs[n_docs:])


def autograd_saved_bytes(model, run) -> int:
    """Bytes of the storages autograd saves while `run()` runs (`saved_tensors_hooks`), each storage once,
    `model`'s parameters and buffers aside: what a forward keeps for backward, counted by torch itself."""
    import torch

    known = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        ptr = t.untyped_storage().data_ptr()
        if ptr not in known:
            saved[ptr] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        run()
    return sum(saved.values())


def run_json_worker(worker: Path, nproc: int, out: Path, timeout: float = 600) -> dict:
    """Launch `worker OUT` on `nproc` forked ranks (gloo, no DETAIL: DDP segfaults under it) and return the JSON it
    wrote to `out` (rank 0's results); fails the test with the ranks' output when it does not finish."""
    cmd = [sys.executable, str(FORK_RUN), str(nproc), str(worker), str(out)]
    proc = warm_python.run(cmd, cwd=REPO, env=titan_env(debug_detail=False), timeout=timeout)
    assert proc.returncode == 0 and out.exists(), proc.stdout[-3000:] + proc.stderr[-5000:]
    return json.loads(out.read_text())
