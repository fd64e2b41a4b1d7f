"""How a worker rank ends (`leave`), under `torchrun` or `tests/fork_run.py` alike."""

from __future__ import annotations

import os
import sys


def leave(code: int) -> None:
    """End this rank with `code`: forked by tests/fork_run.py, by returning to it (it hands the code to the agent);
    a rank of its own leaves by `os._exit`, skipping interpreter teardown, which gloo's threads can abort."""
    sys.stdout.flush()
    sys.stderr.flush()
    if os.environ.get("TITAN_TEST_FORKED_SCRIPT"):
        raise SystemExit(code)
    os._exit(code)
