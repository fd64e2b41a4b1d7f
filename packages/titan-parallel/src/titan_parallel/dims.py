"""Parallel degrees and the one device mesh they live on.

Mesh dims, outermost first: `pp, dp_replicate, dp_shard, cp, tp`. Every dim is
always present (size 1 when unused), so one code path serves one process and
thousands. Flattened views:

- `dp`          = dp_replicate x dp_shard: ranks that read different data.
- `dp_shard_cp` = dp_shard x cp: ranks FSDP shards parameters over.
- `dp_cp`       = dp_replicate x dp_shard x cp: ranks a loss is averaged over.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "cp", "tp")


class ParallelConfigError(ValueError):
    """A parallel layout that cannot work; the message names the key and the fix."""


@dataclass(frozen=True)
class ParallelDims:
    """Degrees of each parallel dimension; their product is the world size.

    Args:
        dp_replicate: HSDP/DDP replicas (`parallelism.data_parallel_replicate_degree`).
        dp_shard: FSDP shards; -1 takes what the other degrees leave of the world
            (`parallelism.data_parallel_shard_degree`).
        cp: context parallel degree (`parallelism.context_parallel_degree`).
        tp: tensor parallel degree (`parallelism.tensor_parallel_degree`).
        pp: pipeline parallel degree (`parallelism.pipeline_parallel_degree`).
        world_size: number of processes.
    """

    dp_replicate: int = 1
    dp_shard: int = -1
    cp: int = 1
    tp: int = 1
    pp: int = 1
    world_size: int = 1

    def __post_init__(self) -> None:
        keys = {
            "dp_replicate": "parallelism.data_parallel_replicate_degree",
            "cp": "parallelism.context_parallel_degree",
            "tp": "parallelism.tensor_parallel_degree",
            "pp": "parallelism.pipeline_parallel_degree",
        }
        for attr, key in keys.items():
            if getattr(self, attr) < 1:
                raise ParallelConfigError(f"{key} must be >= 1, got {getattr(self, attr)}")
        if self.dp_shard == 0 or self.dp_shard < -1:
            raise ParallelConfigError(
                f"parallelism.data_parallel_shard_degree must be >= 1 or -1 (the rest), got {self.dp_shard}"
            )
        others = self.dp_replicate * self.cp * self.tp * self.pp
        if self.dp_shard == -1:
            if self.world_size % others:
                raise ParallelConfigError(
                    f"world size {self.world_size} is not divisible by replicate x cp x tp x pp = {others}; "
                    "change the degrees or the number of processes"
                )
            object.__setattr__(self, "dp_shard", self.world_size // others)
        if others * self.dp_shard != self.world_size:
            raise ParallelConfigError(
                f"parallel degrees multiply to {others * self.dp_shard} "
                f"(replicate {self.dp_replicate} x shard {self.dp_shard} x cp {self.cp} x tp {self.tp} x pp {self.pp}) "
                f"but the world size is {self.world_size}; set parallelism.data_parallel_shard_degree = -1 "
                "or launch that many processes"
            )

    @property
    def dp(self) -> int:
        """Data-parallel degree: how many different batches are read per step."""
        return self.dp_replicate * self.dp_shard

    @property
    def sharded_dp(self) -> int:
        """Ranks that FSDP shards parameters over (dp_shard x cp)."""
        return self.dp_shard * self.cp

    def build_mesh(self, device_type: str) -> ParallelMesh:
        """Create the 5-D mesh `(pp, dp_replicate, dp_shard, cp, tp)` and its flattened views."""
        shape = (self.pp, self.dp_replicate, self.dp_shard, self.cp, self.tp)
        root = init_device_mesh(device_type, shape, mesh_dim_names=MESH_DIMS)
        flat = {name: root[dims]._flatten(name) for name, dims in FLATTENED.items()}
        return ParallelMesh(root, flat)


FLATTENED = {
    "dp": ("dp_replicate", "dp_shard"),
    "dp_shard_cp": ("dp_shard", "cp"),
    "dp_cp": ("dp_replicate", "dp_shard", "cp"),
}


class ParallelMesh:
    """The root mesh plus its flattened views, looked up by name: `mesh["tp"]`, `mesh["dp_cp"]`,
    `mesh["dp_replicate", "dp_shard_cp"]` (the HSDP mesh)."""

    def __init__(self, root: DeviceMesh, flattened: dict[str, DeviceMesh]):
        self.root = root
        self.flattened = flattened

    def __getitem__(self, names: str | tuple[str, ...]) -> DeviceMesh:
        if isinstance(names, str) and names in self.flattened:
            return self.flattened[names]
        return self.root[names]

    def size(self) -> int:
        return self.root.size()

    def __repr__(self) -> str:
        return f"ParallelMesh({self.root})"


def default_device() -> torch.device:
    """The accelerator of this process (`cuda:LOCAL_RANK`) if there is one, else the CPU."""
    if torch.cuda.is_available():
        import os

        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return torch.device("cpu")
