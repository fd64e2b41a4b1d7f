"""fp32 master weights with bf16 compute copies the optimizer writes (`titan_parallel.master_weights`).

The optimizer against torch's fused AdamW stepping the same numbers (bit for bit on CPU, where its
step is torch's kernel), the Triton kernel against torch's in Triton's CPU interpreter, the swap of
masters and copies around forward, state_dict and loads, the job rule, and real `titan train` runs:
the same losses as bf16 through one-rank FSDP and a bit-exact resume.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import subprocess
import sys
from importlib.util import find_spec
from pathlib import Path

import pytest
import torch
from titan_core.config import ConfigError, load_config
from titan_core.job import resolve
from titan_models.registry import get_model_args, get_model_spec
from titan_parallel import ComputeCopies, MasterAdam, MasterAdamW, ParallelOptions, uses_fsdp
from titan_parallel.master_weights import master_weights_blockers

from titan_run import TINY, run_titan, run_titan_shared
import warm_python

REPO = Path(__file__).resolve().parents[1]
HYPER = {"lr": 1e-2, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}


def _fsdp_keeps_fp32_grads() -> bool:
    """Whether FSDP2 gives its gathered bf16 parameters an fp32 `grad_dtype` (torch 2.15 does, 2.11 does not).

    The compute copies keep each gradient in the dtype its backward produced, so RMSNorm's weight gradients stay
    fp32 (`F.rms_norm` computes them in fp32). FSDP2 of torch 2.15 does the same; that of torch 2.11 rounds them
    to bf16 (one gradient dtype per reduce-scatter), so there the two runs part at the last bits of those norms.
    """
    from torch.distributed.fsdp._fully_shard._fsdp_param import FSDPParam

    return "sharded_grad_dtype" in getattr(FSDPParam, "__annotations__", {})


FSDP_KEEPS_FP32_GRADS = _fsdp_keeps_fp32_grads()


def assert_losses_match_fsdp(master: list[float], fsdp: list[float]) -> None:
    """Master-weight losses against one-rank FSDP's: bit for bit where FSDP keeps fp32 gradients; else the
    first two steps bit for bit (the first update's norm gradients round alike) and the rest within 1e-3: FSDP's
    norm gradients rounded to bf16 (2^-8 relative each) compound over the steps; torch 2.11 on CPU measured up to
    4.6e-4 (2026-11-27, float8 precast run, step 4)."""
    assert len(master) == len(fsdp) > 2
    if FSDP_KEEPS_FP32_GRADS:
        assert master == fsdp
    else:
        assert master[:2] == fsdp[:2] and master[2:] == pytest.approx(fsdp[2:], rel=1e-3)


def tiny_llama() -> torch.nn.Module:
    spec = get_model_spec("llama3")
    args = get_model_args("llama3", "debugmodel")
    model = spec.build(type(args)(**{**args.__dict__, "n_layers": 2, "max_seq_len": 32}))
    torch.manual_seed(0)
    model.init_weights()
    return model


def reference_step(ref: torch.nn.Module, tokens: torch.Tensor, opt: torch.optim.Optimizer) -> torch.Tensor:
    """What the copies should compute: the fp32 model's parameters rounded to bf16 (buffers untouched), its
    gradients, in the dtype each backward produced (`grad_dtype = None`, as FSDP's fp32 `grad_dtype` keeps
    them: fp32 for the norm weights), handed to torch's fused optimizer as fp32."""
    compute = copy.deepcopy(ref)
    for p in compute.parameters():
        p.data = p.data.to(torch.bfloat16)
        p.grad_dtype = None
    loss = torch.nn.functional.cross_entropy(compute(tokens).float().flatten(0, 1), tokens.flatten())
    loss.backward()
    for mine, theirs in zip(ref.parameters(), compute.parameters(), strict=True):
        mine.grad = theirs.grad.float()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.detach()


@pytest.mark.parametrize("adam", [MasterAdamW, MasterAdam])
def test_steps_equal_torch_fused_adam_on_bf16_copies(adam):
    model, tokens = tiny_llama(), torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
    ref = copy.deepcopy(model)
    copies = ComputeCopies([model], torch.bfloat16)
    opt = adam(model.parameters(), copies, **HYPER)
    torch_adam = torch.optim.AdamW if adam is MasterAdamW else torch.optim.Adam
    ref_opt = torch_adam(ref.parameters(), fused=True, **HYPER)
    for _ in range(3):
        loss = torch.nn.functional.cross_entropy(model(tokens).float().flatten(0, 1), tokens.flatten())
        assert all(p.dtype == torch.bfloat16 for p in model.parameters())  # forward and backward on the copies
        loss.backward()
        # gradients in the dtype their backward produced: fp32 for RMSNorm's weights, bf16 from the matmuls
        fp32_grads = {name for name, p in model.named_parameters() if p.grad.dtype == torch.float32}
        assert fp32_grads == {name for name, _ in model.named_parameters() if "norm" in name}
        opt.step()
        opt.zero_grad(set_to_none=True)
        assert torch.equal(loss.detach(), reference_step(ref, tokens, ref_opt))
        assert all(p.dtype == torch.float32 for p in model.parameters())  # the masters again after the step
        for mine, theirs in zip(model.parameters(), ref.parameters(), strict=True):
            assert torch.equal(mine, theirs)
        for master, out in zip(copies.masters, copies.copies, strict=True):
            assert torch.equal(out, master.to(torch.bfloat16))
    # The optimizer state is torch's, key for key: checkpoints move between the two.
    mine, theirs = opt.state_dict(), ref_opt.state_dict()
    assert mine["state"].keys() == theirs["state"].keys()
    for k, state in mine["state"].items():
        assert state.keys() == theirs["state"][k].keys()
        assert all(torch.equal(v, theirs["state"][k][name]) for name, v in state.items())


def test_found_inf_drops_the_step_and_grad_scale_divides_as_torch_does():
    model, tokens = tiny_llama(), torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(2))
    ref = copy.deepcopy(model)
    copies = ComputeCopies([model], torch.bfloat16)
    opt, ref_opt = MasterAdamW(model.parameters(), copies, **HYPER), torch.optim.AdamW(ref.parameters(), fused=True, **HYPER)
    for found_inf, scale in ((1.0, 3.0), (0.0, 3.0), (1.0, 1.0), (0.0, 1.7)):
        loss = torch.nn.functional.cross_entropy(model(tokens).float().flatten(0, 1), tokens.flatten())
        loss.backward()
        for o in (opt, ref_opt):
            o.found_inf, o.grad_scale = torch.tensor(found_inf), torch.tensor(scale)
        before = [p.detach().clone() for p in copies.masters]
        opt.step()
        opt.zero_grad(set_to_none=True)
        reference_step(ref, tokens, ref_opt)
        if found_inf:
            assert all(torch.equal(a, b) for a, b in zip(copies.masters, before, strict=True))
        for mine, theirs in zip(model.parameters(), ref.parameters(), strict=True):
            assert torch.equal(mine, theirs)
    assert {float(s["step"]) for s in opt.state.values()} == {2.0}  # two steps dropped of four


def test_masters_come_back_for_state_dict_and_loads_refresh_the_copies():
    model, tokens = tiny_llama(), torch.randint(0, 256, (1, 8), generator=torch.Generator().manual_seed(3))
    copies = ComputeCopies([model], torch.bfloat16)
    opt = MasterAdamW(model.parameters(), copies, **HYPER)
    model(tokens).float().sum().backward()
    opt.step()
    model(tokens)  # an eval-like forward: the parameters hold the copies now
    assert copies.computing
    state = model.state_dict()
    assert not copies.computing and all(v.dtype == torch.float32 for k, v in state.items() if "rope" not in k)
    # a load while computing: moments stay fp32 (torch casts them to each parameter's dtype)
    model(tokens)
    opt.load_state_dict(opt.state_dict())
    assert all(s["exp_avg"].dtype == torch.float32 for s in opt.state.values())
    # a write through the parameters (a checkpoint load) reaches the copies at the next forward
    new = {k: torch.full_like(v, 0.5) if v.is_floating_point() and "rope" not in k else v for k, v in state.items()}
    model.load_state_dict(new)
    model(tokens)
    assert all(torch.equal(c, torch.full_like(c, 0.5)) for c in copies.copies)


KERNEL_CHECK = """
import json
import torch
from titan_parallel.adam_kernel import AdamKernel, CHUNK
sizes = [2 * CHUNK + 5, 7, 1000]
def states(grad_dtype):
    g = torch.Generator().manual_seed(1)
    return ([torch.randn(n, generator=g) for n in sizes], [torch.randn(n, generator=g).to(grad_dtype) for n in sizes],
            [torch.randn(n, generator=g) * 0.1 for n in sizes], [torch.rand(n, generator=g) * 0.01 for n in sizes],
            [torch.tensor(4.0) for _ in sizes])
hyper = dict(lr=1e-2, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)
out = []
cases = [(torch.bfloat16, decoupled, scale, found_inf) for decoupled in (True, False)
         for scale, found_inf in ((None, None), (torch.tensor(2.5), torch.tensor(0.0)), (None, torch.tensor(1.0)))]
cases.append((torch.float32, True, None, None))  # fp32 gradients (RMSNorm's weights)
for grad_dtype, decoupled, scale, found_inf in cases:
    masters, grads, m, v, steps = states(grad_dtype)
    copies = [torch.zeros(n, dtype=torch.bfloat16) for n in sizes]
    AdamKernel(sizes, torch.device("cpu"))(grads, masters, m, v, copies, steps, decoupled=decoupled,
                                           grad_scale=scale, found_inf=found_inf, **hyper)
    rm, rg, rmm, rv, rs = states(grad_dtype)
    fused = torch._fused_adamw_ if decoupled else torch._fused_adam_
    fused(rm, [g.float() for g in rg], rmm, rv, [], rs, amsgrad=False, maximize=False, grad_scale=scale,
          found_inf=found_inf, **hyper)
    rel = lambda a, b: max(((x - y).abs().max() / y.abs().max()).item() for x, y in zip(a, b))
    out.append({"masters": rel(masters, rm), "exp_avg": rel(m, rmm), "exp_avg_sq": rel(v, rv),
                "copies": all(torch.equal(c, x.bfloat16()) for c, x in zip(copies, masters)),
                "untouched": all((c == 0).all().item() for c in copies),
                "dropped": found_inf is not None and found_inf.item() == 1.0})
print("RESULT", json.dumps(out))
"""


@pytest.mark.skipif(find_spec("triton") is None, reason="triton is not installed")
def test_triton_kernel_equals_torch_fused_adam_in_the_cpu_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, "-c", KERNEL_CHECK], env=env, capture_output=True, text=True, timeout=300)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    results = json.loads(lines[0].removeprefix("RESULT "))
    assert len(results) == 7
    for r in results:
        if r["dropped"]:  # found_inf = 1: nothing written
            assert r["untouched"] and r["masters"] == r["exp_avg"] == r["exp_avg_sq"] == 0.0, r
        else:  # torch's arithmetic in torch's order: fp32 rounding apart (its bias corrections use pow, ours exp2)
            assert r["copies"] and max(r["masters"], r["exp_avg"], r["exp_avg_sq"]) < 1e-6, r


def test_the_layouts_it_serves_and_the_rule_that_picks_it():
    assert master_weights_blockers(1, False, torch.bfloat16, False, 1) == []
    assert len(master_weights_blockers(2, True, torch.float32, True, 2)) == 5
    options = ParallelOptions(param_dtype=torch.bfloat16, master_weights=True)
    from titan_parallel import ParallelDims

    assert not uses_fsdp(ParallelDims(dp_shard=1, world_size=1), options)
    assert uses_fsdp(ParallelDims(dp_shard=2, world_size=2), options)  # N ranks: FSDP reduces
    bf16 = ["--training.mixed_precision_param", "bfloat16"]
    on = ["--optimizer.master_weights", "on"]
    assert resolve(load_config(None, bf16 + on), 1).parallel.master_weights
    assert not resolve(load_config(None, bf16), 1, target_device="cpu").parallel.master_weights  # auto: CUDA only
    job = resolve(load_config(None, bf16), 1, target_device="cuda")
    assert job.parallel.master_weights and "auto" in job.weights_reason
    assert not resolve(load_config(None, [*bf16, "--training.global_batch_size", "16"]), 1, target_device="cuda").parallel.master_weights
    for overrides, expected in (
        (["--training.global_batch_size", "16"], "2 micro-batches per step would sum their gradients in bf16"),
        (["--optimizer.name", "Muon"], "optimizer.name = 'Muon'"),
        (["--training.mixed_precision_param", "float32"], "the compute dtype is float32"),
    ):
        with pytest.raises(ConfigError) as caught:
            resolve(load_config(None, [*bf16, *on, *overrides]), 1)
        message = str(caught.value)
        assert message.startswith("optimizer.master_weights = 'on' cannot train this job") and expected in message
    with pytest.raises(ConfigError, match="2 data-parallel ranks need FSDP or DDP"):
        resolve(load_config(None, [*bf16, *on]), 2)


BF16_RUN = [*TINY, "--training.mixed_precision_param", "bfloat16", "--training.steps", "6",
            "--training.local_batch_size", "2", "--checkpoint.enable", "--checkpoint.interval", "2",
            "--checkpoint.keep_latest_k", "0"]  # fmt: skip


def metrics(run: Path) -> dict[int, dict]:
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r for r in records}


def test_titan_train_matches_one_rank_fsdp_and_resumes_bit_exactly(tmp_path):
    master, fsdp = tmp_path / "master", tmp_path / "fsdp"
    done = run_titan_shared({
        master: [*BF16_RUN, "--optimizer.master_weights", "on"],
        fsdp: [*BF16_RUN, "--optimizer.master_weights", "off"],
    })  # fmt: skip
    for run, args in ((master, "on"), (fsdp, "off")):
        if run not in done:
            run_titan(run, *BF16_RUN, "--optimizer.master_weights", args)
    m, f = metrics(master), metrics(fsdp)
    assert sorted(m) == sorted(f) == [1, 2, 3, 4, 5, 6]
    # The same bf16 forward and the same gradients (RMSNorm's weights' in fp32 on both paths where FSDP's gathered
    # parameters have an fp32 `grad_dtype`; the copies have None), so the same losses and norms bit for bit.
    assert_losses_match_fsdp([m[s]["loss/global_avg"] for s in sorted(m)], [f[s]["loss/global_avg"] for s in sorted(f)])
    for step in m:
        rel = 1e-6 if FSDP_KEEPS_FP32_GRADS else 5e-3  # torch 2.11: 1.9e-3 at step 6 (2026-11-27)
        assert m[step]["optim/grad_norm"] == pytest.approx(f[step]["optim/grad_norm"], rel=rel), step
    # Resume from step 2: the steps after it again, bit for bit; the checkpoint holds fp32 masters. The same
    # checkpoint resumes through one-rank FSDP too (torch's AdamW state, fp32 weights).
    resumed, crossed = tmp_path / "resumed", tmp_path / "crossed"
    for run in (resumed, crossed):
        (run / "checkpoint").mkdir(parents=True)
        shutil.copytree(master / "checkpoint" / "step-2", run / "checkpoint" / "step-2")
    run_titan(resumed, *BF16_RUN, "--optimizer.master_weights", "on")
    run_titan(crossed, *BF16_RUN, "--optimizer.master_weights", "off")
    r, c = metrics(resumed), metrics(crossed)
    assert sorted(r) == sorted(c) == [3, 4, 5, 6]
    for step in r:
        assert r[step]["loss/global_avg"] == m[step]["loss/global_avg"], step
        assert r[step]["optim/grad_norm"] == m[step]["optim/grad_norm"], step
        assert c[step]["loss/global_avg"] == pytest.approx(m[step]["loss/global_avg"], rel=3e-3), step
    from test_resume import dcp_tensors

    saved = dcp_tensors(master / "checkpoint" / "step-6")
    weights = {k: v for k, v in saved.items() if not k.startswith("optimizer.") and v.is_floating_point()}
    assert len(weights) > 10 and {v.dtype for v in weights.values()} == {torch.float32}


def test_the_standalone_example_runs():
    """examples/master_weights_any_model.py: titan-parallel's API on a model it has never seen."""
    proc = warm_python.run([sys.executable, str(REPO / "examples" / "master_weights_any_model.py")],
                           timeout=300, cwd=REPO)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "losses equal to the hand-written bf16 loop" in proc.stdout
