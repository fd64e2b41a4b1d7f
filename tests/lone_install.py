"""Installing one Titan package into an empty venv, for the tests that show a library stands alone."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from titan_run import REPO

# The distributions a root distribution requires, transitively, computed inside the venv
# from the installed metadata (so no list is hard-coded in the tests).
_CLOSURE = r"""
import json, re, sys
from importlib.metadata import distributions, distribution
norm = lambda n: re.sub(r"[-_.]+", "-", n).lower()
installed = {norm(d.metadata["Name"]) for d in distributions()}
def requires(name, extras):
    out = []
    for r in distribution(name).requires or []:
        m = re.match(r"\s*([A-Za-z0-9_.-]+)\s*(?:\[([^\]]*)\])?", r)
        want = re.findall(r"extra\s*==\s*['\"]([^'\"]+)", r)
        if want and not set(map(norm, want)) & extras:
            continue
        sub = {norm(e) for e in (m.group(2) or "").split(",") if e.strip()}
        out.append((norm(m.group(1)), frozenset(sub)))
    return out
seen, todo = set(), [(sys.argv[1], frozenset())]
while todo:
    name, extras = todo.pop()
    if (name, extras) in seen or name not in installed:
        continue
    seen.add((name, extras))
    todo.extend(requires(name, extras))
print(json.dumps({"installed": sorted(installed), "closure": sorted({n for n, _ in seen})}))
"""


def make_lone_venv(folder: Path, package: str) -> Path:
    """A fresh venv in `folder` holding `packages/<package>` and what it requires; returns its python.

    Installs with symlinks into uv's cache, so torch is not copied again.
    """
    uv = os.environ.get("UV") or shutil.which("uv")
    if uv is None:
        pytest.fail("uv is needed for this test (the README's set-up installs it: pip install uv)")
    venv = folder / "venv"
    subprocess.run([uv, "venv", "-q", "--python", sys.executable, str(venv)], check=True)
    python = venv / "bin" / "python"
    subprocess.run(
        [uv, "pip", "install", "-q", "--python", str(python), "--link-mode", "symlink", str(REPO / "packages" / package)],
        check=True,
    )
    return python


def installed_and_required(python: Path, root: str) -> tuple[set[str], set[str]]:
    """(every distribution in the venv, those `root` requires transitively, `root` included)."""
    out = subprocess.run([str(python), "-c", _CLOSURE, root], capture_output=True, text=True, check=True).stdout
    report = json.loads(out)
    return set(report["installed"]), set(report["closure"])


def titan_key_pattern() -> re.Pattern[str]:
    """Any of Titan's config keys (`checkpoint.load_step`, `parallelism.tensor_parallel_degree`, ...) as a whole word."""
    from titan_core.config.keys import list_keys

    return re.compile(r"(?<![\w.])(?:%s)(?!\w)" % "|".join(map(re.escape, list_keys())))


def lone_env() -> dict[str, str]:
    """The environment for a process in the lone venv: nothing of the workspace on its path."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("PYTHONPATH", None)
    return env
