"""The fused output projection + cross-entropy (`titan_parallel.linear_cross_entropy`) against the plain loss.

The reference is torch's own: `F.cross_entropy` on the full fp32 logits of `h @ W.T`, with
autograd's gradients. fp32 on CPU, to 1e-6 relative: one chunk and many (a ragged last one
included), ignored labels, no-grad evaluation, and the vocab-parallel path on 2 gloo
processes with a `Shard(0)` weight. The float8 GEMMs (`float8=Float8Loss(...)`, emulated on CPU)
against torchao's own `Float8Linear` output projection with the plain loss, and on 2 processes
against one. The training runs (1 process, TP, PP, FSDP, CP) are
compared by the parity matrix, which now trains every layout through this loss; here one
run checks that `training.fused_loss = false` (the plain loss) gives the same losses, with PaLM's
z-loss (`training.z_loss_weight`) and without; the z-loss itself is checked against its definition
written out with torch's ops, as the cross-entropy is.
"""

from __future__ import annotations

import os
import socket
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from titan_run import TINY, losses, read_metrics, run_titan, run_titan_all

from titan_parallel.float8_matmul import Float8Loss
from titan_parallel.linear_cross_entropy import default_chunk_rows, linear_cross_entropy

FLOAT8 = Float8Loss(emulate=True)  # float8's numbers at fp32 speed: no float8 tensor cores here

TOKENS, DIM, VOCAB = 37, 16, 50


def _inputs(seed: int = 0, ignored: int = 5):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(TOKENS, DIM, generator=g, dtype=torch.float64).float()
    w = (torch.randn(VOCAB, DIM, generator=g) * 0.3).float()
    labels = torch.randint(0, VOCAB, (TOKENS,), generator=g)
    labels[torch.randperm(TOKENS, generator=g)[:ignored]] = -100
    return h, w, labels


def _plain(h, w, labels, z_loss=0.0):
    """torch's cross-entropy on the full logits, plus (z_loss > 0) PaLM's z-loss written out: z_loss times the
    mean over labelled tokens of logsumexp(logits)^2."""
    h, w = h.clone().requires_grad_(), w.clone().requires_grad_()
    logits = (h @ w.t()).float()
    loss = F.cross_entropy(logits, labels)
    if z_loss:
        valid = labels != -100
        loss = loss + z_loss * torch.logsumexp(logits, dim=-1)[valid].pow(2).mean()
    loss.backward()
    return loss.detach(), h.grad, w.grad


def _fused(h, w, labels, **kwargs):
    h, w = h.clone().requires_grad_(), w.clone().requires_grad_()
    loss = linear_cross_entropy(h, w, labels, **kwargs)
    (loss * 3.0).backward()  # a non-unit incoming gradient scales both gradients
    return loss.detach(), h.grad / 3.0, w.grad / 3.0


def _rel_err(got, ref) -> float:
    """Largest |got - ref| over the largest |ref|."""
    return ((got - ref).abs().max() / ref.abs().max()).item()


@pytest.mark.parametrize("chunk_rows", [None, 1, 8, TOKENS])
def test_equals_plain_cross_entropy_with_gradients(chunk_rows):
    h, w, labels = _inputs()
    ref = _plain(h, w, labels)
    got = _fused(h, w, labels, chunk_rows=chunk_rows)
    errors = [_rel_err(a, b) for a, b in zip(got, ref, strict=True)]  # loss, grad h, grad W
    assert max(errors) <= 1e-6, errors


@pytest.mark.parametrize("chunk_rows", [None, 1, 8])
def test_the_z_loss_equals_its_definition_with_gradients(chunk_rows):
    h, w, labels = _inputs(seed=8)
    ref = _plain(h, w, labels, z_loss=0.3)  # large enough to move every figure well past the tolerance
    got = _fused(h, w, labels, chunk_rows=chunk_rows, z_loss=0.3)
    errors = [_rel_err(a, b) for a, b in zip(got, ref, strict=True)]  # loss, grad h, grad W
    assert max(errors) <= 1e-6, errors
    without = _plain(h, w, labels)
    assert min(_rel_err(a, b) for a, b in zip(without, ref, strict=True)) > 1e-2


def test_the_plain_loss_adds_the_z_loss_in_training_only():
    """`titan_core.step_loss.cross_entropy_loss` (the unfused path) and the fused head: the z-loss while autograd
    records; forward-only evaluation (validation, downstream evals) gets the cross-entropy alone."""
    from titan_core.step_loss import cross_entropy_loss

    from titan_models import get_model_spec

    from titan_parallel.linear_cross_entropy import fuse_output_loss

    h, w, labels = _inputs(seed=9)
    ref, ref_h, ref_w = _plain(h, w, labels, z_loss=0.3)
    hg, wg = h.clone().requires_grad_(), w.clone().requires_grad_()
    loss = cross_entropy_loss((hg @ wg.t()).view(1, TOKENS, VOCAB), labels.view(1, TOKENS), z_loss=0.3)
    loss.backward()
    assert max(_rel_err(loss.detach(), ref), _rel_err(hg.grad, ref_h), _rel_err(wg.grad, ref_w)) <= 1e-6

    class Model(torch.nn.Module):
        skip_output = False

        def __init__(self):
            super().__init__()
            self.output = torch.nn.Linear(DIM, VOCAB, bias=False)

    model = Model()
    model.output.weight.data.copy_(w)
    head = fuse_output_loss(model, get_model_spec("llama3").plan, z_loss=0.3)  # its output projection: `output`
    assert _rel_err(head(h, labels=labels), ref) <= 1e-6
    plain = F.cross_entropy(h @ w.t(), labels)
    with torch.no_grad():
        assert _rel_err(head(h, labels=labels), plain) <= 1e-6
        assert _rel_err(cross_entropy_loss((h @ w.t()).view(1, TOKENS, VOCAB), labels.view(1, TOKENS), 0.3), plain) <= 1e-6


def test_the_compiled_per_chunk_arithmetic_equals_plain_cross_entropy():
    """What `compile.enable` runs: Inductor's kernels for the per-chunk arithmetic (~10 s to compile here)."""
    h, w, labels = _inputs(seed=4)
    ref = _plain(h, w, labels)
    got = _fused(h, w, labels, chunk_rows=16, compiled=True)
    errors = [_rel_err(a, b) for a, b in zip(got, ref, strict=True)]  # loss, grad h, grad W
    assert max(errors) <= 1e-6, errors
    ref = _plain(h, w, labels, z_loss=0.3)  # the z-loss's kernels, compiled too
    got = _fused(h, w, labels, chunk_rows=16, compiled=True, z_loss=0.3)
    errors = [_rel_err(a, b) for a, b in zip(got, ref, strict=True)]
    assert max(errors) <= 1e-6, errors


def _torchao_float8_plain(h, w, labels):
    """torchao's tensorwise `Float8Linear` (emulated) as the output projection, then the plain loss."""
    from dataclasses import replace

    f8 = pytest.importorskip("torchao.float8")
    head = torch.nn.Sequential(torch.nn.Linear(DIM, VOCAB, bias=False))
    head[0].weight.data.copy_(w)
    f8.convert_to_float8_training(head, config=replace(f8.Float8LinearConfig.from_recipe_name("tensorwise"), emulate=True))
    h = h.clone().requires_grad_()
    loss = F.cross_entropy(head(h).float(), labels)
    loss.backward()
    return loss.detach(), h.grad, head[0].weight.grad


def test_float8_gemms_equal_torchao_float8_linear_with_the_plain_loss(monkeypatch):
    import titan_parallel.float8_matmul as float8_matmul

    monkeypatch.setattr(float8_matmul, "_BLOCK", 4 * DIM)  # eager casts in blocks of 4 rows
    h, w, labels = _inputs(seed=5)
    ref = _torchao_float8_plain(h, w, labels)
    one_chunk = _fused(h, w, labels, chunk_rows=TOKENS, float8=FLOAT8)
    errors = [_rel_err(a, b) for a, b in zip(one_chunk, ref, strict=True)]  # loss, grad h, grad W
    assert max(errors) <= 1e-6, errors  # the same float8 operands and scales: fp32 rounding apart
    # ... and the GEMMs did run in float8: the high-precision gradients are far from torchao's float8 ones.
    high = _fused(h, w, labels, chunk_rows=TOKENS)
    assert min(_rel_err(a, b) for a, b in zip(high[1:], ref[1:], strict=True)) > 1e-2
    # Chunks: the logits (so the loss) are the same; each chunk's logit gradient gets its own e5m2 scale,
    # whose 2 mantissa bits round a value by up to 12.5%.
    chunked = _fused(h, w, labels, chunk_rows=8, float8=FLOAT8)
    errors = [_rel_err(a, b) for a, b in zip(chunked, ref, strict=True)]
    assert errors[0] <= 1e-6 and max(errors) <= 5e-2, errors


def test_float8_compiled_casts_equal_the_eager_ones():
    """`compile.enable` casts in Inductor kernels (~20 s to compile here)."""
    h, w, labels = _inputs(seed=6)
    eager = _fused(h, w, labels, chunk_rows=16, float8=FLOAT8)
    compiled = _fused(h, w, labels, chunk_rows=16, float8=FLOAT8, compiled=True)
    errors = [_rel_err(a, b) for a, b in zip(compiled, eager, strict=True)]
    assert max(errors) <= 1e-6, errors


def test_float8_through_torch_scaled_mm_equals_the_emulation():
    """The GPU path: `torch._scaled_mm` (torch 2.15 has it on CPU too) with its layouts and reciprocal scales,
    and zero padding where an inner dimension (8-row chunks) is not a multiple of 16."""
    g = torch.Generator().manual_seed(7)
    h, w = torch.randn(TOKENS, 32, generator=g), torch.randn(64, 32, generator=g) * 0.3
    labels = torch.randint(0, 64, (TOKENS,), generator=g)
    emulated = _fused(h, w, labels, chunk_rows=8, float8=FLOAT8)
    scaled_mm = _fused(h, w, labels, chunk_rows=8, float8=Float8Loss(emulate=False))
    errors = [_rel_err(a, b) for a, b in zip(scaled_mm, emulated, strict=True)]
    assert max(errors) <= 1e-6, errors
    with pytest.raises(ValueError, match=r"^the float8 loss needs dim \(32\) and this rank's vocab \(50\) in multiples of 16"):
        linear_cross_entropy(h, w[:50], labels.clamp(max=49), float8=Float8Loss(emulate=False))


def test_batched_hidden_states_and_no_grad_evaluation():
    h, w, labels = _inputs(seed=1, ignored=0)
    ref = F.cross_entropy(h @ w.t(), labels)
    with torch.no_grad():
        got = linear_cross_entropy(h.view(1, TOKENS, DIM), w, labels.view(1, TOKENS), chunk_rows=6)
    assert _rel_err(got, ref) <= 1e-6


def test_autocast_computes_the_matmuls_in_the_autocast_dtype():
    h, w, labels = _inputs(seed=2, ignored=0)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = F.cross_entropy((h @ w.t()).float(), labels)  # what nn.Linear + the plain loss compute
        got = linear_cross_entropy(h, w, labels, chunk_rows=10)
    assert torch.allclose(got, ref, rtol=1e-3)  # bf16 logits either way; only chunking differs
    assert not torch.allclose(got, F.cross_entropy(h @ w.t(), labels), rtol=1e-5)  # and they are bf16


def test_chunk_rows_keep_one_chunk_of_fp32_logits_within_a_gib():
    rows = default_chunk_rows(128256)
    assert rows * 128256 * 4 <= 1 << 30 < (rows + 1) * 128256 * 4


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _vocab_parallel_worker(rank: int, port: int, out: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        mesh = init_device_mesh("cpu", (2,))
        result: dict[str, torch.Tensor] = {}
        h, w, labels = _inputs(seed=3)
        hd = distribute_tensor(h.clone(), mesh, [Replicate()]).requires_grad_()
        wd = distribute_tensor(w.clone(), mesh, [Shard(0)]).requires_grad_()
        for key, float8, z_loss in (("", None, 0.0), ("float8 ", FLOAT8, 0.0), ("z ", None, 0.3)):
            loss = linear_cross_entropy(hd, wd, labels, chunk_rows=8, float8=float8, z_loss=z_loss)
            loss.backward()
            grad_h = hd.grad.full_tensor()  # a partial sum on each rank, reduced here
            grad_w = wd.grad.full_tensor()
            hd.grad = wd.grad = None
            result.update({key + "loss": loss.detach(), key + "grad_h": grad_h, key + "grad_w": grad_w})
        if rank == 0:
            torch.save(result, out)
    finally:
        dist.destroy_process_group()


def test_vocab_parallel_on_two_processes_equals_one_process(tmp_path):
    """Rank 0 hands its results over in a file: through a `multiprocessing.Manager` dict (tensors shared by file
    descriptor) this test once hung for good, the rank and the manager each waiting on the other (2026-12-07)."""
    h, w, labels = _inputs(seed=3)
    ref = _plain(h, w, labels)
    out = tmp_path / "rank0.pt"
    ranks = mp.start_processes(_vocab_parallel_worker, args=(_free_port(), str(out)), nprocs=2, join=False)
    deadline = time.monotonic() + 300
    while not ranks.join(timeout=5):
        if time.monotonic() > deadline:
            for process in ranks.processes:
                process.kill()
            pytest.fail("the two vocab-parallel ranks did not finish in 300 s")
    result = torch.load(out, weights_only=True)
    got = (result["loss"], result["grad_h"], result["grad_w"])
    got8 = (result["float8 loss"], result["float8 grad_h"], result["float8 grad_w"])
    got_z = (result["z loss"], result["z grad_h"], result["z grad_w"])  # the global logsumexp's z-loss
    errors = [_rel_err(a, b) for a, b in zip(got, ref, strict=True)]  # loss, grad h, grad W
    assert max(errors) <= 1e-6, errors
    errors = [_rel_err(a, b) for a, b in zip(got_z, _plain(h, w, labels, z_loss=0.3), strict=True)]
    assert max(errors) <= 1e-6, errors
    # float8: each shard's weight and logit-gradient amax is all-reduced, so the scales are one process's
    ref8 = _fused(h, w, labels, chunk_rows=8, float8=FLOAT8)
    errors = [_rel_err(a, b) for a, b in zip(got8, ref8, strict=True)]
    assert max(errors) <= 1e-6, errors


def test_a_run_with_the_fused_loss_trains_as_the_plain_loss(tmp_path):
    """With and without `training.z_loss_weight` (which adds ~0.01 x 8.3^2 at step 1 here: lse ~ ln(vocab))."""
    args = [*TINY, "--training.steps", "4", "--training.mixed_precision_param", "float32"]
    z = ["--training.z_loss_weight", "0.01"]
    run_titan_all({tmp_path / "fused": args, tmp_path / "plain": [*args, "--training.fused_loss", "false"],
                   tmp_path / "fused_z": [*args, *z], tmp_path / "plain_z": [*args, *z, "--training.fused_loss", "false"]})  # fmt: skip
    for name in ("", "_z"):
        fused, plain = losses(tmp_path / f"fused{name}"), losses(tmp_path / f"plain{name}")
        assert len(fused) == len(plain) == 4
        for a, b in zip(fused, plain, strict=True):
            assert abs(a - b) <= 1e-5 * abs(b), (name, fused, plain)
    # `loss/z_loss` is the part of the loss the z-loss adds: at step 1 (the same weights) the loss less it is
    # the cross-entropy of the runs without it.
    z_terms = {name: [r["loss/z_loss"] for r in read_metrics(tmp_path / name)] for name in ("fused_z", "plain_z")}
    assert z_terms["fused_z"] == pytest.approx(z_terms["plain_z"], rel=1e-5) and min(z_terms["fused_z"]) > 0.3
    assert losses(tmp_path / "fused_z")[0] - z_terms["fused_z"][0] == pytest.approx(losses(tmp_path / "fused")[0], rel=1e-6)
    assert "loss/z_loss" not in read_metrics(tmp_path / "fused")[0]
    # 2 pipeline stages: the last one's terms, its 8 micro-batches' (not torch's extra call of the loss, which
    # infers the backward's shapes at the first step).
    run_titan(tmp_path / "pp_z", *args, *z, "--parallelism.pipeline_parallel_degree", "2", nproc=2)
    assert losses(tmp_path / "pp_z") == pytest.approx(losses(tmp_path / "fused_z"), abs=2e-5)
    assert [r["loss/z_loss"] for r in read_metrics(tmp_path / "pp_z")] == pytest.approx(z_terms["fused_z"], abs=2e-5)
