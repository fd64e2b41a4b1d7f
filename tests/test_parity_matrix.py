"""Every parallel layout matches one process (see parity_matrix.py for the layouts and the tolerances)."""

from __future__ import annotations

import pytest
from parity_matrix import LAYOUTS, bf16_skip_reason, max_diff, reference_losses, run_layout
from titan_run import read_metrics

BF16_SKIP = bf16_skip_reason()


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    """One-process losses per (model, dtype), run on first use."""
    cache: dict[tuple[tuple[str, ...], str], list[float]] = {}

    def reference(model: tuple[str, ...], dtype: str) -> list[float]:
        if (model, dtype) not in cache:
            cache[model, dtype] = reference_losses(tmp_path_factory.mktemp("ref"), model, dtype)
        return cache[model, dtype]

    return reference


def marks(layout) -> list:
    found = [pytest.mark.slow] if layout.slow else []
    if layout.dtype == "bfloat16":
        found.append(pytest.mark.skipif(BF16_SKIP is not None, reason=BF16_SKIP or ""))
    return found


@pytest.mark.parametrize("layout", [pytest.param(lay, id=lay.name, marks=marks(lay)) for lay in LAYOUTS])
def test_layout_matches_one_process(layout, references, tmp_path):
    diff = max_diff(references(layout.model, layout.dtype), run_layout(layout, tmp_path / layout.name))
    assert diff <= layout.tolerance, f"{layout.name}: max loss difference {diff:.2e} > {layout.tolerance:.2g}"
    if layout.dp > 1:  # each data-parallel rank reads its own share, so the per-rank max is above the mean
        records = [r for r in read_metrics(tmp_path / layout.name) if "loss/global_avg" in r]
        assert all(r["loss/global_max"] >= r["loss/global_avg"] for r in records)
