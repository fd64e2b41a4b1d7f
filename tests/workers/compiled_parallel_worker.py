"""What one block keeps for backward on a real tensor- or context-parallel rank when compiled, for
tests/test_memory_compiled_parallel.py.

    python tests/fork_run.py 2 tests/workers/compiled_parallel_worker.py OUT_JSON

Two gloo ranks split the debug Llama's first block as the trainer does and compile it as `parallelize_model`
compiles there, with the backend the trainer runs on CPU (`aot_eager`), with no budget and at 0.5, and run one
forward on one sequence of SEQ tokens: TP 2 by titan-parallel's `apply_tp` (sequence parallel: the rank's SEQ / 2
tokens; compiled per child), CP 2 by `apply_cp` with ring attention (compiled around it) and with Ulysses (one
graph), the rank's SEQ / 2 tokens at its RoPE positions. The storages autograd saves for backward are counted by a
`saved_tensors_hooks` pack written here (a DTensor by its local shard; parameters, buffers and the RoPE table left
out, the block's input counted as the memory estimate counts it: what the previous block produced; each storage
once). Rank 0 writes `{"tp/eager": bytes, "tp/none": ..., "tp/0.5": ..., "ring/none": ..., "ring/0.5": ...,
"ulysses/none": ..., "ulysses/0.5": ..., "tp-float8/none": ...}`, the last with the block's linears in tensorwise
float8 (emulated, every linear: the size filter off), converted before the split as the trainer converts them.
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
from titan_parallel.context_parallel import apply_cp
from titan_parallel.float8 import Float8Options, apply_float8
from titan_parallel.ring_attention import cp_positions
from titan_parallel.tensor_parallel import apply_tp

SEQ = 64
SPEC = get_model_spec("llama3")
ARGS = dataclasses.replace(get_model_args("llama3", "debugmodel"), n_layers=1)
FLOAT8 = Float8Options(emulate=True, auto_filter_small_kn=False, filter_fqns=())


def storage(t: torch.Tensor) -> torch.UntypedStorage:
    return (t._local_tensor if isinstance(t, DTensor) else t).untyped_storage()


def saved_bytes(block: nn.Module, hidden: torch.Tensor, rope: torch.Tensor, **kwargs: torch.Tensor) -> int:
    own = {storage(t).data_ptr() for t in (*block.parameters(), *block.buffers(), rope)}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        s = storage(t)
        if s.data_ptr() not in own:
            saved[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        block(hidden, rope_cache=rope, **kwargs)
    return sum(saved.values())


def main() -> None:
    out_path = sys.argv[1]
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    tp_mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    cp_mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("cp",))
    torch.manual_seed(0)
    model = SPEC.build(ARGS)
    model.init_weights()
    rope = model.get_buffer("rope_cache")
    positions = cp_positions(SEQ // 2, dist.get_rank(), 2)  # the rank's head and tail chunks of the sequence
    results = {}
    rows = [("tp/eager", None), ("tp/none", None), ("tp/0.5", 0.5)]
    rows += [(f"{method}/{name}", budget) for method in ("ring", "ulysses") for name, budget in (("none", None),
                                                                                               ("0.5", 0.5))]
    rows += [("tp-float8/none", None)]
    for name, budget in rows:
        split = name.split("/")[0]
        holder = nn.Module()
        block = copy.deepcopy(model.get_submodule(f"{SPEC.plan.blocks}.0"))
        holder.add_module(SPEC.plan.blocks, nn.ModuleDict({"0": block}))
        if split == "tp-float8":
            apply_float8(holder, FLOAT8)
            split = "tp"
        if split == "tp":
            apply_tp(holder, SPEC.plan, tp_mesh)
        else:
            apply_cp(holder, SPEC.plan, cp_mesh, cp_rotate_method="allgather", cp_method=split)
        if not name.endswith("eager"):
            torch._dynamo.reset()
            apply_compile(holder, SPEC.plan, fullgraph=split != "ring", per_child=split == "tp", backend="aot_eager",
                          memory_budget=budget)  # fmt: skip
        hidden = torch.randn(1, SEQ // 2, ARGS.dim, requires_grad=True)  # (bs, seqlen / 2, dim): this rank's part
        kwargs = {} if split == "tp" else {"positions": positions}
        results[name] = saved_bytes(holder.get_submodule(f"{SPEC.plan.blocks}.0"), hidden, rope, **kwargs)
    write_results_and_leave(out_path, results)


if __name__ == "__main__":
    main()
