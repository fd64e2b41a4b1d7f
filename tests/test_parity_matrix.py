"""Every parallel layout matches one process (see parity_matrix.py for the layouts and the tolerance)."""

from __future__ import annotations

import pytest
from parity_matrix import LAYOUTS, TOLERANCE, max_diff, reference_losses, run_layout
from titan_run import read_metrics


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    """One-process losses per model, run on first use."""
    cache: dict[tuple[str, ...], list[float]] = {}

    def reference(model: tuple[str, ...]) -> list[float]:
        if model not in cache:
            cache[model] = reference_losses(tmp_path_factory.mktemp("ref"), model)
        return cache[model]

    return reference


@pytest.mark.parametrize(
    "layout", [pytest.param(lay, id=lay.name, marks=[pytest.mark.slow] if lay.slow else []) for lay in LAYOUTS]
)
def test_layout_matches_one_process(layout, references, tmp_path):
    diff = max_diff(references(layout.model), run_layout(layout, tmp_path / layout.name))
    assert diff <= TOLERANCE, f"{layout.name}: max loss difference {diff:.2e} > {TOLERANCE}"
    if layout.dp > 1:  # each data-parallel rank reads its own share, so the per-rank max is above the mean
        assert all(r["loss/global_max"] >= r["loss/global_avg"] for r in read_metrics(tmp_path / layout.name))
