"""`titan_ckpt`'s full-weights load on several ranks (`model_state.set_full_model_state`), launched by
tests/test_checkpoint_broadcast.py:

    python tests/fork_run.py 2 tests/workers/full_state_worker.py OUT_JSON

Two gloo ranks load a 3-layer MLP sharded over both by FSDP2, then stand-ins for pipeline stages (rank 0 holds
layers 0-1, rank 1 layers 1-2). Only rank 0 may read the full weights (the reader raises on any other rank); every
rank's parameters (gathered, where sharded) must then equal the source's tensors. A source lacking one of rank 1's
layers must fail on both ranks with the same one line naming rank 1's missing tensor, and a reader failing on rank 0
must fail rank 1 too, naming rank 0's error. Rank 0 writes what each rank saw.
"""

from __future__ import annotations

import datetime
import sys
import traceback

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from rank_exit import write_results_and_leave
from titan_ckpt import CheckpointError
from titan_ckpt.model_state import set_full_model_state

WIDTH = 8


def source() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return {f"{i}.{n}": torch.randn(WIDTH, WIDTH) if n == "weight" else torch.randn(WIDTH) for i in range(3)
            for n in ("weight", "bias")}  # fmt: skip


def sharded(mesh) -> nn.Module:
    """The 3 layers, each sharded over both ranks by FSDP2."""
    model = nn.ModuleDict({str(i): nn.Linear(WIDTH, WIDTH) for i in range(3)})
    for layer in model.values():
        fully_shard(layer, mesh=mesh)
    return model


def stage(rank: int) -> nn.Module:
    """Rank 0 holds layers 0-1, rank 1 layers 1-2, as pipeline stages keep the whole model's names."""
    return nn.ModuleDict({str(i): nn.Linear(WIDTH, WIDTH) for i in ((0, 1) if rank == 0 else (1, 2))})


def main() -> None:
    out_path = sys.argv[1]
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (2,))
    reads: list[int] = []

    def read(full: dict[str, torch.Tensor]):
        def reader():
            reads.append(rank)
            if rank != 0:
                raise AssertionError("only rank 0 reads the source")
            return full
        return reader

    results: dict = {}
    try:
        want = source()
        torch.manual_seed(100)  # initial weights unlike the source's
        for name, model in (("sharded", sharded(mesh)), ("stage", stage(rank))):
            set_full_model_state([model], read(source()), "src")
            got = {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in model.state_dict().items()}
            results[name] = {"keys": sorted(got), "equal": all(torch.equal(v, want[k]) for k, v in got.items())}
        lacking = {k: v for k, v in source().items() if not k.startswith("2.")}  # rank 1's stage lacks layer 2
        try:
            set_full_model_state([model], read(lacking), "src")
            results["error"] = None
        except CheckpointError as e:
            results["error"] = str(e)
        def broken():
            if rank == 0:
                raise CheckpointError("src/model.safetensors is truncated or corrupt")
            raise AssertionError("only rank 0 reads the source")

        try:
            set_full_model_state([model], broken, "src")
        except CheckpointError as e:
            results["broken"] = str(e)
        results["reads"] = reads
    except Exception:
        traceback.print_exc()
        raise
    everything: list = [None, None]
    dist.all_gather_object(everything, results)
    write_results_and_leave(out_path, everything)


if __name__ == "__main__":
    main()
