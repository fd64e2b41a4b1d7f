"""What one block keeps for backward on a real tensor-parallel rank when compiled, for tests/test_memory_compiled_tp.py.

    python tests/fork_run.py 2 tests/workers/compiled_tp_worker.py OUT_JSON

Two gloo ranks split the debug Llama's first block by titan-parallel's `apply_tp` (sequence parallel), compile
it as the trainer compiles under TP (`apply_compile(per_child=True)`, `aot_eager`: what the trainer runs for TP
on CPU), with no budget and at 0.5, and run one forward on one sequence of SEQ tokens (the rank's SEQ / 2 of them,
as sequence parallel hands a block its input). The storages autograd saves for backward are counted by a
`saved_tensors_hooks` pack written here (a DTensor by its local shard; parameters, buffers and the RoPE table left
out, the block's input counted as the memory estimate counts it: what the previous block produced; each storage
once). Rank 0 writes `{"none": bytes, "0.5": bytes, "eager": bytes}`.
"""

from __future__ import annotations

import copy
import dataclasses
import datetime
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
from rank_exit import write_results_and_leave
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from titan_models import get_model_args, get_model_spec
from titan_parallel.compile import apply_compile
from titan_parallel.tensor_parallel import apply_tp

SEQ = 64
SPEC = get_model_spec("llama3")
ARGS = dataclasses.replace(get_model_args("llama3", "debugmodel"), n_layers=1)


def storage(t: torch.Tensor) -> torch.UntypedStorage:
    return (t._local_tensor if isinstance(t, DTensor) else t).untyped_storage()


def saved_bytes(block: nn.Module, hidden: torch.Tensor, rope: torch.Tensor) -> int:
    own = {storage(t).data_ptr() for t in (*block.parameters(), *block.buffers(), rope)}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        s = storage(t)
        if s.data_ptr() not in own:
            saved[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        block(hidden, rope_cache=rope)
    return sum(saved.values())


def main() -> None:
    out_path = sys.argv[1]
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    torch.manual_seed(0)
    model = SPEC.build(ARGS)
    model.init_weights()
    rope = model.get_buffer("rope_cache")
    results = {}
    for name, budget in (("eager", None), ("none", None), ("0.5", 0.5)):
        holder = nn.Module()
        block = copy.deepcopy(model.get_submodule(f"{SPEC.plan.blocks}.0"))
        holder.add_module(SPEC.plan.blocks, nn.ModuleDict({"0": block}))
        apply_tp(holder, SPEC.plan, mesh)
        if name != "eager":
            torch._dynamo.reset()
            apply_compile(holder, SPEC.plan, per_child=True, backend="aot_eager", memory_budget=budget)
        hidden = torch.randn(1, SEQ // 2, ARGS.dim, requires_grad=True)  # (bs, seqlen / tp, dim): this rank's part
        results[name] = saved_bytes(holder.get_submodule(f"{SPEC.plan.blocks}.0"), hidden, rope)
    write_results_and_leave(out_path, results)


if __name__ == "__main__":
    main()
