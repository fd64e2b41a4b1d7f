"""Records the dtype path of one bf16 training step, for tests/test_precision.py.

    python -m torch.distributed.run --standalone --nproc-per-node N tests/workers/precision_worker.py LAYOUT ...

LAYOUT is `fsdp` (every rank an FSDP shard), `tp` (tensor parallel over every rank, one
data-parallel rank) or `ddp` (every rank a DDP replica). For each, the Llama 3 debug model
(2 blocks) is built as the trainer builds it (`titan_core.model_setup.assemble_model`, bf16
compute) and runs one forward and backward under `mixed_precision_context` as the step
runner enters it (autocast only where the model setup says FSDP does not cast). Hooks
record, for every module, the dtypes of its own parameters and tensor inputs as it starts
(after FSDP gathered them) and of its output; then the loss's dtype and each parameter's
gradient dtype. Rank 0 prints one line:

    PRECISION {"fsdp": {"fsdp": true, "wrapped": true, "modules": {"tok_embeddings": {...}, ...}, "loss": "float32",
               "grads": {...}}}
"""

from __future__ import annotations

import dataclasses
import json
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.fsdp import FSDPModule

from titan_core.model_setup import assemble_model
from titan_models.registry import get_model_args, get_model_spec
from titan_parallel import ParallelDims, ParallelOptions, canonical_name
from titan_parallel.distributed import init_distributed
from titan_parallel.precision import mixed_precision_context

CPU = torch.device("cpu")
DTYPE = torch.bfloat16


def dims_for(layout: str, world: int) -> tuple[ParallelDims, str]:
    """The degrees of `layout` on `world` ranks, and its `dp_mode`."""
    if layout == "fsdp":
        return ParallelDims(dp_shard=world, world_size=world), "fsdp"
    if layout == "tp":
        return ParallelDims(dp_shard=1, tp=world, world_size=world), "fsdp"
    if layout == "ddp":
        return ParallelDims(dp_replicate=world, dp_shard=1, world_size=world), "ddp"
    raise SystemExit(f"unknown layout {layout!r}; choose fsdp, tp or ddp")


def dtype_name(value: object) -> str | None:
    return str(value.dtype).removeprefix("torch.") if isinstance(value, torch.Tensor) else None


def record_step(layout: str, world: int) -> dict:
    dims, dp_mode = dims_for(layout, world)
    mesh = dims.build_mesh("cpu")
    options = ParallelOptions(param_dtype=DTYPE, dp_mode=dp_mode, loss_parallel=False)
    spec = get_model_spec("llama3")
    args = dataclasses.replace(get_model_args("llama3", "debugmodel"), n_layers=2)
    built = assemble_model(spec, args, mesh, options, CPU, seed=7)
    model = built.parts[0]

    modules: dict[str, dict] = {}

    def hooks(name: str):
        key = canonical_name(name) or "<root>"  # modules that never run (containers) are not recorded

        def before(module, inputs):  # after FSDP's own pre-forward hook has gathered the unit's parameters
            modules[key] = {
                "params": sorted({dtype_name(p) for p in module.parameters(recurse=False)}),
                "inputs": [dtype_name(x) for x in inputs if isinstance(x, torch.Tensor)],
            }

        def after(module, inputs, output):
            modules[key]["output"] = dtype_name(output)

        return before, after

    handles = []
    for name, module in model.named_modules():
        before, after = hooks(name)
        handles += [module.register_forward_pre_hook(before), module.register_forward_hook(after)]
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, args.vocab_size, (2, 16), generator=generator)
    labels = torch.randint(0, args.vocab_size, (2, 16), generator=generator)
    with mixed_precision_context("cpu", DTYPE, fsdp=built.fsdp):  # as the step runner enters it
        logits = model(tokens)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())
    loss.backward()
    for handle in handles:
        handle.remove()
    grads = {canonical_name(n): dtype_name(p.grad) for n, p in model.named_parameters()}
    wrapped = isinstance(model, FSDPModule)
    return {"fsdp": built.fsdp, "wrapped": wrapped, "modules": modules, "loss": dtype_name(loss), "grads": grads}


def main(layouts: list[str]) -> None:
    rank, world = init_distributed(CPU)
    result = {layout: record_step(layout, world) for layout in layouts}
    if rank == 0:
        print("PRECISION " + json.dumps(result), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
