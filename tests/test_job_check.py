"""Every rule of a valid job, written once (`titan_core.job_check.RULES`), and how a broken one is reported:
one line naming the config keys, before any process starts, and the same for an error raised later on a rank."""

from __future__ import annotations

import sys

import pytest
import torch
from titan_ckpt import CheckpointError
from titan_core.config import ConfigError, load_config
from titan_core.job_check import ARGUMENT_KEYS, RULES, as_config_error, check_job
from titan_parallel import ParallelConfigError

from titan_run import TINY, run_titan

# One job that breaks each rule: (overrides, world size, substrings the one-line message must hold).
BROKEN = {
    "device": (["--training.device", "cuda"], 1, ["training.device"]),
    "model_shape": (["--model.flavor", "debugmodle"], 1, ["model.flavor", "debugmodel"]),
    "degrees": (["--parallelism.tensor_parallel_degree", "4"], 2, ["parallelism.tensor_parallel_degree", "2"]),
    "batch": (["--training.local_batch_size", "4", "--training.global_batch_size", "10"], 2,
              ["training.global_batch_size=10", "training.local_batch_size"]),
    "tensor_parallel": (["--parallelism.tensor_parallel_degree", "3"], 3, ["parallelism.tensor_parallel_degree"]),
    "expert_parallel": (["--model.name", "deepseek_v3", "--parallelism.expert_parallel_degree", "3"], 3,
                        ["parallelism.expert_parallel_degree", "8 experts"]),
    "context_parallel": (["--parallelism.context_parallel_degree", "2", "--training.seq_len", "30"], 2,
                         ["training.seq_len", "parallelism.context_parallel_degree"]),
    "activation_checkpoint": (["--activation_checkpoint.mode", "selective", "--activation_checkpoint.selective_ac_option", "two"], 1,
                              ["activation_checkpoint.selective_ac_option"]),
    "pipeline": (["--parallelism.pipeline_parallel_degree", "2", "--training.local_batch_size", "3",
                  "--parallelism.pipeline_parallel_microbatch_size", "2"], 2,
                 ["training.local_batch_size", "parallelism.pipeline_parallel_microbatch_size"]),
    "converters": (["--model.converters", "float8,mx"], 1, ["model.converters"]),
    "checkpoint": (["--checkpoint.last_save_in_hf", "true"], 1, ["checkpoint.last_save_in_hf", "checkpoint.enable"]),
    "profiling": (["--profiling.enable_profiling", "true", "--profiling.profile_freq", "1"], 1, ["profiling.profile_freq", ">= 2"]),
    "metrics": (["--metrics.enable_wandb", "true"], 1, ["metrics.enable_wandb", "pip install 'titan-core[wandb]'"]),
}


def test_every_rule_has_a_broken_example():
    assert [name for name, _ in RULES] == list(BROKEN)


@pytest.mark.parametrize("rule", list(BROKEN))
def test_a_broken_rule_is_one_line_naming_the_keys(rule, monkeypatch):
    overrides, world_size, expected = BROKEN[rule]
    if rule == "device" and torch.cuda.is_available():
        pytest.skip("a CUDA device is visible")
    if rule == "metrics":
        monkeypatch.setitem(sys.modules, "wandb", None)  # as if the optional package were not installed
    with pytest.raises(ConfigError) as caught:
        check_job(load_config(None, overrides), world_size)
    message = str(caught.value)
    assert "\n" not in message
    for text in expected:
        assert text in message, (text, message)


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (["--parallelism.pipeline_parallel_schedule", "1f1b"], ["parallelism.pipeline_parallel_schedule", "'1f1b'", "GPipe", "DualPipeV"]),
        (["--parallelism.context_parallel_rotate_method", "ring"], ["parallelism.context_parallel_rotate_method", "'ring'"]),
        (["--activation_checkpoint.mode", "some"], ["activation_checkpoint.mode"]),
        (["--parallelism.dp_mode", "ddp", "--parallelism.data_parallel_shard_degree", "2"], ["parallelism.dp_mode"]),
        (["--parallelism.enable_async_tensor_parallel", "true"], ["parallelism.enable_async_tensor_parallel"]),
        (["--parallelism.enable_async_tensor_parallel", "true", "--parallelism.tensor_parallel_degree", "2"], ["compile.enable"]),
        (["--model.converters", "mx"], ["model.converters", "B200"]),
        (["--model.converters", "float8", "--float8.recipe_name", "rowwise", "--float8.enable_fsdp_float8_all_gather", "true"],
         ["float8.enable_fsdp_float8_all_gather", "float8.recipe_name"]),
        (["--validation.enable", "true", "--parallelism.pipeline_parallel_degree", "2"], ["validation.enable"]),
        (["--checkpoint.enable", "--checkpoint.create_seed_checkpoint", "--parallelism.data_parallel_shard_degree", "2"],
         ["checkpoint.create_seed_checkpoint", "not 2"]),
        (["--checkpoint.enable", "--checkpoint.last_save_in_hf"], ["checkpoint.last_save_model_only"]),
        (["--checkpoint.enable", "--checkpoint.last_save_in_hf", "--checkpoint.last_save_model_only",
          "--parallelism.pipeline_parallel_degree", "2"], ["checkpoint.last_save_in_hf", "pipeline stages"]),
        (["--profiling.enable_memory_snapshot", "true"], ["profiling.enable_memory_snapshot", "CUDA"]),
    ],
)
def test_more_broken_jobs(overrides, expected):
    world_size = 2 if any("degree" in o or "dp_mode" in o for o in overrides) else 1
    if torch.cuda.is_available() and any(o in ("mx", "true") for o in overrides[-1:]):
        pytest.skip("the rule depends on the absence of a GPU")
    with pytest.raises(ConfigError) as caught:
        check_job(load_config(None, overrides), world_size)
    for text in expected:
        assert text in str(caught.value), (text, str(caught.value))


def test_a_valid_job_yields_what_the_trainer_builds_from():
    cfg = load_config(None, ["--parallelism.pipeline_parallel_degree", "2", "--training.local_batch_size", "4",
                             "--training.global_batch_size", "16"])
    job = check_job(cfg, 4)
    assert (job.dims.pp, job.dims.dp_shard, job.dims.dp) == (2, 2, 2)
    assert (job.global_batch, job.accum_steps) == (16, 2)
    assert job.names_per_stage[0][0] == "tok_embeddings" and job.names_per_stage[-1][-1] == "output"
    assert job.model_args.vocab_size >= job.tokenizer_vocab_size


def test_library_arguments_become_config_keys():
    error = ParallelConfigError("tp=4 does not divide n_heads=6; choose a tp that divides it", arguments=("tp",))
    assert str(as_config_error(error)) == (
        "parallelism.tensor_parallel_degree=4 does not divide n_heads=6; choose a parallelism.tensor_parallel_degree that divides it"
    )
    # Only the listed arguments are rewritten, as whole words.
    error = CheckpointError("no step 7 in /x/step-7; pick another with load_step=5", arguments=("load_step",))
    assert str(as_config_error(error)) == "no step 7 in /x/step-7; pick another with checkpoint.load_step=5"
    assert all("." in key or key.startswith("the ") for key in ARGUMENT_KEYS.values())


def test_wrong_layouts_are_one_line_before_torchrun_starts(tmp_path):
    # The two layouts of the issue: each used to end in torchrun's ChildFailedError traceback.
    for args, keys in (
        (["--parallelism.tensor_parallel_degree", "4"], ["parallelism.tensor_parallel_degree"]),
        (["--parallelism.pipeline_parallel_degree", "2", "--training.local_batch_size", "3",
          "--parallelism.pipeline_parallel_microbatch_size", "2"], ["training.local_batch_size", "parallelism.pipeline_parallel_microbatch_size"]),
    ):
        proc = run_titan(tmp_path / "run", *TINY, *args, nproc=2, check=False)
        assert proc.returncode == 2, proc.stderr[-2000:]
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("titan: error: "), proc.stderr[-2000:]
        assert all(key in lines[0] for key in keys), lines[0]
        assert not (tmp_path / "run").exists()  # no process started, nothing written


def test_an_error_on_the_ranks_reaches_the_user_as_one_line(tmp_path):
    # A checkpoint step that does not exist is found only by the ranks, at load time: the launcher
    # prints their line (argument names turned into config keys), not torchrun's traceback.
    run = tmp_path / "run"
    ckpt = ["--checkpoint.enable", "--checkpoint.interval", "5", "--training.steps", "5"]
    run_titan(run, *TINY, *ckpt, nproc=2)
    proc = run_titan(run, *TINY, *ckpt, "--checkpoint.load_step", "3", nproc=2, check=False)
    assert proc.returncode == 2, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if "error" in line.lower() or "Traceback" in line]
    assert len(errors) == 1 and errors[0].startswith("titan: error: "), proc.stderr[-3000:]
    assert "checkpoint.load_step" in errors[0], errors[0]
