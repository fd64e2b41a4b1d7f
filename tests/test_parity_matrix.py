"""Every parallel layout matches one process (see parity_matrix.py for the layouts and the tolerances).

The selected layouts train in shared launches, one per (processes, TORCH_DISTRIBUTED_DEBUG) group, and the
one-process references in one more (`titan_run.run_titan_shared`): torchrun's and the imports' start-up, most of a
tiny run's time on 2 cores, is paid once per group rather than once per row. A row whose run did not finish in
its group (a failure, or a run after the failure) is run again in a launch of its own, whose error it reports.
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
    """The folder of a layout's run in its group's shared launch (started on the group's first use), or None
    when that run did not finish."""
    root = tmp_path_factory.mktemp("layouts")
    done: dict[tuple[int, bool], set] = {}

    def run(layout):
        group = (layout.nproc, layout.debug_detail)
        if group not in done:
            members = [lay for lay in selected if (lay.nproc, lay.debug_detail) == group]
            done[group] = run_titan_shared({root / lay.name: layout_args(lay) for lay in members}, *group)
        return root / layout.name if root / layout.name in done[group] else None

    return run


@pytest.mark.parametrize("layout", [pytest.param(lay, id=lay.name, marks=marks(lay)) for lay in LAYOUTS])
def test_layout_matches_one_process(layout, references, shared_runs, tmp_path):
    reference = references(layout.model, layout.dtype)
    folder = shared_runs(layout)
    if folder is None:  # its shared launch failed before it finished: alone, so that a failure is its own
        folder = tmp_path / layout.name
        run_layout(layout, folder)
    diff = max_diff(reference, run_losses(folder))
    assert diff <= layout.tolerance, f"{layout.name}: max loss difference {diff:.2e} > {layout.tolerance:.2g}"
    if layout.dp > 1:  # each data-parallel rank reads its own share, so the per-rank max is above the mean
        records = [r for r in read_metrics(folder) if "loss/global_avg" in r]
        assert all(r["loss/global_max"] >= r["loss/global_avg"] for r in records)
