"""The Mixture-of-Experts layer against a token-by-token reference, and its routing rules by hand."""

from __future__ import annotations

import dataclasses
from unittest import mock

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.utils import counters
from titan_models.errors import ModelConfigError
from titan_models.moe import MoE, MoEArgs, gathered_mm, grouped_mm, sequence_balance_loss

ARGS = MoEArgs(num_experts=6, top_k=2, hidden_dim=12, num_shared_experts=1, score_func="sigmoid", route_norm=True,
               route_scale=2.5, n_groups=3, topk_groups=2, load_balance_coeff=1e-3)


def _built(args: MoEArgs, dim: int = 16, seed: int = 0) -> MoE:
    torch.manual_seed(seed)
    moe = MoE(dim, args)
    moe.init_weights(out_std=0.05)
    with torch.no_grad():
        moe.expert_bias.copy_(torch.randn(args.num_experts) * 0.1)
    return moe


def _reference(moe: MoE, x: torch.Tensor) -> torch.Tensor:
    """Each token on its own: score, keep groups, pick experts, sum their SwiGLUs (plain Python loops)."""
    a = moe.args
    out = torch.zeros_like(x)
    per_group = a.num_experts // a.n_groups
    for t in range(x.shape[0]):
        logits = x[t] @ moe.router.gate.weight.T
        scores = logits.softmax(-1) if a.score_func == "softmax" else logits.sigmoid()
        biased = (scores + moe.expert_bias).tolist()
        groups = sorted(range(a.n_groups), key=lambda g: -sum(sorted(biased[g * per_group:(g + 1) * per_group])[-2:]))
        allowed = [e for g in groups[: a.topk_groups] for e in range(g * per_group, (g + 1) * per_group)]
        chosen = sorted(allowed, key=lambda e: -biased[e])[: a.top_k]
        weights = scores[chosen] / (scores[chosen].sum() if a.route_norm else 1) * a.route_scale
        for w, e in zip(weights, chosen):
            ex = moe.experts
            h = F.silu(x[t] @ ex.w1[e].T) * (x[t] @ ex.w3[e].T)
            out[t] += w * (h @ ex.w2[e].T)
        if moe.shared_experts is not None:
            out[t] += moe.shared_experts(x[t])
    return out


@pytest.mark.parametrize("score_func", ["sigmoid", "softmax"])
def test_moe_matches_a_token_by_token_reference(score_func):
    moe = _built(dataclasses.replace(ARGS, score_func=score_func))
    x = torch.randn(2, 9, 16)
    with torch.no_grad():
        out = moe(x)
        ref = _reference(moe, x.view(-1, 16)).view(2, 9, 16)
    torch.testing.assert_close(out, ref, atol=1e-6, rtol=1e-5)
    assert moe.tokens_per_expert.sum().item() == 0  # a forward under no_grad is not training load
    moe(x)
    assert moe.tokens_per_expert.sum().item() == 2 * 9 * ARGS.top_k  # dropless: every slot counted


def test_expert_bias_selects_but_does_not_weigh():
    moe = _built(dataclasses.replace(ARGS, n_groups=1, topk_groups=1, num_shared_experts=0, route_norm=False, route_scale=1.0))
    x = torch.randn(5, 16)
    with torch.no_grad():
        moe.expert_bias.zero_()
        moe.expert_bias[3] = 100.0  # expert 3 wins every choice...
        weights, chosen, scores, _ = moe.router(x, moe.expert_bias)
    assert (chosen == 3).any(dim=-1).all()
    torch.testing.assert_close(weights, scores.gather(1, chosen))  # ...but weighs by its unbiased score


def test_forced_balance_routes_round_robin_in_training_only():
    """`force_load_balance`: slot k of token i goes to expert (2i + k) % 6 whatever the scores and the bias, weighted
    by the router's (renormalised, scaled) scores of those experts; every expert gets 36 / 6 slots; the router still
    gets a gradient through the weights; in eval mode the router routes."""
    moe = _built(dataclasses.replace(ARGS, force_load_balance=True))
    x = torch.randn(2, 9, 16)
    out = moe(x)
    assert moe.tokens_per_expert.tolist() == [6.0] * 6
    tokens, ref = x.view(-1, 16), torch.zeros(18, 16)
    for t in range(18):
        chosen = [(2 * t) % 6, (2 * t + 1) % 6]
        scores = (tokens[t] @ moe.router.gate.weight.T).sigmoid()[chosen]
        for w, e in zip(scores / scores.sum() * 2.5, chosen):
            ex = moe.experts
            out_e = (F.silu(tokens[t] @ ex.w1[e].T) * (tokens[t] @ ex.w3[e].T)) @ ex.w2[e].T
            ref[t] += w * out_e
        ref[t] += moe.shared_experts(tokens[t])
    torch.testing.assert_close(out, ref.view(2, 9, 16), atol=1e-6, rtol=1e-5)
    out.square().sum().backward()
    assert moe.router.gate.weight.grad.abs().sum() > 0
    moe.eval()
    with torch.no_grad():
        torch.testing.assert_close(moe(x), _reference(moe, tokens).view(2, 9, 16), atol=1e-6, rtol=1e-5)


def test_group_limited_routing_by_hand():
    """Groups {0,1}, {2,3}, {4,5}; group score = sum of its 2 best. Scores 0.9 0.1 | 0.6 0.55 | 0.8 0.0:
    group sums 1.0, 1.15, 0.8 -> groups 1 and 0 are kept; the top 2 of {0.9, 0.1, 0.6, 0.55} are experts
    0 and 2; expert 4 (0.8, the second best overall) is excluded with its group."""
    args = MoEArgs(num_experts=6, top_k=2, hidden_dim=4, score_func="sigmoid", n_groups=3, topk_groups=2)
    moe = MoE(2, args)
    probs = torch.tensor([[0.9, 0.1, 0.6, 0.55, 0.8, 0.0001]])
    with torch.no_grad():
        moe.router.gate.weight.copy_(torch.zeros(6, 2))
    # a bias equal to the target scores minus sigmoid(0) = 0.5 makes the choice scores exactly `probs`
    _, chosen, _, _ = moe.router(torch.zeros(1, 2), probs[0] - 0.5)
    assert sorted(chosen[0].tolist()) == [0, 2]


def test_grouped_mm_fallback_is_exact_per_expert():
    torch.manual_seed(0)
    x, w = torch.randn(10, 8), torch.randn(3, 5, 8)
    counts = torch.tensor([4, 0, 6])
    out = grouped_mm(x, w, counts)
    torch.testing.assert_close(out[:4], x[:4] @ w[0].T, atol=0, rtol=0)
    torch.testing.assert_close(out[4:], x[4:] @ w[2].T, atol=0, rtol=0)
    # a rank that receives no rows (expert parallel) still has a gradient, zeros, for FSDP to reduce
    weight = w.clone().requires_grad_()
    grouped_mm(x[:0], weight, torch.zeros(3, dtype=torch.long)).sum().backward()
    assert weight.grad is not None and not weight.grad.any()
    if hasattr(torch, "_grouped_mm"):  # torch's kernel (CPU in recent torch) agrees with the fallback
        try:
            fused = torch._grouped_mm(x, w.transpose(-2, -1), offs=torch.cumsum(counts, 0, dtype=torch.int32))
        except RuntimeError:
            return
        torch.testing.assert_close(fused, out, atol=1e-5, rtol=1e-5)


def test_few_rows_gather_their_experts_without_reading_counts_on_the_host():
    """Compiled with no more rows than experts (decoding), `grouped_mm` takes `gathered_mm`: each row times
    its own expert's weight, the gradients too, with no host read of the counts (so Dynamo traces it whole)."""
    torch.manual_seed(0)
    x, w = torch.randn(3, 8, requires_grad=True), torch.randn(4, 5, 8, requires_grad=True)
    counts = torch.tensor([1, 0, 0, 2])  # rows 0 | 1, 2 on experts 0 and 3
    expected = torch.cat([x[:1] @ w[0].T, x[1:] @ w[3].T])
    with mock.patch.object(torch.Tensor, "tolist", side_effect=AssertionError("host read")):
        out = gathered_mm(x, w, counts)
    torch.testing.assert_close(out, expected, atol=1e-6, rtol=0)
    grad = torch.randn(3, 5)
    got = torch.autograd.grad(out, (x, w), grad)
    want = torch.autograd.grad(expected, (x, w), grad)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0)
    assert not got[1][1:3].any()  # experts without rows get no gradient
    torch._dynamo.reset()
    counters.clear()
    traced = torch.compile(grouped_mm, backend="aot_eager")  # not fullgraph: that would capture the host read
    torch.testing.assert_close(traced(x, w, counts), expected, atol=1e-6, rtol=0)
    assert not counters["graph_break"] and counters["stats"]["unique_graphs"] == 1


def test_sequence_balance_loss_is_one_at_perfect_balance_and_more_when_skewed():
    # 4 experts, top 1, 4 tokens per sequence each on a different expert, uniform scores: f = 1, P = 1/4 -> 1.
    scores = torch.full((8, 4), 0.5)
    chosen = torch.tensor([0, 1, 2, 3, 3, 2, 1, 0]).view(8, 1)
    assert sequence_balance_loss(scores, chosen, batch=2, top_k=1).item() == pytest.approx(1.0)
    # All 4 tokens of both sequences on expert 0, which also has the highest normalised score 0.4:
    # f = (4, 0, 0, 0), P_0 = 0.4 -> 1.6.
    skewed = torch.tensor([[0.4, 0.2, 0.2, 0.2]]).expand(8, 4)
    assert sequence_balance_loss(skewed, torch.zeros(8, 1, dtype=torch.long), batch=2, top_k=1).item() == pytest.approx(1.6)


def test_aux_loss_reaches_the_router_only_in_training():
    args = dataclasses.replace(ARGS, aux_loss_coeff=0.1)
    grads = []
    for coeff in (0.0, 0.1):
        moe = _built(dataclasses.replace(args, aux_loss_coeff=coeff))
        moe(torch.ones(2, 5, 16).normal_(generator=torch.Generator().manual_seed(1))).sum().backward()
        grads.append(moe.router.gate.weight.grad.clone())
    assert not torch.equal(grads[0], grads[1])
    # the weighted balance loss is recorded for the logs (`aux_losses[0]`), as the router scores it
    x = torch.ones(2, 5, 16).normal_(generator=torch.Generator().manual_seed(1))
    _, chosen, scores, _ = moe.router(x.view(-1, 16), moe.expert_bias)
    expected = 0.1 * sequence_balance_loss(scores, chosen, batch=2, top_k=args.top_k)
    assert moe.aux_losses[0].item() == pytest.approx(expected.item(), rel=1e-6) and moe.aux_losses[1] == 0
    moe = _built(args).eval()
    x = torch.randn(1, 4, 16)
    with torch.no_grad():
        torch.testing.assert_close(moe(x), _built(dataclasses.replace(args, aux_loss_coeff=0.0)).eval()(x))


def _router_z(moe: MoE, x: torch.Tensor) -> torch.Tensor:
    """ST-MoE's router z-loss written out in float64: mean over tokens of log(sum_e exp(logit_e))^2."""
    logits = x.reshape(-1, x.shape[-1]).double() @ moe.router.gate.weight.double().T
    return torch.log(torch.exp(logits).sum(dim=-1)).pow(2).mean()


@pytest.mark.parametrize("score_func", ["sigmoid", "softmax"])
def test_router_z_loss_adds_its_gradient_and_records_the_steps_mean(score_func):
    """Two micro-batches (`aux_loss_scale` 1/2): the router's gradient is the one without the z-loss plus
    c/2 times the written-out z-loss's of each, every other gradient unchanged; the buffer holds c/2 x (z1 + z2)."""
    c = 0.05
    base = dataclasses.replace(ARGS, score_func=score_func)
    xs = [torch.randn(2, 5, 16, generator=torch.Generator().manual_seed(i)) for i in (1, 2)]
    grads = {}
    for coeff in (0.0, c):
        moe = _built(dataclasses.replace(base, router_z_loss_coeff=coeff))
        moe.aux_loss_scale = 0.5
        for x in xs:
            moe(x).sum().backward()
        grads[coeff] = {name: p.grad.clone() for name, p in moe.named_parameters()}
    z = sum(_router_z(moe, x) for x in xs)
    weight = moe.router.gate.weight.detach().double().requires_grad_()
    expected_z = sum(torch.log(torch.exp(x.reshape(-1, 16).double() @ weight.T).sum(-1)).pow(2).mean() for x in xs)
    (0.5 * c * expected_z).backward()
    torch.testing.assert_close(grads[c].pop("router.gate.weight"),
                               grads[0.0].pop("router.gate.weight") + weight.grad.float(), rtol=1e-5, atol=1e-7)
    for name, grad in grads[c].items():
        torch.testing.assert_close(grad, grads[0.0][name], rtol=0, atol=0, msg=name)
    assert moe.aux_losses[1].item() == pytest.approx(0.5 * c * z.item(), rel=1e-6) and moe.aux_losses[0] == 0
    assert z.item() > 1.0  # log(6 experts)^2 at least: a real term, not a zero that matches anything


def test_router_z_loss_is_training_only():
    moe = _built(dataclasses.replace(ARGS, router_z_loss_coeff=0.1)).eval()
    assert moe.router(torch.randn(4, 16), None)[3] is None
    x = torch.randn(1, 4, 16)
    with torch.no_grad():
        out = moe(x)
    assert moe.aux_losses[1].item() == 0.0
    torch.testing.assert_close(out, _built(ARGS).eval()(x), rtol=0, atol=0)


def test_activation_checkpointing_counts_each_token_once():
    """A full-AC recompute runs the layer's forward again inside the backward: its tokens and z-loss were counted
    by the first run (they were counted twice until 2026-12-06), and the gradients equal the plain run's."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    args = dataclasses.replace(ARGS, router_z_loss_coeff=0.01, aux_loss_coeff=0.01)
    x = torch.randn(2, 7, 16)
    runs = []
    for wrap in (False, True):
        moe = _built(args)
        (checkpoint_wrapper(moe) if wrap else moe)(x).sum().backward()
        runs.append((moe.tokens_per_expert.clone(), moe.aux_losses.clone(),
                     {name: p.grad.clone() for name, p in moe.named_parameters()}))
    (counts, z, grads), (ac_counts, ac_z, ac_grads) = runs
    assert counts.sum().item() == 2 * 7 * ARGS.top_k and torch.equal(ac_counts, counts)
    assert (z > 0).all() and torch.equal(ac_z, z)  # the balance loss and the router z-loss, each once
    for name, grad in grads.items():
        torch.testing.assert_close(ac_grads[name], grad, rtol=1e-6, atol=1e-7, msg=name)


@pytest.mark.parametrize("bad, key", [
    (dict(top_k=7), "top_k"), (dict(n_groups=4), "n_groups"), (dict(topk_groups=4), "topk_groups"),
    (dict(score_func="relu"), "score_func"), (dict(top_k=5, topk_groups=2), "top_k"),
    (dict(router_z_loss_coeff=-1e-3), "router_z_loss_coeff"), (dict(aux_loss_coeff=-0.1), "aux_loss_coeff"),
    (dict(load_balance_coeff=0.0), "load_balance_coeff"),
])
def test_bad_moe_args_name_the_field(bad, key):
    with pytest.raises(ModelConfigError, match=key):
        dataclasses.replace(ARGS, **bad)


