"""`pip install titan-parallel` alone pulls in torch (and what torch needs) and nothing else."""

from __future__ import annotations

import json
import re
import subprocess
import sys

from lone_install import installed_and_required, lone_env, make_lone_venv, titan_key_pattern
from titan_run import DEBUG_DETAIL, REPO

def test_titan_parallel_installs_alone(tmp_path):
    python = make_lone_venv(tmp_path, "titan-parallel")
    installed, required = installed_and_required(python, "titan-parallel")
    _, torch_closure = installed_and_required(python, "torch")
    assert installed == required, f"installed beyond titan-parallel's requirements: {sorted(installed - required)}"
    assert not {d for d in installed if d.startswith("titan-") and d != "titan-parallel"}
    # numpy is declared by titan-parallel because torch.distributed.pipelining/DCP import it undeclared.
    assert required - torch_closure == {"titan-parallel", "numpy"} - torch_closure, sorted(required - torch_closure)
    smoke = (
        "import sys;"
        "from titan_parallel import ParallelDims;"
        "print(ParallelDims(dp_shard=-1, tp=2, world_size=8).dp_shard, 'torch' in sys.modules)"
    )
    out = subprocess.run([str(python), "-c", smoke], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["4", "False"]  # the layout rules need no torch
    # Errors speak of the library's own arguments, never of Titan's config keys.
    errors = r"""
import json
from titan_parallel import ParallelConfigError, ParallelDims, PipelineConfig, check_ac, check_cp, check_pipeline, ModelPlan
plan = ModelPlan(blocks="layers", pp_first=("embed",), pp_last=("head",))
calls = [
    lambda: ParallelDims(dp_shard=2, tp=2, world_size=2),
    lambda: check_cp(36, 4),
    lambda: check_ac("selective", "every"),
    lambda: check_pipeline(PipelineConfig(microbatch_size=3), pp=2, n_layers=4, local_batch_size=8, plan=plan),
]
out = []
for call in calls:
    try:
        call()
    except ParallelConfigError as e:
        out.append([str(e), list(e.arguments)])
print(json.dumps(out))
"""
    raised = json.loads(subprocess.run([str(python), "-c", errors], capture_output=True, text=True, check=True).stdout)
    assert len(raised) == 4
    for message, arguments in raised:
        assert arguments and all(re.search(rf"(?<![\w.]){a}(?!\w)", message) for a in arguments), (message, arguments)
        assert not titan_key_pattern().search(message), message
    # A model titan-models does not define, parallelized from the lone install: FSDP x TP and PP x FSDP.
    env = {**lone_env(), **DEBUG_DETAIL}
    example = REPO / "examples" / "parallelize_any_model.py"
    run = subprocess.run(
        [str(python), "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4", str(example)],
        capture_output=True, text=True, env=env, cwd=tmp_path, timeout=600,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    for layout in ("FSDP2 x TP2", "PP2 x FSDP2"):
        line = next(x for x in run.stdout.splitlines() if x.startswith(layout))
        assert float(line.rsplit(" ", 1)[1]) < 1e-5, line
    # bf16 from fp32 master weights on a model it does not define, from the same lone install.
    example = REPO / "examples" / "master_weights_any_model.py"
    run = subprocess.run([str(python), str(example)], capture_output=True, text=True, env=lone_env(), cwd=tmp_path,
                         timeout=300)  # fmt: skip
    assert run.returncode == 0 and "losses equal to the hand-written bf16 loop" in run.stdout, run.stderr[-3000:]


def test_cli_help_does_not_import_torch():
    code = "import sys, titan_cli.main; assert 'torch' not in sys.modules, 'titan --help imports torch'"
    subprocess.run([sys.executable, "-c", code], check=True)
    out = subprocess.run([sys.executable, "-m", "titan_cli", "--help"], capture_output=True, text=True, check=True)
    assert "train" in out.stdout
