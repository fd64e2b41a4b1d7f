"""What `titan plan` reads off the model: the cost model's numbers (`Workload`), and the blocks' sizes by
what divides them (`BlockSizes`), for the memory lower bound.

Parameters of Mixture-of-Experts layers are counted on the meta model (`build_meta_model`, shared with
the job check): the routed experts of each MoE module (`ModelPlan.moe`) are what expert parallel
splits by expert, and tensor parallel by hidden dim (`TPStyle.MOE_INPUT`).
"""

from __future__ import annotations

from typing import Any

from titan_core.config import ConfigError, JobConfig
from titan_core.memory.expert_cost import MoEWork
from titan_core.memory.plan_bounds import BlockSizes
from titan_core.memory.step_cost import Workload


def model_of(cfg: JobConfig) -> tuple[Any, Any]:
    """The model family's spec and args of `cfg` as a run of it builds them (`titan_core.job.model_rules`):
    `model.shape` and `[mup]` applied (`model_shape.run_args`), the RoPE table as long as `training.seq_len`
    (`model_shape.for_seq_len`: a 64k-token plan of Qwen3 4B, whose table holds 40,960 positions, crashed measuring
    its blocks); a `ConfigError` naming model.name / model.flavor. The flavor's vocabulary: the planner reads no
    tokenizer."""
    from titan_core.model_shape import for_seq_len, run_args
    from titan_models import get_model_args, get_model_spec

    try:
        spec, args = get_model_spec(cfg.model.name), get_model_args(cfg.model.name, cfg.model.flavor)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    return spec, for_seq_len(run_args(args, cfg.model_dump()), cfg.training.seq_len)


def workload(cfg: JobConfig) -> Workload:
    """The model and batch of `cfg` as the cost model's numbers (a Llama-shaped family's args)."""
    from titan_core.job.run_rules import master_weights_config_blockers
    from titan_core.memory.analytic import DTYPE_BYTES, compute_dtype_bytes

    spec, a = model_of(cfg)
    q_dim, kv_dim = a.n_heads * a.attention_head_dim, a.kv_heads * a.attention_head_dim
    compute_bytes = compute_dtype_bytes(cfg, "cuda")
    return Workload(
        n_params=spec.count_params(a),
        n_layers=a.n_layers,
        dim=a.dim,
        kv_dim=kv_dim,
        q_dim=q_dim,
        kv_heads=a.kv_heads,
        flops_per_token=spec.flops_per_token(a, cfg.training.seq_len),
        op_recompute_flops_per_token=op_recompute_flops_per_token(a.n_layers, a.dim, q_dim, kv_dim, a.ffn_hidden_dim),
        seq_len=cfg.training.seq_len,
        global_batch=cfg.training.global_batch_size,
        gather_bytes=compute_bytes,
        reduce_bytes=DTYPE_BYTES[cfg.training.mixed_precision_reduce],
        act_bytes=compute_bytes,
        fsdp_reshard=cfg.parallelism.fsdp_reshard_after_forward,
        cp_rotate_method=cfg.parallelism.context_parallel_rotate_method,
        cp_method=cfg.parallelism.context_parallel_method,
        moe=moe_work(cfg),
        budget_recompute=budget_recompute(cfg),  # tp = 1; `plan.search` adds its TP degrees'
        master_weights=cfg.optimizer.master_weights != "off" and not master_weights_config_blockers(cfg),
        **muon_work(cfg),
    )


def newton_schulz_flops(shape: tuple[int, ...], steps: int) -> float:
    """FLOPs of torch's Newton-Schulz orthogonalisation of one parameter (`torch.optim._muon`): per step, with
    X the `m x n` matrix, m <= n, `A = X X^T` (2 m^2 n), `B = b A + c A A` (2 m^3), `X = a X + B X` (2 m^2 n).
    A 3-D parameter (stacked experts) is that many matrices.

    Args:
        shape: the parameter's shape, `(out, in)` or `(experts, out, in)`.
        steps: Newton-Schulz steps (`optimizer.muon_ns_steps`).
    """
    *stack, rows, cols = shape
    m, n = min(rows, cols), max(rows, cols)
    matrices = stack[0] if stack else 1
    return float(matrices * steps * (4 * m * m * n + 2 * m**3))


def muon_work(cfg: JobConfig) -> dict[str, Any]:
    """`Workload`'s Muon fields for `cfg`: the parameters Muon steps (`titan_core.muon_groups.takes_muon`) and one
    orthogonalisation's FLOPs, counted on the meta model, and the bytes per element the matrices travel in to
    their owners (Newton-Schulz's dtype); none under AdamW."""
    if cfg.optimizer.name != "Muon":
        return {}
    from titan_core.job.meta_model import build_meta_model
    from titan_core.muon_groups import takes_muon

    spec, args = model_of(cfg)
    muon = [p for n, p in build_meta_model(spec, args).named_parameters() if takes_muon(n, p.dim(), spec.plan)]
    return {
        "muon_params": sum(p.numel() for p in muon),
        "muon_ns_flops": sum(newton_schulz_flops(tuple(p.shape), cfg.optimizer.muon_ns_steps) for p in muon),
        "muon_exchange_bytes": 4 if cfg.optimizer.muon_ns_dtype == "float32" else 2,  # "auto": bf16 on a GPU
    }


def op_recompute_flops_per_token(n_layers: int, dim: int, q_dim: int, kv_dim: int, ffn_dim: int) -> float:
    """FLOPs per token that selective "op" checkpointing recomputes in a Llama block.

    It keeps every other matmul's output (`titan_parallel.activation_checkpoint`); in a
    block's forward order wq, wk, wv, wo, w1, w3, w2 it recomputes the 2nd, 4th and 6th:
    wk (dim x kv_dim), wo (q_dim x dim) and w3 (dim x ffn_dim), 2 FLOPs per weight each.

    Args:
        n_layers: blocks.
        dim: residual width.
        q_dim: query heads x head dim.
        kv_dim: kv heads x head dim.
        ffn_dim: feed-forward hidden width.
    """
    return 2.0 * n_layers * (dim * kv_dim + q_dim * dim + dim * ffn_dim)


def budget_recompute(cfg: JobConfig, tps: tuple[int, ...] = (1,)) -> tuple[tuple[int, float, float], ...]:
    """`(tp, budget, FLOPs per token)` for each of `tps` and each of `plan_space.PLAN_BUDGETS`: what the model's
    compiled blocks recompute at that `activation_checkpoint.memory_budget` and tensor parallel degree, measured,
    not assumed.

    A block is traced without a budget and at each budget (one sequence of `training.seq_len` in the compute dtype,
    fake CPU tensors): a dense family's whole by `compiled_saved.measure_block` at tp = 1; split and compiled child
    by child as the trainer compiles it under TP, and a Mixture-of-Experts model's compiled around its eager routed
    experts, each kind of block (DeepSeek-V3's dense and MoE blocks), by
    `compiled_parallel.parallel_block_backward_flops` (the partitioner cuts each compiled piece alone, so a budget
    recomputes otherwise there). A budget's recompute is the FLOPs its backward graphs add over the unbudgeted ones
    (matmuls and attention, `graph_flops.graph_flops`), per token, summed over the TP ranks, times the blocks of each
    kind. Float8 blocks are traced with their float8 linears as the target GPU runs them, converted before the split
    as the trainer converts them. No row for a degree whose trace fails; () where the memory estimate does not
    measure compiled blocks either (compile off or not on the blocks, MX linears;
    `compiled_estimate.compiled_block_bytes`): the planner then searches no budget there.

    Args:
        cfg: the job config.
        tps: tensor parallel degrees to measure at.
    """
    if not (cfg.compile.enable and "model" in cfg.compile.components) or set(cfg.model.converters) - {"float8"}:
        return ()
    import torch

    from titan_core.job.meta_model import build_meta_model
    from titan_core.memory.compiled_estimate import traced_float8
    from titan_core.memory.compiled_parallel import Split, parallel_block_backward_flops
    from titan_core.memory.compiled_saved import block_signature, measure_block
    from titan_core.memory.plan_space import PLAN_BUDGETS

    spec, args = model_of(cfg)
    meta = build_meta_model(spec, args)
    blocks = list(meta.get_submodule(spec.plan.blocks).children())
    rope = getattr(meta, "rope_cache", None)
    if not isinstance(rope, torch.Tensor):
        return ()
    seq = cfg.training.seq_len
    # the planner's target is CUDA, where `auto` computes in bf16 (`compute_dtype_bytes`)
    dtype = torch.float32 if cfg.training.mixed_precision_param == "float32" else torch.bfloat16
    float8 = traced_float8(cfg, "cuda")
    # each kind of block (a multi-token-prediction depth, whose budget the estimate does not measure, left out): its
    # first block's index and how many there are
    kinds: dict[Any, list[int]] = {}
    for i, one in enumerate(blocks):
        if not hasattr(one, "input_width"):
            kinds.setdefault(block_signature(one), []).append(i)
    shape = {"rope_shape": tuple(rope.shape), "rope_dtype": rope.dtype, "dim": args.dim, "batch": 1, "ac": "none",
             "float8": float8}  # fmt: skip
    where = {"family": cfg.model.name, "blocks_path": spec.plan.blocks, "seq_len": seq}
    found: list[tuple[int, float, float]] = []
    for tp in tps:
        more = dict.fromkeys(PLAN_BUDGETS, 0.0)
        try:  # FLOPs of one rank's backward, one sequence, per budget (None: the partitioner's default)
            for indices in kinds.values():
                if tp == 1 and spec.plan.moe is None:
                    block = blocks[indices[0]]
                    flops = {
                        b: measure_block(block, **where, **shape, dtype=dtype, memory_budget=b).backward_flops
                        for b in (None, *PLAN_BUDGETS)
                    }
                else:
                    flops = {
                        b: parallel_block_backward_flops(spec, meta, split=Split(tp), dim=args.dim, seq_len=seq,
                                                         dtype=dtype, memory_budget=b, float8=float8,
                                                         index=indices[0], target="cuda")
                        for b in (None, *PLAN_BUDGETS)
                    }  # fmt: skip
                for b in PLAN_BUDGETS:
                    more[b] += len(indices) * max(0.0, flops[b] - flops[None])
        except Exception:  # torch raises many kinds; the estimate says what failed where it traces the block again
            continue
        found += [(tp, b, tp * extra / seq) for b, extra in more.items()]
    return tuple(found)


def _experts_name(plan: Any) -> str | None:
    """The parameter-name prefix of a block's routed experts (`<moe>.experts.`), or None for a dense model."""
    return None if plan.moe is None else f"{plan.moe}.experts."


def block_sizes(cfg: JobConfig) -> BlockSizes:
    """Each block's (non-expert, routed-expert) parameter counts, on the meta model."""
    from titan_core.job.meta_model import build_meta_model

    spec, args = model_of(cfg)
    experts = _experts_name(spec.plan)
    sizes = []
    for block in build_meta_model(spec, args).get_submodule(spec.plan.blocks).children():
        routed = sum(p.numel() for n, p in block.named_parameters() if experts and n.startswith(experts))
        sizes.append((sum(p.numel() for p in block.parameters()) - routed, routed))
    return BlockSizes(tuple(sizes))


def moe_work(cfg: JobConfig) -> MoEWork:
    """The Mixture-of-Experts layers' numbers of `cfg`'s model, counted on the meta model; `MoEWork()` when it
    has none (`ModelPlan.moe` is None)."""
    from titan_core.job.meta_model import build_meta_model
    from titan_parallel.expert_parallel import moe_modules

    spec, args = model_of(cfg)
    if spec.plan.moe is None:
        return MoEWork()
    layers = moe_modules(build_meta_model(spec, args), spec.plan)
    if not layers:
        return MoEWork()
    top_k = getattr(getattr(args, "moe", None), "top_k", None)
    if not isinstance(top_k, int):
        raise ConfigError(f"model.name={cfg.model.name!r} has MoE layers but its args have no moe.top_k")
    num_experts = layers[0].get_submodule("experts").get_parameter("w1").shape[0]
    routed = sum(p.numel() for moe in layers for p in moe.get_submodule("experts").parameters())
    shared = any(getattr(moe, "shared_experts", None) is not None for moe in layers)
    return MoEWork(expert_params=routed, num_experts=num_experts, top_k=top_k, layers=len(layers), shared=shared)
