"""Context parallel: head-tail layout and validation in process, parity under torchrun.

The parity run is one launch of `workers/tp_cp_worker.py cp` on 4 gloo processes:
ring and Ulysses attention alone against causal SDPA (incl. GQA, Ulysses' repeated KV
heads and values of another head dim) and against SDPA under a block-causal mask, a seeded 2-layer debugmodel under CP=2 and CP=4
with both ring K/V exchanges and Ulysses, two pipeline stages run back to back
(positions from the pre-hook), and TP=2 x CP=2 through `parallelize` with FSDP.
"""

from __future__ import annotations

import json

import pytest
import torch

from test_tensor_parallel import TOL, launch_worker
from titan_parallel import ParallelConfigError, check_cp
from titan_parallel.context_parallel import cp_positions


@pytest.fixture(scope="module")
def cp_results(tmp_path_factory) -> dict:
    results = launch_worker("cp", tmp_path_factory.mktemp("cp"))
    print(json.dumps(results, indent=1))
    return results


# ---- layout and validation (no processes) ----------------------------------------------------


def test_cp_positions_head_tail_by_hand():
    # T = 8, cp = 2: chunks [0,1] [2,3] [4,5] [6,7]; rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2.
    assert cp_positions(4, 0, 2).tolist() == [0, 1, 6, 7]
    assert cp_positions(4, 1, 2).tolist() == [2, 3, 4, 5]
    # T = 16, cp = 4: eight chunks of 2; rank r holds chunks r and 7 - r.
    assert cp_positions(4, 0, 4).tolist() == [0, 1, 14, 15]
    assert cp_positions(4, 1, 4).tolist() == [2, 3, 12, 13]
    assert cp_positions(4, 2, 4).tolist() == [4, 5, 10, 11]
    assert cp_positions(4, 3, 4).tolist() == [6, 7, 8, 9]
    assert cp_positions(6, 0, 1).tolist() == list(range(6))  # cp = 1 is the identity


def test_cp_positions_partition_the_sequence_with_equal_causal_work():
    seq, cp = 64, 4
    parts = [cp_positions(seq // cp, r, cp) for r in range(cp)]
    assert sorted(torch.cat(parts).tolist()) == list(range(seq))
    # Causal work of a query at position p is p + 1 keys; head-tail makes it equal on every rank.
    work = [int((p + 1).sum()) for p in parts]
    assert work == [seq * (seq + 1) // 2 // cp] * cp


def test_cp_positions_refuses_an_odd_local_length():
    with pytest.raises(ParallelConfigError, match=r"^seq_len=6 is not divisible by 2 x cp=2 = 4"):
        cp_positions(3, 0, 2)
    assert cp_positions(5, 0, 1).tolist() == list(range(5))  # cp = 1: any length


def test_check_cp_names_its_arguments():
    check_cp(32, 4)
    check_cp(7, 1)  # no context parallel: any length
    with pytest.raises(ParallelConfigError) as err:
        check_cp(36, 4)
    assert str(err.value) == (
        "seq_len=36 is not divisible by 2 x cp=4 = 8: context parallel cuts each sequence into 2 chunks per rank; "
        "change seq_len or cp"
    )
    assert err.value.arguments == ("seq_len", "cp")


def test_check_cp_under_sequence_parallel():
    # Sequence parallel splits each cp rank's seq_len / cp tokens into tp pieces.
    check_cp(32, 2, tp=8)
    check_cp(16, 1, tp=4)
    with pytest.raises(ParallelConfigError, match=r"^seq_len=15 is not divisible by tp=2: sequence parallel") as err:
        check_cp(15, 1, tp=2)
    assert err.value.arguments == ("seq_len", "tp")
    with pytest.raises(ParallelConfigError, match=r"^seq_len=24 is not divisible by cp=2 x tp=8 = 16") as err:
        check_cp(24, 2, tp=8)  # 24 splits into 2 x cp = 4 chunks, but 12 tokens per cp rank do not split 8 ways
    assert err.value.arguments == ("seq_len", "cp", "tp")


# ---- parity under torchrun ---------------------------------------------------------------------


@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("method", ["allgather", "rotate", "rotate_math", "ulysses"])
@pytest.mark.parametrize("heads", [(4, 4), (4, 2), (6, 2)])
def test_ring_attention_matches_causal_sdpa(cp_results, cp, method, heads):
    r = cp_results[f"ring_cp{cp}_{method}_h{heads[0]}_kv{heads[1]}"]
    if method == "ulysses" and heads[0] % cp:  # 6 query heads do not split over 4 ranks
        assert r == {"refused": 1.0}
        return
    for key in ("out", "dq", "dk", "dv"):
        assert r[key] < TOL, (key, r)


@pytest.mark.parametrize("cp", [2, 4])
def test_ulysses_with_values_of_another_head_dim(cp_results, cp):
    r = cp_results[f"ulysses_cp{cp}_v_head_dim"]
    for key in ("out", "dq", "dk", "dv"):
        assert r[key] < TOL, (key, r)


# Ulysses hands the model's own core (dense here) its mask; the rotation needs one head dim (MLA: allgather).
# "rotate_math": the rotation with float32 matmul blocks (its path off CPU), not CPU's fused kernel.
MASKED = [
    (shape, method, form)
    for shape in ("gqa", "mla")
    for method in ("ulysses", "allgather", "rotate", "rotate_math")
    for form in ("dense", "block_mask")
    if not (method == "ulysses" and form == "block_mask") and not (method.startswith("rotate") and shape == "mla")
]


@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize(("shape", "method", "form"), MASKED)
def test_attention_under_the_whole_sequences_mask(cp_results, cp, shape, method, form):
    """Block-causal over packed documents: Ulysses' core gets the whole sequence's mask after the exchange; ring
    attention reads it at each block's positions, from the dense mask or a FlexAttention BlockMask."""
    r = cp_results[f"masked_cp{cp}_{shape}_{method}_{form}"]
    for key in ("out", "dq", "dk", "dv"):
        assert r[key] < TOL, (key, r)
    assert r["mask_matters"] == 1.0, r  # without the mask the output is another one


@pytest.mark.parametrize("cp", [2, 4])
def test_ring_steps_compute_only_where_a_query_sees_a_key(cp_results, cp):
    """Under the mask the rotation's blocks after step 0 are cut to the rows and columns where some query sees some
    key, and left out where none does (the outputs and gradients above are those of the cut blocks)."""
    r = cp_results[f"masked_cp{cp}_ring_blocks"]
    assert r["kept"] < 0.75, r  # of the blocks' query x key pairs
    if cp == 4:
        assert r["left_out"] >= 1, r  # a chunk whose documents no query of the other rank is in


@pytest.mark.parametrize("cp", [2, 4])
def test_shard_sequence_takes_the_head_tail_positions(cp_results, cp):
    assert cp_results[f"shard_sequence_cp{cp}"] == {"labels": 0.0, "tokens": 0.0}


@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("method", ["allgather", "rotate", "ulysses"])
def test_cp_model_matches_single_process(cp_results, cp, method):
    r = cp_results[f"cp{cp}_{method}"]
    assert r["not_swapped"] == 0.0
    assert r["local_loss_differs"] == 1.0  # each rank's loss is over its own tokens only
    assert r["n_grads"] == 21
    for key in ("logits", "unshard", "loss", "grads"):
        assert r[key] < TOL, (key, r)
    assert r["grads_rel"] < 1e-5, r


@pytest.mark.parametrize("layout", ["tp1_cp4", "tp2_cp2", "tp2_cp2_ulysses"])
def test_pipeline_stage_gets_positions_from_the_hook(cp_results, layout):
    r = cp_results[f"stages_{layout}"]
    assert r["hidden_seq"] == 8  # 32 tokens over cp x tp = 4: the last stage saw only local hidden states
    assert r["logits"] < TOL, r


@pytest.mark.parametrize("method", ["allgather", "rotate", "ulysses"])
def test_tp_cp_fsdp_through_parallelize(cp_results, method):
    r = cp_results[f"parallelize_tp2_cp2_{method}"]
    assert r["n_grads"] == 21
    # FSDP's pre-backward hook sits on the embedding's output: a tensor of its own, not to_local()'s view
    # (where an in-place op would drop the hook; torch 2.15 warned "returned a view tensor" on every forward)
    assert r["embedding_output_is_view"] == 0.0 and r["view_warnings"] == 0.0, r
    # the gradient norm (clipping's) over FSDP x TP: one process's, one scalar all-reduce per mesh dim, and no
    # DTensor warning about sequential all-reduces (torch 2.15 logged one on every FSDP x TP run)
    assert r["grad_norm_rel"] < 1e-6 and r["grad_norm_collectives"] == 2.0 and r["grad_norm_warnings"] == 0.0, r
    for key in ("logits", "loss", "grads"):
        assert r[key] < TOL, (key, r)
    assert r["grads_rel"] < 1e-5, r
