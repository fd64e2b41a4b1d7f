"""`pip install titan-parallel` alone pulls in torch (and what torch needs) and nothing else."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
from titan_run import REPO

# Distributions that are torch's own requirements, computed inside the new venv
# from torch's metadata, so this list is not hard-coded here.
CLOSURE = r"""
import json, re
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
seen, todo = set(), [("torch", frozenset())]
while todo:
    name, extras = todo.pop()
    if (name, extras) in seen or name not in installed:
        continue
    seen.add((name, extras))
    todo.extend(requires(name, extras))
print(json.dumps({"installed": sorted(installed), "torch_closure": sorted({n for n, _ in seen})}))
"""


def uv_binary() -> str:
    uv = os.environ.get("UV") or shutil.which("uv")
    if uv is None:
        pytest.fail("uv is needed for this test (the README's set-up installs it: pip install uv)")
    return uv


def test_titan_parallel_installs_alone(tmp_path):
    uv = uv_binary()
    venv = tmp_path / "venv"
    subprocess.run([uv, "venv", "-q", "--python", sys.executable, str(venv)], check=True)
    python = venv / "bin" / "python"
    # symlinks into uv's cache: torch is not copied again.
    subprocess.run(
        [uv, "pip", "install", "-q", "--python", str(python), "--link-mode", "symlink",
         str(REPO / "packages" / "titan-parallel")],
        check=True,
    )
    report = json.loads(subprocess.run([str(python), "-c", CLOSURE], capture_output=True, text=True, check=True).stdout)
    installed = set(report["installed"])
    assert "titan-parallel" in installed
    assert not {d for d in installed if d.startswith("titan-") and d != "titan-parallel"}
    # numpy is declared by titan-parallel because torch.distributed.pipelining/DCP import it undeclared.
    extra = installed - set(report["torch_closure"]) - {"titan-parallel", "numpy"}
    assert not extra, f"titan-parallel pulled in more than torch needs: {sorted(extra)}"
    smoke = (
        "import titan_parallel.parallelize, titan_parallel.dims, titan_parallel.fsdp;"
        "from titan_parallel.dims import ParallelDims;"
        "print(ParallelDims(dp_shard=-1, tp=2, world_size=8).dp_shard)"
    )
    out = subprocess.run([str(python), "-c", smoke], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "4"
    # A model titan-models does not define, parallelized from the lone install: FSDP x TP and PP x FSDP.
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCH_DISTRIBUTED_DEBUG": "DETAIL"}
    env.pop("PYTHONPATH", None)
    example = REPO / "examples" / "parallelize_any_model.py"
    run = subprocess.run(
        [str(python), "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4", str(example)],
        capture_output=True, text=True, env=env, cwd=tmp_path, timeout=600,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    for layout in ("FSDP2 x TP2", "PP2 x FSDP2"):
        line = next(x for x in run.stdout.splitlines() if x.startswith(layout))
        assert float(line.rsplit(" ", 1)[1]) < 1e-5, line


def test_cli_help_does_not_import_torch():
    code = "import sys, titan_cli.main; assert 'torch' not in sys.modules, 'titan --help imports torch'"
    subprocess.run([sys.executable, "-c", code], check=True)
    out = subprocess.run([sys.executable, "-m", "titan_cli", "--help"], capture_output=True, text=True, check=True)
    assert "train" in out.stdout
