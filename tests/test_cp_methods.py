"""Context parallel's two methods, ring and Ulysses, outside any process group: the rule that refuses a Ulysses
layout before launch, its KV-head repeats, and what `titan estimate-memory` and `titan plan` charge each method.

The numerical parity of Ulysses (alone, GQA with repeated KV heads, MLA's head dims, a model at CP 2 and 4, TP x
CP through `parallelize`, pipeline stages) is in test_context_parallel.py's launch; whole runs against one process
(compile x PP x FSDP, and DeepSeek-V3 with EP x TP) are rows of the parity matrix.
"""

from __future__ import annotations

import dataclasses

import pytest
from titan_core.config import ConfigError, load_config
from titan_core.job import resolve
from titan_core.memory.analytic import estimate_analytic
from titan_core.memory.plan import PlanRequest, prepare_plan
from titan_core.memory.plan_space import refuse_by_rule
from titan_core.memory.step_cost import Cluster, Layout, estimate_step_cost
from titan_core.memory.activations import ActivationLayout
from titan_models import get_model_args, get_model_spec
from titan_parallel import ParallelConfigError, check_cp_method
from titan_parallel.layout import ulysses_kv_repeats

ULYSSES = ("--parallelism.context_parallel_method", "ulysses")


# ---- the rule ----------------------------------------------------------------------------------


def test_check_cp_method_names_its_arguments():
    check_cp_method("ring", n_heads=6, cp=4)  # ring does not split heads
    check_cp_method("ulysses", n_heads=16, cp=4, tp=4)
    check_cp_method("ulysses", n_heads=6, cp=1)  # no context parallel: nothing to split
    with pytest.raises(ParallelConfigError) as err:
        check_cp_method("ulysses", n_heads=6, cp=4)
    assert str(err.value) == (
        "cp_method='ulysses' splits the attention heads over tp x cp ranks, but n_heads=6 is not divisible by cp=4; "
        "change cp, or use cp_method='ring'"
    )
    assert err.value.arguments == ("cp_method", "n_heads", "cp")
    with pytest.raises(ParallelConfigError, match=r"n_heads=16 is not divisible by cp=4 x tp=8 = 32") as err:
        check_cp_method("ulysses", n_heads=16, cp=4, tp=8)
    assert err.value.arguments == ("cp_method", "n_heads", "cp", "tp")
    with pytest.raises(ParallelConfigError, match=r"^cp_method='ulysess' is unknown; choose 'ring' or 'ulysses'$"):
        check_cp_method("ulysess")


def test_kv_heads_are_repeated_until_cp_divides_them():
    # (KV heads on a rank, cp) -> copies of each: cp / gcd(kv, cp)
    cases = {(8, 2): 1, (8, 8): 1, (2, 4): 2, (1, 8): 8, (3, 2): 2, (6, 4): 2, (4, 6): 3}
    assert {case: ulysses_kv_repeats(*case) for case in cases} == cases


def test_the_job_check_refuses_ulysses_before_launch_naming_the_keys():
    # 16 query heads do not split over cp 3.
    with pytest.raises(ConfigError) as err:
        resolve(load_config(None, ["--parallelism.context_parallel_degree", "3", "--training.seq_len", "96", *ULYSSES]), 3)
    assert "\n" not in str(err.value)
    assert str(err.value).endswith(
        "(cp_method set by parallelism.context_parallel_method, n_heads set by model.flavor, "
        "cp set by parallelism.context_parallel_degree)"
    )
    # The 10M flavor's 4 heads over tp 2 x cp 4.
    overrides = ["--model.flavor", "10M", "--parallelism.context_parallel_degree", "4",
                 "--parallelism.tensor_parallel_degree", "2", "--training.seq_len", "64", *ULYSSES]
    with pytest.raises(ConfigError, match=r"n_heads=4 is not divisible by cp=4 x tp=2 = 8") as err:
        resolve(load_config(None, overrides), 8)
    assert err.value.keys == ("parallelism.context_parallel_method", "model.flavor",
                              "parallelism.context_parallel_degree", "parallelism.tensor_parallel_degree")
    with pytest.raises(ConfigError, match=r"cp_method='ulysess' is unknown.*parallelism.context_parallel_method"):
        resolve(load_config(None, ["--parallelism.context_parallel_method", "ulysess"]), 1)


def test_ring_rotates_rule_on_head_dims_is_rings_alone():
    # DeepSeek-V3's keys and values differ in head dim: ring's 'rotate' refuses it, Ulysses exchanges them apart.
    deepseek = ["--model.name", "deepseek_v3", "--parallelism.context_parallel_degree", "2",
                "--parallelism.context_parallel_rotate_method", "rotate"]
    with pytest.raises(ConfigError, match="use 'allgather'"):
        resolve(load_config(None, deepseek), 2)
    job = resolve(load_config(None, [*deepseek, *ULYSSES]), 2)
    assert job.parallel.cp_method == "ulysses"


# ---- titan estimate-memory ----------------------------------------------------------------------


def test_saved_activations_per_method():
    """What a block keeps per token under each CP method, measured on fake tensors (`eager_saved`), against what
    each method adds by design."""
    from titan_core.memory.eager_saved import measure_eager

    spec, args = get_model_spec("llama3"), get_model_args("llama3", "debugmodel")  # q = 256, kv = 128, 16 / 8 heads
    b, seq = 2, 2048  # bf16: cuDNN attention, grouped K/V as they are

    def attention(cp: int, method: str = "ring", rotate: str = "allgather", tp: int = 1, model=args) -> int:
        layout = ActivationLayout(compute_bytes=b, tp=tp, cp=cp, cp_method=method, cp_rotate_method=rotate,
                                  seq_len=seq, device_type="cuda")
        return measure_eager(spec, model, layout).act.block  # per token; ring's mask, per call, apart

    none = attention(1)
    assert attention(4, "ulysses") - none == b * 256  # the output exchanged back is wo's own input
    assert attention(4, "ring") - none == b * 2 * 128 * 3  # the gathered K/V
    # 2 KV heads over cp 8: each is sent 4 times (K and V)
    gqa = dataclasses.replace(args, n_kv_heads=2)
    assert attention(8, "ulysses", model=gqa) - attention(1, model=gqa) == b * 256 + 2 * b * 32 * 3
    # Under TP the heads are split first: 8 KV heads / tp 4 = 2 per rank, over cp 4 -> 2 copies
    assert attention(4, "ulysses", tp=4) - attention(1, tp=4) == (b * 256 + 2 * b * 128 * 1) / 4


def test_estimate_memory_knows_the_method():
    overrides = ["--training.seq_len", "4096", "--training.local_batch_size", "1",
                 "--parallelism.context_parallel_degree", "4"]
    ring = estimate_analytic(load_config(None, overrides), 4, device_type="cuda")
    ulysses = estimate_analytic(load_config(None, [*overrides, *ULYSSES]), 4, device_type="cuda")
    assert "CP ring (allgather)" in ring.layout and "CP ulysses" in ulysses.layout
    # Per block and token (bf16 on CUDA, q = 256, kv = 128): ring keeps the gathered K/V, 2 (3 x 2 x 128), and its
    # causal mask over the 4096 gathered keys as the bf16 additive bias the cuDNN kernel takes, 2 x 4096 (the
    # estimate runs torch's SDPA on fake CUDA tensors with that kernel); Ulysses the exchanged output, 2 x 256.
    # Six blocks of 1024 tokens.
    per_token = 2 * 3 * 2 * 128 + 2 * 4096 - 2 * 256
    assert ring.ranks[0].activations - ulysses.ranks[0].activations == 6 * 1024 * per_token
    assert ulysses.ranks[0].total < ring.ranks[0].total


# ---- titan plan --------------------------------------------------------------------------------


def test_plan_charges_ulysses_all_to_alls_and_refuses_its_layouts():
    request = dict(gpus=64, gpus_per_node=8, seq_len=65536, global_batch=64)
    ring = prepare_plan(PlanRequest("llama3_8b", **request))
    ulysses = prepare_plan(PlanRequest("llama3_8b", overrides=ULYSSES, **request))
    assert (ring.workload.cp_method, ulysses.workload.cp_method) == ("ring", "ulysses")
    cluster = Cluster(gpus=64, gpus_per_node=8, peak_flops=989e12)

    def cp_term(plan, cp: int, tp: int = 1) -> tuple[float, str]:
        t = Layout(dp_shard=64 // (cp * tp), cp=cp, tp=tp, local_batch=1, microbatch=1, ac="full")
        cost = estimate_step_cost(t, plan.workload, cluster)
        return cost.terms["cp"], cost.notes["cp"]

    # Llama 3 8B: q = 4096, kv = 1024 (8 KV heads). Per rank and block, ring moves (cp - 1) / cp of the whole
    # sequence's K and V, 2 kv S; Ulysses sends (cp - 1) / cp of its own tokens' q, k, v and output,
    # (2 q + 2 kv) S / cp: (q + kv) / (cp kv) = 2.5x ring at cp 2, 0.625x at cp 8 (both in one node).
    for cp, ratio in ((2, 2.5), (8, 0.625)):
        (ring_s, ring_link), (ulysses_s, ulysses_link) = cp_term(ring, cp), cp_term(ulysses, cp)
        assert ulysses_s == pytest.approx(ratio * ring_s) and ring_link == ulysses_link == "NVLink"
    # cp 16 spans two nodes: the all-to-all's share to the other node crosses the network.
    assert cp_term(ulysses, 16)[1] == "network"
    # Ulysses splits the 32 heads tp x cp ways: tp 4 x cp 8 = 32 does, tp 8 x cp 8 = 64 is refused, naming the key.
    args = get_model_args("llama3", "8B")
    assert refuse_by_rule(Layout(cp=8, tp=4), args, ulysses.base, 65536) is None
    refusal = refuse_by_rule(Layout(cp=8, tp=8), args, ulysses.base, 65536)
    assert refusal is not None and "parallelism.context_parallel_method" in refusal
    assert refuse_by_rule(Layout(cp=8, tp=8), args, ring.base, 65536) is None
