"""Every parallel layout matches one process (see parity_matrix.py for the layouts and the tolerances).

The selected layouts train in shared launches, one per process count, and the one-process references in one
more (`titan_run.run_titan_shared`): torchrun's and the imports' start-up, most of a tiny run's time on 2 cores,
is paid once per group rather than once per row.

The shared launches run without `TORCH_DISTRIBUTED_DEBUG=DETAIL`, whose check before every collective (a
monitored barrier and an all-gather of the op's fingerprint) made a 4-process launch of 5 rows take 77 s instead
of 51 s (2-core AMD EPYC, torch 2.15, 2026-11-28). A collective that ranks call differently shows here anyway: as
a loss off the reference's, or a run that fails or hangs. A row that did not pass in its group (its run failed,
came after a failure, or its losses are off) is run again in a launch of its own, under DETAIL where its layout
allows: a mismatched collective then fails naming what each rank called, and any other error or loss difference
is reported from that run.
"""

from __future__ import annotations

import pytest
from parity_matrix import (
    LAYOUTS,
    bf16_skip_reason,
    layout_args,
    max_diff,
    reference_args,
    reference_losses,
    run_layout,
    run_losses,
)
from titan_run import read_metrics, run_titan_shared

BF16_SKIP = bf16_skip_reason()


def marks(layout) -> list:
    found = [pytest.mark.slow] if layout.slow else []
    if layout.dtype == "bfloat16":
        found.append(pytest.mark.skipif(BF16_SKIP is not None, reason=BF16_SKIP or ""))
    return found


def runs_here(layout) -> bool:
    return not (layout.dtype == "bfloat16" and BF16_SKIP is not None)


@pytest.fixture(scope="module")
def selected(request) -> list:
    """The layouts this session runs (after -k / -m selection, less the skipped bf16 rows)."""
    return [item.callspec.params["layout"] for item in request.session.items
            if item.module is request.module and item.originalname == "test_layout_matches_one_process"
            and runs_here(item.callspec.params["layout"])]  # fmt: skip


@pytest.fixture(scope="module")
def references(selected, tmp_path_factory):
    """One-process losses per (model, dtype): every one the selected layouts need, in one process, on first use."""
    root = tmp_path_factory.mktemp("ref")
    keys = list(dict.fromkeys((lay.model, lay.dtype) for lay in selected))
    folders = {key: root / f"ref{i}" for i, key in enumerate(keys)}
    cache: dict[tuple[tuple[str, ...], str], list[float]] = {}

    def reference(model: tuple[str, ...], dtype: str) -> list[float]:
        if not cache and keys:
            done = run_titan_shared({folders[key]: reference_args(*key) for key in keys}, nproc=1)
            cache.update({key: run_losses(folders[key]) for key in keys if folders[key] in done})
        if (model, dtype) not in cache:  # not run above, or its run failed: alone, which reports the error
            cache[model, dtype] = reference_losses(tmp_path_factory.mktemp("ref"), model, dtype)
        return cache[model, dtype]

    return reference


@pytest.fixture(scope="module")
def shared_runs(selected, tmp_path_factory):
    """The folder of a layout's run in its process count's shared launch (started on the group's first use, without
    DETAIL: module docstring), or None when that run did not finish."""
    root = tmp_path_factory.mktemp("layouts")
    done: dict[int, set] = {}

    def run(layout):
        if layout.nproc not in done:
            members = [lay for lay in selected if lay.nproc == layout.nproc]
            runs = {root / lay.name: layout_args(lay) for lay in members}
            done[layout.nproc] = run_titan_shared(runs, layout.nproc, debug_detail=False)
        return root / layout.name if root / layout.name in done[layout.nproc] else None

    return run


@pytest.mark.parametrize("layout", [pytest.param(lay, id=lay.name, marks=marks(lay)) for lay in LAYOUTS])
def test_layout_matches_one_process(layout, references, shared_runs, tmp_path):
    reference = references(layout.model, layout.dtype)
    folder = shared_runs(layout)
    diff = None if folder is None else max_diff(reference, run_losses(folder))
    if diff is None or diff > layout.tolerance:  # alone, under DETAIL: a failure or mismatch is its own, and named
        folder = tmp_path / layout.name
        run_layout(layout, folder)
        diff = max_diff(reference, run_losses(folder))
    assert diff <= layout.tolerance, f"{layout.name}: max loss difference {diff:.2e} > {layout.tolerance:.2g}"
    if layout.dp > 1:  # each data-parallel rank reads its own share, so the per-rank max is above the mean
        records = [r for r in read_metrics(folder) if "loss/global_avg" in r]
        assert all(r["loss/global_max"] >= r["loss/global_avg"] for r in records)


def test_a_pipeline_run_logs_the_loss_of_the_stage_that_holds_the_output(selected, shared_runs):
    """Rank 0 holds the first stage (the last too under V schedules); its log says what the stage holding the
    output projection computes, which the shared runs keep in `train.log`."""
    rows = [lay for lay in selected if "--parallelism.pipeline_parallel_degree" in lay.args]
    if not rows:
        pytest.skip("no pipeline row selected")
    for layout in rows:
        folder = shared_runs(layout)
        if folder is None:
            continue  # its parity test reports the failure
        lines = [line for line in (folder / "train.log").read_text().splitlines() if " loss: " in line]
        assert len(lines) == 1 and lines[0].endswith(
            "output projection + cross-entropy fused, in chunks of at most 1 GiB of fp32 logits"
            " (training.fused_loss) on the last pipeline stage"), (layout.name, lines)
