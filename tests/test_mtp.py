"""Multi-token prediction (DeepSeek-V3's MTP, `mtp.layers`): each depth's rows against the paper's equations
written out on truncated sequences, the loss against its definition (value and gradient), the Hugging Face
layout of the Hub checkpoints, the parameter and FLOP counts, the job check's refusals, and `titan train` with
two depths: FSDP 2, TP 2 (fused and plain loss), EP 2, full AC and compiled blocks against one process at every
step, a zero weight that leaves the language model's training as without MTP, and the trained run converted to
Hugging Face files (parity-checked) and back, and sampled from."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from titan_cli.main import app
from titan_core.config import ConfigError, load_config
from titan_core.job import resolve
from titan_core.step_loss import StepLoss, cross_entropy_loss, shift_labels
from titan_models import get_model_spec
from titan_models.deepseek_v3 import Transformer, count_params, flops_per_token
from titan_models.deepseek_v3.hf_adapter import from_hf_state_dict, to_hf_state_dict
from titan_models.mtp import MTPDepth
from titan_models.mup import MuP
from typer.testing import CliRunner

from titan_run import losses, read_metrics, run_titan_all

DEBUG = get_model_spec("deepseek_v3").flavors["debugmodel"]
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


def small_model(depths: int = 2, family: str = "deepseek_v3", **changes) -> torch.nn.Module:
    spec = get_model_spec(family)
    args = dataclasses.replace(spec.flavors["debugmodel"], n_layers=2, n_mtp_layers=depths, vocab_size=97,
                               max_seq_len=64, **changes)  # fmt: skip
    torch.manual_seed(0)
    model = spec.build(args)
    model.init_weights()
    return model.double()


FAMILIES = {  # row -> (family, ModelArgs changes)
    "deepseek_v3": ("deepseek_v3", {}),
    "llama3": ("llama3", {}),
    "qwen3": ("qwen3", {}),
    # muP's multipliers reach the depths: the embeddings of the tokens ahead and each depth's head input
    "llama3_mup": ("llama3", {"mup": MuP(base_dim=128, base_head_dim=32, embedding_multiplier=3.0, output_multiplier=2.0)}),
}


@pytest.mark.parametrize("row", FAMILIES)
def test_each_depth_predicts_one_more_token_ahead_as_the_paper_writes_it(row):
    family, changes = FAMILIES[row]
    model = small_model(2, family, **changes)
    mup = model.args.mup if family != "deepseek_v3" else None
    emb_mult, readout = (mup.embedding_multiplier, mup.readout_scale(model.args.dim)) if mup else (1.0, 1.0)
    n_layers, seqlen = model.args.n_layers, 24
    tokens = torch.randint(0, 97, (2, seqlen), generator=torch.Generator().manual_seed(3))
    captured = []
    model.norm.register_forward_pre_hook(lambda module, inputs: captured.append(inputs[0]))  # the main hidden states
    with torch.no_grad():
        stacked = model(tokens, mtp=True)  # (2 * 3, seqlen, vocab)
        plain = model(tokens)
    assert stacked.shape == (6, seqlen, 97)
    torch.testing.assert_close(stacked[:2], plain, rtol=0, atol=0)  # the main rows are the model's logits
    rows = stacked.chunk(3, dim=0)
    # DeepSeek-V3 eq. 21-23 on the sequence cut to the positions that have a target: depth k at position i joins
    # h^{k-1}_i with Emb(t_{i+k}) through M_k [RMSNorm(h); RMSNorm(Emb)], one block, the shared output head.
    h = captured[0]  # (2, seqlen, dim), before the final norm
    with torch.no_grad():
        for k in (1, 2):
            block = model.layers[str(n_layers + k - 1)]
            proj, length = block.input_proj, seqlen - k
            emb = model.tok_embeddings(tokens[:, k:]) * emb_mult  # t_{i+k} for i < seqlen - k
            x = proj.eh_proj(torch.cat([proj.enorm(emb), proj.hnorm(h[:, :length])], dim=-1))
            h = super(MTPDepth, block).forward(x, model.rope_cache)  # the family's block, causal over the cut sequence
            expected = model.output(block.head_norm(h) * readout)
            torch.testing.assert_close(rows[k][:, :length], expected, rtol=1e-6, atol=1e-8)


def test_the_loss_adds_the_weighted_mean_of_the_depths_and_reports_them_apart():
    torch.manual_seed(1)
    depths, weight, divisor, (bs, seqlen, vocab) = 2, 0.3, 2, (2, 9, 11)
    logits = torch.randn(bs * (1 + depths), seqlen, vocab, requires_grad=True)  # the loss computes in fp32
    labels = torch.randint(0, vocab, (bs, seqlen))
    labels[0, 3] = -100  # a position without a target stays without one at every depth
    loss_fn = StepLoss(cross_entropy_loss, divisor=divisor)
    loss_fn.mtp_depths, loss_fn.mtp_weight = depths, weight
    loss = loss_fn(logits, labels)
    # By definition: the main cross-entropy plus weight x the depths' mean, depth k's row i scored on token
    # i + k + 1 = labels[:, i + k], over the positions that have one.
    exact = logits.double()
    main, rows = exact[:bs], exact[bs:].reshape(depths, bs, seqlen, vocab)
    per_depth = [F.cross_entropy(rows[k - 1][:, : seqlen - k].flatten(0, 1), labels[:, k:].flatten()) for k in (1, 2)]
    expected = (F.cross_entropy(main.flatten(0, 1), labels.flatten()) + weight * sum(per_depth) / depths) / divisor
    torch.testing.assert_close(loss.double(), expected, rtol=1e-6, atol=0)
    grad, expected_grad = torch.autograd.grad(loss, logits)[0], torch.autograd.grad(expected, logits)[0]
    torch.testing.assert_close(grad.double(), expected_grad.double(), rtol=1e-5, atol=1e-8)
    torch.testing.assert_close(loss_fn.mtp_terms[0].double(), torch.stack(per_depth).detach(), rtol=1e-6, atol=0)
    assert shift_labels(labels, 2)[0].tolist() == [*labels[0, 2:].tolist(), -100, -100]
    # A forward without the depths' rows (evaluation) is the plain loss; a z-loss term is the main rows' alone.
    plain = F.cross_entropy(main.flatten(0, 1), labels.flatten()) / divisor
    torch.testing.assert_close(loss_fn(logits[:bs], labels).double(), plain, rtol=1e-6, atol=0)
    z_loss = StepLoss(lambda out, lab: cross_entropy_loss(out, lab, z_loss=1e-2, z_loss_out=z_loss.z_terms))
    z_loss.mtp_depths, z_loss.mtp_weight = depths, weight
    z_loss(logits, labels)
    main_z = 1e-2 * torch.logsumexp(main.flatten(0, 1)[labels.flatten() != -100], dim=-1).square().mean()
    assert len(z_loss.z_terms) == 1
    torch.testing.assert_close(z_loss.z_terms[0].double(), main_z.detach(), rtol=1e-6, atol=0)


def test_hugging_face_layout_is_the_hub_checkpoints_and_round_trips():
    model = small_model(depths=1)
    state = model.state_dict()
    hf = to_hf_state_dict(state, model.args)
    mtp_only = {name for name in hf if name.startswith("model.layers.2.")} - {
        name.replace("model.layers.1.", "model.layers.2.") for name in hf if name.startswith("model.layers.1.")
    }
    # DeepSeek-V3's model.safetensors.index.json, layer 61 (its MTP module), less the names every MoE block has.
    assert mtp_only == {
        f"model.layers.2.{leaf}"
        for leaf in ("embed_tokens.weight", "enorm.weight", "hnorm.weight", "eh_proj.weight",
                     "shared_head.norm.weight", "shared_head.head.weight")
    }  # fmt: skip
    assert torch.equal(hf["model.layers.2.shared_head.head.weight"], state["output.weight"])
    assert torch.equal(hf["model.layers.2.embed_tokens.weight"], state["tok_embeddings.weight"])
    back = from_hf_state_dict(hf, model.args)
    assert back.keys() == state.keys() and all(torch.equal(back[k], state[k]) for k in state)
    plain_args = dataclasses.replace(model.args, n_mtp_layers=0)  # a model without the depths skips them
    Transformer(plain_args).load_state_dict(from_hf_state_dict(hf, plain_args), strict=True)


def test_counts_include_the_depths():
    args = dataclasses.replace(DEBUG, n_mtp_layers=1)
    with torch.device("meta"):
        assert count_params(args) == sum(p.numel() for p in Transformer(args).parameters())
    # One more MoE block's active FLOPs (its routed top 2 and shared expert, attention, eh_proj), and the output
    # projection applied once more: 6 x (block + 2 dim^2 + 3 dim + vocab dim) + the block's attention term.
    dim, seqlen = args.dim, 64
    attention = 32768 + 128 + 49152 + 36864 + 128 + 65536 + 65536  # as test_deepseek_v3's by-hand count
    block = attention + 2 * dim + dim * 8 + 3 * 3 * dim * 256  # norms, router, 2 routed + 1 shared expert
    extra = 6 * (block + 2 * dim * dim + 3 * dim + args.vocab_size * dim) + 6 * 8 * (48 + 32) * seqlen
    assert flops_per_token(args, seqlen) - flops_per_token(DEBUG, seqlen) == extra


def test_the_memory_estimate_measures_a_depth_as_autograd_runs_it():
    """The analytic tier's eager figures for a depth's block (input twice as wide, two outputs): what it keeps
    against what autograd saves, and its backward's peak against autograd's engine, on real CPU tensors."""
    from titan_core.memory.activations import ActivationLayout
    from titan_core.memory.eager_saved import measure_eager
    from titan_core.memory.fake_run import LiveBytes
    from titan_run import autograd_saved_bytes

    spec, args, seq = get_model_spec("deepseek_v3"), dataclasses.replace(DEBUG, n_mtp_layers=1), 64
    torch.manual_seed(0)
    model = spec.build(args)
    model.init_weights()
    for p in model.parameters():  # the model states count the parameters' gradients
        p.register_post_accumulate_grad_hook(lambda p: setattr(p, "grad", None))
    eager = measure_eager(spec, args, ActivationLayout(compute_bytes=4, seq_len=seq, device_type="cpu"))
    block = model.layers[str(args.n_layers)]
    for bs in (1, 3):
        figures = eager.for_tokens(bs * seq).per_block[args.n_layers]
        x = torch.randn(bs, seq, 2 * args.dim, requires_grad=True)
        kept = autograd_saved_bytes(model, lambda x=x: block(x, model.rope_cache))
        assert kept / (bs * seq) == pytest.approx(figures.block, rel=0.015)
        live = LiveBytes([*model.parameters(), *model.buffers(), model.rope_cache])
        with live:
            outputs = list(block(x.clone(), model.rope_cache))
            for i in range(2):
                live.drop(outputs[i])
            before = live.now()
            grads = [torch.ones_like(out) for out in outputs]
            live.watch()
            torch.autograd.backward(outputs, grads)
        # Autograd's peak holds one input-wide fp32 gradient (2 x dim per token) more than the node-by-node walk
        # finds, at both batch sizes; otherwise to the byte (a block's agree to 2%, tests/test_memory_eager.py).
        gap = (live.peak - before) / (bs * seq) - figures.block_backward
        assert gap == pytest.approx(2 * args.dim * 4, abs=0.02 * figures.block_backward), (bs, gap)


def test_the_traced_and_measured_estimates_run_the_depths_and_agree():
    # Both used to fail on a job with depths: MemTracker refused the fused loss's head, called once per depth
    # ("multiple iterative calls"); then the measured tier extrapolated its runs' blocks, depths included, to the
    # main blocks only (2 depths: 95 MiB instead of 282 MiB). Now the 8-block line meets the traced figure.
    from titan_core.memory.measured import estimate_measured
    from titan_core.memory.traced import estimate_traced

    cfg = load_config(None, ["--mtp.layers", "2", "--training.local_batch_size", "2", "--training.seq_len", "128",
                             "--training.mixed_precision_param", "float32"])  # fmt: skip
    traced, measured = estimate_traced(cfg, 1, device_type="cpu"), estimate_measured(cfg, 1)
    assert measured.peak == pytest.approx(traced.peak, rel=0.01), (measured.peak, traced.peak)
    no_depths = estimate_traced(load_config(None, ["--training.local_batch_size", "2", "--training.seq_len", "128",
                                                   "--training.mixed_precision_param", "float32"]), 1, device_type="cpu")
    assert traced.peak > no_depths.peak  # fmt: skip


@pytest.mark.parametrize("fused", ["true", "false"])
def test_the_analytic_estimate_counts_each_depths_head_rows_as_the_trace_does(fused):
    """Each depth's rows go through the output and the loss, whose saved bytes (the fused loss's hidden-state
    gradients, or the plain loss's logits) stay until backward: what one depth adds per token, analytic against
    traced (CPU kernels, so the analytic tier estimates for CPU too). It used to count the head once: 11% (fused)
    and 20% (plain) below the trace."""
    from titan_core.memory.analytic import estimate_analytic
    from titan_core.memory.traced import estimate_traced

    tokens, added = 8 * 128, {}
    for depths in (0, 1):
        cfg = load_config(None, ["--mtp.layers", str(depths), "--training.local_batch_size", "8",
                                 "--training.seq_len", "128", "--training.mixed_precision_param", "float32",
                                 "--training.fused_loss", fused])  # fmt: skip
        analytic = estimate_analytic(cfg, 1, device_type="cpu").ranks[0].total
        added[depths] = (analytic, estimate_traced(cfg, 1, device_type="cpu").peak)
    per_token = [(added[1][i] - added[0][i]) / tokens for i in (0, 1)]
    assert per_token[0] == pytest.approx(per_token[1], rel=0.04), per_token


def test_the_job_check_refuses_what_cannot_run_it():
    base = ["--model.name", "deepseek_v3", "--mtp.layers", "1"]
    assert resolve(load_config(None, base), 2).model_args.n_mtp_layers == 1
    example = resolve(load_config(str(Path(__file__).parents[1] / "examples" / "mtp.toml")), 2)  # as README runs it
    assert example.model_args.n_mtp_layers == 1 and example.cfg.mtp.loss_weight == 0.3
    pp = [*base, "--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_parallel_schedule"]
    for schedule in ("InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV"):  # they split the weight gradients
        with pytest.raises(ConfigError, match=f"mtp.layers=1 with .*schedule='{schedule}'.*use 1F1B, GPipe or Inter"):
            resolve(load_config(None, [*pp, schedule]), 2)
    # Under pipeline parallel the last stage holds the depths and a copy of the embedding; the depths weigh on
    # the cut as blocks. DeepSeek-V3's debug model: 4 blocks + the embedding (1 unit) + norm and output (1) + the
    # depth (1) = 7 units over 2 stages: 4 (the embedding and 3 blocks), then 3 (1 block, the output, the depth).
    job = resolve(load_config(None, [*pp, "1F1B"]), 2)
    assert job.names_per_stage == [["tok_embeddings", "layers.0", "layers.1", "layers.2"],
                                   ["layers.3", "norm", "output", "layers.4", "tok_embeddings"]]  # fmt: skip


RUN = [
    "--model.name", "deepseek_v3", "--model.flavor", "debugmodel", "--mtp.layers", "2",
    "--training.steps", "4", "--training.seq_len", "32", "--training.global_batch_size", "4",
    "--training.mixed_precision_param", "float32", "--lr_scheduler.warmup_steps", "2",
    "--metrics.log_freq", "1", "--metrics.enable_tensorboard", "false", "--metrics.peak_tflops", "1", "--debug.seed", "7",
]  # fmt: skip
ONE_PROCESS = {  # row -> arguments, local batch 4
    "reference": ["--checkpoint.enable", "--checkpoint.interval", "4"],
    "plain_loss": ["--training.fused_loss", "false"],
    "full_ac_compiled": ["--activation_checkpoint.mode", "full", "--compile.enable"],
    "weight_0": ["--mtp.loss_weight", "0"],
    "no_mtp": ["--mtp.layers", "0"],
}
TWO_PROCESSES = {
    "fsdp": ["--training.local_batch_size", "2"],
    "tp": ["--training.local_batch_size", "4", "--parallelism.tensor_parallel_degree", "2"],
    "tp_plain_loss": ["--training.local_batch_size", "4", "--parallelism.tensor_parallel_degree", "2",
                      "--training.fused_loss", "false"],
    "ep": ["--training.local_batch_size", "2", "--parallelism.expert_parallel_degree", "2"],
    "pp": ["--training.local_batch_size", "4", "--parallelism.pipeline_parallel_degree", "2", "--checkpoint.enable",
           "--checkpoint.interval", "4"],
    "cp": ["--training.local_batch_size", "4", "--parallelism.context_parallel_degree", "2"],
}  # fmt: skip


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("mtp")
    run_titan_all({root / name: [*RUN, "--training.local_batch_size", "4", *a] for name, a in ONE_PROCESS.items()})
    run_titan_all({root / name: [*RUN, *a] for name, a in TWO_PROCESSES.items()}, nproc=2)
    return root


def test_layouts_train_the_depths_as_one_process(runs):
    reference = read_metrics(runs / "reference")
    assert [r["step"] for r in reference] == [1, 2, 3, 4]
    for row in ["plain_loss", "full_ac_compiled", *TWO_PROCESSES]:
        records = read_metrics(runs / row)
        for key in ("loss/global_avg", "loss/mtp", "loss/mtp_1", "loss/mtp_2"):
            gap = max(abs(a[key] - b[key]) for a, b in zip(records, reference, strict=True))
            assert gap < 2e-5, (row, key, gap)
    for record in reference:  # each depth's loss, and their mean
        assert record["loss/mtp"] == pytest.approx((record["loss/mtp_1"] + record["loss/mtp_2"]) / 2, rel=1e-6)
    log = (runs / "reference" / "train.log").read_text()
    assert "2 multi-token-prediction depths (loss weight 0.3)" in log and " mtp " in log
    assert " mtp " in (runs / "pp" / "train.log").read_text()  # the last stage's depth losses reach rank 0's line


def test_pipeline_parallel_writes_the_weights_of_one_process(runs):
    # The last stage held the depths and a copy of the embedding: the checkpoint (DCP writes the copy once) has
    # the reference's weights, the embedding's among them.
    from titan_ckpt.dcp_files import read_dcp_state_dict, read_dcp_tensor_shapes

    ours, theirs = runs / "pp" / "checkpoint" / "step-4", runs / "reference" / "checkpoint" / "step-4"
    names = [n for n in read_dcp_tensor_shapes(theirs) if n.startswith(("tok_embeddings.", "layers.4.", "layers.5."))]
    assert "tok_embeddings.weight" in names and "layers.5.input_proj.eh_proj.weight" in names
    assert sorted(read_dcp_tensor_shapes(ours)) == sorted(read_dcp_tensor_shapes(theirs))
    a, b = read_dcp_state_dict(ours, names), read_dcp_state_dict(theirs, names)
    gap = max((a[n] - b[n]).abs().max().item() for n in names)
    assert gap < 1e-5, gap


def test_the_depths_learn_and_a_zero_weight_leaves_the_language_model_alone(runs):
    # loss/global_avg is the language-model loss alone: with weight 0 the depths add no gradient, and the run
    # trains the main model exactly as one without MTP (the depths' blocks are initialised after the main ones).
    assert losses(runs / "weight_0") == pytest.approx(losses(runs / "no_mtp"), rel=0, abs=1e-6)
    assert "loss/mtp" not in read_metrics(runs / "no_mtp")[0]
    trained, untrained = read_metrics(runs / "reference"), read_metrics(runs / "weight_0")
    assert trained[0]["loss/mtp"] == pytest.approx(untrained[0]["loss/mtp"], abs=1e-6)  # same start
    assert trained[-1]["loss/mtp"] < untrained[-1]["loss/mtp"] - 0.1  # the weighted loss trains the depths


def test_trained_depths_convert_to_hugging_face_and_back_and_sampling_skips_them(runs, tmp_path):
    step = runs / "reference" / "checkpoint" / "step-4"
    cli = CliRunner()
    result = cli.invoke(app, ["convert", str(step), str(tmp_path / "hf"), "--to", "hf"])
    assert result.exit_code == 0, result.output
    assert "parity:" in result.output and "(ok;" in result.output  # transformers ignores the MTP layers' names
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["num_nextn_predict_layers"] == 2 and config["num_hidden_layers"] == 4
    start = ["--model.name", "deepseek_v3", "--checkpoint.initial_load_path", str(tmp_path / "hf"),
             "--checkpoint.initial_load_in_hf", "true", "--checkpoint.enable", "--mtp.layers"]  # fmt: skip
    assert resolve(load_config(None, [*start, "2"]), 1).model_args.n_mtp_layers == 2
    with pytest.raises(ConfigError, match="mtp.layers=3: the Hugging Face checkpoint .* holds 2 prediction depths"):
        resolve(load_config(None, [*start, "3"]), 1)
    result = cli.invoke(app, ["convert", str(tmp_path / "hf"), str(tmp_path / "dcp"), "--to", "dcp"])
    assert result.exit_code == 0, result.output
    from titan_ckpt.dcp_files import read_dcp_state_dict, read_dcp_tensor_shapes

    names = [n for n in read_dcp_tensor_shapes(step) if n.startswith("layers.5.")]  # the second depth's weights
    assert "layers.5.input_proj.eh_proj.weight" in names and "layers.5.head_norm.weight" in names
    ours, back = read_dcp_state_dict(step, names), read_dcp_state_dict(tmp_path / "dcp", names)
    assert all(torch.equal(ours[n], back[n]) for n in names)
    result = cli.invoke(app, ["generate", str(runs / "reference"), "--prompt", "def ", "--max-new-tokens", "4"])
    assert result.exit_code == 0, result.output


@pytest.mark.parametrize("family", ["llama3", "qwen3"])
def test_dense_families_count_their_depths(family):
    spec = get_model_spec(family)
    args = dataclasses.replace(spec.flavors["debugmodel"], n_mtp_layers=1)
    with torch.device("meta"):
        assert spec.count_params(args) == sum(p.numel() for p in spec.build(args).parameters())
    # The debug shapes by hand (dim 256, 16 heads, 8 KV heads, vocab 2048): Llama 3's head 16 and feed-forward
    # 768 (8/3 x 256 rounded up to 256); Qwen3's head 32 with its QK-norms and feed-forward 768.
    dim, seqlen = 256, 64
    if family == "llama3":
        block, head = 256 * 16 * (2 * 16 + 2 * 8) + 3 * 256 * 768 + 2 * 256, 16
    else:
        block, head = 256 * 32 * (2 * 16 + 2 * 8) + 2 * 32 + 3 * 256 * 768 + 2 * 256, 32
    extra = 6 * (block + 2 * dim * dim + 3 * dim + 2048 * dim) + 12 * 16 * head * seqlen
    assert spec.flops_per_token(args, seqlen) - spec.flops_per_token(spec.flavors["debugmodel"], seqlen) == extra


DENSE_RUN = RUN[4:]  # RUN without its model.name and flavor: Llama 3 by default
QWEN3_TIED = ["--model.name", "qwen3", "--model.shape", "tie_word_embeddings=true", "--training.local_batch_size", "4"]
DENSE_ROWS = {  # row -> (nproc, arguments)
    "llama_reference": (1, ["--training.local_batch_size", "4", "--checkpoint.enable", "--checkpoint.interval", "4"]),
    "llama_fsdp": (2, ["--training.local_batch_size", "2"]),
    "llama_tp": (2, ["--training.local_batch_size", "4", "--parallelism.tensor_parallel_degree", "2"]),
    "qwen3_reference": (1, ["--model.name", "qwen3", "--training.local_batch_size", "4"]),
    "qwen3_tp": (2, ["--model.name", "qwen3", "--training.local_batch_size", "4", "--parallelism.tensor_parallel_degree",
                     "2"]),
    "llama_pp": (2, ["--training.local_batch_size", "4", "--parallelism.pipeline_parallel_degree", "2",
                     "--parallelism.pipeline_parallel_schedule", "Interleaved1F1B"]),
    "llama_cp": (2, ["--training.local_batch_size", "4", "--parallelism.context_parallel_degree", "2",
                     "--parallelism.context_parallel_method", "ulysses"]),
    # 2 stages x FSDP 2: the embedding's copies kept equal per FSDP shard (two pairs of ranks)
    "llama_ppfsdp": (4, ["--training.local_batch_size", "2", "--parallelism.pipeline_parallel_degree", "2",
                         "--parallelism.data_parallel_shard_degree", "2"]),
    # Tied embeddings: the last stage's embedding copy (for the depths) is also its output
    "qwen3tied_reference": (1, [*QWEN3_TIED, "--checkpoint.enable", "--checkpoint.interval", "4"]),
    "qwen3tied_pp": (2, [*QWEN3_TIED, "--parallelism.pipeline_parallel_degree", "2", "--checkpoint.enable",
                         "--checkpoint.interval", "4"]),
}  # fmt: skip


@pytest.fixture(scope="module")
def dense_runs(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("mtp_dense")
    for nproc in (1, 2, 4):
        run_titan_all({root / row: [*DENSE_RUN, *a] for row, (n, a) in DENSE_ROWS.items() if n == nproc}, nproc=nproc)
    return root


def test_llama_and_qwen3_train_depths_on_every_layout_as_one_process(dense_runs):
    for row in ("llama_fsdp", "llama_tp", "qwen3_tp", "llama_pp", "llama_cp", "llama_ppfsdp", "qwen3tied_pp"):
        reference = read_metrics(dense_runs / f"{row.split('_')[0]}_reference")
        records = read_metrics(dense_runs / row)
        assert len(records) == len(reference) == 4
        for key in ("loss/global_avg", "loss/mtp"):
            gap = max(abs(a[key] - b[key]) for a, b in zip(records, reference, strict=True))
            assert gap < 2e-5, (row, key, gap)
    first, last = read_metrics(dense_runs / "llama_reference")[0], read_metrics(dense_runs / "llama_reference")[-1]
    assert last["loss/mtp"] < first["loss/mtp"] - 0.5  # the depths learn
    assert "2 multi-token-prediction depths" in (dense_runs / "qwen3_reference" / "train.log").read_text()


def test_a_tied_embedding_stays_one_weight_in_one_process_and_across_stages(dense_runs):
    # One process used to train a tied embedding and output as two weights on a CPU (`to_empty` unties them and
    # the CPU init copied values without re-tying): 4 steps later they must still be one. Under pipeline parallel
    # the first stage's embedding, the last stage's copy and its output are three copies of that weight.
    from titan_ckpt.dcp_files import read_dcp_state_dict

    names = ["tok_embeddings.weight", "output.weight"]
    one = read_dcp_state_dict(dense_runs / "qwen3tied_reference" / "checkpoint" / "step-4", names)
    two = read_dcp_state_dict(dense_runs / "qwen3tied_pp" / "checkpoint" / "step-4", names)
    assert torch.equal(one["tok_embeddings.weight"], one["output.weight"])
    assert torch.equal(two["tok_embeddings.weight"], two["output.weight"])
    assert (one["output.weight"] - two["output.weight"]).abs().max().item() < 1e-5


def test_a_llama_run_with_depths_exports_the_language_model_and_generates(dense_runs, tmp_path):
    step = dense_runs / "llama_reference" / "checkpoint" / "step-4"
    cli = CliRunner()
    result = cli.invoke(app, ["convert", str(step), str(tmp_path / "hf"), "--to", "hf"])
    assert result.exit_code == 0, result.output
    assert "parity:" in result.output and "(ok;" in result.output
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    from titan_ckpt.hf_safetensors import read_hf_state_dict

    names = read_hf_state_dict(tmp_path / "hf").keys()
    assert config["num_hidden_layers"] == 6 and not any(n.startswith("model.layers.6.") for n in names)
    start = ["--checkpoint.initial_load_path", str(tmp_path / "hf"), "--checkpoint.initial_load_in_hf", "true",
             "--checkpoint.enable"]  # fmt: skip
    with pytest.raises(ConfigError, match="mtp.layers=1: the Hugging Face checkpoint .* holds 0 prediction depths"):
        resolve(load_config(None, [*start, "--mtp.layers", "1"]), 1)
    result = cli.invoke(app, ["generate", str(dense_runs / "llama_reference"), "--prompt", "def ", "--max-new-tokens", "4"])
    assert result.exit_code == 0, result.output


@pytest.mark.parametrize("family", ["llama3", "qwen3", "deepseek_v3"])
def test_speculative_decoding_gives_the_greedy_tokens(family):
    from titan_core.generation import GREEDY, generate, generate_speculative

    model = small_model(1, family).float().eval()  # untrained: the depth's drafts mostly fail
    spec = get_model_spec(family)
    prompt = [5, 17, 3, 42, 8]
    plain = generate(model, spec.plan, [prompt], 24, GREEDY, static_cache=False).tokens[0]
    result = generate_speculative(model, spec.plan, prompt, 24)
    assert result.tokens == plain and len(plain) == 24
    assert result.drafts > result.accepted  # rejected drafts were rolled back
    eos = plain[10]
    stopped = generate_speculative(model, spec.plan, prompt, 24, eos_ids=[eos])
    assert stopped.tokens == plain[: plain.index(eos) + 1]


def test_speculative_decoding_of_a_trained_run_accepts_drafts_and_says_so(dense_runs):
    from titan_core.generation import GREEDY, generate, generate_speculative, load_model

    loaded = load_model(str(dense_runs / "llama_reference"), keep_mtp=True)
    assert loaded.args.n_mtp_layers == 2
    prompt = [100, 101, 102, 32]
    plain = generate(loaded.model, loaded.spec.plan, [prompt], 30, GREEDY, static_cache=False).tokens[0]
    result = generate_speculative(loaded.model, loaded.spec.plan, prompt, 30)
    assert result.tokens == plain and result.accepted > 0 and result.tokens_per_forward > 1
    cli = CliRunner()
    out = cli.invoke(app, ["generate", str(dense_runs / "llama_reference"), "-p", "def ", "-n", "8", "--speculative"])
    assert out.exit_code == 0 and "drafts accepted" in out.output, out.output
    refused = cli.invoke(app, ["generate", str(dense_runs / "llama_reference"), "-p", "a", "-p", "b", "--speculative"])
    assert refused.exit_code == 2 and "--speculative decodes one prompt" in refused.output
    no_depths = load_model(str(dense_runs / "llama_reference"))  # loaded without them: refused in one line
    with pytest.raises(ConfigError, match="this checkpoint has none; train with mtp.layers = 1"):
        generate_speculative(no_depths.model, no_depths.spec.plan, prompt, 4)
