"""Mixture-of-Experts feed-forward: token-choice top-k routing, dropless, with grouped experts.

    scores  = softmax | sigmoid(gate(x))                    (tokens, experts), fp32
    chosen  = top_k(scores + expert_bias)                   the bias only selects (aux-loss-free balancing)
    weights = scores[chosen] (renormalised if route_norm) * route_scale
    out     = sum_k weights_k * expert_k(x) + shared_experts(x)

Dropless: every token reaches its k experts, whatever the load. The token slots are sorted
by expert and run through `GroupedExperts` as one grouped matmul per weight
(`torch._grouped_mm` on GPUs that have it, a loop of exact per-expert matmuls elsewhere;
compiled with no more rows than experts, as when decoding, each row meets its expert's
weight gathered for it, which reads no counts on the host and so stays one graph).
Nothing here splits anything: expert parallel (titan-parallel) wraps `GroupedExperts`
so that its input is sent to the ranks holding the experts and its output comes back, and
the trainer updates `expert_bias` from `tokens_per_expert` after each step. The one
collective is the auxiliary loss's: under context parallel it sums each sequence's slot
counts over the ranks that context parallel names (`MoE.sequence_group`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from titan_models.errors import ModelConfigError
from titan_models.llama3.model import FeedForward, init_trunc_normal_

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

SCORE_FUNCS = ("softmax", "sigmoid")


@dataclass(frozen=True)
class MoEArgs:
    """Shape and routing of one Mixture-of-Experts layer. Frozen: derive variants with `dataclasses.replace`."""

    num_experts: int = 8
    """Routed experts."""
    top_k: int = 2
    """Experts each token is sent to."""
    hidden_dim: int = 1408
    """Each routed expert's SwiGLU hidden size (Hugging Face `moe_intermediate_size`)."""
    num_shared_experts: int = 0
    """Shared SwiGLU of hidden `num_shared_experts * hidden_dim` that every token goes through; 0 = none."""
    score_func: str = "softmax"
    """"softmax" (Qwen3-MoE) or "sigmoid" (DeepSeek-V3) over the router logits of all experts."""
    route_norm: bool = False
    """Renormalise the chosen experts' scores to sum to 1 (Hugging Face `norm_topk_prob`)."""
    route_scale: float = 1.0
    """Multiplies the routing weights (Hugging Face `routed_scaling_factor`)."""
    n_groups: int = 1
    """Group-limited routing: the experts form this many equal groups (Hugging Face `n_group`)."""
    topk_groups: int = 1
    """Groups kept per token, ranked by the sum of each group's two best biased scores (`topk_group`)."""
    load_balance_coeff: float | None = 1e-3
    """Auxiliary-loss-free balancing: `expert_bias` moves by this much per step towards even load; None = no bias."""
    aux_loss_coeff: float = 0.0
    """Weight of the sequence-wise auxiliary balance loss (DeepSeek-V3's); 0 = off."""
    router_z_loss_coeff: float = 0.0
    """Weight of the router z-loss (ST-MoE's, OLMoE's 1e-3): mean over tokens of logsumexp(router logits)^2; 0 = off."""
    force_load_balance: bool = False
    """In training, send slot k of the i-th token (in this rank's order) to expert `(i * top_k + k) % num_experts`,
    whatever the router scores, weighted by the router's scores of those experts: every expert gets the same tokens
    (throughput measurements free of an untrained router's imbalance). The model does not learn to route; eval
    (validation, generation) routes by the router."""

    def __post_init__(self) -> None:
        for name in ("aux_loss_coeff", "router_z_loss_coeff"):
            if not getattr(self, name) >= 0:
                raise ModelConfigError(f"MoEArgs.{name}={getattr(self, name)} must be >= 0 (0 = off)")
        if self.load_balance_coeff is not None and not self.load_balance_coeff > 0:
            raise ModelConfigError(
                f"MoEArgs.load_balance_coeff={self.load_balance_coeff} must be > 0, or None for no expert bias"
            )
        if self.score_func not in SCORE_FUNCS:
            raise ModelConfigError(f"MoEArgs.score_func '{self.score_func}' is unknown; choose 'softmax' or 'sigmoid'")
        if not 1 <= self.top_k <= self.num_experts:
            raise ModelConfigError(f"MoEArgs.top_k={self.top_k} must be in 1..num_experts={self.num_experts}")
        if self.n_groups < 1 or self.num_experts % self.n_groups:
            raise ModelConfigError(f"MoEArgs.n_groups={self.n_groups} must divide num_experts={self.num_experts}")
        if not 1 <= self.topk_groups <= self.n_groups:
            raise ModelConfigError(f"MoEArgs.topk_groups={self.topk_groups} must be in 1..n_groups={self.n_groups}")
        if self.top_k > self.topk_groups * (self.num_experts // self.n_groups):
            raise ModelConfigError(
                f"MoEArgs.top_k={self.top_k} exceeds the experts of topk_groups={self.topk_groups} groups; "
                "raise topk_groups or lower top_k"
            )

    @property
    def shared_hidden_dim(self) -> int:
        """Hidden size of the shared experts' SwiGLU (0 without shared experts)."""
        return self.num_shared_experts * self.hidden_dim


def local_tensor(weight: torch.Tensor) -> torch.Tensor:
    """This rank's part of a parameter: a split parameter (a DTensor, e.g. under expert parallel)
    gives its local shard, a plain tensor itself."""
    return weight.to_local() if hasattr(weight, "to_local") else weight


def grouped_mm_supported(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `torch._grouped_mm` runs `x @ weight[e].T` per group here: CUDA compute capability
    9.0 or newer (Hopper), and inputs it takes (`grouped_mm_fits`)."""
    return x.is_cuda and torch.cuda.get_device_capability(x.device) >= (9, 0) and grouped_mm_fits(x, weight)


def grouped_mm_fits(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether Hopper's `torch._grouped_mm` takes these inputs, whatever their device: the op exists in this torch,
    bf16, and 16-byte aligned rows (dims multiple of 8)."""
    aligned = x.shape[-1] % 8 == 0 and weight.shape[1] % 8 == 0
    return hasattr(torch, "_grouped_mm") and x.dtype == weight.dtype == torch.bfloat16 and aligned


def grouped_mm(x: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """Per-expert matmul of rows grouped by expert: rows of group e times `weight[e].T`.

    Args:
        x: `(rows, in)`, the rows of expert 0 first, then expert 1, ...
        weight: `(experts, out, in)`.
        counts: `(experts,)` int64 rows per expert, summing to `rows`.

    Returns:
        `(rows, out)`. Where `grouped_mm_supported`, one `torch._grouped_mm`; elsewhere, under
        `torch.compile` with no more rows than experts, `gathered_mm`; else one matmul per expert,
        with the counts read on the host. Each is exact: a row meets only its own expert's weight.
    """
    if grouped_mm_supported(x, weight):
        offsets = torch.cumsum(counts, dim=0, dtype=torch.int32)
        return torch._grouped_mm(x, weight.transpose(-2, -1), offs=offsets)
    if x.shape[0] <= weight.shape[0] and torch.compiler.is_compiling():
        return gathered_mm(x, weight, counts)
    sizes = counts.tolist()
    # Experts without rows are skipped (a zero-row matmul still costs a dispatch: at decoding's 8 rows of 128
    # experts of 128 x 256, 638 -> 170 us on the 2-core AVX2-only AMD EPYC); with no rows at all one zero-row
    # matmul keeps `weight` in the graph, so that every rank has its gradient (zeros) for FSDP to reduce.
    pieces = [rows @ w.T for rows, w, n in zip(x.split(sizes), weight, sizes, strict=True) if n]  # (count_e, out)
    return torch.cat(pieces) if pieces else x[:0] @ weight[0].T


def gathered_mm(x: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """`grouped_mm` for few rows (decoding): each row's expert weight gathered for it, one batched matmul.

    Nothing is read on the host and every shape is known from `x` and `weight`, so `torch.compile`
    captures it in one graph (and CUDA graphs replay it). `grouped_mm` takes it only when compiling:
    Inductor fuses the gather into the matmul (on CPU always; on CUDA when coordinate-descent tuning
    turns the one-column `bmm` into a reduction, as `titan generate` does there by default, else
    cuBLAS reads a gathered copy), while eager copies one weight per row first. On the
    2-core AVX2-only AMD EPYC (torch 2.15, fp32) at Qwen3-30B-A3B's expert shape (8 rows of 128
    experts, 768 x 2048): Inductor 1.9 ms, the eager per-expert loop 3.3 ms, this eager 39 ms.

    Args:
        x: `(rows, in)`, grouped by expert as for `grouped_mm`.
        weight: `(experts, out, in)`.
        counts: `(experts,)` int64 rows per expert, summing to `rows`.

    Returns:
        `(rows, out)`.
    """
    starts = torch.arange(x.shape[0], device=counts.device)
    expert = torch.searchsorted(counts.cumsum(0), starts, right=True)  # (rows,) each row's expert
    return torch.bmm(weight[expert], x.unsqueeze(-1)).squeeze(-1)


class GroupedExperts(nn.Module):
    """`num_experts` SwiGLU experts whose weights are stacked on dim 0.

    Expert parallel splits dim 0 over ranks (a rank's `w1` holds its experts only) and
    wraps `forward` so that rows arrive grouped by this rank's experts.
    """

    def __init__(self, dim: int, hidden_dim: int, num_experts: int):
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))  # gate projection
        self.w2 = nn.Parameter(torch.empty(num_experts, dim, hidden_dim))  # down projection
        self.w3 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))  # up projection

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Args:
            x: `(rows, dim)` token slots grouped by expert.
            counts: `(experts,)` int64 rows per expert (this rank's experts).

        Returns:
            `(rows, dim)`: each row through its expert's SwiGLU.
        """
        w1, w2, w3 = (local_tensor(w) for w in (self.w1, self.w2, self.w3))
        hidden = F.silu(grouped_mm(x, w1, counts)) * grouped_mm(x, w3, counts)  # (rows, hidden)
        return grouped_mm(hidden, w2, counts)

    def init_weights(self, out_std: float) -> None:
        """Args:
        out_std: std of `w2` and `w3`; `w1` uses 0.02 (as a dense FeedForward)."""
        init_trunc_normal_(self.w1, 0.02)
        for weight in (self.w2, self.w3):
            init_trunc_normal_(weight, out_std)


class TokenChoiceTopKRouter(nn.Module):
    """Scores every expert for every token and picks each token's top k."""

    def __init__(self, dim: int, args: MoEArgs):
        super().__init__()
        self.args = args
        self.gate = nn.Linear(dim, args.num_experts, bias=False)

    def forward(
        self, x: torch.Tensor, expert_bias: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Args:
            x: `(tokens, dim)`.
            expert_bias: `(experts,)` added to the scores for the choice only, or None.

        Returns:
            weights `(tokens, top_k)` fp32, chosen experts `(tokens, top_k)` int64, the
            scores of all experts `(tokens, experts)` fp32, and in training with a router z-loss
            (`router_z_loss_coeff`) the mean over tokens of `logsumexp(logits)^2` (0-dim fp32, unweighted),
            else None.
        """
        a = self.args
        logits = self.gate(x).float()  # (tokens, experts)
        z = logits.logsumexp(dim=-1).square().mean() if a.router_z_loss_coeff > 0 and self.training else None
        scores = logits.softmax(dim=-1) if a.score_func == "softmax" else logits.sigmoid()
        if a.force_load_balance and self.training:
            return *self._weights(scores, balanced_choice(x.shape[0], a.top_k, a.num_experts, x.device)), scores, z
        choice = scores + expert_bias if expert_bias is not None else scores
        if a.n_groups > 1:
            grouped = choice.view(x.shape[0], a.n_groups, -1)  # (tokens, groups, experts per group)
            group_scores = grouped.topk(min(2, grouped.shape[-1]), dim=-1).values.sum(dim=-1)  # (tokens, groups)
            kept = group_scores.topk(a.topk_groups, dim=-1).indices
            mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, kept, True)
            choice = grouped.masked_fill(~mask.unsqueeze(-1), float("-inf")).flatten(1)
        return *self._weights(scores, choice.topk(a.top_k, dim=-1).indices), scores, z  # chosen: (tokens, top_k)

    def _weights(self, scores: torch.Tensor, chosen: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(the routing weights of the `chosen` experts `(tokens, top_k)`: their scores, renormalised if
        `route_norm`, times `route_scale`; `chosen`)."""
        weights = scores.gather(1, chosen)
        if self.args.route_norm:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * self.args.route_scale, chosen

    def init_weights(self) -> None:
        init_trunc_normal_(self.gate.weight, 0.02)


def balanced_choice(tokens: int, top_k: int, num_experts: int, device: torch.device) -> torch.Tensor:
    """Round-robin routing (`MoEArgs.force_load_balance`): slot k of token i goes to expert
    `(i * top_k + k) % num_experts`, so every expert gets `tokens * top_k / num_experts` slots (to within one),
    and a token's k experts differ while `top_k <= num_experts`.

    Args:
        tokens: tokens routed on this rank.
        top_k: experts per token.
        num_experts: routed experts.
        device: where the indices live.

    Returns:
        `(tokens, top_k)` int64 expert indices.
    """
    return (torch.arange(tokens * top_k, device=device) % num_experts).view(tokens, top_k)


def _recomputing() -> bool:
    """Whether this forward runs inside a backward: activation checkpointing's recompute, where the autograd
    engine has a graph task. Never under `no_grad` (decoding), nor while torch.compile traces (the engine's
    graph task is not traceable; Titan compiles the layer's children, not the layer, in training)."""
    if not torch.is_grad_enabled() or torch.compiler.is_compiling():
        return False
    return torch._C._current_graph_task_id() != -1


class _AddAuxLoss(torch.autograd.Function):
    """Returns `x` unchanged; backward also gives `aux_loss` the gradient 1, as if it had been
    added to the training loss (the loss itself stays the language-model loss)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, aux_loss: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(aux_loss)
        return x

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        (aux_loss,) = ctx.saved_tensors
        return grad, torch.ones_like(aux_loss)


def sequence_balance_loss(
    scores: torch.Tensor, chosen: torch.Tensor, batch: int, top_k: int, group: ProcessGroup | None = None
) -> torch.Tensor:
    """DeepSeek-V3's sequence-wise balance loss, averaged over sequences: `sum_e f_e * P_e`, where
    `f_e` is the fraction of the sequence's token slots sent to expert e times `experts / top_k`
    (1 everywhere at perfect balance) and `P_e` the mean normalised score of e.

    With `group` (context parallel: each of its ranks holds an equal part of every sequence), `f_e`
    counts the slots of the whole sequence, summed over the group, while `P_e` stays the mean over this
    rank's tokens. The loss is linear in `P_e`, so the mean of the ranks' losses is the loss of the
    whole sequences, and so are the gradients data parallel averages over those ranks.

    Args:
        scores: `(tokens, experts)` router scores, tokens sequence-major (`batch` sequences).
        chosen: `(tokens, top_k)` chosen experts.
        batch: sequences in `scores`.
        top_k: experts per token.
        group: the ranks holding the other parts of these sequences; None = the sequences are whole here.
    """
    experts = scores.shape[-1]
    per_seq = scores.view(batch, -1, experts)  # (batch, local seqlen, experts)
    probs = per_seq / per_seq.sum(dim=-1, keepdim=True)
    counts = torch.zeros(batch, experts, device=scores.device).scatter_add_(
        1, chosen.view(batch, -1), torch.ones(chosen.numel() // batch, device=scores.device).expand(batch, -1)
    )  # (batch, experts)
    seqlen = per_seq.shape[1]
    if group is not None:
        import torch.distributed as dist
        import torch.distributed._functional_collectives as funcol

        counts = funcol.all_reduce(counts, "sum", group)  # the whole sequences' slots (carry no gradient)
        seqlen *= dist.get_world_size(group)
    load = counts * experts / (top_k * seqlen)
    return (load * probs.mean(dim=1)).sum(dim=-1).mean()


class MoE(nn.Module):
    """Routed experts plus optional shared experts, in place of a block's FeedForward.

    Buffers: `expert_bias` `(experts,)` (persistent: checkpoints keep it);
    `tokens_per_expert` `(experts,)`, the token slots each expert received since the trainer
    last read it, and `aux_losses` `(2,)`, the weighted balance loss and router z-loss of the training
    forwards since then, each times `aux_loss_scale` (so over one step, the step's mean); neither persistent.
    Only training forwards count: a forward under `no_grad` adds to neither, nor does an activation-checkpointing
    recompute (a forward run again inside the backward).

    `aux_loss_scale` multiplies the auxiliary losses' gradient (the balance loss and the router z-loss): the
    trainer's step (`titan_core.step_loss.StepLoss`) sets it to one over what it divides the language-model
    loss by (gradient-accumulation steps x pipeline microbatches). `sequence_group`, set by context
    parallel, is the ranks holding the rest of this rank's sequences: the balance loss counts the
    token slots of whole sequences over them. `grad_share`, set by tensor parallel (`TPStyle.MOE_INPUT`,
    which sums the TP ranks' partial gradients of the layer's input and router), is the share of the
    auxiliary losses' gradient each rank adds: 1 / tp. The auxiliary losses enter the backward
    here, inside the block, rather than being returned: under FSDP the router's weights are gathered
    only while the block's own backward runs.
    """

    expert_bias: torch.Tensor
    tokens_per_expert: torch.Tensor
    aux_losses: torch.Tensor

    def __init__(self, dim: int, args: MoEArgs):
        super().__init__()
        self.args = args
        self.router = TokenChoiceTopKRouter(dim, args)
        self.experts = GroupedExperts(dim, args.hidden_dim, args.num_experts)
        self.shared_experts = FeedForward(dim, args.shared_hidden_dim) if args.num_shared_experts else None
        self.register_buffer("expert_bias", torch.zeros(args.num_experts), persistent=True)
        self.register_buffer("tokens_per_expert", torch.zeros(args.num_experts), persistent=False)
        self.register_buffer("aux_losses", torch.zeros(2), persistent=False)  # balance loss, router z-loss
        self.aux_loss_scale: float = 1.0
        self.grad_share: float = 1.0  # set by tensor parallel: its ranks' gradients are summed
        self.sequence_group: ProcessGroup | None = None  # set by context parallel (`sequence_balance_loss`)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Args:
        x: `(bs, seqlen, dim)`; returns the same shape."""
        bs, seqlen, dim = x.shape
        tokens = x.reshape(-1, dim)  # (bs * seqlen, dim)
        k = self.args.top_k
        bias = self.expert_bias if self.args.load_balance_coeff is not None else None
        # (tokens, k), (tokens, k), (tokens, experts), 0-dim or None
        weights, chosen, scores, z = self.router(tokens, bias)
        slots = chosen.flatten()
        counts = slots.new_zeros(self.args.num_experts).scatter_add_(
            0, slots, torch.ones_like(slots)
        )  # (experts,) int64
        # A training forward's first run: not under no_grad (validation, decoding, the shape inference torch 2.11's
        # pipeline stages run on zeros at their first step), not activation checkpointing's recompute.
        first_run = torch.is_grad_enabled() and not _recomputing()
        if first_run:
            with torch.no_grad():
                self.tokens_per_expert += counts
        order = slots.argsort(stable=True)  # token slots grouped by expert
        routed = self.experts(tokens[order // k], counts)  # (tokens * k, dim), in `order`
        routed = routed[order.argsort()].view(-1, k, dim)  # back to (tokens, k, dim)
        out = (routed * weights.unsqueeze(-1).to(routed.dtype)).sum(dim=1)  # (tokens, dim)
        balance = None
        if self.args.aux_loss_coeff > 0 and self.training:
            balance = self.args.aux_loss_coeff * sequence_balance_loss(scores, chosen, bs, k, self.sequence_group)
        if z is not None:
            z = self.args.router_z_loss_coeff * z
        terms = [t for t in (balance, z) if t is not None]
        if terms:
            if first_run:
                with torch.no_grad():
                    zero = torch.zeros((), device=out.device)
                    both = torch.stack([t.detach() if t is not None else zero for t in (balance, z)])
                    self.aux_losses += self.aux_loss_scale * both
            aux = terms[0] if len(terms) == 1 else terms[0] + terms[1]
            out = _AddAuxLoss.apply(out, self.grad_share * self.aux_loss_scale * aux)
        if self.shared_experts is not None:
            out = out + self.shared_experts(tokens)
        return out.view(bs, seqlen, dim)

    def init_weights(self, out_std: float, buffer_device: torch.device | None = None) -> None:
        """Router 0.02, experts and shared experts as a FeedForward (`w2`, `w3` at `out_std`);
        `expert_bias`, `tokens_per_expert` and `aux_losses` to zeros.

        Args:
            out_std: std of the output-side weights (depth-scaled by the block).
            buffer_device: where the buffers live; None keeps their device.
        """
        self.router.init_weights()
        self.experts.init_weights(out_std)
        if self.shared_experts is not None:
            self.shared_experts.init_weights(out_std)
        device = buffer_device if buffer_device is not None else self.expert_bias.device
        self.expert_bias = torch.zeros(self.args.num_experts, device=device)
        self.tokens_per_expert = torch.zeros(self.args.num_experts, device=device)
        self.aux_losses = torch.zeros(2, device=device)
