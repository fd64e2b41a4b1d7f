"""The analytic tier's eager figures, measured on fake tensors (`titan_core.memory.eager_saved`): what a block
keeps against what autograd really saves on real CPU tensors; a block's and the loss's backward peaks (walked
node by node on fake tensors) against autograd's own engine on real CPU tensors; TP / CP layouts and both
device types measured; and the fused loss's fit."""

from __future__ import annotations

import pytest
import torch

from titan_core.memory.eager_saved import measure_eager
from titan_core.memory.activations import ActivationLayout
from titan_core.memory.fake_run import LiveBytes
from titan_core.step_loss import cross_entropy_loss
from titan_models import get_model_args, get_model_spec
from titan_run import autograd_saved_bytes

SEQ = 64
BLOCKS = [  # (model.name, flavor, a block of each kind)
    ("llama3", "debugmodel", 0),
    ("qwen3_moe", "debugmodel_moe", 0),
    ("deepseek_v3", "debugmodel", 0),  # dense
    ("deepseek_v3", "debugmodel", 1),  # Mixture-of-Experts
]


def _built(name: str, flavor: str):
    """(args, the model built for real, its figures measured on fake tensors: CPU, fp32, SEQ tokens)."""
    spec, args = get_model_spec(name), get_model_args(name, flavor)
    torch.manual_seed(0)
    model = spec.build(args)
    model.init_weights()
    return args, model, measure_eager(spec, args, ActivationLayout(compute_bytes=4, seq_len=SEQ, device_type="cpu"))


@pytest.mark.parametrize("name, flavor, layer", BLOCKS)
def test_a_measured_block_keeps_what_autograd_saves_for_real(name, flavor, layer):
    args, model, eager = _built(name, flavor)
    for bs in (1, 3):  # per token, and per call (RoPE's table slices), spread over the batch
        act = eager.for_tokens(bs * SEQ)
        expected = act.per_block[layer].block if act.per_block else act.block
        x = torch.randn(bs, SEQ, args.dim, requires_grad=True)
        real = autograd_saved_bytes(model, lambda x=x: model.layers[str(layer)](x, model.rope_cache))
        # to the byte but for DeepSeek-V3's dense block, whose CPU math-path attention keeps a reshape as a view of
        # one sequence and as a copy of several (1.2% at 3 sequences)
        assert real / (bs * SEQ) == pytest.approx(expected, rel=0.015)


def _real_peak(model: torch.nn.Module, exclude: list[torch.Tensor], forward) -> int:
    """The peak of the backward of `forward()`'s output beyond what the forward kept, on real tensors through
    autograd's engine, counted by storages alive; each parameter's gradient dropped once accumulated (the model
    states count them)."""
    for p in model.parameters():
        p.register_post_accumulate_grad_hook(lambda p: setattr(p, "grad", None))
    live = LiveBytes([*model.parameters(), *model.buffers(), *exclude])
    with live:
        out = forward()
        live.drop(out)
        kept = live.now()
        grad = torch.ones_like(out)
        live.watch()
        out.backward(grad)
    return live.peak - kept


@pytest.mark.parametrize("name, flavor, layer", BLOCKS)
def test_a_blocks_backward_peaks_as_autograds_engine_peaks_for_real(name, flavor, layer):
    """`block_backward` (the node-by-node walk on fake tensors) against autograd's engine on real CPU tensors:
    the peak beyond what the block kept, at 1 and 3 sequences."""
    args, model, eager = _built(name, flavor)
    for bs in (1, 3):
        act = eager.for_tokens(bs * SEQ)
        expected = (act.per_block[layer] if act.per_block else act).block_backward
        x = torch.randn(bs, SEQ, args.dim, requires_grad=True)
        block = model.layers[str(layer)]
        peak = _real_peak(model, [model.rope_cache], lambda x=x: block(x.clone(), model.rope_cache))
        assert peak / (bs * SEQ) == pytest.approx(expected, rel=0.02), (bs, peak / (bs * SEQ), expected)


def test_the_plain_losss_peak_and_gradient_are_autograds_for_real():
    spec, args = get_model_spec("llama3"), get_model_args("llama3", "debugmodel")
    torch.manual_seed(0)
    model = spec.build(args)
    act = measure_eager(spec, args, ActivationLayout(compute_bytes=4, seq_len=SEQ, device_type="cpu")).act
    bs = 2
    logits = torch.randn(bs, SEQ, args.vocab_size, requires_grad=True)
    labels = torch.randint(0, args.vocab_size, (bs, SEQ))
    live = LiveBytes([labels, logits])
    with live:
        made = logits.clone()
        live.watch()
        loss = cross_entropy_loss(made, labels)
        del made
        kept = live.now()
        loss.backward()
        del loss
        left = live.now()
    tokens = bs * SEQ
    assert act.logits_saved == 4 * args.vocab_size  # the fp32 log-softmax
    assert kept / tokens == pytest.approx(act.logits_saved, rel=1e-3)  # and the loss's scalars
    assert (live.peak - kept) / tokens == pytest.approx(act.logits, rel=0.01)
    assert left / tokens == act.logits_grad == 4 * args.vocab_size  # the logits' gradient, handed on
    del model


LAYOUTS = [  # (tp, cp, cp_method, rotate)
    (1, 1, "ring", "allgather"),
    (2, 1, "ring", "allgather"),
    (1, 2, "ulysses", "allgather"),
    (2, 2, "ring", "allgather"),
]


@pytest.mark.parametrize("device, b", [("cpu", 4), ("cuda", 2)])
@pytest.mark.parametrize("name, flavor", [("llama3", "debugmodel"), ("qwen3_moe", "debugmodel_moe")])
def test_every_layout_is_measured_and_tensor_parallel_splits_what_a_rank_keeps(name, flavor, device, b):
    """The measurement runs the trainer's own TP / CP / AC code over a fake process group. Under TP 2 a rank
    keeps about half of a dense block's activations and of its backward's (sequence parallel splits what lies
    between the blocks too), less of a Mixture-of-Experts block's (TP does not split the routed experts), and
    half of the loss's."""
    spec, args = get_model_spec(name), get_model_args(name, flavor)
    figures = {}
    seq = 1024
    for tp, cp, method, rotate in LAYOUTS:
        layout = ActivationLayout(compute_bytes=b, tp=tp, cp=cp, cp_method=method, cp_rotate_method=rotate,
                                  seq_len=seq, device_type=device)
        act = figures[tp, cp] = measure_eager(spec, args, layout).for_tokens(2 * seq // cp)
        assert all(v > 0 for v in (act.block, act.block_op, act.block_input, act.block_backward, act.logits)), act
        assert act.block_input == b * args.dim // tp  # full AC keeps the (sequence-parallel) input alone
        assert act.block_op < act.block
    one, two = figures[1, 1], figures[2, 1]
    if name == "llama3":
        for field in ("block", "block_backward"):
            assert 0.4 <= getattr(two, field) / getattr(one, field) <= 0.62, (field, getattr(two, field), getattr(one, field))
    else:  # the routed experts see the whole sequence of every TP rank
        assert 0.4 <= two.block / one.block <= 0.9, (two.block, one.block)
    assert two.logits_saved == one.logits_saved // 2 and two.logits_grad == one.logits_grad // 2


def test_the_fused_loss_keeps_its_two_gradients():
    """`per_token x tokens + fixed`: the hidden states' gradient per token, the output weight's once."""
    spec, args = get_model_spec("llama3"), get_model_args("llama3", "debugmodel")
    for b, tp in ((4, 1), (2, 2)):
        fused = measure_eager(spec, args, ActivationLayout(compute_bytes=b, tp=tp, seq_len=256)).fused_loss
        assert fused.per_token == b * args.dim
        assert fused.fixed == b * args.dim * args.vocab_size // tp


def test_a_layout_is_measured_once():
    spec, args = get_model_spec("llama3"), get_model_args("llama3", "debugmodel")
    layout = ActivationLayout(compute_bytes=2, tp=2, seq_len=512)
    assert measure_eager(spec, args, layout) is measure_eager(spec, args, layout)


def test_measurements_over_fake_groups_leave_uncaught_errors_unprefixed(capsys):
    """`init_process_group` wraps `sys.excepthook` to prefix each traceback line with `[rank0]: `, and destroying the
    group does not unwrap it: after a planner's many fake-group measurements a later uncaught error printed one
    prefix per measurement on every line. The fake groups put the hook back."""
    import sys

    from titan_core.memory.fake_run import fake_mesh

    def uncaught() -> str:  # what this process prints for an uncaught error
        try:
            raise ValueError("boom")
        except ValueError as e:
            sys.excepthook(type(e), e, e.__traceback__)
        return capsys.readouterr().err

    before = uncaught()  # other tests in this process may have wrapped the hook already (real process groups)
    for tp, cp in ((2, 1), (1, 2), (2, 2)):
        with fake_mesh(tp, cp, "cpu") as mesh:
            assert mesh is not None and mesh.size() == tp * cp
    after = uncaught()
    assert "ValueError: boom" in after and after.count("[rank") == before.count("[rank"), (before, after)
