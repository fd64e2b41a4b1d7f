"""Full weights (a Hugging Face checkpoint, `checkpoint.initial_load_in_hf`) load into a sharded model from rank 0
alone: the other ranks receive each tensor in turn, so a node holds one copy of the weights, not one per rank
(tests/workers/full_state_worker.py). `titan train` from Hugging Face weights on 2 FSDP ranks starts from them."""

from __future__ import annotations

from titan_run import REPO, run_json_worker


def test_only_rank_0_reads_and_every_rank_gets_its_shards(tmp_path):
    rank0, rank1 = run_json_worker(REPO / "tests" / "workers" / "full_state_worker.py", 2, tmp_path / "out.json")
    assert rank0["sharded"] == rank1["sharded"] == {"keys": [f"{i}.{n}" for i in range(3) for n in ("bias", "weight")],
                                                    "equal": True}
    assert rank0["stage"] == {"keys": ["0.bias", "0.weight", "1.bias", "1.weight"], "equal": True}
    assert rank1["stage"] == {"keys": ["1.bias", "1.weight", "2.bias", "2.weight"], "equal": True}
    assert rank0["reads"] == [0, 0, 0] and rank1["reads"] == []  # each of the 3 loads read on rank 0 only
    expected = "src lacks '2.weight' (2 of 4 model tensors missing (rank 1's parts)); load weights of the model"
    assert rank0["error"].startswith(expected) and rank1["error"] == rank0["error"]
    # rank 0 failing to read tells the others, which would otherwise wait on it, and keeps its own error
    assert rank0["broken"] == "src/model.safetensors is truncated or corrupt"
    assert rank1["broken"] == ("rank 0 could not read src (CheckpointError: src/model.safetensors is truncated or "
                               "corrupt); see rank 0's error")
