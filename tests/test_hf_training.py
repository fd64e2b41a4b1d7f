"""Train directly from a Hugging Face checkpoint and hand the result back to transformers."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from titan_core.data import ByteTokenizer, PackedLoader, StdlibSource
from titan_run import losses, run_titan

transformers = pytest.importorskip("transformers")

SEQ, BATCH = 32, 4
COMMON = [
    "--training.seq_len", str(SEQ), "--training.local_batch_size", str(BATCH),
    "--training.mixed_precision_param", "float32", "--lr_scheduler.warmup_steps", "1",
    "--metrics.log_freq", "1", "--metrics.enable_tensorboard", "false", "--metrics.peak_tflops", "1",
    "--checkpoint.enable", "--checkpoint.initial_load_in_hf",
]


def hf_loss(model, inputs, labels) -> float:
    with torch.no_grad():
        logits = model(input_ids=inputs).logits
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten()).item()


def test_train_from_hf_and_export_to_hf(tmp_path):
    # A small random Llama with a shape no Titan flavor has: the shape must come from config.json.
    config = transformers.LlamaConfig(
        vocab_size=300, hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, rope_theta=50000.0, tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(config).float().eval()
    src = tmp_path / "hf-src"
    hf.save_pretrained(src, safe_serialization=True)

    batches = iter(PackedLoader(StdlibSource(), ByteTokenizer(), seq_len=SEQ, local_batch_size=BATCH))
    first, second = next(batches), next(batches)

    one = tmp_path / "one-step"
    run_titan(one, *COMMON, "--training.steps", "1", "--checkpoint.initial_load_path", str(src),
              "--checkpoint.last_save_in_hf", "--checkpoint.last_save_model_only")
    # Step 1's loss is computed on the HF weights before any update.
    assert abs(losses(one)[0] - hf_loss(hf, *first)) < 1e-5

    exported = transformers.LlamaForCausalLM.from_pretrained(one / "checkpoint" / "step-1", local_files_only=True)
    two = tmp_path / "two-steps"
    # On 2 FSDP ranks (the same global batch of 4): rank 0 alone reads the Hugging Face files and hands each tensor
    # to rank 1 (titan_ckpt.model_state.set_full_model_state), so step 1 again starts from the HF weights ...
    run_titan(two, *COMMON, "--training.steps", "2", "--checkpoint.initial_load_path", str(src),
              "--training.local_batch_size", str(BATCH // 2), nproc=2)  # fmt: skip
    assert abs(losses(two)[0] - hf_loss(hf, *first)) < 1e-5
    # ... and step 2's loss uses the weights after step 1: exactly what the one-process run exported.
    assert abs(losses(two)[1] - hf_loss(exported.float().eval(), *second)) < 1e-5
    assert abs(losses(two)[1] - losses(two)[0]) > 1e-3  # the update did change the weights


def test_a_run_from_hf_weights_changes_rope_converts_and_samples_from_its_folder(tmp_path):
    # Continuing a Hugging Face model at a longer context: model.shape may change what leaves every weight's shape
    # (RoPE theta and scaling); the run keeps the source's config.json, so convert and generate read its shape
    # (not model.flavor's: the debug model would not hold these weights) even after the source is gone.
    from typer.testing import CliRunner

    from titan_cli.main import app

    config = transformers.LlamaConfig(
        vocab_size=300, hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, rope_theta=50000.0, tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    source = transformers.LlamaForCausalLM(config)
    with torch.no_grad():  # sharper attention, so the loss depends on RoPE (at init it barely does: 4e-6)
        for name, param in source.named_parameters():
            if "q_proj" in name or "k_proj" in name:
                param.mul_(20)
    src = tmp_path / "hf-src"
    source.save_pretrained(src, safe_serialization=True)
    run = tmp_path / "longer"
    rope = "rope_theta=1000000,rope_scaling.factor=4,rope_scaling.original_max_position_embeddings=16"
    proc = run_titan(run, *COMMON, "--training.steps", "2", "--checkpoint.interval", "2",
                     "--checkpoint.initial_load_path", str(src), "--model.shape", rope)  # fmt: skip
    assert f"model llama3 from the Hugging Face weights in {src} with rope_theta=1000000," in proc.stdout + proc.stderr
    # Step 1 is transformers' loss with the same RoPE settings on the source's weights (4.8e-3 from the source's own).
    scaled = json.loads((src / "config.json").read_text())
    scaled.pop("rope_parameters", None)  # newer transformers write RoPE here; its older keys are still read
    scaled |= {"rope_theta": 1e6, "rope_scaling": {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0,
                                                    "high_freq_factor": 4.0, "original_max_position_embeddings": 16}}
    hf = transformers.LlamaForCausalLM.from_pretrained(
        src, config=transformers.LlamaConfig(**scaled), local_files_only=True
    ).float().eval()
    first = next(iter(PackedLoader(StdlibSource(), ByteTokenizer(), seq_len=SEQ, local_batch_size=BATCH)))
    assert abs(losses(run)[0] - hf_loss(hf, *first)) < 1e-5
    assert (run / "hf_config.json").read_text() == (src / "config.json").read_text()

    import shutil

    shutil.rmtree(src)
    cli = CliRunner()
    result = cli.invoke(app, ["convert", str(run / "checkpoint" / "step-2"), str(tmp_path / "out"), "--to", "hf"])
    assert result.exit_code == 0 and "(ok;" in result.output, result.output
    exported = json.loads((tmp_path / "out" / "config.json").read_text())
    rope = exported.get("rope_parameters") or exported.get("rope_scaling")
    assert (exported.get("rope_theta", rope.get("rope_theta")), rope["factor"], exported["num_hidden_layers"]) == (
        1e6, 4.0, 2
    )
    result = cli.invoke(app, ["generate", str(run), "--prompt", "def ", "--max-new-tokens", "4"])
    assert result.exit_code == 0, result.output
    (run / "hf_config.json").unlink()  # neither kept nor at the source: one line naming the file to put back
    result = cli.invoke(app, ["convert", str(run / "checkpoint" / "step-2"), str(tmp_path / "out2"), "--to", "hf"])
    assert result.exit_code != 0 and "put it in the run folder as hf_config.json, or pass --flavor" in result.output
    assert not (tmp_path / "out2").exists()


def test_a_shape_change_that_reshapes_hf_weights_is_refused_in_one_line(tmp_path):
    from titan_core.config import ConfigError, load_config
    from titan_core.job import resolve

    config = transformers.LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)  # fmt: skip
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path / "src", safe_serialization=True)
    start = ["--checkpoint.enable", "--checkpoint.initial_load_in_hf", "--checkpoint.initial_load_path", str(tmp_path / "src")]
    with pytest.raises(ConfigError) as caught:
        resolve(load_config(None, [*start, "--model.shape", "n_layers=1"]), 1)
    message = str(caught.value)
    assert "model.shape ['n_layers=1']: the Hugging Face checkpoint" in message and "layers.1." in message
    assert "\n" not in message
    assert resolve(load_config(None, [*start, "--model.shape", "norm_eps=1e-6"]), 1).model_args.norm_eps == 1e-6
