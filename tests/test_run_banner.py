"""The start-up banner describes the run that was asked for: its model, data, batch, dtype and layout, with
`job.description` beside it only when the user wrote one.

Expected values are typed in from the config given and from published sizes (Llama 3.1 8B has 8,030,261,248
parameters), not read back from the code.
"""

from pathlib import Path

from titan_core.config import load_config
from titan_core.job import resolve
from titan_core.run_banner import run_banner

OLD_DEFAULT = "Titan default run: Llama 3 debugmodel on the Python stdlib corpus"


def banner(overrides: list[str], world_size: int = 1) -> str:
    return run_banner(resolve(load_config(None, overrides), world_size))


def test_the_banner_names_a_non_default_model_data_and_layout(tmp_path: Path):
    corpus = tmp_path / "c4_sample.jsonl"
    corpus.write_text('{"text": "the quick brown fox"}\n' * 20)
    heldout = tmp_path / "heldout.txt"
    heldout.write_text("jumps over the lazy dog\n" * 20)
    line = banner(
        [
            "--model.flavor",
            "8B",
            "--training.dataset",
            "c4",
            "--training.dataset_path",
            str(corpus),
            "--validation.enable",
            "--validation.dataset_path",
            str(heldout),
            "--training.seq_len",
            "2048",
            "--training.local_batch_size",
            "4",
            "--training.mixed_precision_param",
            "float32",
            "--parallelism.tensor_parallel_degree",
            "2",
            "--model.converters",
            "float8",
        ],
        world_size=8,
    )
    assert "\n" not in line
    assert "model llama3/8B (8030.3M params)" in line
    assert f"data: c4 from {corpus}" in line
    assert f"validation {heldout}" in line
    assert "byte tokenizer" in line  # no model.hf_assets_path
    # 8 ranks = dp_shard 4 x tp 2: 4 data-parallel ranks x local batch 4 = 16 sequences per step.
    assert "global batch 16 x seq_len 2048, 1 micro-batch per step" in line
    assert "float32 on cpu, float8 tensorwise" in line
    assert line.endswith("| 8 processes: dp_shard=4 x tp=2")
    for stale in ("debugmodel", "stdlib", OLD_DEFAULT):
        assert stale not in line


def test_the_default_run_says_what_it_runs_and_a_description_follows_when_set():
    line = banner(["--training.mixed_precision_param", "float32"])
    # debugmodel: dim 256, 6 blocks, 16 heads (head dim 16), 8 KV heads, FFN 768, vocab 2048. Per block
    # 256*256*2 + 256*128*2 (attention) + 3*256*768 (FFN) + 2*256 (norms) = 786,944; x 6 + 2 * 2048*256
    # (embedding, output) + 256 (final norm) = 5,770,496.
    assert line == (
        "model llama3/debugmodel (5.8M params) | data: the built-in Python stdlib corpus, byte tokenizer | "
        "global batch 8 x seq_len 256, 1 micro-batch per step | float32 on cpu | 1 process"
    )
    described = banner(["--training.mixed_precision_param", "float32", "--job.description", "lr sweep, run 3"])
    assert described == f"{line} | lr sweep, run 3"
    masked = banner(["--training.mixed_precision_param", "float32", "--model.attn_mask_type", "block_causal"])
    assert masked == line.replace("(5.8M params)", "(5.8M params, attention within each document)")


def test_a_moe_banner_counts_active_parameters_and_expert_parallel():
    line = banner(
        [
            "--model.name",
            "deepseek_v3",
            "--parallelism.expert_parallel_degree",
            "2",
            "--training.global_batch_size",
            "32",
            "--training.local_batch_size",
            "4",
        ],
        world_size=2,
    )
    assert "model deepseek_v3/debugmodel (" in line and "M active)" in line
    # 2 data-parallel ranks x local batch 4 = 8 sequences per micro-batch: 32 takes 4 of them.
    assert "global batch 32 x seq_len 256, 4 micro-batches per step" in line
    assert line.endswith("| 2 processes: dp_shard=2, ep=2")


def test_the_layout_names_ulysses_context_parallel():
    ulysses = ["--training.seq_len", "64", "--parallelism.context_parallel_degree", "2"]
    assert banner(ulysses, world_size=4).endswith("| 4 processes: dp_shard=2 x cp=2")  # ring, the default
    ulysses += ["--parallelism.context_parallel_method", "ulysses"]
    assert banner(ulysses, world_size=4).endswith("| 4 processes: dp_shard=2 x cp=2 Ulysses")


def test_the_layout_says_when_the_tp_ranks_join_expert_parallel():
    moe = ["--model.name", "deepseek_v3", "--parallelism.tensor_parallel_degree", "2",
           "--parallelism.expert_parallel_degree", "2"]
    assert banner(moe, world_size=4).endswith("| 4 processes: dp_shard=2 x tp=2, ep=2")
    joined = banner([*moe, "--parallelism.expert_tensor_parallel_degree", "1"], world_size=4)
    assert joined.endswith("| 4 processes: dp_shard=2 x tp=2, ep=2 (etp=1: over the tp ranks too)")


def test_no_shipped_default_claims_a_description():
    assert load_config(None, []).job.description == ""
    assert load_config("llama3_debugmodel", []).job.description == ""


def test_validation_on_the_stdlib_corpus_reads_its_held_out_files():
    line = banner(["--validation.enable"])
    assert "data: the built-in Python stdlib corpus, validation the stdlib corpus's held-out files" in line
    longer = banner(["--validation.enable", "--validation.seq_len", "4096"])
    assert "validation the stdlib corpus's held-out files at 4096 tokens per sequence, byte tokenizer" in longer


def test_a_mix_says_which_sources_are_token_shards_and_which_text(tmp_path: Path):
    import json

    from titan_core.config.schema import DatasetSource
    from titan_core.data.token_shards import FORMAT, MANIFEST
    from titan_core.run_banner import describe_mix

    (tmp_path / MANIFEST).write_text(json.dumps({"format": FORMAT}))  # what marks a token-shard folder
    shards, text = DatasetSource(path=str(tmp_path), weight=7, name="plays"), DatasetSource(path="stdlib", weight=3)
    assert describe_mix([shards], shuffle=True) == "mix of plays 100% (token shards shuffled)"
    assert describe_mix([text], shuffle=True) == "mix of stdlib 100% (text tokenized in document order)"
    assert describe_mix([shards, text], shuffle=False) == (
        "mix of plays 70% + stdlib 30% (token shards in file order: plays; text tokenized in document order: stdlib)"
    )
