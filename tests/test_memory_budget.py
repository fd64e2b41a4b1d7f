"""Activation memory budgets (`activation_checkpoint.mode = 'memory_budget'`, `titan_parallel.compile.budget_backend`):
what the compiled blocks keep for backward at a budget, counted on the real tensors autograd saves, their gradients,
and the memory estimate's figure for it. Training under a budget against one process: the parity matrix's
`compile_tp2_budget_0.5` and `compile_pp2_budget_0.5` rows; the job check's refusals: tests/test_job_check.py.
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
import torch.nn as nn

from titan_core.config import load_config
from titan_core.job.meta_model import build_meta_model
from titan_core.memory import estimate_memory
from titan_core.memory.analytic import estimate_analytic
from titan_core.memory.compiled_saved import measure_block
from titan_models import get_model_args, get_model_spec
from titan_parallel import ModelPlan
from titan_parallel.activation_checkpoint import apply_ac
from titan_parallel.compile import apply_compile

SPEC = get_model_spec("llama3")
ARGS = dataclasses.replace(get_model_args("llama3", "debugmodel"), n_layers=2)
BATCH, SEQ = 2, 64


@pytest.fixture(scope="module")
def model() -> nn.Module:
    torch.manual_seed(0)
    with torch.device("meta"):
        built = SPEC.build(ARGS)
    built.to_empty(device="cpu")
    built.init_weights()
    return built


def saved_bytes_and_grads(module: nn.Module, *inputs: torch.Tensor) -> tuple[int, list[torch.Tensor]]:
    """One forward and backward of `module`: the bytes of every storage autograd saved for backward (its parameters,
    buffers and `inputs` left out, each storage once), and the parameters' gradients. Torch 2.11's checkpoint also
    keeps the CPU generator's state for the recompute (5,056 bytes of uint8 per block), which 2.15 leaves out when
    the block draws no random numbers: not counted."""
    own = {t.untyped_storage().data_ptr() for t in (*module.parameters(), *module.buffers(), *inputs)}
    saved: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        rng_state = tensor.dtype == torch.uint8 and tensor.dim() == 1 and storage.nbytes() <= 8192
        if storage.data_ptr() not in own and not rng_state:
            saved[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        out = module(*inputs)
    out.float().square().mean().backward()
    return sum(saved.values()), [p.grad.clone() for p in module.parameters()]


def kept_as_estimated(block: nn.Module, rope: torch.Tensor, hidden: torch.Tensor, estimate) -> tuple[int, list]:
    """`saved_bytes_and_grads` of `block` called as the model calls it, with the model's RoPE table (a buffer: not
    counted), its fp32 input `hidden` counted where the estimate's traced block (`measure_block`'s) keeps it, as the
    estimate counts it (what the previous block produced)."""

    class Call(nn.Module):
        def __init__(self):
            super().__init__()
            self.block = block
            self.register_buffer("rope", rope)

        def forward(self, x):
            return self.block(x, rope_cache=self.rope)

    kept, grads = saved_bytes_and_grads(Call(), hidden)
    inputs_kept = hidden.numel() * 4 if any(t.shape == hidden.shape for t in estimate.tensors) else 0
    return kept + inputs_kept, grads


def test_a_lower_budget_keeps_less_and_leaves_the_gradients_unchanged(model):
    """aot_eager (the min-cut partitioner without code generation; Inductor's takes the same budget, below): 1 keeps
    what no budget keeps, 0.5 less, 0 what full AC keeps (the blocks' inputs), every gradient bit for bit."""
    tokens = torch.randint(ARGS.vocab_size, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    found = {}
    for budget in (None, 1.0, 0.5, 0.0):
        torch._dynamo.reset()
        found[budget] = saved_bytes_and_grads(
            apply_compile(copy.deepcopy(model), SPEC.plan, backend="aot_eager", memory_budget=budget), tokens
        )
    torch._dynamo.reset()
    full_ac = apply_compile(apply_ac(copy.deepcopy(model), SPEC.plan, "full"), SPEC.plan, backend="aot_eager")
    full_ac_bytes, _ = saved_bytes_and_grads(full_ac, tokens)
    eager_bytes, eager_grads = saved_bytes_and_grads(copy.deepcopy(model), tokens)

    kept = {budget: n for budget, (n, _) in found.items()}
    assert kept[1.0] == kept[None] < eager_bytes, kept
    assert kept[0.0] < kept[0.5] < kept[1.0], kept
    assert kept[0.0] == full_ac_bytes, (kept, full_ac_bytes)
    for budget, (_, grads) in found.items():
        assert all(torch.equal(g, e) for g, e in zip(grads, eager_grads, strict=True)), budget


def test_the_estimate_is_what_the_compiled_block_keeps_at_the_budget(model):
    """One block compiled by Inductor at budget 0.5 keeps, on real tensors, the bytes the memory estimate reads from
    the partitioner on fake ones (`measure_block`), its input counted as the estimate counts it."""
    meta = build_meta_model(SPEC, ARGS)
    blocks = SPEC.plan.blocks
    estimate, unbudgeted = (
        measure_block(meta.get_submodule(f"{blocks}.0"), family="llama3", blocks_path=blocks,
                      rope_shape=tuple(meta.get_buffer("rope_cache").shape), dim=ARGS.dim, batch=BATCH, seq_len=SEQ,
                      dtype=torch.float32, ac="none", memory_budget=budget)
        for budget in (0.5, None)
    )  # fmt: skip
    holder = nn.Module()
    holder.add_module(blocks, nn.ModuleDict({"0": copy.deepcopy(model.get_submodule(f"{blocks}.0"))}))
    torch._dynamo.reset()
    apply_compile(holder, ModelPlan(blocks=blocks), backend="inductor", memory_budget=0.5)
    hidden = torch.randn(BATCH, SEQ, ARGS.dim, requires_grad=True)  # (bs, seqlen, dim), what a block receives
    kept, _ = kept_as_estimated(holder.get_submodule(f"{blocks}.0"), model.get_buffer("rope_cache"), hidden, estimate)
    assert kept == estimate.total, (kept, [(t.name, t.shape) for t in estimate.tensors])
    assert estimate.total < unbudgeted.total


def test_the_analytic_estimate_follows_the_budget_and_says_what_it_measured():
    base = ["--training.seq_len", "256", "--training.local_batch_size", "4", "--training.mixed_precision_param",
            "float32", "--compile.enable", "true"]  # fmt: skip

    def estimate(*extra: str):
        return estimate_analytic(load_config(None, [*base, *extra]), 1, device_type="cpu")

    budget = ("--activation_checkpoint.mode", "memory_budget", "--activation_checkpoint.memory_budget")
    none, full = estimate(), estimate("--activation_checkpoint.mode", "full")
    totals = {b: estimate(*budget, b) for b in ("1", "0.5", "0")}
    assert full.ranks[0].total < totals["0.5"].ranks[0].total < totals["1"].ranks[0].total
    assert totals["1"].ranks[0].total == none.ranks[0].total  # nothing to recompute at 1
    assert totals["0"].ranks[0].activations <= full.ranks[0].activations + 2**20  # as full AC (its RNG state aside)
    assert any("memory budget 0.5:" in n for n in totals["0.5"].notes), totals["0.5"].notes
    # a Mixture-of-Experts block is cut at the budget too (its routed experts eager between the compiled pieces)
    moe = ("--model.name", "qwen3_moe", "--model.flavor", "debugmodel_moe")
    moe_none, moe_half = estimate(*moe), estimate(*moe, *budget, "0.5")
    assert moe_half.ranks[0].activations < moe_none.ranks[0].activations
    assert any("memory budget 0.5:" in n for n in moe_half.notes), moe_half.notes
    # where the compiled blocks are not measured (DDP's autocast) the estimate keeps every activation, says so
    ddp = ["--parallelism.dp_mode", "ddp", "--parallelism.data_parallel_replicate_degree", "2",
           "--training.mixed_precision_param", "bfloat16"]  # fmt: skip
    ddp = estimate_analytic(load_config(None, [*base, *budget, "0.5", *ddp]), 2, device_type="cpu")
    assert any("the memory budget's recompute is not counted" in n for n in ddp.notes), ddp.notes


def test_a_compiled_run_that_does_not_fit_is_offered_the_budget_that_fits():
    """The cheapest fix of a compiled 1B at batch 8 x 2048 on a 40 GiB GPU is a memory budget (before selective op
    AC and smaller micro-batches), and the run it proposes fits."""
    job = ["--model.flavor", "1B", "--compile.enable", "true", "--training.seq_len", "2048",
           "--training.local_batch_size", "8", "--training.device", "cuda"]  # fmt: skip
    first = estimate_memory(load_config(None, job), 1, gpu_memory="40GiB")
    assert not first.fits and first.fix is not None
    assert first.fix.startswith("--activation_checkpoint.mode memory_budget --activation_checkpoint.memory_budget "), (
        first.fix
    )
    flags = first.fix.split(" (")[0].split()
    fixed = estimate_memory(load_config(None, [*job, *flags]), 1, gpu_memory="40GiB")
    assert fixed.fits and fixed.ranks[0].activations < first.ranks[0].activations


def test_a_blocks_backward_flops_are_the_flop_counters_and_a_budget_adds_its_recompute(model):
    """`measure_block`'s backward FLOPs (read off the partitioned backward graph's nodes) are what torch's
    FlopCounterMode counts in an eager backward of the block on real tensors; budget 1 recomputes nothing, budget 0
    what full AC recomputes, selective "op" the matmuls it does not keep (`op_recompute_flops_per_token`'s count:
    wk, wo and w3), and the planner's figures per budget grow as the budget falls, up to full AC's."""
    from torch.utils.flop_counter import FlopCounterMode, flop_registry

    from titan_core.memory.plan_model import budget_recompute, op_recompute_flops_per_token

    meta = build_meta_model(SPEC, ARGS)
    blocks, rope = SPEC.plan.blocks, model.get_buffer("rope_cache")

    def traced(ac: str = "none", budget: float | None = None):
        return measure_block(meta.get_submodule(f"{blocks}.0"), family="llama3", blocks_path=blocks,
                             rope_shape=tuple(rope.shape), dim=ARGS.dim, batch=BATCH, seq_len=SEQ,
                             dtype=torch.float32, ac=ac, memory_budget=budget)  # fmt: skip

    none = traced()
    block = copy.deepcopy(model.get_submodule(f"{blocks}.0"))
    out = block(torch.randn(BATCH, SEQ, ARGS.dim, requires_grad=True), rope_cache=rope)  # (bs, seqlen, dim)
    with FlopCounterMode(display=False) as counter:
        out.backward(torch.randn_like(out))
    # torch 2.11's counter does not count CPU's flash attention (2.15's does): its backward by hand there, 5 matmuls
    # of (seq x seq) by (seq x head_dim) per head (the scores again, then the gradients of the scores, v, q and k)
    counted = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward in flop_registry
    attention = 0 if counted else 5 * 2 * BATCH * ARGS.n_heads * SEQ * SEQ * ARGS.attention_head_dim
    assert none.backward_flops == counter.get_total_flops() + attention > 0

    def recompute(ac: str = "none", budget: float | None = None) -> float:
        return traced(ac, budget).backward_flops - none.backward_flops

    tokens = BATCH * SEQ
    q_dim, kv_dim = ARGS.n_heads * ARGS.attention_head_dim, ARGS.kv_heads * ARGS.attention_head_dim
    op = op_recompute_flops_per_token(1, ARGS.dim, q_dim, kv_dim, ARGS.ffn_hidden_dim) * tokens
    assert recompute("op") == op
    assert recompute(budget=1.0) == 0 < recompute(budget=0.5) < recompute(budget=0.0)
    # budget 0 recomputes what full AC does; torch 2.11's compiled full AC keeps attention's output instead
    attention_forward = 2 * 2 * BATCH * ARGS.n_heads * SEQ * SEQ * ARGS.attention_head_dim
    assert recompute("full") in (recompute(budget=0.0), recompute(budget=0.0) - attention_forward)
    cfg = load_config(None, ["--compile.enable", "true", "--training.seq_len", str(SEQ),
                             "--training.mixed_precision_param", "float32"])  # fmt: skip
    per_budget = budget_recompute(cfg)  # the debug model's 6 blocks, at one sequence of SEQ
    assert [(tp, b) for tp, b, _ in per_budget] == [(1, 0.75), (1, 0.5), (1, 0.25)]
    full = get_model_args("llama3", "debugmodel").n_layers * recompute("full") / tokens
    flops = [f for *_, f in per_budget]
    assert 0 <= flops[0] <= flops[1] <= flops[2] <= full, (flops, full)
    # no budget is searched where the estimate does not measure compiled blocks
    assert budget_recompute(load_config(None, ["--compile.enable", "false"])) == ()
