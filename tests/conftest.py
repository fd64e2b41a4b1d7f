"""Suite-wide fixtures."""

from __future__ import annotations

import gc
import json
import os
import resource
import shutil
import time

import pytest
import torch.distributed as dist
import warm_python

# The suite runs on 2 workers, a file to a worker (pytest-xdist: `-n 2 --dist loadfile` in pyproject.toml), each
# worker taking the next file in collection order when it is free. The longest files go first, so that the last
# file a worker takes is a short one and the other worker is not left waiting on it. Longest first by their wall
# time in the suite's last full run (`TITAN_TEST_CPU_REPORT`, below; docs/benchmarks.md), 2-core AMD EPYC with
# AVX-512 and native bf16, 2026-12-06: the parity matrix and the memory matrix first (355 and 385 s of wall, 503
# and 219 CPU-s: the memory matrix's launches are mostly one process at a time), then the rest down to ~20 s
# (test_plan moved up, and test_memory_compiled_parallel in, by the run of 2026-12-07: 326 and 88 CPU-s).
# A file not named keeps its place after these. (xdist's own reordering, by the number of tests in a file, is
# off: `--no-loadscope-reorder`.)
LONGEST_FIRST = (
    "test_parity_matrix.py", "test_memory_accuracy.py", "test_plan.py", "test_float8.py", "test_mtp.py",
    "test_plan_ep.py", "test_diloco.py", "test_faults.py", "test_benchmarks.py", "test_ema.py", "test_titan_eval.py",
    "test_muon_parity.py", "test_isolated_install.py", "test_memory_measure.py", "test_memory_compiled_parallel.py",
    "test_resume.py",
    "test_downstream_eval.py", "test_master_weights.py", "test_memory_eager.py", "test_fused_loss.py", "test_train.py",
    "test_memory_compiled.py", "test_moe_training.py", "test_hangs.py", "test_pipeline.py", "test_params_cmd.py",
    "test_document_mask.py", "test_memory.py", "test_data_mix_training.py", "test_mup.py", "test_multinode.py",
    "test_errors.py", "test_static_decode.py", "test_grad_sync.py", "test_torchft_moe.py", "test_float8_precast.py",
    "test_optim.py", "test_generate.py", "test_context_parallel.py",
)  # fmt: skip


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Longest files first (LONGEST_FIRST), each file's tests in their order."""
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: the rest keep their order


def pytest_report_header(config: pytest.Config) -> str:
    """The free disk under pytest's temporary folders: a run's checkpoints need some (README, Tests)."""
    folder = config._tmp_path_factory.getbasetemp().parent  # type: ignore[attr-defined]
    return f"disk: {shutil.disk_usage(folder).free / 2**30:.1f} GiB free under {folder}"


def pytest_collection_finish(session: pytest.Session) -> None:
    """What collection imported (torch and the packages, ~350,000 objects alive for the whole session) is left out
    of the garbage collector's later passes, as `titan train`'s ranks do (`titan_core.launch.collector_paused`):
    test_plan_ep's in-process tests spent 9.6 s of 130 s of CPU in the collector before, 7.0 s after (2-core
    AVX2-only AMD EPYC, torch 2.15, with another test run beside them)."""
    gc.freeze()


def pytest_sessionfinish(session: pytest.Session) -> None:
    gc.unfreeze()  # before the interpreter's teardown: else triton's bindings report the frozen objects as leaked


def _cpu_seconds() -> float:
    """CPU time of this process and of the processes it waited for (their own children included), and of the runs
    it had forked from a warm interpreter (`warm_python`; that interpreter's own start-up is not counted)."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime + warm_python.children_cpu()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    """`TITAN_TEST_CPU_REPORT=FILE`: append each test's CPU seconds (setup and teardown included) and wall seconds
    to FILE, a JSON line per test (`{"file", "test", "cpu", "wall"}`), to sum by file: on the 2-core machines the
    suite is bound by CPU, and a test's wall time says little there (beside another worker's 8-process launch, a
    2-process run gets a fifth of the cores)."""
    report = os.environ.get("TITAN_TEST_CPU_REPORT")
    cpu, wall = _cpu_seconds(), time.monotonic()
    yield
    if report:
        line = {"file": item.location[0], "test": item.name, "cpu": round(_cpu_seconds() - cpu, 2),
                "wall": round(time.monotonic() - wall, 2)}  # fmt: skip
        with open(report, "a") as f:
            f.write(json.dumps(line) + "\n")


@pytest.fixture(autouse=True)
def _environment_restored():
    """Each test leaves `os.environ` as it found it.

    A run in the pytest process sets variables for itself (the flight recorder's dump folder, for one:
    `titan_parallel.flight_recorder.enable_flight_recorder`), and every job a later test starts inherits the
    environment: it would take them for the user's and dump into the earlier test's folder.
    """
    saved = dict(os.environ)
    yield
    if os.environ != saved:
        os.environ.clear()
        os.environ.update(saved)


_FAILED_FILES: set[str] = set()


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.failed:
        _FAILED_FILES.add(report.nodeid.split("::")[0])


@pytest.fixture(scope="module", autouse=True)
def _module_folders_removed(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    """The folders a module's fixtures made with `tmp_path_factory.mktemp` go when the module ends, unless one of
    its tests failed (`tmp_path_retention_policy = "failed"` in pyproject.toml removes a passed test's `tmp_path`,
    not these). Autouse, so set up before the module's own fixtures and torn down after them."""
    base = tmp_path_factory.getbasetemp()
    before = set(base.iterdir())
    yield
    if request.node.nodeid not in _FAILED_FILES:
        for path in set(base.iterdir()) - before:
            if path.is_symlink():  # mktemp's `<name>current` link
                path.unlink(missing_ok=True)
            elif path.is_dir():
                shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module")
def world_of_one():
    """A default process group of one process (gloo, in memory) for the module's tests that call collectives
    in the pytest process (the checkpoint manager's, a guard's); removed after the module if it made it."""
    created = not dist.is_initialized()
    if created:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    if created:
        dist.destroy_process_group()
