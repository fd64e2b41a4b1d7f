"""Train directly from a Hugging Face checkpoint and hand the result back to transformers."""

from __future__ import annotations

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
    run_titan(two, *COMMON, "--training.steps", "2", "--checkpoint.initial_load_path", str(src))
    # Step 2's loss uses the weights after step 1: exactly what was exported.
    assert abs(losses(two)[1] - hf_loss(exported.float().eval(), *second)) < 1e-5
    assert abs(losses(two)[1] - losses(two)[0]) > 1e-3  # the update did change the weights
