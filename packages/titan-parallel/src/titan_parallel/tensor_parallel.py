"""Tensor parallel with sequence parallel and loss parallel, read from a `ModelPlan`.

Each `TPStyle` of the plan becomes one of torch's `ParallelStyle`s, applied with
`parallelize_module` (the layouts are torchtitan's Llama plan):

- activations between blocks are sharded on the sequence dim, `Shard(1)`;
- norms run on that sequence-sharded activation (`SequenceParallel`);
- a sub-block (attention, feed-forward) all-gathers its first input to
  `Replicate()`; its colwise linears shard the hidden dim, its rowwise linear
  reduce-scatters back to `Shard(1)`;
- the output projection keeps the logits sharded on the vocab dim, `Shard(-1)`,
  under loss parallel (cross-entropy then runs inside `loss_parallel()`).

Works on the meta device (parameters become meta DTensors; materialise after).
"""

from __future__ import annotations

import warnings
from typing import cast

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from titan_parallel.layout import check_async_tp
from titan_parallel.modules import get_submodule_or_none, iter_blocks
from titan_parallel.plan import ModelPlan, TPStyle
from titan_parallel.tensor_parallel_layout import MOE_TP_SPLITS, check_tp


class EmbeddingParallel(RowwiseParallel):
    """torch's `RowwiseParallel` for an embedding (its rows, the vocab, split; its output summed and scattered on
    the sequence dim), whose output is a tensor of its own rather than a view.

    `DTensor.to_local()` hands back a view of the scattered local tensor, and FSDP2 registers its pre-backward
    hook (the all-gather of the embedding's weight for its backward) on the output of each module it wraps: an
    in-place op on that view (`h *= scale`) would drop the hook, and torch 2.15 warns on every forward that it
    might. The copy costs one sequence-sharded activation per forward.

    Args:
        input_layouts: as `RowwiseParallel`'s: the layout of the token ids (`Replicate()`).
        output_layouts: as `RowwiseParallel`'s: the layout of the embedding's output (`Shard(1)`).
        use_local_output: as `RowwiseParallel`'s: hand on a plain tensor rather than a DTensor.
    """

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        module = super()._apply(module, device_mesh)
        # Runs before FSDP's post-forward hook, which `fully_shard` registers after this.
        module.register_forward_hook(lambda _mod, _args, out: out.clone() if out._base is not None else out)
        return module


def build_tp_style(
    style: TPStyle, *, loss_parallel: bool, float8: bool = False, ep_spans_tp: bool = False
) -> ParallelStyle:
    """The torch `ParallelStyle` for one `TPStyle` (see `TPStyle` for the layouts).

    Args:
        style: how the module is split.
        loss_parallel: for `TPStyle.OUTPUT`, keep the logits as a vocab-sharded DTensor.
        float8: for COLWISE, ROWWISE and BLOCK_INPUT, torchao's float8 styles (same
            layouts; activations cast to float8 before the all-gather), for tensorwise
            `Float8Linear`s (see `titan_parallel.float8`).
        ep_spans_tp: for `TPStyle.MOE_INPUT`, the TP ranks are part of the expert-parallel group
            (`ParallelDims.ep_spans_tp`): `MoETokenParallel` rather than `MoETensorParallel`.
    """
    colwise, rowwise, prepare_input = ColwiseParallel, RowwiseParallel, PrepareModuleInput
    if float8 and style in (TPStyle.COLWISE, TPStyle.ROWWISE, TPStyle.BLOCK_INPUT):
        from titan_parallel.float8 import float8_tp_style_classes

        colwise, rowwise, prepare_input = float8_tp_style_classes()
    if style is TPStyle.EMBEDDING:
        return EmbeddingParallel(input_layouts=Replicate(), output_layouts=Shard(1))
    if style is TPStyle.COLWISE:
        return colwise()
    if style is TPStyle.ROWWISE:
        return rowwise(output_layouts=Shard(1))
    if style is TPStyle.NORM:
        return SequenceParallel()
    if style is TPStyle.BLOCK_INPUT:
        # Only the first positional input (the hidden state) is redistributed; the block
        # passes everything else (RoPE table, positions) as keyword arguments.
        return prepare_input(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
    if style is TPStyle.REPLICATED:
        return ReplicatedParallel()
    if style is TPStyle.SUM_GRAD:
        return SumGradParallel()
    if style is TPStyle.HEAD_NORM:
        # The heads dim plays the sequence dim's part: the norm runs per head on this rank's heads.
        return SequenceParallel(sequence_dim=2, use_local_output=True)
    if style is TPStyle.TOKENWISE:
        return TokenwiseParallel()
    if style is TPStyle.MOE_INPUT:
        return MoETokenParallel() if ep_spans_tp else MoETensorParallel()
    if style is TPStyle.OUTPUT:
        return OutputParallel(
            input_layouts=Shard(1),
            output_layouts=Shard(-1) if loss_parallel else Replicate(),
            use_local_output=not loss_parallel,
        )
    raise ValueError(f"unknown TPStyle {style!r}; add it to titan_parallel.tensor_parallel.build_tp_style")


class OutputParallel(ColwiseParallel):
    """`TPStyle.OUTPUT`: the colwise (vocab-sharded) output projection. When it returns the fused loss
    (`titan_parallel.linear_cross_entropy`, a plain tensor, the same on every rank) rather than
    logits, that passes through untouched.

    Args:
        input_layouts: as `ColwiseParallel`'s (`Shard(1)`: sequence-parallel hidden states).
        output_layouts: the logits' layout (`Shard(-1)` under loss parallel, else `Replicate()`).
        use_local_output: return the logits as a local tensor rather than a DTensor.
    """

    @staticmethod
    def _prepare_output_fn(output_layouts, use_local_output, mod, outputs, device_mesh):
        if not isinstance(outputs, DTensor):
            return outputs
        return ColwiseParallel._prepare_output_fn(output_layouts, use_local_output, mod, outputs, device_mesh)


def _as_replicated(inputs: tuple, mesh: DeviceMesh) -> tuple:
    """Each plain tensor input as a `Replicate()` DTensor (DTensors and non-tensors unchanged)."""
    return tuple(
        DTensor.from_local(x, mesh, (Replicate(),), run_check=False)
        if isinstance(x, torch.Tensor) and not isinstance(x, DTensor)
        else x
        for x in inputs
    )


class ReplicatedParallel(ParallelStyle):
    """`TPStyle.REPLICATED`: weights `Replicate()`, inputs taken as `Replicate()`, a plain local output."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        # torch types distribute_module's input_fn/output_fn as returning None; they return the new inputs/outputs
        return distribute_module(
            module,
            device_mesh,
            None,
            input_fn=lambda mod, inputs, mesh: _as_replicated(inputs, mesh),  # type: ignore[arg-type]
            output_fn=lambda mod, out, mesh: out.to_local() if isinstance(out, DTensor) else out,  # type: ignore[arg-type]
        )


class SumGradParallel(ParallelStyle):
    """`TPStyle.SUM_GRAD`: an identity whose output gradient, a partial sum on each TP rank, is summed over them."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        # torch types distribute_module's input_fn/output_fn as returning None; they return the new inputs/outputs
        return distribute_module(
            module,
            device_mesh,
            None,
            input_fn=lambda mod, inputs, mesh: _as_replicated(inputs, mesh),  # type: ignore[arg-type]
            output_fn=lambda mod, out, mesh: out.to_local(grad_placements=(Partial(),)),
        )


class TokenwiseParallel(ParallelStyle):
    """`TPStyle.TOKENWISE`: a module acting on each token alone, run on this rank's sequence shard.

    Its parameters become `Replicate()` DTensors (so FSDP and checkpoints see one layout), but the forward runs on
    local tensors, so a linear's reshapes need no DTensor rule: each rank computes its own tokens, and each weight's
    gradient, a partial sum over those tokens, is summed over the TP ranks (its local tensor enters as a
    `Replicate()` DTensor and leaves with a `Partial()` gradient, as `MoETensorParallel`'s router). No collective in
    the forward.
    """

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        return _run_on_local_shard(module, device_mesh)


def _run_on_local_shard(module: nn.Module, tp_mesh: DeviceMesh) -> nn.Module:
    """Make `module`'s plain parameters `Replicate()` DTensors (those split already keep their placement) and run
    its forward on this rank's sequence shard as a local tensor, each replicated weight entering as its local
    tensor with a gradient summed over the TP ranks (`_grad_summed_locals`); `module` is changed in place."""
    from torch.nn.utils.stateless import _reparametrize_module

    _, replicated = _distribute_params(module, tp_mesh, {})
    inner = module.forward

    def forward(x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        if isinstance(x, DTensor):  # a sequence-parallel module hands on its Shard(1) output
            x = x.to_local()
        with _reparametrize_module(module, _grad_summed_locals(module, replicated, tp_mesh)):
            return inner(x, *args, **kwargs)

    module.forward = forward
    return module


class MoETensorParallel(ParallelStyle):
    """`TPStyle.MOE_INPUT`: a Mixture-of-Experts module whose experts' hidden dim is split over the TP ranks.

    The parameters `MOE_TP_SPLITS` names (routed experts `w1`/`w3` on their hidden dim, `w2` on its input,
    the shared experts' SwiGLU colwise and rowwise) become `Shard` DTensors on the TP mesh; the rest (the
    router) `Replicate()`. The forward runs on the local tensors: routing's index arithmetic has no DTensor
    rules. Each TP rank routes the same all-gathered tokens (the router is small) and runs every token slot
    through its slice of each expert, so its output is a partial sum, reduce-scattered back to `Shard(1)`:

        x (Shard(1)) --all-gather--> tokens --router, expert slices--> partial out --reduce-scatter--> Shard(1)

    The output's gradient comes back whole on every rank, and everything it reaches inside the module gets
    a partial gradient: the tokens' (through the expert slices and, via the routing weights, the router),
    and the router weight's. So the all-gather's backward is a reduce-scatter (a sum, not a slice), and
    the router weight's gradient (experts x dim) is summed over the TP ranks, as `SumGradParallel` sums
    its output's: its local tensor enters as a `Replicate()` DTensor and leaves with a `Partial()`
    gradient. A gradient the module adds itself (an auxiliary loss) must be scaled by its `grad_share`
    attribute, which this style sets to `1 / tp` when the module has one.

    Experts that expert parallel split already (DTensors on the `(ep, tp)` mesh, `apply_ep`) keep their
    placement, and the module reads their local tensors itself.

    Per TP rank this costs the experts' FLOPs and weights divided by tp, and one all-gather and one
    reduce-scatter of the layer's activation each way, as a dense feed-forward does under TP.
    """

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        from torch.nn.utils.stateless import _reparametrize_module

        split, replicated = _distribute_params(module, device_mesh, MOE_TP_SPLITS)
        inner = module.forward

        def forward(x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
            if not isinstance(x, DTensor):  # a sequence-parallel norm hands on a DTensor already
                x = DTensor.from_local(x, device_mesh, (Shard(1),), run_check=False)
            tokens = x.redistribute(device_mesh, (Replicate(),)).to_local(grad_placements=(Partial(),))
            local = {name: cast(DTensor, module.get_parameter(name)).to_local() for name in split}
            local.update(_grad_summed_locals(module, replicated, device_mesh))
            with _reparametrize_module(module, local):
                out = inner(tokens, *args, **kwargs)
            partial = DTensor.from_local(out, device_mesh, (Partial(),), run_check=False)
            return partial.redistribute(device_mesh, (Shard(1),)).to_local()

        module.forward = forward
        return module


class MoETokenParallel(ParallelStyle):
    """`TPStyle.MOE_INPUT` when the TP ranks are part of the expert-parallel group (`ParallelDims.etp=1`,
    torchtitan's ETP=1): each TP rank routes only its own sequence shard's tokens, to whole experts.

    The routed experts must be split by expert parallel already (`apply_ep` over an `ep` mesh that spans the
    TP ranks), so the layer's all-to-alls carry each rank's own token slots, 1 / tp of what every TP rank
    sends when TP splits the experts (`MoETensorParallel`), and the routed part needs no TP collective:

        x (Shard(1), local) --router, all-to-all to whole experts, back--> routed out (local)
        tokens --all-gather--> shared experts (colwise / rowwise) --reduce-scatter--> shared out (local)

    The router is `Replicate()` and runs on this rank's tokens only, so its weight's gradient is a partial sum,
    summed over the TP ranks as `MoETensorParallel` sums it. The shared experts, when there are any, are split
    colwise / rowwise on the layer's flattened tokens (`Shard(0)`: a SwiGLU treats each token alone, so the
    all-gather's token order does not matter); torchao's float8 styles when all three are tensorwise
    `Float8Linear`s. The auxiliary loss counts each sequence's slots over the ranks holding its parts (the
    caller sets the MoE's `sequence_group` to the `cp x tp` ranks) and each rank adds `grad_share = 1 / tp`
    of its gradient, as under `MoETensorParallel`.

    Per TP rank: the router's FLOPs and the all-to-all's volume divided by tp; whole experts, `E / ep` of them.
    """

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        experts = module.get_submodule("experts")
        if not any(isinstance(p, DTensor) for p in experts.parameters(recurse=False)):
            raise ValueError(
                f"MoETokenParallel needs {type(module).__name__}'s experts split by expert parallel first "
                "(apply_ep over an ep mesh that spans the TP ranks)"
            )
        shared = getattr(module, "shared_experts", None)
        if isinstance(shared, nn.Module):
            _split_shared_experts(shared, device_mesh)
        return _run_on_local_shard(module, device_mesh)  # the experts are split already; the router replicated


def _distribute_params(module: nn.Module, tp_mesh: DeviceMesh, splits: dict[str, int]) -> tuple[list[str], list[str]]:
    """Make each plain parameter of `module` (a MoE, a token-wise module) a DTensor on `tp_mesh` in place:
    `Shard(dim)` where `splits` names it, else `Replicate()`; DTensors already (expert parallel's, a TP style's)
    are left alone. Sets the
    module's `grad_share` (its auxiliary loss's share of each rank's backward) to `1 / tp` where it has one.

    Returns:
        The names of the parameters made `Shard`, and of those made `Replicate()`.
    """
    split: list[str] = []
    replicated: list[str] = []
    for name, param in list(module.named_parameters()):
        if isinstance(param, DTensor):
            continue
        dim = splits.get(name)
        owner, _, leaf = name.rpartition(".")
        placement = Shard(dim) if dim is not None else Replicate()
        whole = distribute_tensor(param, tp_mesh, [placement], src_data_rank=None)
        (module.get_submodule(owner) if owner else module).register_parameter(leaf, nn.Parameter(whole))
        (split if dim is not None else replicated).append(name)
    if hasattr(module, "grad_share"):
        module.grad_share = 1.0 / tp_mesh.size()  # type: ignore[assignment]  # an attribute, not a submodule
    return split, replicated


def _grad_summed_locals(module: nn.Module, names: list[str], tp_mesh: DeviceMesh) -> dict[str, torch.Tensor]:
    """The local tensors of `module`'s `Replicate()` parameters `names`, each entering autograd as a `Replicate()`
    DTensor and leaving with a `Partial()` gradient: the TP ranks' partial gradients are summed (as
    `SumGradParallel` sums its output's)."""
    local = {}
    for name in names:
        weight = cast(DTensor, module.get_parameter(name)).to_local()
        whole = DTensor.from_local(weight, tp_mesh, (Replicate(),), run_check=False)
        local[name] = whole.to_local(grad_placements=(Partial(),))
    return local


def _split_shared_experts(shared: nn.Module, tp_mesh: DeviceMesh) -> None:
    """Split a shared-experts SwiGLU (`w1`, `w3` colwise, `w2` rowwise) over `tp_mesh` for flattened tokens:
    its input all-gathered from `Shard(0)`, its output reduce-scattered back to `Shard(0)`."""
    from titan_parallel.float8 import is_tensorwise_float8

    linears = [shared.get_submodule(name) for name in ("w1", "w2", "w3")]
    colwise, rowwise, prepare_input = ColwiseParallel, RowwiseParallel, PrepareModuleInput
    if all(is_tensorwise_float8(linear) for linear in linears):
        from titan_parallel.float8 import float8_tp_style_classes

        colwise, rowwise, prepare_input = float8_tp_style_classes()
    styles: dict[str, ParallelStyle] = {
        "": prepare_input(input_layouts=(Shard(0),), desired_input_layouts=(Replicate(),)),
        "w1": colwise(),
        "w3": colwise(),
        "w2": rowwise(output_layouts=Shard(0)),
    }
    parallelize_module(shared, tp_mesh, styles)


def enable_async_tp(tp_mesh: DeviceMesh) -> None:
    """Let Inductor overlap TP collectives with matmuls (micro-pipeline TP on symmetric memory).

    Args:
        tp_mesh: the 1-D tensor-parallel mesh.
    """
    import torch._inductor.config as inductor_config
    from torch.distributed._symmetric_memory import enable_symm_mem_for_group

    inductor_config._micro_pipeline_tp = True
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # a no-op (and deprecated) in newer torch
        enable_symm_mem_for_group(tp_mesh.get_group().group_name)


def apply_tp(
    model: nn.Module,
    plan: ModelPlan,
    tp_mesh: DeviceMesh,
    *,
    loss_parallel: bool = True,
    async_tp: bool = False,
    compile: bool = False,
    ep_spans_tp: bool = False,
) -> nn.Module:
    """Split `model` in place over `tp_mesh` as `plan.tp` / `plan.block_tp` say (with sequence parallel).

    Modules the plan names but the model lacks (dropped by a pipeline stage) are
    skipped. Validates first (`check_tp`; `layout.check_async_tp` when `async_tp`).

    Args:
        model: the model or pipeline stage, on the meta device or real.
        plan: how the model may be split.
        tp_mesh: the 1-D tensor-parallel mesh, e.g. `mesh["tp"]`.
        loss_parallel: the output projection returns vocab-sharded DTensor logits
            (`Shard(-1)`) for a cross-entropy under `loss_parallel()`; else replicated
            plain-tensor logits.
        async_tp: overlap TP communication with compute (needs CUDA and torch.compile).
        compile: whether the blocks will be compiled (required by `async_tp`).
        ep_spans_tp: the TP ranks are part of the expert-parallel group (`ParallelDims.ep_spans_tp`, `etp=1`):
            Mixture-of-Experts layers keep their experts whole and route each rank's own tokens
            (`MoETokenParallel`); `apply_ep` must have split the experts over that group first.

    Returns:
        `model`, changed in place.
    """
    check_tp(model, plan, tp_mesh.size(), ep_spans_tp)
    if async_tp:
        check_async_tp(tp_mesh.size(), tp_mesh.device_type, compile)
    tied = _tied_output_embedding(model, plan)
    parallelize_module(model, tp_mesh, planned_styles(model, plan.tp, loss_parallel))
    for block in iter_blocks(model, plan):
        parallelize_module(block, tp_mesh, planned_styles(block, plan.block_tp, loss_parallel, ep_spans_tp))
    if tied is not None:
        # Both styles shard the shared weight on dim 0 (the vocab); restore one shared parameter.
        embedding, output = tied
        output.weight = embedding.weight
    if async_tp:
        enable_async_tp(tp_mesh)
    return model


def planned_styles(
    root: nn.Module, table: tuple[tuple[str, TPStyle], ...], loss_parallel: bool, ep_spans_tp: bool = False
) -> dict[str, ParallelStyle]:
    """The `parallelize_module` plan for the entries of `table` that exist under `root`.

    Float8 styles are chosen from the modules themselves: a COLWISE/ROWWISE linear that
    is a tensorwise `Float8Linear`, and a BLOCK_INPUT whose colwise linears all are (its
    input then all-gathers once, in float8). Rowwise-scaled float8 linears get the plain
    styles: torchao's float8 TP is tensorwise-only, so they all-gather in high precision.

    Args:
        root: the module the table's paths are relative to (the model, or one block).
        table: (module path, style) entries, e.g. `plan.block_tp`.
        loss_parallel: see `build_tp_style`.
        ep_spans_tp: see `build_tp_style`.
    """
    from titan_parallel.float8 import is_tensorwise_float8

    present = {path: style for path, style in table if get_submodule_or_none(root, path) is not None}

    def float8(path: str, style: TPStyle) -> bool:
        if style is TPStyle.BLOCK_INPUT:
            users = [p for p, s in present.items() if s is TPStyle.COLWISE and p.startswith(path + ".")]
            return bool(users) and all(is_tensorwise_float8(root.get_submodule(p)) for p in users)
        return style in (TPStyle.COLWISE, TPStyle.ROWWISE) and is_tensorwise_float8(root.get_submodule(path))

    return {
        path: build_tp_style(style, loss_parallel=loss_parallel, float8=float8(path, style), ep_spans_tp=ep_spans_tp)
        for path, style in present.items()
    }


def _tied_output_embedding(model: nn.Module, plan: ModelPlan) -> tuple[nn.Module, nn.Module] | None:
    """(embedding, output) modules of `plan.tp` that share one weight, or None."""
    embeddings = [get_submodule_or_none(model, p) for p, s in plan.tp if s is TPStyle.EMBEDDING]
    outputs = [get_submodule_or_none(model, p) for p, s in plan.tp if s is TPStyle.OUTPUT]
    for embedding in embeddings:
        for output in outputs:
            if embedding is not None and output is not None and embedding.weight is output.weight:
                return embedding, output
    return None
