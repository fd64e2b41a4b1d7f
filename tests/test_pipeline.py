"""Pipeline parallel (titan_parallel.pipeline): stage cuts worked out by hand, errors naming their arguments, and
parity with a single process for every schedule, over real torchrun processes (gloo, CPU).

One 4-process launch carries all the multi-process checks (tests/workers/pp_worker.py):
pp=2 for every available schedule, an explicit module list and a CSV schedule (as two
pipeline replicas of 2 ranks each), pp=4 for three schedules, pp=2 x FSDP 2 for three.
"""

from __future__ import annotations

import pytest
import torch

from titan_models.llama3 import llama3_plan
from titan_parallel import SCHEDULE_NAMES, ParallelConfigError, PipelineConfig, check_pipeline
from titan_parallel.pipeline_layout import (
    SCHEDULE_KINDS,
    available_schedules,
    check_module_names,
    count_microbatches,
    count_stages,
    stage_indices,
    stage_module_names,
)

from titan_run import REPO, run_json_worker

WORKER = REPO / "tests" / "workers" / "pp_worker.py"
TOL = 1e-5
V_SCHEDULES = {"ZBVZeroBubble", "DualPipeV"}


def layers(*ids: int) -> list[str]:
    return [f"layers.{i}" for i in ids]


# ---- stage cuts, worked out by hand -----------------------------------------------------
# Units = layers + first weight + last weight, spread evenly, the first `units % stages`
# stages one more; the first stage spends `first` units on the embeddings, the last
# `last` units on norm + output (torchtitan's generate_llm_fqn_per_model_part).


def test_six_layers_two_stages():
    # 6 + 1 + 1 = 8 units, 4 per stage: embeddings + 3 layers | 3 layers + norm + output.
    assert stage_module_names(llama3_plan, 6, 2) == [
        ["tok_embeddings", *layers(0, 1, 2)],
        [*layers(3, 4, 5), "norm", "output"],
    ]


def test_eight_layers_four_stages_uneven():
    # 10 units over 4 stages: 3, 3, 2, 2.
    assert stage_module_names(llama3_plan, 8, 4) == [
        ["tok_embeddings", *layers(0, 1)],
        layers(2, 3, 4),
        layers(5, 6),
        [*layers(7), "norm", "output"],
    ]


def test_one_unit_per_stage_leaves_embeddings_and_output_alone():
    # 6 + 1 + 1 = 8 units over 8 stages: the first holds only the embeddings, the last only norm + output.
    assert stage_module_names(llama3_plan, 6, 8) == [["tok_embeddings"], *([name] for name in layers(0, 1, 2, 3, 4, 5)), ["norm", "output"]]


def test_weights_shift_layers_between_first_and_last():
    # 5 + 0 + 2 = 7 units: 4 and 3; the first stage's 4 are all layers, the last keeps 3 - 2 = 1 layer.
    names = stage_module_names(llama3_plan, 5, 2, first_stage_less_layers=0, last_stage_less_layers=2)
    assert names == [["tok_embeddings", *layers(0, 1, 2, 3)], [*layers(4), "norm", "output"]]


def test_single_stage_holds_everything():
    assert stage_module_names(llama3_plan, 3, 1) == [["tok_embeddings", *layers(0, 1, 2), "norm", "output"]]


def test_stage_indices_loop_and_v():
    assert stage_indices(0, 2, 4, "Interleaved1F1B") == (0, 2)
    assert stage_indices(1, 4, 8, "InterleavedZeroBubble") == (1, 5)
    assert stage_indices(3, 4, 4, "1F1B") == (3,)
    assert stage_indices(0, 2, 4, "ZBVZeroBubble") == (0, 3)
    assert stage_indices(1, 4, 8, "DualPipeV") == (1, 6)


def test_count_stages():
    assert count_stages(6, 2, "1F1B") == 2
    assert count_stages(6, 2, "Interleaved1F1B") == 4  # default 2 per rank
    assert count_stages(6, 4, "ZBVZeroBubble") == 8
    assert count_stages(6, 2, "Interleaved1F1B", layers_per_stage=2) == 4  # ceil(8 / 2)
    assert count_stages(10, 2, "Interleaved1F1B", layers_per_stage=2) == 6  # ceil(12 / 2): 3 per rank
    assert count_stages(6, 2, "GPipe", layers_per_stage=4) == 2


def test_count_microbatches():
    assert count_microbatches(8, 2, 2, "1F1B") == 4
    assert count_microbatches(2, 1, 4, "Interleaved1F1B") == 2  # fewer than stages: allowed, just bubbly


def test_every_schedule_is_available():
    assert set(available_schedules()) == set(SCHEDULE_NAMES)


def test_schedule_kinds_match_torchs_classes():
    from torch.distributed.pipelining import schedules

    for name, kind in SCHEDULE_KINDS.items():
        cls = schedules.get_schedule_class(name)
        assert (kind.placement == "single") == issubclass(cls, schedules.PipelineScheduleSingle), name
        assert (kind.placement == "v") == issubclass(cls, (schedules.ScheduleZBVZeroBubble, schedules.ScheduleDualPipeV)), name
        assert kind.microbatch_per_stage == issubclass(cls, (schedules.Schedule1F1B, schedules.ScheduleDualPipeV)), name


def test_check_pipeline_returns_the_stage_cut():
    config = PipelineConfig(schedule="Interleaved1F1B", microbatch_size=2)
    names = check_pipeline(config, pp=2, n_layers=6, local_batch_size=8, plan=llama3_plan)
    assert names == stage_module_names(llama3_plan, 6, 4)
    explicit = [["tok_embeddings", "layers.0"], ["layers.1", "norm", "output"]]
    config = PipelineConfig(module_names_per_stage=explicit)
    assert check_pipeline(config, pp=2, n_layers=2, local_batch_size=2, plan=llama3_plan) == explicit
    # pp = 1: no pipeline; the schedule is still checked, nothing else.
    whole = [["tok_embeddings", "layers.0", "layers.1", "norm", "output"]]
    assert check_pipeline(PipelineConfig(microbatch_size=3), pp=1, n_layers=2, local_batch_size=8, plan=llama3_plan) == whole
    with pytest.raises(ParallelConfigError, match="schedule='1f1b' is unknown"):
        check_pipeline(PipelineConfig(schedule="1f1b"), pp=1, n_layers=2, local_batch_size=8, plan=llama3_plan)


# ---- errors: one line each, naming the arguments to change -------------------------------


TOO_FEW_UNITS = ("n_layers", "first_stage_less_layers", "last_stage_less_layers", "pp", "layers_per_stage")


def pipeline(pp: int = 2, n_layers: int = 6, local_batch_size: int = 8, **config) -> list[list[str]]:
    return check_pipeline(PipelineConfig(**config), pp=pp, n_layers=n_layers, local_batch_size=local_batch_size, plan=llama3_plan)


@pytest.mark.parametrize(
    "call, arguments, words",
    [
        (lambda: stage_module_names(llama3_plan, 2, 5), TOO_FEW_UNITS, ["5 stages but only 4 units"]),
        (lambda: pipeline(pp=8, n_layers=2, schedule="1F1B"), TOO_FEW_UNITS, ["8 stages but only 4 units"]),
        (lambda: stage_module_names(llama3_plan, 6, 4, first_stage_less_layers=3), ("first_stage_less_layers",), ["first_stage_less_layers=3 exceeds"]),
        (lambda: stage_module_names(llama3_plan, 6, 4, last_stage_less_layers=3), ("last_stage_less_layers",), ["last_stage_less_layers=3 exceeds"]),
        (lambda: count_stages(6, 2, "1F1B", layers_per_stage=2), ("schedule", "pp", "layers_per_stage"),
         ["layers_per_stage=2 cuts 8 units into 4 stages = 2 per rank", "exactly 1 stage per rank", "Interleaved1F1B"]),
        (lambda: count_stages(6, 2, "Interleaved1F1B", layers_per_stage=3), ("pp", "layers_per_stage"), ["do not divide over pp=2", "multiple of 2"]),
        (lambda: count_stages(6, 2, "ZBVZeroBubble", layers_per_stage=1), ("schedule", "pp", "layers_per_stage"), ["exactly 2 stages per rank"]),
        (lambda: count_stages(6, 2, "Interleaved1F1B", layers_per_stage=4), ("schedule", "pp", "layers_per_stage"), ["at least 2 stages per rank", "1F1B"]),
        (lambda: count_stages(6, 2, "1F1B", layers_per_stage=0), ("layers_per_stage",), ["layers_per_stage=0 must be >= 1"]),
        (lambda: pipeline(schedule="Looped"), ("schedule",), ["schedule='Looped' is unknown", "GPipe", "DualPipeV"]),
        (lambda: stage_indices(0, 2, 2, "ZBVZeroBubble"), ("schedule", "pp"), ["exactly 2 stages per rank, but 2 stages = 1 per rank"]),
        (lambda: pipeline(module_names_per_stage=[["tok_embeddings", *layers(0)], layers(1), [*layers(2, 3, 4, 5), "norm", "output"]]),
         ("pp", "module_names_per_stage"), ["module_names_per_stage lists 3 stages"]),
        (lambda: count_microbatches(8, 3, 2, "1F1B"), ("local_batch_size", "microbatch_size"), ["local_batch_size=8", "microbatch_size=3"]),
        (lambda: pipeline(local_batch_size=8, microbatch_size=3), ("local_batch_size", "microbatch_size"), ["not divisible"]),
        (lambda: count_microbatches(8, 4, 4, "DualPipeV"), ("schedule", "local_batch_size", "microbatch_size"), ["needs >= 4 microbatches per step", "gives 2"]),
        (lambda: count_microbatches(4, 1, 2, "Bogus"), ("schedule",), ["'Bogus' is unknown"]),
        (lambda: pipeline(schedule_csv="/no/such.csv"), ("schedule_csv",), ["schedule_csv='/no/such.csv' is not a file"]),
    ],
)
def test_config_errors(call, arguments, words):
    with pytest.raises(ParallelConfigError) as info:
        call()
    message = str(info.value)
    assert "\n" not in message
    assert info.value.arguments == arguments, (info.value.arguments, message)
    for word in words:
        assert word in message, message


@pytest.mark.parametrize(
    "names, words",
    [
        ([["tok_embeddings", "layers.0"], ["layers.1", "layers.9", "norm", "output"]], ["unknown module 'layers.9'"]),
        ([["tok_embeddings", "layers.0", "layers.1"], ["layers.1", "norm", "output"]], ["'layers.1' is in stage 0 and stage 1"]),
        ([["tok_embeddings", "layers.0"], ["layers.1", "norm"]], ["['output'] are in no stage"]),
        ([["tok_embeddings", "layers.1"], ["layers.0", "norm", "output"]], ["forward order"]),
        ([["tok_embeddings", "layers.0", "layers.1"], [], ["norm", "output"]], ["stage 1 is empty"]),
    ],
)
def test_module_name_errors(names, words):
    with pytest.raises(ParallelConfigError) as info:
        check_module_names(llama3_plan, 2, names)
    message = str(info.value)
    assert "\n" not in message and message.startswith("module_names_per_stage: ")
    assert info.value.arguments == ("module_names_per_stage",)
    for word in words:
        assert word in message, message


def test_valid_explicit_names_pass():
    check_module_names(llama3_plan, 2, [["tok_embeddings"], ["layers.0", "layers.1"], ["norm", "output"]])


def test_gloo_link_warm_up_leaves_out_sends_to_the_own_rank(monkeypatch):
    """torch 2.11's first step sends a dummy tensor to each neighbouring stage, the own rank too under V schedules;
    gloo never completes that send (the pp2 V-schedule cases below hung there on 2.11). Ops to other ranks stay."""
    from types import SimpleNamespace

    from titan_parallel import pipeline_compat

    class Stage:
        def _get_init_p2p_neighbors_ops(self):
            return [SimpleNamespace(peer=peer, kind=kind) for peer, kind in ((1, "recv"), (0, "send"), (1, "send"))]

    monkeypatch.setattr(pipeline_compat.torch.distributed, "get_rank", lambda: 1)
    stage = Stage()
    pipeline_compat.skip_warm_up_sends_to_self(stage)
    assert [(op.peer, op.kind) for op in stage._get_init_p2p_neighbors_ops()] == [(0, "send")]
    newer = SimpleNamespace()  # torch 2.15's stages have no such warm-up: nothing to change
    pipeline_compat.skip_warm_up_sends_to_self(newer)
    assert vars(newer) == {}


@pytest.mark.parametrize("divisor", [None, 2.0])
def test_a_fused_loss_node_outlives_the_detach_between_the_backward_halves(divisor):
    """Zero-bubble schedules run a stage's input backward, detach the loss in place, and later take the weight
    gradients from the node where the paths meet: for the output projection, the fused loss's Python
    `autograd.Function` node. torch 2.11 let that node die with the detach (held weakly), so the weight half
    failed; `keep_custom_loss_node` keeps it. The weight gradient taken after the detach equals autograd's own."""
    from torch.autograd.graph import GradientEdge

    from titan_parallel.linear_cross_entropy import linear_cross_entropy
    from titan_parallel.pipeline_compat import keep_custom_loss_node

    torch.manual_seed(0)
    h = torch.randn(6, 8, requires_grad=True)
    weight = torch.randn(16, 8, requires_grad=True)
    labels = torch.randint(0, 16, (6,))
    expected = torch.autograd.grad(linear_cross_entropy(h, weight, labels) / (divisor or 1), weight)[0]

    raw = linear_cross_entropy(h, weight, labels)
    fused = raw.grad_fn  # its Python object: what torch's split backward keeps of the node
    assert type(fused).__name__ == "_LinearCrossEntropyBackward"
    loss = keep_custom_loss_node(raw if divisor is None else raw / divisor)
    del raw
    grad_in = {}
    fused.register_prehook(lambda grads: grad_in.setdefault("g", grads))
    (dh,) = torch.autograd.grad(loss, h, retain_graph=True)  # the input half
    loss.detach_()  # what torch's stage_backward_input does next
    (dw,) = torch.autograd.grad(GradientEdge(fused, 0), GradientEdge(_accumulator(weight), 0),
                                grad_outputs=grad_in["g"])  # the weight half, from the node alone
    torch.testing.assert_close(dw, expected, rtol=0, atol=0)
    assert dh.shape == h.shape


def _accumulator(leaf: torch.Tensor):
    """The AccumulateGrad node of a leaf tensor (what torch's split backward differentiates towards)."""
    return leaf.view_as(leaf).grad_fn.next_functions[0][0]


def test_a_plain_loss_is_left_as_it_is():
    """Without a Python function node that takes a weight under it, the loss comes back unchanged: its graph (the
    logits a compiled loss saves, say) still frees at the detach."""
    from titan_parallel.pipeline_compat import keep_custom_loss_node

    class Identity(torch.autograd.Function):  # stands in for a compiled loss: a Python node fed by the logits
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, grad):
            return grad

    head = torch.nn.Linear(8, 16)
    labels = torch.randint(0, 16, (4,))
    for logits in (torch.randn(4, 16, requires_grad=True), Identity.apply(head(torch.randn(4, 8)))):
        loss = torch.nn.functional.cross_entropy(logits, labels) / 2
        assert keep_custom_loss_node(loss) is loss and not hasattr(loss, "_titan_loss_root")


# ---- parity with one process, over real processes ----------------------------------------


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    """Launch the worker once on 4 processes; its per-case, per-rank results."""
    return run_json_worker(WORKER, 4, tmp_path_factory.mktemp("pp") / "result.json")


def expected_stages(schedule: str, pp: int, pp_rank: int) -> list[int]:
    if schedule in V_SCHEDULES:
        return [pp_rank, 2 * pp - 1 - pp_rank]
    if schedule in ("GPipe", "1F1B"):
        return [pp_rank]
    return [pp_rank, pp_rank + pp]


def check_case(results: dict, name: str, schedule: str, pp: int) -> None:
    """Parity, stage placement, loss placement and parameter coverage of one layout on 4 ranks."""
    assert name in results["cases"], f"case {name} did not run: an earlier case failed ({list(results['cases'])[-1]})"
    ranks = results["cases"][name]
    errors = [r["error"] for r in ranks if "error" in r]
    assert not errors, errors[0]
    dp = len(ranks) // pp  # copies of each stage: pipeline replicas or FSDP shards
    for r in ranks:
        assert r["loss_diff"] < TOL and r["param_diff"] < TOL and r["grad_diff"] < TOL, (name, r)
        assert r["stages"] == expected_stages(schedule, pp, r["pp_rank"]), (name, r["stages"])
        # The last stage, hence the loss, lives on pp rank 0 under V schedules, else on the last pp rank.
        assert r["has_loss"] == (r["pp_rank"] == (0 if schedule in V_SCHEDULES else pp - 1)), (name, r)
    # Every parameter lives on exactly one stage of each pipeline, i.e. on dp ranks in all.
    held = sorted(n for r in ranks for n in r["held"])
    assert held == sorted(results["ref_params"] * dp)


@pytest.mark.parametrize("schedule", SCHEDULE_NAMES)
def test_pp2_matches_single_process(runs, schedule):
    check_case(runs, f"pp2-{schedule}", schedule, pp=2)


def test_pp2_explicit_module_names(runs):
    check_case(runs, "pp2-1F1B-explicit", "1F1B", pp=2)
    assert sorted(runs["cases"]["pp2-1F1B-explicit"][0]["held"]) == ["layers.0.attention.wk.weight", "layers.0.attention.wo.weight",
        "layers.0.attention.wq.weight", "layers.0.attention.wv.weight", "layers.0.attention_norm.weight", "layers.0.feed_forward.w1.weight",
        "layers.0.feed_forward.w2.weight", "layers.0.feed_forward.w3.weight", "layers.0.ffn_norm.weight", "tok_embeddings.weight"]


def test_pp2_csv_schedule(runs):
    check_case(runs, "pp2-csv-Interleaved1F1B", "Interleaved1F1B", pp=2)


def test_weight_tied_across_stages_is_refused(runs):
    message = runs.get("errors", {}).get("tied")
    assert message is not None and "\n" not in message
    assert "'tok_embeddings.weight' and 'output.weight'" in message and "stages 0 and 1" in message and "module_names_per_stage" in message


@pytest.mark.parametrize(
    "name", ["tied-pp2-1F1B", "tied-pp2-ZBVZeroBubble", "tied-pp2xfsdp2-Interleaved1F1B", "tied-pp4-1F1B"]
)
def test_a_weight_tied_across_stages_trains_as_the_one_weight(runs, name):
    # split_model(shared=True) keeps the embedding on the first stage and the output on the last; SharedWeights
    # gives the output's copy (zeroed on purpose) the embedding's values and sums the two gradients each step:
    # losses, weights and gradients as the tied single-process model's.
    ranks = runs["cases"][name]
    errors = [r["error"] for r in ranks if "error" in r]
    assert not errors, errors[0]
    for r in ranks:
        assert r["loss_diff"] < TOL and r["param_diff"] < TOL and r["grad_diff"] < TOL, (name, r)
    held = [n for r in ranks for n in r["held"]]
    pp = int(name.split("-")[1][2])  # each stage on world / pp ranks (pipeline replicas or FSDP shards)
    assert held.count("tok_embeddings.weight") == held.count("output.weight") == len(ranks) // pp


@pytest.mark.parametrize("schedule", ["1F1B", "Interleaved1F1B", "ZBVZeroBubble"])
def test_pp4_matches_single_process(runs, schedule):
    check_case(runs, f"pp4-{schedule}", schedule, pp=4)


@pytest.mark.parametrize("schedule", ["1F1B", "Interleaved1F1B", "DualPipeV"])
def test_pp2_with_fsdp2_matches_single_process(runs, schedule):
    check_case(runs, f"pp2xfsdp2-{schedule}", schedule, pp=2)
