"""The fused output projection + cross-entropy (`titan_parallel.linear_cross_entropy`) against the plain loss.

The reference is torch's own: `F.cross_entropy` on the full fp32 logits of `h @ W.T`, with
autograd's gradients. fp32 on CPU, to 1e-6 relative: one chunk and many (a ragged last one
included), ignored labels, no-grad evaluation, and the vocab-parallel path on 2 gloo
processes with a `Shard(0)` weight. The training runs (1 process, TP, PP, FSDP, CP) are
compared by the parity matrix, which now trains every layout through this loss; here one
run checks that `training.fused_loss = false` (the plain loss) gives the same losses.
"""

from __future__ import annotations

import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from titan_run import TINY, losses, run_titan

from titan_parallel.linear_cross_entropy import default_chunk_rows, linear_cross_entropy

TOKENS, DIM, VOCAB = 37, 16, 50


def _inputs(seed: int = 0, ignored: int = 5):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(TOKENS, DIM, generator=g, dtype=torch.float64).float()
    w = (torch.randn(VOCAB, DIM, generator=g) * 0.3).float()
    labels = torch.randint(0, VOCAB, (TOKENS,), generator=g)
    labels[torch.randperm(TOKENS, generator=g)[:ignored]] = -100
    return h, w, labels


def _plain(h, w, labels):
    h, w = h.clone().requires_grad_(), w.clone().requires_grad_()
    loss = F.cross_entropy((h @ w.t()).float(), labels)
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


def test_the_compiled_per_chunk_arithmetic_equals_plain_cross_entropy():
    """What `compile.enable` runs: Inductor's kernels for the per-chunk arithmetic (~10 s to compile here)."""
    h, w, labels = _inputs(seed=4)
    ref = _plain(h, w, labels)
    got = _fused(h, w, labels, chunk_rows=16, compiled=True)
    errors = [_rel_err(a, b) for a, b in zip(got, ref, strict=True)]  # loss, grad h, grad W
    assert max(errors) <= 1e-6, errors


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


def _vocab_parallel_worker(rank: int, port: int, result: dict) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        mesh = init_device_mesh("cpu", (2,))
        h, w, labels = _inputs(seed=3)
        hd = distribute_tensor(h.clone(), mesh, [Replicate()]).requires_grad_()
        wd = distribute_tensor(w.clone(), mesh, [Shard(0)]).requires_grad_()
        loss = linear_cross_entropy(hd, wd, labels, chunk_rows=8)
        loss.backward()
        grad_h = hd.grad.full_tensor()  # a partial sum on each rank, reduced here
        grad_w = wd.grad.full_tensor()
        if rank == 0:
            result.update(loss=loss.detach(), grad_h=grad_h, grad_w=grad_w)
    finally:
        dist.destroy_process_group()


def test_vocab_parallel_on_two_processes_equals_one_process():
    h, w, labels = _inputs(seed=3)
    ref = _plain(h, w, labels)
    with mp.Manager() as manager:
        result = manager.dict()
        mp.spawn(_vocab_parallel_worker, args=(_free_port(), result), nprocs=2)
        got = (result["loss"], result["grad_h"], result["grad_w"])
    errors = [_rel_err(a, b) for a, b in zip(got, ref, strict=True)]  # loss, grad h, grad W
    assert max(errors) <= 1e-6, errors


def test_a_run_with_the_fused_loss_trains_as_the_plain_loss(tmp_path):
    args = [*TINY, "--training.steps", "4", "--training.mixed_precision_param", "float32"]
    run_titan(tmp_path / "fused", *args)
    run_titan(tmp_path / "plain", *args, "--training.fused_loss", "false")
    fused, plain = losses(tmp_path / "fused"), losses(tmp_path / "plain")
    assert len(fused) == len(plain) == 4
    for a, b in zip(fused, plain, strict=True):
        assert abs(a - b) <= 1e-5 * abs(b), (fused, plain)
