"""Suite-wide fixtures."""

from __future__ import annotations

import os

import pytest
import torch.distributed as dist


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
