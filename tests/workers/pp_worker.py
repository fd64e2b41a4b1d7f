"""Pipeline-parallel parity worker, launched by tests/test_pipeline.py under torchrun (gloo, CPU).

    python -m torch.distributed.run --nproc-per-node 4 tests/workers/pp_worker.py OUT_JSON

Every rank trains the same tiny Llama for 3 SGD steps twice: alone, on the whole
batch (the reference), and as its part of a pipeline (optionally with FSDP).
pp=2 layouts without FSDP run as two independent pipeline replicas
(`dp_replicate`=2, no data-parallel wrapping), each on the whole batch.
Rank 0 writes, per case, the largest differences of the losses, the final
parameters and the last step's gradients, where the loss was seen, and which
parameter names the stages held, to OUT_JSON; the test asserts on them.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import sys
import time
import traceback

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from rank_exit import write_results_and_leave
from titan_models.llama3 import Transformer, llama3_flavors, llama3_plan
from titan_parallel import (
    ParallelDims,
    SharedWeights,
    find_shared_weights,
    ParallelOptions,
    PipelineConfig,
    build_pipeline,
    canonical_name,
    check_pipeline,
    copy_full_state,
    parallelize,
    pipeline_step,
    split_model,
)
from titan_parallel.pipeline import build_schedule, build_stages
from titan_parallel.pipeline_layout import available_schedules, stage_module_names

ARGS = dataclasses.replace(llama3_flavors["debugmodel"], dim=64, n_layers=6, n_heads=4, n_kv_heads=2, vocab_size=512, multiple_of=32, max_seq_len=64)
TIED = dataclasses.replace(ARGS, tie_word_embeddings=True)
GLOBAL_BS, SEQ, STEPS, LR = 8, 32, 3, 0.5


def make_batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1234)
    batches = []
    for _ in range(STEPS):
        tokens = torch.randint(0, ARGS.vocab_size, (GLOBAL_BS, SEQ + 1), generator=gen)
        batches.append((tokens[:, :-1], tokens[:, 1:]))
    return batches


def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())  # mean over the microbatch's tokens


def full_init_state(args=ARGS) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = Transformer(args)
    model.init_weights()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def train_reference(state: dict[str, torch.Tensor], batches, args=ARGS) -> dict:
    model = Transformer(args)
    model.load_state_dict(state)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for inputs, labels in batches:
        opt.zero_grad()
        loss = loss_fn(model(inputs), labels)
        loss.backward()
        losses.append(loss.item())
        opt.step()
    named = list(model.named_parameters(remove_duplicate=False))  # a tied weight under both names
    params = {n: p.detach().clone() for n, p in named}
    grads = {n: p.grad.detach().clone() for n, p in named}
    return {"losses": losses, "params": params, "grads": grads}


def full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def run_case(case: dict, state, batches, ref, csv_dir: str) -> dict:
    """Train one pipeline layout; return this rank's differences to the reference."""
    world = dist.get_world_size()
    pp, dp_shard = case["pp"], case.get("dp_shard", 1)
    schedule_name = case["schedule"]
    dims = ParallelDims(pp=pp, dp_replicate=world // (pp * dp_shard), dp_shard=dp_shard, world_size=world)
    mesh = dims.build_mesh("cpu")
    pp_mesh = mesh["pp"]
    local_bs = GLOBAL_BS // dp_shard
    csv_path = os.path.join(csv_dir, f"{case['csv_from']}.csv") if case.get("csv_from") else None
    config = PipelineConfig(
        schedule=schedule_name, microbatch_size=1, layers_per_stage=case.get("layers_per_stage"),
        module_names_per_stage=case.get("names"), schedule_csv=csv_path,
    )
    names = check_pipeline(  # the CSV is written below: checked without it
        dataclasses.replace(config, schedule_csv=None), pp=pp, n_layers=ARGS.n_layers, local_batch_size=local_bs, plan=llama3_plan
    )
    with torch.device("meta"):
        whole = Transformer(TIED if case.get("tied") else ARGS)
    weights = find_shared_weights(whole, llama3_plan, names)  # the tied embedding and output: stages 0 and last
    parts = split_model(whole, llama3_plan, names, pp_mesh, schedule_name, shared=bool(weights))
    for part in parts:
        if dp_shard > 1:
            parallelize(part.module, llama3_plan, mesh, ParallelOptions(pipeline_parallel=True))
    if csv_path is not None:  # the compute-only actions of a built-in schedule, as a custom CSV schedule
        stages = build_stages(parts, len(names), pp_mesh, torch.device("cpu"))
        if dist.get_rank() == 0:
            build_schedule(stages, case["csv_from"], local_bs, loss_fn)._dump_csv(csv_path, format="compute_only")
        dist.barrier()

    def build():
        return build_pipeline(parts, config, n_stages=len(names), pp_mesh=pp_mesh, device=torch.device("cpu"),
                              local_batch_size=local_bs, loss_fn=loss_fn)

    if case.get("stages_on_meta"):  # PipelineStage wraps the meta modules; they are materialised after
        pipe = build()
    for part in parts:
        part.module.to_empty(device="cpu")
        part.module.init_weights(buffer_device="cpu")
        copy_full_state(part.module, state)
    if not case.get("stages_on_meta"):
        pipe = build()
    shared = SharedWeights(weights, parts, pp_mesh, schedule_name, len(names))
    for part in parts:  # the output's copy starts wrong: sync_weights gives it the embedding's values
        if part.index == len(names) - 1 and weights:
            with torch.no_grad():
                part.module.output.weight.zero_()
    shared.sync_weights()
    schedule, stages = pipe.schedule, pipe.stages
    params = [p for part in parts for p in part.module.parameters()]
    opt = torch.optim.SGD(params, lr=LR)
    dp_rank = mesh["dp_shard"].get_local_rank()
    losses = []
    for inputs, labels in batches:
        opt.zero_grad()
        rows = slice(dp_rank * local_bs, (dp_rank + 1) * local_bs)
        loss = pipeline_step(schedule, stages, inputs[rows], labels[rows], pp_mesh)
        if loss is not None and dp_shard > 1:  # average the local means over data parallel
            dist.all_reduce(loss, group=mesh["dp_shard"].get_group())
            loss = loss / dp_shard
        losses.append(loss)
        shared.reduce_grads()  # the tied copies' gradients summed, as the one weight's in the reference
        opt.step()
    has_loss = losses[0] is not None
    loss_diff = max(abs(l.item() - r) for l, r in zip(losses, ref["losses"])) if has_loss else 0.0
    param_diff = grad_diff = 0.0
    held = []
    for part in parts:
        for name, p in part.module.named_parameters():
            key = canonical_name(name)
            held.append(key)
            param_diff = max(param_diff, (full(p.detach()) - ref["params"][key]).abs().max().item())
            grad_diff = max(grad_diff, (full(p.grad) - ref["grads"][key]).abs().max().item())
    return {"loss_diff": loss_diff, "param_diff": param_diff, "grad_diff": grad_diff, "has_loss": has_loss, "held": held,
            "stages": [part.index for part in parts], "pp_rank": pp_mesh.get_local_rank()}


def record_errors() -> dict:
    """Errors split_model raises that need a real pp mesh: a weight tied across stages."""
    out = {}
    mesh = ParallelDims(pp=2, dp_replicate=dist.get_world_size() // 2, dp_shard=1, world_size=dist.get_world_size()).build_mesh("cpu")
    with torch.device("meta"):
        tied = Transformer(dataclasses.replace(ARGS, tie_word_embeddings=True))
    names = stage_module_names(llama3_plan, ARGS.n_layers, mesh["pp"].size())
    try:
        split_model(tied, llama3_plan, names, mesh["pp"], "1F1B")
        out["tied"] = None
    except ValueError as e:
        out["tied"] = str(e)
    return out


CASES = [
    *({"name": f"pp2-{s}", "pp": 2, "schedule": s} for s in available_schedules()),
    {"name": "pp2-1F1B-explicit", "pp": 2, "schedule": "1F1B", "stages_on_meta": True,
     "names": [["tok_embeddings", "layers.0"], ["layers.1", "layers.2", "layers.3", "layers.4", "layers.5", "norm", "output"]]},
    {"name": "pp2-csv-Interleaved1F1B", "pp": 2, "schedule": "Interleaved1F1B", "csv_from": "Interleaved1F1B"},
    {"name": "pp4-1F1B", "pp": 4, "schedule": "1F1B"},
    {"name": "pp4-Interleaved1F1B", "pp": 4, "schedule": "Interleaved1F1B"},
    {"name": "pp4-ZBVZeroBubble", "pp": 4, "schedule": "ZBVZeroBubble", "stages_on_meta": True},
    {"name": "pp2xfsdp2-1F1B", "pp": 2, "dp_shard": 2, "schedule": "1F1B"},
    {"name": "pp2xfsdp2-Interleaved1F1B", "pp": 2, "dp_shard": 2, "schedule": "Interleaved1F1B"},
    {"name": "pp2xfsdp2-DualPipeV", "pp": 2, "dp_shard": 2, "schedule": "DualPipeV", "stages_on_meta": True},
    # A weight tied across the cut (SharedWeights): ranks 0 and 1 of each of two pipelines; both stages on rank 0
    # (a V schedule); the last stage on rank 1 of each of two FSDP-sharded pipelines; ranks 0 and 3 of one.
    {"name": "tied-pp2-1F1B", "pp": 2, "schedule": "1F1B", "tied": True},
    {"name": "tied-pp2-ZBVZeroBubble", "pp": 2, "schedule": "ZBVZeroBubble", "tied": True},
    {"name": "tied-pp2xfsdp2-Interleaved1F1B", "pp": 2, "dp_shard": 2, "schedule": "Interleaved1F1B", "tied": True},
    {"name": "tied-pp4-1F1B", "pp": 4, "schedule": "1F1B", "tied": True},  # ranks 1 and 2 hold no copy
]


def main() -> None:
    out_path = sys.argv[1]
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    state = full_init_state()
    batches = make_batches()
    ref = train_reference(state, batches)
    tied_state = full_init_state(TIED)
    tied_ref = train_reference(tied_state, batches, TIED)
    results: dict = {"ref_params": sorted(ref["params"]), "ref_losses": ref["losses"], "cases": {}}
    csv_dir = os.path.dirname(os.path.abspath(out_path))
    for case in [c for c in CASES if c["schedule"] in available_schedules()]:
        start = time.perf_counter()
        try:
            tied = case.get("tied")
            local = run_case(case, tied_state if tied else state, batches, tied_ref if tied else ref, csv_dir)
            local["seconds"] = round(time.perf_counter() - start, 2)
        except Exception:  # report, and keep the other ranks from hanging on this case
            local = {"error": traceback.format_exc()}
        gathered: list = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, local)
        results["cases"][case["name"]] = gathered
        if any("error" in g for g in gathered):
            break  # later cases could hang on ranks left out of step; report this one
    else:
        results["errors"] = record_errors()
    write_results_and_leave(out_path, results)


if __name__ == "__main__":
    main()
