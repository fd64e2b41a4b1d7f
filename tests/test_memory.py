"""`titan estimate-memory`: the analytic tier's terms against hand-derived values, the command on every
shipped config, the verdict and its fix, and an impossible layout as one line."""

from __future__ import annotations

import json
import sys

import pytest
import warm_python
from typer.testing import CliRunner

from titan_cli.main import app
from titan_core.config import ConfigError, load_config
from titan_core.memory import estimate_memory
from titan_core.memory.analytic import estimate_analytic
from titan_core.memory.budget import parse_gpu_memory, usable_bytes

LLAMA31_8B_PARAMS = 8_030_261_248  # Meta's published count
ROPE_8B = 131072 * 128 * 4  # the fp32 RoPE table (max_seq_len x head_dim) every rank holds

runner = CliRunner()


def _cli(*args: str):
    return runner.invoke(app, ["estimate-memory", *args])


def test_8b_fsdp8_model_states_are_the_published_count_over_8():
    est = estimate_analytic(load_config("llama3_8b"), 8)
    (rank,) = est.ranks
    shard = LLAMA31_8B_PARAMS // 8  # every 8B weight's rows divide by 8: no FSDP padding
    assert rank.parameters == 4 * shard + ROPE_8B
    assert rank.optimizer == 8 * shard
    # [ema]: the moving average is one more fp32 copy of the shards
    averaged = estimate_analytic(load_config("llama3_8b", ["--ema.enable", "true"]), 8).ranks[0]
    assert averaged.parameters == 8 * shard + ROPE_8B and averaged.optimizer == rank.optimizer
    # the 8B config: selective op AC, seq 8192, batch 1: the fused loss holds one chunk of logits at a time,
    # 2093 rows (1 GiB of fp32 logits), 12 x V bytes per row at its peak; the plain loss all 8192 rows
    assert rank.detail["logits_transient"] == 12 * 128256 * (2**30 // (4 * 128256))
    # the plain loss compiled (the config compiles): Inductor's backward writes one bf16 gradient of the logits
    plain = estimate_analytic(load_config("llama3_8b", ["--training.fused_loss", "false"]), 8).ranks[0]
    assert plain.detail["logits_transient"] == 2 * 128256 * 8192
    # eager, all 8192 rows: the loss's backward peaks at its kept fp32 log-softmax and two fp32 gradients (of the
    # log-softmax's output and of its input), 12 x V; the kept 4 x V counts with the saved activations
    eager = estimate_analytic(load_config("llama3_8b", ["--training.fused_loss", "false", "--compile.enable", "false"]), 8)
    assert eager.ranks[0].detail["logits_transient"] == (12 - 4) * 128256 * 8192


def test_activations_scale_with_tokens_and_tp_divides_them():
    base = [
        "--training.device",
        "cuda",
        "--training.mixed_precision_param",
        "bfloat16",
        "--training.seq_len",
        "4096",
        "--activation_checkpoint.mode",
        "none",
        "--training.fused_loss",
        "false",
        "--compile.enable",
        "false",
    ]  # the fused loss keeps its output-weight gradient, which does not scale with tokens; eager: the blocks
    # measured on fake tensors for TP 1 and 2 alike (compiled, TP 1's blocks and loss are measured from the graph)
    one = estimate_analytic(load_config("llama3_8b", base), 8).ranks[0].detail["saved_activations_per_microbatch"]
    double = estimate_analytic(load_config("llama3_8b", [*base, "--training.local_batch_size", "2"]), 8)
    # what a block keeps once per call (RoPE's table slices, measured on fake tensors) does not double
    assert double.ranks[0].detail["saved_activations_per_microbatch"] == pytest.approx(2 * one, rel=5e-3)
    tp = estimate_analytic(load_config("llama3_8b", [*base, "--parallelism.tensor_parallel_degree", "2"]), 8)
    # TP with SP splits every saved tensor except the gathered linear inputs (b d per norm, 2 per block)
    assert 0.5 * one < tp.ranks[0].detail["saved_activations_per_microbatch"] < 0.65 * one


def test_ac_modes_order_and_full_keeps_one_input_per_block():
    def saved(mode: str, option: str = "2") -> int:
        cfg = load_config(
            "llama3_8b", ["--activation_checkpoint.mode", mode, "--activation_checkpoint.selective_ac_option", option]
        )
        return estimate_analytic(cfg, 8).ranks[0].detail["saved_activations_per_microbatch"]

    none, op, every2, full = saved("none"), saved("selective", "op"), saved("selective", "2"), saved("full")
    assert full < op < every2 < none
    head = saved("full") - 32 * 8192 * 2 * 4096  # 32 blocks x T x b x d of block inputs
    assert 0 < head < none / 10  # what is left is the final norm and the log-softmax output


def test_pipeline_1f1b_first_stage_holds_pp_microbatches():
    cfg = load_config(
        "llama3_8b",
        [
            "--parallelism.pipeline_parallel_degree",
            "4",
            "--parallelism.pipeline_parallel_schedule",
            "1F1B",
            "--training.local_batch_size",
            "8",
            "--activation_checkpoint.mode",
            "full",
        ],
    )
    est = estimate_analytic(cfg, 8)
    assert [r.detail["microbatches_in_flight_x1000"] for r in est.ranks] == [4000, 3000, 2000, 1000]


def test_budget_parsing_and_usable_part():
    assert parse_gpu_memory("80GiB")[0] == 80 * 2**30
    assert parse_gpu_memory("80GB")[0] == 80 * 10**9
    assert parse_gpu_memory("h100")[0] == 80 * 2**30
    assert usable_bytes(80 * 2**30) == int((80 - 2.5) * 2**30 * 0.90)
    assert usable_bytes(2 * 2**30, "cpu") == int(2 * 2**30 * 0.90)  # no CUDA context on a CPU
    with pytest.raises(ConfigError, match="--gpu-memory 2 GiB leaves nothing for tensors"):
        usable_bytes(2 * 2**30)  # within what CUDA keeps outside the allocator: no layout would fit
    with pytest.raises(ValueError, match="--gpu-memory 'eighty'"):
        parse_gpu_memory("eighty")


@pytest.mark.parametrize(
    "config, ranks",
    [
        ("llama3_debugmodel", ["--nproc-per-node", "1"]),
        ("llama3_10m", ["--nproc-per-node", "2"]),
        ("llama3_110m", ["--nproc-per-node", "4"]),
        ("llama3_8b", ["--nproc-per-node", "8"]),
        ("llama3_70b", ["--nproc-per-node", "8", "--nnodes", "32"]),
        ("llama3_405b", ["--nproc-per-node", "8", "--nnodes", "64"]),
    ],
)
def test_every_shipped_config_prints_its_table(config, ranks):
    result = _cli("--config", config, *ranks, "--gpu-memory", "H100")
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    for component in ("parameters", "gradients", "optimizer", "activations", "communication", "temporary", "total"):
        assert any(line.startswith(component) for line in lines), component
    assert "fits" in result.output and "does NOT fit" not in result.output


def test_json_totals_are_the_sum_of_components_per_stage():
    result = _cli("--config", "llama3_405b", "--nproc-per-node", "8", "--nnodes", "64", "--json")
    data = json.loads(result.output)
    assert len(data["ranks"]) == 8  # one entry per pipeline stage
    for rank in data["ranks"]:
        parts = ("parameters", "gradients", "optimizer", "activations", "communication", "temporary")
        assert rank["total"] == sum(rank[p] for p in parts)
    assert data["peak"] == max(r["total"] for r in data["ranks"])


def test_does_not_fit_names_a_fix_that_fits():
    result = _cli(
        "--config",
        "llama3_8b",
        "--nproc-per-node",
        "8",
        "--gpu-memory",
        "40GiB",
        "--activation_checkpoint.mode",
        "none",
    )
    assert result.exit_code == 1, result.output
    assert "does NOT fit" in result.output
    fix = next(line for line in result.output.splitlines() if line.startswith("cheapest fix: "))
    flags = fix.removeprefix("cheapest fix: ").split(" (")[0].split(":")[0].split()
    fixed = estimate_memory(
        load_config("llama3_8b", ["--activation_checkpoint.mode", "none", *flags]), 8, gpu_memory="40GiB"
    )
    assert fixed.fits


def test_impossible_layout_is_one_line_naming_the_key():
    proc = warm_python.run(
        [
            sys.executable,
            "-m",
            "titan_cli",
            "estimate-memory",
            "--config",
            "llama3_8b",
            "--nproc-per-node",
            "8",
            "--parallelism.tensor_parallel_degree",
            "3",
        ],
        timeout=120,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0, proc.stderr
    assert "parallelism.tensor_parallel_degree" in proc.stderr and proc.stderr.startswith("titan: error: ")


def test_rules_are_the_trainers():
    with pytest.raises(ConfigError, match="training.global_batch_size"):
        estimate_analytic(load_config("llama3_8b", ["--training.global_batch_size", "12"]), 8)


def test_traced_tier_runs_the_step_and_falls_back_naming_what_it_cannot_trace():
    traced = _cli("--config", "llama3_debugmodel", "--nproc-per-node", "2", "--traced", "--json")
    assert traced.exit_code == 0, traced.output
    data = json.loads(traced.output[traced.output.index("{") :])
    assert data["tier"] == "traced" and data["world_size"] == 2
    (rank,) = data["ranks"]
    assert rank["total"] == rank["detail"]["tracker_total"]  # the components add up to the tracker's peak
    shard = rank["parameters"] - rank["detail"]["tracker_buffer"]  # the rank's fp32 parameter shards
    assert 0 <= rank["optimizer"] - 2 * shard < 4096  # AdamW's two fp32 moments, and a scalar step per parameter
    pipeline = _cli(
        "--config",
        "llama3_debugmodel",
        "--nproc-per-node",
        "2",
        "--traced",
        "--parallelism.pipeline_parallel_degree",
        "2",
    )
    assert pipeline.exit_code == 0, pipeline.output
    assert "analytic estimate, 2 ranks" in pipeline.output
    assert "note: not traced: pipeline parallel (parallelism.pipeline_parallel_degree > 1)" in pipeline.output
    alone = _cli("--config", "llama3_debugmodel")
    assert alone.exit_code == 0 and "analytic estimate, 1 rank: no parallelism (" in alone.output, alone.output


def test_torchft_replica_groups_add_the_flat_gradient_copy():
    """A torchft replica group averages its gradient shards across groups through one flat copy per dtype
    (titan_core.fault_tolerance): between backward and the step the rank holds every gradient twice."""
    from titan_core.memory import estimate_memory

    base = ["--model.flavor", "debugmodel", "--training.local_batch_size", "1", "--training.seq_len", "64"]
    ft = [*base, "--fault_tolerance.enable", "true", "--fault_tolerance.group_size", "2"]
    ft += ["--fault_tolerance.lighthouse", "http://localhost:29510"]
    plain = estimate_analytic(load_config(None, base), 1, device_type="cpu").ranks[0]
    replica = estimate_analytic(load_config(None, ft), 1, device_type="cpu").ranks[0]
    assert "peak_moment_replica_all-reduce" in replica.detail  # the debug model at 64 tokens: model states dominate
    assert replica.total == plain.parameters + plain.optimizer + 2 * replica.gradients
    traced = estimate_memory(load_config(None, ft), 1, device_type="cpu", traced=True)
    assert traced.tier == "analytic" and "fault_tolerance.enable" in traced.notes[0]


def test_diloco_adds_its_anchors_and_outer_momentum_and_no_gradient_copy():
    """DiLoCo (`fault_tolerance.semi_sync_method`) keeps the last sync's weights and the outer momentum, two fp32
    copies of the rank's parameters (local SGD: one, no momentum), and averages no gradients each step: its sync
    writes the pseudo-gradients into one flat buffer after the inner gradients are freed (titan_core.diloco)."""
    base = ["--model.flavor", "debugmodel", "--training.local_batch_size", "1", "--training.seq_len", "64"]
    ft = [*base, "--fault_tolerance.enable", "true", "--fault_tolerance.group_size", "2"]
    ft += ["--fault_tolerance.lighthouse", "http://localhost:29510"]
    plain = estimate_analytic(load_config(None, base), 1, device_type="cpu").ranks[0]
    for method, copies in (("diloco", 2), ("local_sgd", 1)):
        cfg = load_config(None, [*ft, "--fault_tolerance.semi_sync_method", method])
        rank = estimate_analytic(cfg, 1, device_type="cpu").ranks[0]
        weights = plain.gradients  # fp32 gradients: 4 bytes per parameter, as the copies (buffers aside)
        assert rank.parameters == plain.parameters + copies * weights, method
        assert rank.total == plain.total + copies * weights, method  # the step's peak moment is unchanged
        assert "peak_moment_replica_all-reduce" not in rank.detail
    # Overlapped (fragment_sync_delay): a fragment's flat buffer lives through the next steps' peaks too.
    cfg = load_config(None, [*ft, "--fault_tolerance.semi_sync_method", "diloco", "--fault_tolerance.num_fragments",
                             "2", "--fault_tolerance.sync_steps", "4", "--fault_tolerance.fragment_sync_delay", "1"])
    rank = estimate_analytic(cfg, 1, device_type="cpu").ranks[0]
    assert rank.total == plain.total + 2 * plain.gradients + plain.gradients // 2
    # bfloat16 on the wire: the held buffer halves (read back as fp32 at the outer step, below the step's peak)
    cfg = load_config(None, [*ft, "--fault_tolerance.semi_sync_method", "diloco", "--fault_tolerance.num_fragments",
                             "2", "--fault_tolerance.sync_steps", "4", "--fault_tolerance.fragment_sync_delay", "1",
                             "--fault_tolerance.sync_dtype", "bfloat16"])
    rank = estimate_analytic(cfg, 1, device_type="cpu").ranks[0]
    assert rank.total == plain.total + 2 * plain.gradients + plain.gradients // 4


def test_the_table_says_which_moment_of_the_step_holds_the_peak():
    """A long sequence on FSDP 8 peaks in the backward, before FSDP's gradient shards exist (the table's 0 gradients
    is that moment's, not a missing term); 16 tokens on one rank peak at the optimizer step, every gradient alive;
    a pipeline's stages peak at their own moments, named per stage. The 8B config compiles its blocks under selective
    AC, which the estimate measures compiled: torch's warning to the authors of such regions stays out of its output
    (a process of its own: the warning is printed once per process)."""
    long = warm_python.run([sys.executable, "-m", "titan_cli", "estimate-memory", "--config", "llama3_8b",
                           "--nproc-per-node", "8"], timeout=300)  # fmt: skip
    assert long.returncode == 0, long.stderr[-3000:]
    assert "context_fn" not in long.stdout + long.stderr, long.stderr[-3000:]
    assert any(line.startswith("at the peak: the") and "backward" in line for line in long.stdout.splitlines())
    assert next(line for line in long.stdout.splitlines() if line.startswith("gradients")).split()[1:] == ["0.0", "MiB"]
    short = _cli("--training.seq_len", "16", "--training.local_batch_size", "1")
    assert short.exit_code == 0, short.output
    assert "at the peak: the optimizer step" in short.output.splitlines()
    assert next(line for line in short.output.splitlines() if line.startswith("gradients")).split()[1:] != ["0.0", "MiB"]
    staged = _cli("--parallelism.pipeline_parallel_degree", "2", "--nproc-per-node", "2")
    line = next(line for line in staged.output.splitlines() if line.startswith("at the peak:"))
    assert line.endswith("(stage 1)") and "(stage 0)" in line, line
