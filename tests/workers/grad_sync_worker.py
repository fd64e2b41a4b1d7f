"""Gradient accumulation's synchronisation (titan_parallel.set_gradient_sync), launched by tests/test_grad_sync.py:

    python -m torch.distributed.run --nproc-per-node 4 tests/workers/grad_sync_worker.py OUT_JSON

Every rank builds the same tiny Llama, accumulates 2 micro-batches of its data-parallel share under DDP (4 ranks),
FSDP (4), FSDP with one reduce-scatter per step (4) and HSDP (2 replicas x 2 shards), with `set_gradient_sync(...,
False)` before the first micro-batch and `True` before the second, counting the all-reduces and reduce-scatters
each backward issues (torch.distributed's functions wrapped). Rank 0 writes, per case, the counts and each rank's
largest gradient difference to one process's over the whole batch; DDP also reports whether its ranks' gradients
differed after the first micro-batch (they must: nothing was all-reduced).
"""

from __future__ import annotations

import dataclasses
import datetime
import sys
import traceback

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from rank_exit import write_results_and_leave
from titan_models.llama3 import Transformer, llama3_flavors, llama3_plan
from titan_parallel import apply_ddp, apply_fsdp, set_gradient_sync

ARGS = dataclasses.replace(llama3_flavors["debugmodel"], dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=256,
                           multiple_of=32, max_seq_len=32)  # fmt: skip
WORLD, MICRO, BS, SEQ = 4, 2, 2, 16
COUNTS = {"all_reduce": 0, "reduce_scatter": 0}


def count(name: str, fn):
    def wrapped(*args, **kwargs):
        COUNTS[name] += 1
        return fn(*args, **kwargs)

    return wrapped


dist.all_reduce = count("all_reduce", dist.all_reduce)
for _name in ("reduce_scatter_single", "reduce_scatter_tensor"):  # torch 2.15's FSDP2 calls the first
    if hasattr(dist, _name):
        setattr(dist, _name, count("reduce_scatter", getattr(dist, _name)))


def data() -> torch.Tensor:
    gen = torch.Generator().manual_seed(3)
    return torch.randint(0, ARGS.vocab_size, (WORLD, MICRO, BS, SEQ + 1), generator=gen)


def fresh() -> Transformer:
    torch.manual_seed(0)
    model = Transformer(ARGS)
    model.init_weights()
    return model


def loss_of(model, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(tokens[..., :-1])
    return F.cross_entropy(logits.flatten(0, 1).float(), tokens[..., 1:].flatten())


def reference_grads(tokens: torch.Tensor) -> dict[str, torch.Tensor]:
    model = fresh()
    loss_of(model, tokens.flatten(0, 2)).backward()  # the mean over every rank's micro-batches
    return {n: p.grad for n, p in model.named_parameters()}


def full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def run_case(case: str, tokens: torch.Tensor, reference: dict[str, torch.Tensor]) -> dict:
    rank = dist.get_rank()
    model = fresh()
    if case == "ddp":
        apply_ddp(model, init_device_mesh("cpu", (WORLD,)))
    elif case == "hsdp":
        apply_fsdp(model, llama3_plan, init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard")))
    else:
        apply_fsdp(model, llama3_plan, init_device_mesh("cpu", (WORLD,)))
    reduce_scatter = case != "fsdp_once"
    out: dict = {"counts": []}
    for micro in range(MICRO):
        set_gradient_sync([model], micro == MICRO - 1, reduce_scatter=reduce_scatter)
        before = dict(COUNTS)
        (loss_of(model, tokens[rank, micro]) / MICRO).backward()
        out["counts"].append({k: COUNTS[k] - before[k] for k in COUNTS})
        if case == "ddp" and micro == 0:  # unsynchronised: each rank's own gradient
            mine = torch.cat([p.grad.flatten() for p in model.parameters()])
            everyone = [torch.empty_like(mine) for _ in range(WORLD)]
            dist.all_gather(everyone, mine)
            out["ranks_differ_after_first"] = not all(torch.equal(everyone[0], g) for g in everyone[1:])
    out["grad_diff"] = max(
        (full(p.grad) - reference[n.replace("_checkpoint_wrapped_module.", "")]).abs().max().item()
        for n, p in model.named_parameters()
    )
    return out


def main() -> None:
    out_path = sys.argv[1]
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    tokens = data()
    reference = reference_grads(tokens)
    results = {}
    for case in ("ddp", "fsdp", "fsdp_once", "hsdp"):
        try:
            local = run_case(case, tokens, reference)
        except Exception:
            local = {"error": traceback.format_exc()}
        gathered: list = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, local)
        results[case] = gathered
    write_results_and_leave(out_path, results)


if __name__ == "__main__":
    main()
