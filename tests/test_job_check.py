"""Every rule of a valid job, written once (`titan_core.job.RULES`) and run once per `resolve`, and how a broken
one is reported: one line naming the config keys (found by lookup from the library error's arguments), before
any process starts, and the same for an error raised later on a rank."""

from __future__ import annotations

import dataclasses
import inspect
import sys

import pytest
import torch
from titan_ckpt import CheckpointError, CheckpointManager, CheckpointOptions
from titan_cli.main import app
from titan_core.config import ConfigError, load_config
from titan_core.config.keys import list_keys
from titan_core.converters import FLOAT8_KEYS, MX_KEYS
from titan_core.job import RULES, Job, Rule, config_error, resolve
from titan_core.job.naming import PARALLEL_KEYS, RUN_KEYS
from titan_core.job.options import CHECKPOINT_KEYS, DIMS_KEYS, PARALLEL_OPTION_KEYS, PIPELINE_KEYS
from titan_core.launch import error_line
from titan_parallel import ParallelConfigError, ParallelDims, ParallelOptions, PipelineConfig
from titan_models import get_model_spec, registry
from titan_models.llama3 import Transformer
from titan_parallel.float8 import Float8Options, MXOptions
from typer.testing import CliRunner

from titan_run import TINY, run_titan

# One job that breaks each rule: (overrides, world size, substrings the one-line message must hold). Where a
# library's rule is broken, the message is the library's own, followed by the key behind each argument it names.
BROKEN = {
    "device": (["--training.device", "cuda"], 1, ["device='cuda' but no CUDA GPU", "(device set by training.device)"]),
    "model_shape": (["--model.flavor", "debugmodle"], 1, ["model.flavor", "debugmodel"]),
    "moe": (["--moe.router_z_loss_coeff", "0.001"], 1,
            ["moe.router_z_loss_coeff: model.name='llama3' flavor 'debugmodel' has no Mixture-of-Experts",
             "remove it or choose an MoE flavor"]),
    "mup": (["--mup.enable", "true", "--model.name", "deepseek_v3"], 1,
            ["mup.enable: deepseek_v3 models have no muP", "use llama3 or qwen3"]),
    "degrees": (["--parallelism.tensor_parallel_degree", "4"], 2,
                ["world size 2 is not divisible by tp=4", "(tp set by parallelism.tensor_parallel_degree)"]),
    "mtp": (["--mtp.layers", "1", "--parallelism.pipeline_parallel_degree", "2",
             "--parallelism.pipeline_parallel_schedule", "ZBVZeroBubble"], 2,
            ["mtp.layers=1 with parallelism.pipeline_parallel_schedule='ZBVZeroBubble'", "use 1F1B"]),
    "batch": (["--training.local_batch_size", "4", "--training.global_batch_size", "10"], 2,
              ["training.global_batch_size=10", "training.local_batch_size"]),
    "tensor_parallel": (["--parallelism.tensor_parallel_degree", "3"], 3,
                        ["tp=3 does not divide", "(tp set by parallelism.tensor_parallel_degree)"]),
    "expert_parallel": (["--model.name", "deepseek_v3", "--parallelism.expert_parallel_degree", "3"], 3,
                        ["8 experts", "(ep set by parallelism.expert_parallel_degree)"]),
    "context_parallel": (["--parallelism.context_parallel_degree", "2", "--training.seq_len", "30"], 2,
                         ["seq_len=30 is not divisible by 2 x cp=2",
                          "(seq_len set by training.seq_len, cp set by parallelism.context_parallel_degree)"]),
    "activation_checkpoint": (["--activation_checkpoint.mode", "selective", "--activation_checkpoint.selective_ac_option", "two"], 1,
                              ["ac_selective_option='two'", "(ac_selective_option set by activation_checkpoint.selective_ac_option)"]),
    "compile": (["--compile.enable", "true", "--compile.backend", "inductr"], 1,
                ["compile_backend='inductr' is not a registered torch.compile backend; choose 'inductor', 'aot_eager' or "
                 "'eager'", "(compile_backend set by compile.backend)"]),
    "pipeline": (["--parallelism.pipeline_parallel_degree", "2", "--training.local_batch_size", "3",
                  "--parallelism.pipeline_parallel_microbatch_size", "2"], 2,
                 ["local_batch_size=3 is not divisible by microbatch_size=2",
                  "(local_batch_size set by training.local_batch_size, "
                  "microbatch_size set by parallelism.pipeline_parallel_microbatch_size)"]),
    "converters": (["--model.converters", "float8,mx"], 1, ["model.converters"]),
    "checkpoint": (["--checkpoint.last_save_in_hf", "true"], 1, ["checkpoint.last_save_in_hf", "checkpoint.enable"]),
    "profiling": (["--profiling.enable_profiling", "true", "--profiling.profile_freq", "3",
                   "--profiling.profiler_active", "3"], 1,
                  ["profiling.profile_freq=3", "profiling.profiler_warmup=1 + profiling.profiler_active=3", ">= 4"]),
    "metrics": (["--metrics.enable_wandb", "true"], 1, ["metrics.enable_wandb", "pip install 'titan-core[wandb]'"]),
    "lr_schedule": (["--training.steps", "3", "--lr_scheduler.warmup_steps", "5"], 1,
                    ["lr_scheduler.warmup_steps: 5 must be between 0 and training.steps (3)", "unset it"]),
    "data": (["--training.dataset_path", "/tmp/shards", "--training.dataset_mix", '[{"path": "/tmp/a", "weight": 1}]'], 1,
             ["training.dataset_mix and training.dataset_path=/tmp/shards are both set", "unset training.dataset_path"]),
    "attention_mask": (["--model.name", "causal_only_test", "--model.attn_mask_type", "block_causal"], 1,
                       ["model.attn_mask_type = 'block_causal': model.name 'causal_only_test'",
                        "takes no document_ids", "set attn_mask_type to 'causal'"]),
    "fault_tolerance": (["--fault_tolerance.enable", "true", "--fault_tolerance.replica_id", "2",
                         "--fault_tolerance.group_size", "2", "--fault_tolerance.lighthouse", "http://localhost:29510"], 1,
                        ["fault_tolerance.replica_id=2 must be below fault_tolerance.group_size=2"]),
    "master_weights": (["--optimizer.master_weights", "on", "--training.mixed_precision_param", "float32"], 1,
                       ["optimizer.master_weights = 'on' cannot train this job", "float32"]),
    "weight_decay": (["--optimizer.weight_decay_exclude", "*.bias,*nrom*"], 1,
                     ["optimizer.weight_decay_exclude: '*.bias', '*nrom*' match no parameter of llama3 debugmodel",
                      "layers.0.attention_norm.weight"]),
    "z_loss": (["--training.z_loss_weight", "1e-4", "--training.fused_loss", "false",
                "--parallelism.tensor_parallel_degree", "2"], 2,
               ["training.z_loss_weight under tensor parallel needs training.fused_loss = true",
                "parallelism.disable_loss_parallel = true"]),
    "ema": (["--ema.validation", "true", "--ema.enable", "true"], 1,
            ["ema.validation = true scores the averaged weights", "set validation.enable = true"]),
}

FT_ON = ["--fault_tolerance.enable", "true", "--fault_tolerance.group_size", "2",
         "--fault_tolerance.lighthouse", "http://localhost:29510"]

# The keys a broken library rule's error carries as data (`ConfigError.keys`), in the order the library named them.
NAMED_KEYS = {
    "device": ("training.device",),
    "degrees": ("parallelism.tensor_parallel_degree",),
    "tensor_parallel": ("parallelism.tensor_parallel_degree",),
    "expert_parallel": ("parallelism.expert_parallel_degree",),
    "context_parallel": ("training.seq_len", "parallelism.context_parallel_degree"),
    "activation_checkpoint": ("activation_checkpoint.selective_ac_option",),
    "compile": ("compile.backend",),
    "pipeline": ("training.local_batch_size", "parallelism.pipeline_parallel_microbatch_size"),
}


def register_causal_only_family(monkeypatch) -> None:
    """`causal_only_test`: Llama 3 written before document masks (`forward(tokens)`), in the registry for one test
    (`register_model_spec` would keep it for the rest of the session)."""
    llama = get_model_spec("llama3")

    class CausalOnly(Transformer):
        def forward(self, tokens):
            return super().forward(tokens)

    spec = dataclasses.replace(llama, name="causal_only_test", build=CausalOnly)
    monkeypatch.setitem(registry._MODEL_SPECS, "causal_only_test", spec)


def test_every_rule_has_a_broken_example():
    assert [rule.name for rule in RULES] == list(BROKEN)


@pytest.mark.parametrize("rule", list(BROKEN))
def test_a_broken_rule_is_one_line_naming_the_keys(rule, monkeypatch):
    overrides, world_size, expected = BROKEN[rule]
    if rule == "device" and torch.cuda.is_available():
        pytest.skip("a CUDA device is visible")
    if rule == "metrics":
        monkeypatch.setitem(sys.modules, "wandb", None)  # as if the optional package were not installed
    if rule == "attention_mask":
        register_causal_only_family(monkeypatch)
    with pytest.raises(ConfigError) as caught:
        resolve(load_config(None, overrides), world_size)
    message = str(caught.value)
    assert "\n" not in message
    for text in expected:
        assert text in message, (text, message)
    assert caught.value.keys == NAMED_KEYS.get(rule, ()), caught.value.keys


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (["--parallelism.pipeline_parallel_schedule", "1f1b"], ["parallelism.pipeline_parallel_schedule", "'1f1b'", "GPipe", "DualPipeV"]),
        (["--parallelism.context_parallel_rotate_method", "ring"], ["parallelism.context_parallel_rotate_method", "'ring'"]),
        (["--activation_checkpoint.mode", "some"], ["activation_checkpoint.mode"]),
        (["--activation_checkpoint.mode", "memory_budget"],
         ["ac_mode='memory_budget' needs compile=True", "(ac_mode set by activation_checkpoint.mode, compile set by compile.enable)"]),
        (["--activation_checkpoint.mode", "memory_budget", "--compile.enable", "true", "--compile.components", "loss"],
         ["needs compile=True"]),
        (["--activation_checkpoint.mode", "memory_budget", "--compile.enable", "true",
          "--activation_checkpoint.memory_budget", "1.5"],
         ["ac_memory_budget=1.5 is outside [0, 1]", "(ac_memory_budget set by activation_checkpoint.memory_budget)"]),
        (["--parallelism.dp_mode", "ddp", "--parallelism.data_parallel_shard_degree", "2"], ["parallelism.dp_mode"]),
        (["--parallelism.enable_async_tensor_parallel", "true"], ["parallelism.enable_async_tensor_parallel"]),
        (["--parallelism.enable_async_tensor_parallel", "true", "--parallelism.tensor_parallel_degree", "2"],
         ["(async_tp set by parallelism.enable_async_tensor_parallel, compile set by compile.enable, "
          "device_type set by training.device)"]),
        (["--model.converters", "mx"], ["model.converters = ['mx']: MXFP8 needs", "B200", "(device_type set by training.device)"]),
        (["--model.converters", "float8", "--float8.recipe_name", "rowwise", "--float8.enable_fsdp_float8_all_gather", "true"],
         ["(enable_fsdp_float8_all_gather set by float8.enable_fsdp_float8_all_gather, recipe_name set by float8.recipe_name)"]),
        (["--validation.enable", "true", "--validation.local_batch_size", "2", "--parallelism.pipeline_parallel_degree",
          "2"], ["validation.local_batch_size=2", "training.local_batch_size=8", "pipeline parallel"]),
        (["--validation.enable", "true", "--parallelism.pipeline_parallel_degree", "2",
          "--parallelism.pipeline_parallel_schedule", "DualPipeV"], ["validation.enable", "'DualPipeV'", "schedule.eval"]),
        (["--checkpoint.enable", "--checkpoint.create_seed_checkpoint", "--parallelism.data_parallel_shard_degree", "2"],
         ["checkpoint.create_seed_checkpoint", "not 2"]),
        (["--checkpoint.enable", "--checkpoint.last_save_in_hf"], ["checkpoint.last_save_model_only"]),
        (["--checkpoint.enable", "--checkpoint.last_save_in_hf", "--checkpoint.last_save_model_only",
          "--parallelism.pipeline_parallel_degree", "2"], ["checkpoint.last_save_in_hf", "pipeline stages"]),
        (["--profiling.enable_memory_snapshot", "true"], ["profiling.enable_memory_snapshot", "CUDA"]),
        (["--checkpoint.enable", "true", "--checkpoint.interval", "4", "--checkpoint.keep_interval", "6"],
         ["checkpoint.keep_interval=6 is not a multiple of checkpoint.interval=4"]),
        (["--checkpoint.load_only"], ["checkpoint.load_only is set but checkpoint.enable is false"]),
        (["--compile.enable", "true", "--compile.backend", "inductor", "--parallelism.tensor_parallel_degree", "2",
          "--training.device", "cpu"],
         ["compile_backend='inductor' with tp=2 on CPU", "(compile_backend set by compile.backend, tp set by "
          "parallelism.tensor_parallel_degree, device_type set by training.device)"]),
        (["--compile.enable", "true", "--compile.backend", "eager", "--activation_checkpoint.mode", "memory_budget"],
         ["ac_mode='memory_budget' needs a backend whose partitioner the budget steers (inductor, aot_eager, "
          "aot_eager_decomp_partition), not compile_backend='eager'"]),
        (["--checkpoint.enable", "--checkpoint.load_only", "--checkpoint.create_seed_checkpoint"],
         ["checkpoint.load_only saves nothing, but checkpoint.create_seed_checkpoint asks for a save; unset one"]),
        (FT_ON + ["--fault_tolerance.semi_sync_method", "diloco", "--training.on_nonfinite", "rollback",
                  "--checkpoint.enable"], ["between the syncs of fault_tolerance.semi_sync_method = 'diloco'",
                                           "training.on_nonfinite = 'skip_step'"]),
        (FT_ON + ["--fault_tolerance.min_replica_size", "3"], ["fault_tolerance.min_replica_size=3"]),
        (FT_ON + ["--fault_tolerance.process_group", "nccl"], ["fault_tolerance.process_group = 'nccl'", "'gloo'"]),
        (["--fault_tolerance.semi_sync_method", "diloco"], ["semi_sync_method = 'diloco'", "fault_tolerance.enable"]),
        (FT_ON + ["--fault_tolerance.semi_sync_method", "local_sgd", "--fault_tolerance.outer_momentum", "0.5"],
         ["fault_tolerance.outer_momentum is DiLoCo's", "semi_sync_method = 'diloco'"]),
        (FT_ON + ["--fault_tolerance.num_fragments", "2"], ["fault_tolerance.num_fragments=2", "'diloco'"]),
        (FT_ON + ["--fault_tolerance.fragment_update_alpha", "0.5"],
         ["fault_tolerance.fragment_update_alpha shapes the syncs", "'diloco'"]),
        (FT_ON + ["--fault_tolerance.sync_dtype", "bfloat16"], ["fault_tolerance.sync_dtype shapes the syncs"]),
        (FT_ON + ["--fault_tolerance.semi_sync_method", "diloco", "--fault_tolerance.num_fragments", "2",
                  "--fault_tolerance.sync_steps", "10", "--fault_tolerance.fragment_sync_delay", "5"],
         ["fragment_sync_delay=5 must be below sync_steps / num_fragments = 5"]),
        (FT_ON + ["--fault_tolerance.semi_sync_method", "diloco", "--debug.seed", "none"],
         ["averages the groups' weight changes from one start", "set debug.seed"]),
        (FT_ON + ["--fault_tolerance.semi_sync_method", "diloco", "--fault_tolerance.num_fragments", "3",
                  "--fault_tolerance.sync_steps", "10"], ["sync_steps=10 is not a multiple of", "num_fragments=3"]),
        (FT_ON + ["--fault_tolerance.semi_sync_method", "diloco", "--fault_tolerance.num_fragments", "12",
                  "--fault_tolerance.sync_steps", "12"], ["num_fragments=12 exceeds the model's 6 blocks"]),
        # The TP ranks joining expert parallel (etp=1) need an ep that spans them.
        (["--model.name", "deepseek_v3", "--parallelism.tensor_parallel_degree", "2",
          "--parallelism.expert_parallel_degree", "4", "--parallelism.expert_tensor_parallel_degree", "1"],
         ["ep=4 must be cp=1 x tp=2 times a divisor of dp_shard=1",
          "etp set by parallelism.expert_tensor_parallel_degree"]),
        (["--model.name", "deepseek_v3", "--parallelism.tensor_parallel_degree", "2",
          "--parallelism.expert_tensor_parallel_degree", "3"], ["etp=3 must be tp=2"]),
    ],
)
def test_more_broken_jobs(overrides, expected):
    world_size = 2 if any("degree" in o or "dp_mode" in o for o in overrides) else 1
    if torch.cuda.is_available() and any(o in ("mx", "true") for o in overrides[-1:]):
        pytest.skip("the rule depends on the absence of a GPU")
    with pytest.raises(ConfigError) as caught:
        resolve(load_config(None, overrides), world_size)
    for text in expected:
        assert text in str(caught.value), (text, str(caught.value))


def test_a_valid_job_yields_what_the_trainer_builds_from(tmp_path):
    cfg = load_config(None, ["--parallelism.pipeline_parallel_degree", "2", "--training.local_batch_size", "4",
                             "--training.global_batch_size", "16", "--job.dump_folder", str(tmp_path),
                             "--checkpoint.enable", "--checkpoint.interval", "7", "--optimizer.lr", "0.01"])
    job = resolve(cfg, 4)
    assert (job.dims.pp, job.dims.dp_shard, job.dims.dp) == (2, 2, 2)
    assert (job.global_batch, job.accum_steps) == (16, 2)
    assert job.names_per_stage[0][0] == "tok_embeddings" and job.names_per_stage[-1][-1] == "output"
    assert job.model_args.vocab_size >= job.tokenizer_vocab_size
    # The libraries' own options, built once here.
    assert job.parallel.pipeline_parallel and job.parallel.dp_mode == "fsdp" and job.dtype_reason
    assert job.parallel.param_dtype in (torch.bfloat16, torch.float32) and job.parallel.reduce_dtype == torch.float32
    assert job.pipeline == PipelineConfig(schedule="1F1B", microbatch_size=1)
    assert job.optimizer.lr == 0.01 and job.optimizer.betas == (0.9, 0.95)
    assert job.checkpoint == CheckpointOptions(folder=tmp_path / "checkpoint", enable=True, interval=7)
    assert job.converters.float8 is None and job.converters.mx is None
    assert job.meta_model() is job.meta_model()  # built once


@pytest.mark.parametrize(
    ("overrides", "warmup", "note"),
    [
        ([], 10, None),  # the default, in a run of 20 steps
        (["--training.steps", "10"], 10, None),
        (["--training.steps", "1"], 1, "warming up over all 1 step(s) of training.steps"),
        (["--training.steps", "4"], 4, "warming up over all 4 step(s)"),
        (["--training.steps", "4", "--lr_scheduler.warmup_steps", "4"], 4, None),  # set: kept, no note
        (["--training.steps", "4", "--lr_scheduler.warmup_steps", "0"], 0, None),
    ],
)
def test_the_default_warmup_fits_a_shorter_run(overrides, warmup, note):
    job = resolve(load_config(None, ["--training.steps", "20", *overrides]), 1)
    assert job.warmup_steps == warmup
    assert (job.warmup_note is None) if note is None else (note in job.warmup_note)


def test_an_unknown_world_size_leaves_only_what_needs_it_unset():
    job = resolve(load_config(None, []), None)  # an elastic --nnodes range
    assert (job.dims, job.global_batch, job.accum_steps, job.names_per_stage) == (None, None, None, None)
    assert job.parallel == dataclasses.replace(job.parallel, pipeline_parallel=False)


def test_the_job_is_frozen():
    job = resolve(load_config(None, []), 1)
    with pytest.raises(dataclasses.FrozenInstanceError):
        job.accum_steps = 3
    with pytest.raises(dataclasses.FrozenInstanceError):
        job.parallel = ParallelOptions()
    assert isinstance(job, Job) and all(
        type(value).__dataclass_params__.frozen  # the libraries' options are frozen values too
        for value in (job.parallel, job.pipeline, job.optimizer, job.checkpoint, job.converters, job.dims)
    )


def test_each_rule_and_each_library_check_runs_once_per_resolve(monkeypatch):
    import titan_parallel
    import titan_parallel.expert_parallel
    import titan_parallel.float8

    import titan_core.job.resolved as resolved
    import titan_core.job.rules as rules

    calls: dict[str, int] = {}

    def counted(name, fn):
        def wrapper(*args, **kwargs):
            calls[name] = calls.get(name, 0) + 1
            return fn(*args, **kwargs)

        return wrapper

    library = {
        titan_parallel: ("resolve_device", "check_data_parallel", "check_tp", "check_cp", "check_cp_method",
                         "check_rotate_method", "check_ac", "check_pipeline"),
        titan_parallel.expert_parallel: ("check_ep",),
        titan_parallel.float8: ("check_float8",),
        rules: ("parallel_dims", "parallel_options", "pipeline_config", "build_meta_model"),
        resolved: ("optimizer_options", "checkpoint_options"),
    }
    for module, names in library.items():
        for name in names:
            monkeypatch.setattr(module, name, counted(name, getattr(module, name)))
    monkeypatch.setattr(resolved, "RULES", tuple(Rule(r.name, counted(r.name, r.check), r.keys) for r in RULES))
    monkeypatch.setattr("titan_core.job.meta_model._META_MODELS", {})  # built here, not found in the cache
    cfg = load_config(None, ["--parallelism.pipeline_parallel_degree", "2", "--training.local_batch_size", "2",
                             "--model.converters", "float8", "--float8.emulate", "true"])
    job = resolve(cfg, 2)
    job.meta_model()  # the rules' model, not a second one
    expected = [rule.name for rule in RULES] + [name for names in library.values() for name in names]
    assert calls == dict.fromkeys(expected, 1), calls


def test_library_errors_name_their_keys_by_lookup():
    # The library's message stays as it is; the keys behind the arguments it names follow it.
    error = ParallelConfigError("tp=4 does not divide n_heads=6; choose a tp that divides it", arguments=("tp",))
    named = config_error(error, {"tp": "parallelism.tensor_parallel_degree"})
    assert str(named) == (
        "tp=4 does not divide n_heads=6; choose a tp that divides it (tp set by parallelism.tensor_parallel_degree)"
    )
    assert named.keys == ("parallelism.tensor_parallel_degree",)
    # One name, two keys: only the table of the call that raised it decides.
    recipe = ParallelConfigError("recipe_name='x' is unknown", arguments=("recipe_name",))
    assert str(config_error(recipe, FLOAT8_KEYS)).endswith("(recipe_name set by float8.recipe_name)")
    assert str(config_error(recipe, MX_KEYS)).endswith("(recipe_name set by mx.recipe_name)")
    assert str(config_error(recipe)) == "recipe_name='x' is unknown"  # outside its rule: not guessed
    # Raised on a rank, outside any rule: looked up in the table of the library that raised it.
    missing = CheckpointError("no step 7 in /x/step-7; pick another with load_step=5", arguments=("load_step",))
    assert str(config_error(missing)) == (
        "no step 7 in /x/step-7; pick another with load_step=5 (load_step set by checkpoint.load_step)"
    )
    assert error_line(missing) == f"titan: error: {config_error(missing)}"
    seed = CheckpointError("a seed checkpoint needs a manager with enable=True", arguments=("enable",))
    assert config_error(seed).keys == ("checkpoint.enable",)
    assert config_error(ParallelConfigError("enable=True is wrong", arguments=("enable",))).keys == ()
    # An argument no key sets is left as the library named it.
    assert str(config_error(CheckpointError("rename that entry of states", arguments=("states",)))) == (
        "rename that entry of states"
    )


def test_every_table_maps_real_fields_to_real_keys():
    keys = set(list_keys())
    manager_arguments = set(inspect.signature(CheckpointManager).parameters)
    for table, fields in (
        (DIMS_KEYS, {f.name for f in dataclasses.fields(ParallelDims)}),
        (PARALLEL_OPTION_KEYS, {f.name for f in dataclasses.fields(ParallelOptions)}),
        (PIPELINE_KEYS, {f.name for f in dataclasses.fields(PipelineConfig)}),
        (FLOAT8_KEYS, {f.name for f in dataclasses.fields(Float8Options)}),
        (MX_KEYS, {f.name for f in dataclasses.fields(MXOptions)}),
        (CHECKPOINT_KEYS, {f.name for f in dataclasses.fields(CheckpointOptions)} | manager_arguments),
    ):
        assert set(table) <= fields, set(table) - fields
        assert all(key in keys or key.startswith("--") for key in table.values()), table
    assert set(DIMS_KEYS) | set(PARALLEL_OPTION_KEYS) == {f.name for f in dataclasses.fields(ParallelDims)} | {
        f.name for f in dataclasses.fields(ParallelOptions)
    }  # every degree and option has its key
    assert all(key in keys for key in RUN_KEYS.values()) and set(PARALLEL_KEYS) >= set(RUN_KEYS)
    for rule in RULES:
        assert all(key in keys or key.startswith("--") for key in rule.keys.values()), rule.name


def test_wrong_layouts_are_one_line_before_torchrun_starts(tmp_path):
    # The two layouts of the issue: each used to end in torchrun's ChildFailedError traceback.
    for i, (args, keys) in enumerate((
        (["--parallelism.tensor_parallel_degree", "4"], ["parallelism.tensor_parallel_degree"]),
        (["--parallelism.pipeline_parallel_degree", "2", "--training.local_batch_size", "3",
          "--parallelism.pipeline_parallel_microbatch_size", "2"], ["training.local_batch_size", "parallelism.pipeline_parallel_microbatch_size"]),
    )):
        if i == 0:  # a real `titan train` process: its whole stderr is the one line
            proc = run_titan(tmp_path / "run", *TINY, *args, nproc=2, check=False)
            code, stderr = proc.returncode, proc.stderr
        else:  # the same command in this process (torch is imported already: no second start-up to pay)
            folder = ["--job.dump_folder", str(tmp_path / "run")]
            result = CliRunner().invoke(app, ["train", "--nproc-per-node", "2", *folder, *TINY, *args])
            code, stderr = result.exit_code, result.stderr
        assert code == 2, stderr[-2000:]
        lines = stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("titan: error: "), stderr[-2000:]
        assert all(key in lines[0] for key in keys), lines[0]
        assert not (tmp_path / "run").exists()  # no process started, nothing written


def test_an_error_on_the_ranks_reaches_the_user_as_one_line(tmp_path):
    # A checkpoint step that does not exist is found only by the ranks, at load time: the launcher
    # prints their line (argument names turned into config keys), not torchrun's traceback. The run folder
    # holds no checkpoint at all (`_choose_step` is the same either way: load_step not among the complete steps),
    # which spares a first 2-rank run that would save one.
    run = tmp_path / "run"
    ckpt = ["--checkpoint.enable", "--checkpoint.interval", "5", "--training.steps", "5"]
    # OMP_NUM_THREADS unset, as in a user's shell: the launcher sets torchrun's default of 1 itself, without
    # torchrun's 7-line "Setting OMP_NUM_THREADS environment variable for each process" banner
    proc = run_titan(run, *TINY, *ckpt, "--checkpoint.load_step", "3", nproc=2, check=False,
                     env={"OMP_NUM_THREADS": None})  # fmt: skip
    assert proc.returncode == 2, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if "error" in line.lower() or "Traceback" in line]
    assert len(errors) == 1 and errors[0].startswith("titan: error: "), proc.stderr[-3000:]
    assert "OMP_NUM_THREADS" not in proc.stdout + proc.stderr, proc.stderr[-3000:]
    assert "checkpoint.load_step" in errors[0] and "complete checkpoints: none" in errors[0], errors[0]
