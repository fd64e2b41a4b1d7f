"""Suite-wide fixtures."""

from __future__ import annotations

import os

import pytest


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
