"""titan-ckpt as a library other codebases adopt: it installs alone, checkpoints a model
Titan does not define (examples/checkpoint_any_model.py) from that lone install, and
speaks in its own terms: its messages name its arguments, never Titan's config keys."""

from __future__ import annotations

import inspect
import re
import subprocess
import sys

import pytest
from lone_install import installed_and_required, lone_env, make_lone_venv, titan_key_pattern
from titan_run import REPO

SOURCES = REPO / "packages" / "titan-ckpt" / "src" / "titan_ckpt"
EXAMPLE = REPO / "examples" / "checkpoint_any_model.py"
CHECKS = ("atomic", "verified", "resume", "damaged", "hf-to-dcp", "hf-load")

def test_sources_name_no_titan_config_key():
    pattern = titan_key_pattern()
    hits = [
        f"{path.name}:{number}: {line.strip()}"
        for path in sorted(SOURCES.rglob("*.py"))
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if pattern.search(line)
    ]
    assert not hits, "titan-ckpt names Titan config keys; name its own arguments instead:\n" + "\n".join(hits)


def test_public_api_is_lazy_typed_and_documented():
    code = "import sys, titan_ckpt; assert 'torch' not in sys.modules, 'import titan_ckpt imported torch'"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
    import titan_ckpt

    assert set(titan_ckpt.__all__) <= set(dir(titan_ckpt))
    for name in titan_ckpt.__all__:
        obj = getattr(titan_ckpt, name)
        is_protocol = inspect.isclass(obj) and getattr(obj, "_is_protocol", False)
        if not (inspect.isfunction(obj) or inspect.isclass(obj)) or is_protocol:
            continue  # a constant, a type alias or a Protocol
        signature = inspect.signature(obj)
        params = [p for p in signature.parameters.values() if p.name != "self"]
        assert all(p.annotation is not inspect.Parameter.empty for p in params), f"{name}: untyped parameter"
        if inspect.isfunction(obj):
            assert signature.return_annotation is not inspect.Signature.empty, f"{name}: no return type"
        if params:
            assert "Args:" in (inspect.getdoc(obj) or ""), f"{name}: no Args: docstring"


@pytest.fixture(scope="module")
def lone_install(tmp_path_factory):
    """A fresh venv with `pip install titan-ckpt` only."""
    return make_lone_venv(tmp_path_factory.mktemp("lone"), "titan-ckpt")


def test_installs_alone(lone_install):
    installed, closure = installed_and_required(lone_install, "titan-ckpt")
    assert "titan-ckpt" in installed
    assert not {d for d in installed if d.startswith("titan-") and d != "titan-ckpt"}
    assert not installed & {"pydantic", "typer", "typer-slim", "transformers"}
    assert {"torch", "safetensors", "huggingface-hub", "tqdm", "numpy"} <= closure
    assert installed == closure, f"installed beyond titan-ckpt's requirements: {sorted(installed - closure)}"


def test_example_runs_from_the_lone_install(lone_install, tmp_path):
    run = subprocess.run(
        [str(lone_install), str(EXAMPLE), str(tmp_path / "work")], capture_output=True, text=True, env=lone_env(), cwd=tmp_path, timeout=300
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    lines = {m.group(1): m.group(2) for m in re.finditer(r"^check (\S+): (ok|FAILED)", run.stdout, re.MULTILINE)}
    assert lines == dict.fromkeys(CHECKS, "ok"), run.stdout
    # The library's error names its own argument, with the fix, and no Titan config key.
    damaged = next(line for line in run.stdout.splitlines() if line.startswith("check damaged:"))
    assert "arguments=('load_step',)" in damaged and "load_step=2" in damaged, damaged
    assert not titan_key_pattern().search(damaged), damaged
