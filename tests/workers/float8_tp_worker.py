"""Float8 under tensor parallel, launched by tests/test_float8.py under torchrun (2 processes, gloo, CPU).

    python -m torch.distributed.run --nproc-per-node 2 tests/workers/float8_tp_worker.py OUT_JSON
    python -m torch.distributed.run --nproc-per-node 4 tests/workers/float8_tp_worker.py OUT_JSON

On 4 processes it runs only `tp_cp_compiled_vs_eager` (TP 2 x CP 2, ring attention). On 2, for each float8
recipe, the trainer's own model setup (`assemble_model`) builds a seeded tiny Llama converted to float8 and split
TP=2. Hooks placed after TP's own record what each linear really receives (a float8 DTensor, all-gathered in
float8, or a high-precision one); one forward and backward on a fixed batch is compared with the same float8 model
alone and with the unconverted model alone. Rank 0 writes the types and differences to OUT_JSON; the test asserts
on them.
"""

from __future__ import annotations

import dataclasses
import json
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor.parallel import loss_parallel

from titan_core.converters import Converters
from titan_core.model_setup import assemble_model
from titan_models import get_model_spec
from titan_models.llama3 import llama3_flavors
from titan_parallel import Float8Options, ParallelDims, ParallelOptions, apply_float8
from titan_parallel.mesh import ParallelMesh

ARGS = dataclasses.replace(llama3_flavors["debugmodel"], n_layers=2, vocab_size=512)
SEED, BS, SEQ = 3, 4, 32
WATCHED = ("layers.0.attention.wq", "layers.0.attention.wo", "layers.1.feed_forward.w1", "layers.1.feed_forward.w2")


def describe(t: torch.Tensor) -> dict:
    """What a linear received: DTensor or not, its local tensor's class, placements."""
    local = t._local_tensor if isinstance(t, DTensor) else t
    return {
        "dtensor": isinstance(t, DTensor),
        "local_type": type(local).__name__,
        "replicated": isinstance(t, DTensor) and all(isinstance(p, Replicate) for p in t.placements),
    }


def single(spec, options: Float8Options | None, tokens, labels) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """Logits, loss and gradients of the model alone (float8-converted when `options`)."""
    model = spec.build(ARGS)
    torch.manual_seed(SEED)
    model.init_weights()
    if options is not None:
        apply_float8(model, options)
    logits = model(tokens)
    loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten())
    loss.backward()
    return logits.detach(), loss.detach(), {n: p.grad for n, p in model.named_parameters()}


def tp_model(recipe: str, compile: bool = False, cp: int = 1) -> tuple[torch.nn.Module, ParallelMesh]:
    """The float8 model split TP=2 (x CP `cp`: ring attention, FSDP over the CP ranks) by the trainer's own setup
    (compiled as the trainer compiles TP blocks: each child, the sequence-parallel norms eager; `aot_eager` on
    CPU), and its mesh."""
    options = Float8Options(recipe_name=recipe, auto_filter_small_kn=False, emulate=True)
    mesh = ParallelDims(tp=2, cp=cp, world_size=2 * cp).build_mesh("cpu")
    return assemble_model(
        get_model_spec("llama3"), ARGS, mesh, ParallelOptions(compile=compile), torch.device("cpu"), SEED,
        converters=Converters(float8=options),
    ).parts[0], mesh  # fmt: skip


def forward_backward(model: torch.nn.Module, tokens, labels) -> tuple[torch.Tensor, dict]:
    """The full logits and every parameter's full gradient of one step."""
    with loss_parallel():
        logits = model(tokens)
        F.cross_entropy(logits.flatten(0, 1), labels.flatten()).backward()
    return logits.full_tensor().detach(), {n: p.grad.full_tensor() for n, p in model.named_parameters()}


def differences(compiled: tuple[torch.Tensor, dict], eager: tuple[torch.Tensor, dict]) -> dict:
    """The largest differences of two `forward_backward` results' logits and gradients."""
    (compiled_logits, compiled_grads), (eager_logits, eager_grads) = compiled, eager
    return {
        "logits_max_diff": (compiled_logits - eager_logits).abs().max().item(),
        "grad_max_diff": max((compiled_grads[n] - g).abs().max().item() for n, g in eager_grads.items()),
        "grads": len(eager_grads),
    }


def compiled_vs_eager(tokens, labels) -> dict:
    """Tensorwise float8 under TP, compiled against eager: the float8 input cast and its all-gather (the children's
    input hooks) trace into each child's graph; until 2026-12-07 the first backward failed ("Expected a
    Float8TrainingTensor tangent but got a plain Tensor")."""
    torch._dynamo.reset()
    compiled = forward_backward(tp_model("tensorwise", compile=True)[0], tokens, labels)
    return differences(compiled, forward_backward(tp_model("tensorwise")[0], tokens, labels))


def tp_cp_compiled_vs_eager(tokens, labels) -> dict:
    """Tensorwise float8 under TP 2 x CP 2 (ring), compiled against eager, on this rank's part of the sequences. Ring
    attention (eager) breaks the attention's graph; until 2026-12-07 Dynamo closed the attention's input hooks (the
    float8 cast and all-gather) into a graph of their own there, and the first backward failed as TP alone did."""
    from titan_parallel.context_parallel import shard_sequence

    runs = []
    for compile in (True, False):
        torch._dynamo.reset()
        model, mesh = tp_model("tensorwise", compile=compile, cp=2)
        runs.append(forward_backward(model, *shard_sequence(tokens, labels, cp_mesh=mesh["cp"])))
    return differences(*runs)  # rank 0's part of the sequences (the test reads rank 0's file)


def run(recipe: str, tokens, labels) -> dict:
    spec = get_model_spec("llama3")
    options = Float8Options(recipe_name=recipe, auto_filter_small_kn=False, emulate=True)
    model, _ = tp_model(recipe)
    seen: dict[str, dict] = {}

    def record(name: str):
        def hook(_module, args) -> None:  # registered after TP's hooks: sees what the linear computes on
            seen.setdefault(name, describe(args[0]))

        return hook

    for name in WATCHED:
        model.get_submodule(name).register_forward_pre_hook(record(name))
    with loss_parallel():
        logits = model(tokens)
        loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten())
        loss.backward()
    logits, loss = logits.full_tensor().detach(), loss.full_tensor().detach()
    grads = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
    ref_logits, ref_loss, ref_grads = single(spec, options, tokens, labels)
    plain_logits, plain_loss, plain_grads = single(spec, None, tokens, labels)
    rel = lambda a, b: ((a - b).norm() / b.norm()).item()  # noqa: E731
    wq = model.get_submodule("layers.0.attention.wq")
    return {
        "module_types": sorted({type(model.get_submodule(n)).__name__ for n in WATCHED}),
        "weight": {"dtensor": isinstance(wq.weight, DTensor), "placements": str(wq.weight.placements)},
        "inputs": seen,
        "logits_rel_vs_float8_alone": rel(logits, ref_logits),
        "logits_rel_float8_alone_vs_unconverted": rel(ref_logits, plain_logits),
        "loss": loss.item(),
        "loss_float8_alone": ref_loss.item(),
        "loss_unconverted": plain_loss.item(),
        # per parameter: (TP float8 vs float8 alone, float8 alone vs unconverted), relative L2
        "grad_rel": {n: (rel(grads[n], ref_grads[n]), rel(ref_grads[n], plain_grads[n])) for n in ref_grads},
    }


def main(out: str) -> None:
    dist.init_process_group("gloo")
    gen = torch.Generator().manual_seed(1234)
    data = torch.randint(0, ARGS.vocab_size, (BS, SEQ + 1), generator=gen)
    tokens, labels = data[:, :-1].contiguous(), data[:, 1:].contiguous()
    if dist.get_world_size() == 4:
        results = {"tp_cp_compiled": tp_cp_compiled_vs_eager(tokens, labels)}
    else:
        results = {recipe: run(recipe, tokens, labels) for recipe in ("tensorwise", "rowwise")}
        results["tensorwise_compiled"] = compiled_vs_eager(tokens, labels)
    if dist.get_rank() == 0:
        with open(out, "w") as f:
            json.dump(results, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
