"""Float8 weights cast once per optimizer step under master weights (`titan_parallel.float8_precast`).

The reference is torchao's own `Float8Linear`, which casts its bf16 weight in every forward and
backward: with the precast copies the same training, bit for bit (emulated float8, bf16 compute
copies, on CPU), with no weight cast left in torchao's matmul; a write to the masters (a checkpoint
load) recasts before the next forward. Then a real `titan train` with master weights and float8
against the same run through one-rank FSDP.
"""

from __future__ import annotations

import copy
import dataclasses
import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from test_master_weights import assert_losses_match_fsdp
from titan_run import TINY, run_titan, run_titan_shared

from titan_models.llama3 import Transformer, llama3_flavors
from titan_parallel import ComputeCopies, Float8Options, MasterAdamW, apply_float8

pytest.importorskip("torchao")
from titan_parallel.float8_precast import PrecastFloat8Weights  # noqa: E402

TOKENS = torch.randint(0, 2048, (4, 32), generator=torch.Generator().manual_seed(1))


@pytest.fixture(scope="module")
def float8_model() -> torch.nn.Module:
    torch.manual_seed(0)
    model = Transformer(dataclasses.replace(llama3_flavors["debugmodel"], n_layers=2))
    model.init_weights()
    apply_float8(model, Float8Options(emulate=True, auto_filter_small_kn=False))
    return model


def _weight_casts(monkeypatch) -> list[str]:
    """Records the role of every cast torchao's float8 matmul makes itself."""
    import torchao.float8.float8_linear as float8_linear

    roles: list[str] = []
    cast = float8_linear.hp_tensor_to_float8_dynamic

    def recording(*args, **kwargs):
        roles.append(str(kwargs.get("gemm_input_role")))
        return cast(*args, **kwargs)

    monkeypatch.setattr(float8_linear, "hp_tensor_to_float8_dynamic", recording)
    return roles


def _train(model: torch.nn.Module, precast: bool, steps: int = 3, backend: str | None = None):
    model = copy.deepcopy(model)
    copies = ComputeCopies([model], torch.bfloat16)
    if precast:
        PrecastFloat8Weights([model], copies)
    if backend is not None:  # regional compile, as `compile.enable`: each block traced with the precast forward
        for block in model.layers.values():
            block.compile(backend=backend)
    opt = MasterAdamW(model.parameters(), copies, lr=1e-3)
    losses = []
    for _ in range(steps):
        loss = F.cross_entropy(model(TOKENS).float().flatten(0, 1), TOKENS.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return model, losses


def test_precast_weights_train_as_torchao_casting_them_in_every_forward(float8_model, monkeypatch):
    roles = _weight_casts(monkeypatch)
    reference, ref_losses = _train(float8_model, precast=False)
    n_linears = sum(type(m).__name__ == "Float8Linear" for m in float8_model.modules())
    assert roles.count("GemmInputRole.WEIGHT") == 3 * 2 * n_linears  # forward and backward, every step
    roles.clear()
    model, losses = _train(float8_model, precast=True)
    assert "GemmInputRole.WEIGHT" not in roles and roles  # torchao still casts activations and gradients
    assert losses == ref_losses
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        assert torch.equal(p, q), name


def test_compiled_blocks_trace_the_precast_weights(float8_model):
    """Dynamo traces the already-cast weight (a torchao tensor subclass built in an autograd function); aot_eager
    checks the capture without Inductor's code generation (Inductor was checked by hand: equal losses too)."""
    _, ref_losses = _train(float8_model, precast=False, backend="aot_eager")
    _, losses = _train(float8_model, precast=True, backend="aot_eager")
    assert losses == ref_losses


def test_a_write_to_the_masters_recasts_before_the_next_forward(float8_model):
    model, _ = _train(float8_model, precast=True, steps=2)
    model.load_state_dict(float8_model.state_dict())  # back to the initial weights, as a checkpoint load
    plain = copy.deepcopy(float8_model)
    ComputeCopies([plain], torch.bfloat16)
    with torch.no_grad():
        assert torch.equal(model(TOKENS), plain(TOKENS))


def _losses(run: Path) -> list[float]:
    return [json.loads(line)["loss/global_avg"] for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_titan_train_with_master_weights_equals_one_rank_fsdp_under_float8(tmp_path):
    args = [*TINY, "--training.mixed_precision_param", "bfloat16", "--training.steps", "6",
            "--model.converters", "float8", "--float8.auto_filter_small_kn", "false"]  # fmt: skip
    runs = {tmp_path / "master": [*args, "--optimizer.master_weights", "on"],
            tmp_path / "fsdp": [*args, "--optimizer.master_weights", "off"]}  # fmt: skip
    done = run_titan_shared(runs)
    for folder in runs.keys() - done:
        run_titan(folder, *runs[folder])
    log = (tmp_path / "master" / "train.log").read_text()
    assert "weights cast to float8 once per optimizer step (master weights)" in log
    master, fsdp = _losses(tmp_path / "master"), _losses(tmp_path / "fsdp")
    assert len(master) == 6
    assert_losses_match_fsdp(master, fsdp)


def test_the_compiled_casts_write_the_eager_copies(float8_model):
    """`compiled=True` (CUDA's choice): one Inductor kernel per weight storing straight into the float8 copy."""
    copies_of = {}
    for compiled in (False, True):
        model = copy.deepcopy(float8_model)
        precast = PrecastFloat8Weights([model], ComputeCopies([model], torch.bfloat16), compiled=compiled)
        precast.refresh()
        copies_of[compiled] = [(d.clone(), s.clone()) for d, s in zip(precast.data, precast.scales, strict=True)]
    assert len(copies_of[True]) == len(copies_of[False]) > 0
    for (d1, s1), (d2, s2) in zip(copies_of[True], copies_of[False], strict=True):
        assert torch.equal(s1, s2) and torch.equal(d1.view(torch.uint8), d2.view(torch.uint8))
