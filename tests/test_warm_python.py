"""tests/warm_python.py: a run forked from the warm interpreter sees what a new interpreter would, and ends as one."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time

import pytest
import warm_python
from titan_run import REPO, titan_env

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="runs fork from the warm interpreter on Linux only")

REPORT = textwrap.dedent("""
    import atexit, json, os, sys, threading, time
    from pathlib import Path

    out = Path(sys.argv[1])
    report = {"argv": sys.argv[1:], "cwd": os.getcwd(), "path0": sys.path[0], "name": __name__,
              "env": os.environ.get("TITAN_WARM_TEST"), "stdin": sys.stdin.read(), "warm": "torch" in sys.modules,
              "session": os.getsid(0) == os.getpid()}
    print("to stdout")
    print("to stderr", file=sys.stderr)

    def late():  # a thread that is not a daemon: the interpreter waits for it before it exits
        time.sleep(0.3)
        (out.parent / "thread").write_text("joined")

    threading.Thread(target=late).start()
    atexit.register(lambda: (out.parent / "atexit").write_text("ran"))
    out.write_text(json.dumps(report))
    sys.exit(3)
""")


def report(tmp_path, name: str, cmd: list[str], env: dict[str, str]) -> tuple[subprocess.CompletedProcess, dict]:
    """Run `cmd` (which writes its report to report.json) in a folder of its own."""
    folder = tmp_path / name
    folder.mkdir()
    proc = warm_python.run(cmd, env=env, cwd=folder, timeout=120)
    seen = json.loads((folder / "report.json").read_text())
    assert (folder / "thread").read_text() == "joined" and (folder / "atexit").read_text() == "ran"
    seen["cwd"] = os.path.relpath(seen["cwd"], folder)
    return proc, seen


def test_a_forked_run_sees_and_ends_as_a_new_interpreter(tmp_path):
    script = tmp_path / "report.py"
    script.write_text(REPORT)
    env = {**titan_env(debug_detail=False), "TITAN_WARM_TEST": "a value"}  # a TITAN_ variable: no server of its own
    cold = {**env, "TITAN_TEST_COLD": "1"}
    for form, cmd in {"script": [sys.executable, str(script), "report.json", "x"],
                      "-c": [sys.executable, "-c", REPORT, "report.json", "x"]}.items():  # fmt: skip
        warm_proc, warm = report(tmp_path, f"warm{form}", cmd, env)
        cold_proc, fresh = report(tmp_path, f"cold{form}", cmd, cold)
        assert warm.pop("warm") and not fresh.pop("warm"), form  # forked from the server, and a new interpreter
        assert warm == fresh, form
        assert fresh["env"] == "a value" and fresh["name"] == "__main__" and fresh["session"] and fresh["stdin"] == ""
        for proc in (warm_proc, cold_proc):
            assert (proc.returncode, proc.stdout, proc.stderr) == (3, "to stdout\n", "to stderr\n"), form


def test_a_module_run_is_titan_train_with_its_exit_code(tmp_path):
    proc = warm_python.run([sys.executable, "-m", "titan_cli", "train", "--training.stepz", "1"],
                           env=titan_env(debug_detail=False), cwd=REPO, timeout=120)  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip() == "titan: error: unknown config key 'training.stepz' (from --training.stepz); " \
                                  "did you mean 'training.steps'?"  # fmt: skip


def test_a_timeout_kills_the_run_and_what_it_started(tmp_path):
    script = tmp_path / "sleepy.py"
    script.write_text(textwrap.dedent("""
        import subprocess, sys, time
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        open(sys.argv[1], "w").write(str(child.pid))
        time.sleep(600)
    """))
    pid_file = tmp_path / "child.pid"
    started = time.monotonic()
    with pytest.raises(subprocess.TimeoutExpired):
        warm_python.run([sys.executable, script, pid_file], env=titan_env(debug_detail=False), timeout=5)
    assert time.monotonic() - started < 60
    child = int(pid_file.read_text())
    deadline = time.monotonic() + 10
    while os.path.exists(f"/proc/{child}") and "Z" not in open(f"/proc/{child}/stat").read().split()[2]:
        assert time.monotonic() < deadline, "the run's own child outlived the timeout"
        time.sleep(0.05)


def test_a_start_up_variable_the_server_lacks_takes_effect(monkeypatch):
    """A variable read at start-up (here one of Python's own) that differs from every server's: with no room for
    another server, the run starts cold, and the variable takes effect."""
    code = "import sys; print('torch' in sys.modules, sys.flags.dont_write_bytecode)"
    env = titan_env(debug_detail=False)
    assert warm_python.run([sys.executable, "-c", code], env=env).stdout.split()[0] == "True"
    monkeypatch.setattr(warm_python, "MAX_SERVERS", len(warm_python._servers))
    flipped = "" if env.get("PYTHONDONTWRITEBYTECODE") else "1"
    proc = warm_python.run([sys.executable, "-c", code], env={**env, "PYTHONDONTWRITEBYTECODE": flipped})
    assert proc.stdout.split() == ["False", str(int(bool(flipped)))], proc.stderr


def test_the_run_takes_the_distributed_debug_level_of_its_own_environment():
    """`import torch.distributed` reads TORCH_DISTRIBUTED_DEBUG, in the server: each run sets c10d's level from its own
    (DDP's reducer crashed, SIGSEGV on gloo in torch 2.15, when a run without it kept a server's DETAIL)."""
    code = "import torch.distributed as dist; print(dist.get_debug_level())"
    for level in ("DETAIL", "OFF", "INFO"):
        env = {**titan_env(debug_detail=False), "TORCH_DISTRIBUTED_DEBUG": level}
        assert warm_python.run([sys.executable, "-c", code], env=env).stdout.strip() == f"DebugLevel.{level}"
