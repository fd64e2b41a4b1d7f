"""The one device mesh every parallelism lives on.

Mesh dims, outermost first: `pp, dp_replicate, dp_shard, cp, tp`. Every dim is
always present (size 1 when unused), so one code path serves one process and
thousands. Flattened views:

- `dp`          = dp_replicate x dp_shard: ranks that read different data.
- `dp_shard_cp` = dp_shard x cp: ranks FSDP shards parameters over.
- `dp_cp`       = dp_replicate x dp_shard x cp: ranks a loss is averaged over.

Under expert parallel (`ParallelDims.ep > 1`) `dp_shard` is split into
`dp_shard_mod_ep x dp_shard_in_ep` (outermost first), so the mesh is 6-D and:

- `dp_shard` = dp_shard_mod_ep x dp_shard_in_ep (a flattened view, same ranks as before);
- `ep`       = dp_shard_in_ep x cp: ranks that split the experts (all-to-all of tokens);
- `dp_shard_mod_ep` (a root dim): ranks holding the same experts, which FSDP shards the
  experts over (with `dp_replicate` for HSDP).

When the tensor-parallel ranks join expert parallel (`ParallelDims.ep_spans_tp`, `etp=1`):

- `ep`       = dp_shard_in_ep x cp x tp;
- `cp_tp`    = cp x tp: the ranks holding the parts of one sequence that a MoE layer routes;
- `dp_cp_tp` = dp_replicate x dp_shard x cp x tp: every rank that routes different tokens.
"""

from __future__ import annotations

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from titan_parallel.layout import ParallelDims

MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "cp", "tp")

FLATTENED = {
    "dp": ("dp_replicate", "dp_shard"),
    "dp_shard_cp": ("dp_shard", "cp"),
    "dp_cp": ("dp_replicate", "dp_shard", "cp"),
}

EP_MESH_DIMS = ("pp", "dp_replicate", "dp_shard_mod_ep", "dp_shard_in_ep", "cp", "tp")
_SHARD = ("dp_shard_mod_ep", "dp_shard_in_ep")
EP_FLATTENED = {
    "dp_shard": _SHARD,
    "dp": ("dp_replicate", *_SHARD),
    "dp_shard_cp": (*_SHARD, "cp"),
    "dp_cp": ("dp_replicate", *_SHARD, "cp"),
    "ep": ("dp_shard_in_ep", "cp"),
}
EP_TP_FLATTENED = {
    **EP_FLATTENED,
    "ep": ("dp_shard_in_ep", "cp", "tp"),
    "cp_tp": ("cp", "tp"),
    "dp_cp_tp": ("dp_replicate", *_SHARD, "cp", "tp"),
}


class ParallelMesh:
    """The root mesh plus its flattened views, looked up by name: `mesh["tp"]`, `mesh["dp_cp"]`,
    `mesh["dp_replicate", "dp_shard_cp"]` (the HSDP mesh).

    Args:
        root: the 5-D mesh `(pp, dp_replicate, dp_shard, cp, tp)`, or under expert parallel the 6-D
            `(pp, dp_replicate, dp_shard_mod_ep, dp_shard_in_ep, cp, tp)`.
        flattened: the views of `FLATTENED`, by name.
        dims: the degrees the mesh was built from.
    """

    def __init__(self, root: DeviceMesh, flattened: dict[str, DeviceMesh], dims: ParallelDims):
        self.root = root
        self.flattened = flattened
        self.dims = dims

    def __getitem__(self, names: str | tuple[str, ...]) -> DeviceMesh:
        if isinstance(names, str) and names in self.flattened:
            return self.flattened[names]
        return self.root[names]

    @property
    def device_type(self) -> str:
        return self.root.device_type

    def size(self) -> int:
        return self.root.size()

    def __repr__(self) -> str:
        return f"ParallelMesh({self.root})"


def init_parallel_mesh(dims: ParallelDims, device_type: str) -> ParallelMesh:
    """Create the 5-D mesh of `dims` and its flattened views (what `ParallelDims.build_mesh` does).

    Args:
        dims: the parallel degrees; their product must be the process group's size.
        device_type: "cuda" or "cpu".
    """
    if dims.ep == 1:
        shape: tuple[int, ...] = (dims.pp, dims.dp_replicate, dims.dp_shard, dims.cp, dims.tp)
        root = init_device_mesh(device_type, shape, mesh_dim_names=MESH_DIMS)
        flat = {name: root[names]._flatten(name) for name, names in FLATTENED.items()}
        return ParallelMesh(root, flat, dims)
    shape = (dims.pp, dims.dp_replicate, dims.dp_shard_mod_ep, dims.dp_shard_in_ep, dims.cp, dims.tp)
    root = init_device_mesh(device_type, shape, mesh_dim_names=EP_MESH_DIMS)
    views = EP_TP_FLATTENED if dims.ep_spans_tp else EP_FLATTENED
    flat = {name: root[names]._flatten(name) for name, names in views.items()}
    return ParallelMesh(root, flat, dims)
