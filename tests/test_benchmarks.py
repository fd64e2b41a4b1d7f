"""The benchmark scripts still run end to end (tiny sizes; their figures are not checked here:
speed is measured by running them, see docs/performance.md)."""

from __future__ import annotations

import json
import sys

from titan_run import REPO, titan_env
import warm_python


def run(*cmd: str, **env: str) -> str:
    proc = warm_python.run(cmd, cwd=REPO, timeout=600, env={**titan_env(debug_detail=False), **env})
    assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout


def test_cpu_peers_compares_three_loops_from_the_same_weights():
    out = run(sys.executable, "benchmarks/cpu_peers.py", "--flavor", "debugmodel", "--seq-len", "64", "--batch", "2",
              "--steps", "1", "--rounds", "2", "--warmup", "1")
    # The logits check ran (a mismatch above --max-diff aborts the script) and all three were timed.
    assert "titan's model (outside its train step) vs hand-written 0.00e+00" in out, out
    for name in ("titan", "hand-written", "transformers"):
        assert f"\n  {name} " in out, out
    assert "titan / hand-written: " in out and "titan / transformers: " in out, out


def test_gpu_suite_smoke_mode_writes_its_results(tmp_path):
    run("bash", "benchmarks/run_gpu_suite.sh", str(tmp_path), "--smoke", PYTHON=sys.executable)
    results = json.loads((tmp_path / "results.json").read_text())
    rows = {row["row"]: row for row in results["rows"]}
    measured = [row for row in rows.values() if row.get("tokens_per_s")]
    assert measured, rows  # at least the eager rows measured something
    assert (tmp_path / "results.md").read_text().count("|") > 10


def test_loader_scaling_times_both_loaders_and_the_data_wait():
    out = run(sys.executable, "benchmarks/loader_scaling.py", "--max-world", "8", "--packed-max-world", "4", "--steps", "2",
              "--min-tokens", "1000", "--max-files", "2", "--seq-len", "32", "--train-steps", "2", "--train-seq-len", "32")
    assert "PackedLoader x" in out and "TokenShardLoader x" in out, out
    assert "(skipped)" in out  # W=8 is past --packed-max-world
    for label in ("token shards, prefetch off", "token shards, prefetch 2", "text tokenized on the fly"):
        assert f"\n  {label} " in out, out


def test_mup_coord_check_prints_both_parametrizations_for_a_config():
    out = run(sys.executable, "benchmarks/mup_coord_check.py", "--widths", "64,256", "--steps", "2",
              "--model.name", "qwen3", "--model.shape", "n_layers=1,vocab_size=128")  # fmt: skip
    usual, mup = out.split("\nusual: ")[1].split("\nmuP: ")
    growth = {kind: float(text.split("\nblock 0")[1].splitlines()[0].split()[-1].rstrip("x"))
              for kind, text in (("usual", usual), ("mup", mup))}  # fmt: skip
    assert growth["usual"] > 5 and 0.5 < growth["mup"] < 2, out  # block 0's change at 4x the width over the base's
    assert "logits" in mup
