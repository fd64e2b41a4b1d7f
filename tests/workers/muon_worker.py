"""Several `titan train` runs (the real `Trainer`) one after another in one launch, and a check of the
matrix exchange on its own, for tests/test_muon_parity.py.

    python tests/workers/muon_worker.py N JOBS.json

JOBS.json is a list of
- `{"folder": run folder, "args": [titan train args ...], "resume": [folder, step] | null}`: a run trains into
  its folder (metrics.jsonl, checkpoints); with `resume`, rank 0 first copies that folder's
  `checkpoint/step-<step>` into the run's, so that the run resumes from it (same or another layout);
- `{"owners": out.json}`: `MatrixOwners` on DTensors of several placements over every rank (and over a 2 x 2
  mesh on 4 ranks), against Newton-Schulz of each whole matrix, in bf16 (torch's) and in fp32 (case
  names end ", fp32"); rank 0 writes `{case: [equal, owners]}`.
For N > 1 the ranks run under torchrun's elastic agent, forked from one process that imported the trainer, as
`titan train` starts a CPU job (`titan_core.rank_fork`); the imports are in the functions, so that the agent
does not pay them too. One launch pays the imports' start-up once for all its jobs and ranks.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

from titan_core.launch import collector_paused


def train(run: dict) -> None:
    import torch.distributed as dist

    from titan_core.config import load_config
    from titan_core.trainer import Trainer

    folder = Path(run["folder"])
    if run["resume"] and dist.get_rank() == 0:
        source, step = run["resume"]
        shutil.copytree(Path(source) / "checkpoint" / f"step-{step}", folder / "checkpoint" / f"step-{step}")
    dist.barrier()
    Trainer(load_config(None, [*run["args"], "--job.dump_folder", str(folder)])).train()


def check_owners(out: Path) -> None:
    """Each case: (global shape, placements); 3-D shapes are stacks of matrices (dim 0)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from titan_core.muon import Muon, newton_schulz
    from titan_parallel.matrix_owners import MatrixOwners

    world = dist.get_world_size()
    cases = {
        "rows, uneven": ((7, 5), [Shard(0)]),
        "columns": ((6, 9), [Shard(1)]),
        "experts split by rows": ((4, 6, 5), [Shard(1)]),
        "experts whole on each rank": ((4, 6, 5), [Shard(0)]),
        "replicated": ((6, 5), [Replicate()]),
    }
    every_rank = init_device_mesh("cpu", (world,))
    meshes = dict.fromkeys(cases, every_rank)
    if world == 4:
        square = init_device_mesh("cpu", (2, 2))
        cases |= {
            "rows x columns": ((8, 6), [Shard(0), Shard(1)]),
            "rows x rows": ((8, 6), [Shard(0), Shard(0)]),
            "replicas x rows (HSDP)": ((8, 6), [Replicate(), Shard(0)]),
            "experts by rank x rows (EP x FSDP)": ((4, 6, 5), [Shard(1), Shard(0)]),
            "experts by rank x hidden (EP x TP)": ((4, 6, 5), [Shard(0), Shard(2)]),
        }
        meshes |= {name: square for name in list(cases)[-5:]}
    generator = torch.Generator().manual_seed(0)
    fulls = [torch.randn(shape, generator=generator) for shape, _ in cases.values()]
    params = [distribute_tensor(f, meshes[n], p) for f, (n, (_, p)) in zip(fulls, cases.items(), strict=True)]
    result = {}
    for dtype, suffix in ((torch.bfloat16, ""), (torch.float32, ", fp32")):  # torch's Newton-Schulz, and Titan's fp32
        owners = MatrixOwners(params, list(cases), dtype=dtype)
        got = owners.apply([p.to_local() for p in params], lambda i, m: newton_schulz(m, Muon.MUON_DEFAULTS, dtype))
        for i, (name, (shape, placements)) in enumerate(cases.items()):
            whole = fulls[i] if len(shape) == 3 else fulls[i][None]
            expected = torch.stack([newton_schulz(m, Muon.MUON_DEFAULTS, dtype) for m in whole]).reshape(shape)
            mine = distribute_tensor(expected, meshes[name], placements).to_local()
            equal = torch.tensor(float(got[i].dtype == dtype and torch.equal(got[i], mine)))
            dist.all_reduce(equal, op=dist.ReduceOp.MIN)
            owned = [m.owner for g in owners.groups for m in g.matrices if m.param == i]
            result[name + suffix] = [bool(equal.item()), owned]
    if dist.get_rank() == 0:
        out.write_text(json.dumps(result))


def main(jobs_file: str) -> None:
    """One rank: every job of `jobs_file`, in order."""
    with collector_paused(freeze=True):  # as `titan train`'s ranks import (imported already when forked)
        import torch
        import torch.distributed as dist

        from titan_parallel.distributed import init_distributed

    init_distributed(torch.device("cpu"))
    for job in json.loads(Path(jobs_file).read_text()):
        if "owners" in job:
            check_owners(Path(job["owners"]))
        else:
            train(job)
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    from rank_exit import run_ranks

    run_ranks(int(sys.argv[1]), main, sys.argv[2])
