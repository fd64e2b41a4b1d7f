"""Gradient clipping with the norm taken over the whole model, however it is split.

Under FSDP/TP the gradients are DTensors and their norm is reduced over the mesh
they live on; under expert parallel the experts' gradients live on another mesh
than the rest, so each mesh's norm is taken apart and their squares summed. A
pipeline stage holds only its own layers, so the squared norms of all stages are
summed over the `pp` mesh as well.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor


@torch.no_grad()
def clip_grad_norm_(
    parameters: Iterable[torch.nn.Parameter],
    max_norm: float,
    *,
    pp_mesh: DeviceMesh | None = None,
    foreach: bool | None = None,
) -> torch.Tensor:
    """Scale gradients in place so their global L2 norm is at most `max_norm`; returns that norm.

    Args:
        parameters: the parameters of this rank's model (or pipeline stages).
        max_norm: the largest allowed norm; <= 0 measures only.
        pp_mesh: the pipeline mesh when the model is pipelined, else None.
        foreach: use the multi-tensor kernels (None = torch's choice).
    """
    parameters = [p for p in parameters if p.grad is not None]
    by_mesh: dict[object, list[torch.nn.Parameter]] = {}
    for p in parameters:
        by_mesh.setdefault(p.grad.device_mesh if isinstance(p.grad, DTensor) else None, []).append(p)
    norms = []
    for group in by_mesh.values():
        grads = [p.grad for p in group if p.grad is not None]  # all of them (filtered above); narrows the type
        norm = torch.nn.utils.get_total_norm(grads, norm_type=2.0, foreach=foreach)
        # A Partial or Replicate DTensor: materialise the global value.
        norms.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
    if not norms:
        total = torch.zeros(())
    else:
        total = norms[0] if len(norms) == 1 else torch.stack(norms).square().sum().sqrt()
    if pp_mesh is not None and pp_mesh.size() > 1:
        total = total**2
        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=pp_mesh.get_group())
        total = total.sqrt()
    if max_norm > 0:
        for group in by_mesh.values():  # DTensors of different meshes do not mix in one foreach op
            torch.nn.utils.clip_grads_with_norm_(group, max_norm, total, foreach=foreach)
    return total
