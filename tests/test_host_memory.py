"""A CPU run over this machine's memory is refused in one line before it allocates anything
(`titan_core.job.host_memory`), rather than killed by the OOM killer."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from titan_core.job.host_memory import bytes_per_param_at_least, check_host_memory, host_memory_available
from titan_core.optim import build_optimizer
from titan_models import get_model_args, get_model_spec
from titan_run import TINY, run_titan


@pytest.mark.parametrize("name", ["AdamW", "Adam", "Muon"])
def test_the_bound_per_parameter_is_at_most_what_torch_holds_at_the_step(name):
    """After one step, the weights, gradients and optimizer state torch holds are >= the bound's bytes."""
    torch.manual_seed(0)
    spec = get_model_spec("llama3")
    model = spec.build(dataclasses.replace(get_model_args("llama3", "debugmodel"), n_layers=1))
    opt = build_optimizer(model.named_parameters(), name=name, lr=1e-3, device_type="cpu", plan=spec.plan)
    tokens = torch.randint(256, (2, 17))
    loss = torch.nn.functional.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
    loss.backward()
    opt.step()
    params = list(model.parameters())
    held = sum(p.nbytes + p.grad.nbytes for p in params)
    held += sum(t.nbytes for state in opt.state.values() for t in state.values() if isinstance(t, torch.Tensor) and t.dim())
    n = sum(p.numel() for p in params)
    assert held / n >= bytes_per_param_at_least(name), (held / n, name)


def test_available_memory_is_memavailable_plus_free_swap(tmp_path):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       24000000 kB\nMemAvailable:   20000000 kB\nSwapFree:        1000000 kB\n")
    assert host_memory_available(meminfo) == (20000000 + 1000000) * 1024
    assert host_memory_available(tmp_path / "none") is None  # not Linux: the check is skipped
    check_host_memory(10**12, "AdamW", 1, 1, None)  # no figure, no refusal


def test_the_need_scales_with_the_nodes_processes_over_the_model_shards():
    need = 10**9 * bytes_per_param_at_least("AdamW")  # 1B parameters on one process, unsharded
    check_host_memory(10**9, "AdamW", 1, 1, need)  # exactly enough
    with pytest.raises(ValueError, match="model.flavor"):
        check_host_memory(10**9, "AdamW", 1, 1, need - 1)
    check_host_memory(10**9, "AdamW", 4, 2, need // 2)  # 2 of 4 shards on this node
    with pytest.raises(ValueError, match=r"x 2 process\(es\) / 4 model shard\(s\)"):
        check_host_memory(10**9, "AdamW", 4, 2, need // 2 - 1)


def test_titan_train_refuses_a_model_over_host_memory_in_one_line_and_writes_nothing(tmp_path):
    available = host_memory_available()
    if available is None or available > 405e9 * 14:
        pytest.skip("no /proc/meminfo, or memory for a 405B model's states")
    proc = run_titan(tmp_path / "run", *TINY, "--model.flavor", "405B", check=False)
    assert proc.returncode == 2, proc.stderr[-3000:]
    lines = [line for line in proc.stderr.splitlines() if line.startswith("titan: error:")]
    assert len(lines) == 1 and lines[0].startswith("titan: error: the model needs at least 5291.7 GiB"), proc.stderr[-2000:]
    assert "405.85B parameters x 14 bytes" in lines[0] and "Traceback" not in proc.stderr
    assert not (tmp_path / "run").exists()
