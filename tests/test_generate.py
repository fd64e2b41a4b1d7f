"""`titan generate` and `titan_core.generation`, single process on CPU, fp32.

Greedy decoding against transformers' own `generate` on the same weights (a batch of
two prompts of different lengths, left-padded), the KV cache against recomputing
every sequence from scratch, the samplers on hand-made distributions, and the command
end to end on the checkpoint of a real `titan train` run.
"""

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from titan_cli.main import app
from titan_core.config.errors import ConfigError
from titan_core.generation import (
    GREEDY,
    CachedAttention,
    LatentCachedAttention,
    SamplingParams,
    generate,
    kv_cache,
    load_model,
    load_prompt_codec,
    sample_next_token,
    top_k_filter,
    top_p_filter,
)
from titan_core.model_source import resolve_checkpoint
from titan_parallel.modules import iter_blocks
from titan_run import TINY, run_titan

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")

FAMILIES = ["llama3", "qwen3", "qwen3_moe", "deepseek_v3"]
"""Model families whose Hugging Face twin is checked; each needs an entry in HF_BUILDERS."""

PROMPTS = [[1, 5, 9, 33, 40, 7, 8, 100], [1, 200, 3]]  # different lengths: the second is left-padded
NEW_TOKENS = 12
EOS, PAD = 2, 0
LOGITS_TOL = 1e-5


def _tiny_llama3():
    config = transformers.LlamaConfig(
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,  # grouped-query attention
        vocab_size=256,
        max_position_embeddings=128,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        initializer_range=0.15,  # large enough that greedy decoding does not settle on one token
        bos_token_id=1,
        eos_token_id=EOS,
        pad_token_id=PAD,
    )
    return transformers.LlamaForCausalLM(config)


def _tiny_qwen3():
    return transformers.Qwen3ForCausalLM(transformers.Qwen3Config(
        hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
        vocab_size=256, max_position_embeddings=128, rope_theta=10000.0, initializer_range=0.15, eos_token_id=EOS,
        pad_token_id=PAD, bos_token_id=1, tie_word_embeddings=False))


def _tiny_qwen3_moe():
    return transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
        hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=256,
        max_position_embeddings=128, rope_theta=10000.0, initializer_range=0.15, eos_token_id=EOS, pad_token_id=PAD,
        bos_token_id=1, norm_topk_prob=True))


def _tiny_deepseek_v3():
    return transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(
        vocab_size=256, hidden_size=48, intermediate_size=80, moe_intermediate_size=24, num_hidden_layers=3,
        first_k_dense_replace=1, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=3,
        n_group=4, topk_group=2, n_shared_experts=2, norm_topk_prob=True, routed_scaling_factor=2.5, kv_lora_rank=16,
        q_lora_rank=None, qk_nope_head_dim=12, qk_rope_head_dim=8, v_head_dim=10, max_position_embeddings=128,
        initializer_range=0.15, eos_token_id=EOS, pad_token_id=PAD, bos_token_id=1))


HF_BUILDERS = {"llama3": _tiny_llama3, "qwen3": _tiny_qwen3, "qwen3_moe": _tiny_qwen3_moe, "deepseek_v3": _tiny_deepseek_v3}
"""Family -> a small random transformers model of it (built under a fixed seed)."""


@pytest.fixture(scope="module", params=FAMILIES)
def hf_checkpoint(request, tmp_path_factory):
    """(family, transformers model, its save_pretrained folder)."""
    torch.manual_seed(0)
    hf_model = HF_BUILDERS[request.param]().eval()
    folder = tmp_path_factory.mktemp(f"hf-{request.param}")
    hf_model.save_pretrained(folder)
    return request.param, hf_model, folder


@pytest.fixture(scope="module")
def loaded(hf_checkpoint):
    """The Hugging Face folder loaded by Titan (family found from config.json's architectures)."""
    family, _, folder = hf_checkpoint
    result = load_model(str(folder), device="cpu")
    assert result.spec.name == family and result.checkpoint_format == "hf"
    return result


def _hf_greedy(hf_model, prompts, max_new_tokens):
    """transformers' greedy continuation of each prompt (left-padded batch), cut after EOS."""
    longest = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), longest), PAD, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, prompt in enumerate(prompts):
        ids[row, longest - len(prompt) :] = torch.tensor(prompt)
        mask[row, longest - len(prompt) :] = 1
    with torch.no_grad():
        out = hf_model.generate(ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=PAD)
    rows = []
    for row in out[:, longest:].tolist():
        rows.append(row[: row.index(EOS) + 1] if EOS in row else row)
    return rows


def test_greedy_matches_transformers(hf_checkpoint, loaded):
    _, hf_model, _ = hf_checkpoint
    expected = _hf_greedy(hf_model, PROMPTS, NEW_TOKENS)
    result = generate(loaded.model, loaded.spec.plan, PROMPTS, NEW_TOKENS, eos_ids=[EOS], max_seq_len=loaded.args.max_seq_len)
    assert result.tokens == expected
    assert len(set(expected[0])) > 3  # a real continuation, not one token repeated
    # one prompt alone decodes as it does in the padded batch
    alone = generate(loaded.model, loaded.spec.plan, PROMPTS[1:], NEW_TOKENS, eos_ids=[EOS])
    assert alone.tokens == expected[1:]


@pytest.mark.parametrize("sampling", [GREEDY, SamplingParams(temperature=0.9, top_k=50, top_p=0.95)], ids=["greedy", "sampled"])
def test_kv_cache_matches_recompute(loaded, sampling):
    kwargs = dict(sampling=sampling, seed=3, return_logits=True)
    cached = generate(loaded.model, loaded.spec.plan, PROMPTS, NEW_TOKENS, **kwargs)
    plain = generate(loaded.model, loaded.spec.plan, PROMPTS, NEW_TOKENS, use_kv_cache=False, **kwargs)
    assert cached.tokens == plain.tokens and all(len(t) == NEW_TOKENS for t in cached.tokens)
    assert len(cached.step_logits) == len(plain.step_logits) == NEW_TOKENS
    for step, (a, b) in enumerate(zip(cached.step_logits, plain.step_logits)):
        assert a.shape == (len(PROMPTS), loaded.args.vocab_size)
        torch.testing.assert_close(a, b, atol=LOGITS_TOL, rtol=0, msg=lambda m: f"step {step}: {m}")
    args = loaded.args
    if loaded.spec.name == "llama3":
        assert cached.kv_bytes_per_token == 2 * args.n_layers * args.kv_heads * args.attention_head_dim * 4  # k and v, fp32
    if loaded.spec.name == "deepseek_v3":  # MLA's latent and rotated key, not 4 heads x (20 + 10) dims
        assert cached.kv_bytes_per_token == args.n_layers * (args.kv_lora_rank + args.qk_rope_head_dim) * 4
    assert cached.kv_bytes_per_token > 0
    assert plain.kv_bytes_per_token == 0


def test_kv_cache_swaps_attention_and_restores(loaded):
    """The attention core is swapped, or for MLA (a `latent_forward`) the whole attention module, and put back."""
    model, plan = loaded.model, loaded.spec.plan
    parent, _, name = plan.attention.rpartition(".")
    cores = lambda: [getattr(block.get_submodule(parent), name) for block in iter_blocks(model, plan)]  # noqa: E731
    attentions = lambda: [block.get_submodule(parent) for block in iter_blocks(model, plan)]  # noqa: E731
    before, before_attentions = cores(), attentions()
    latent = loaded.spec.name == "deepseek_v3"
    with kv_cache(model, plan, batch_size=1, max_len=8, device="cpu") as cache:
        swapped = [a.core for a in attentions()] if latent else cores()
        assert all(isinstance(a, LatentCachedAttention) for a in attentions()) == latent
        assert all(isinstance(c, CachedAttention) and c.cache is cache for c in swapped)
        assert cache.layers == swapped
    assert cores() == before and attentions() == before_attentions


def test_bfloat16_load_keeps_rope_in_float32(hf_checkpoint):
    _, _, folder = hf_checkpoint
    half = load_model(str(folder), device="cpu", dtype="bfloat16")
    assert {p.dtype for p in half.model.parameters()} == {torch.bfloat16}
    assert all(b.dtype == torch.float32 for b in half.model.buffers())
    result = generate(half.model, half.spec.plan, PROMPTS, 2)
    assert [len(t) for t in result.tokens] == [2, 2] and result.kv_bytes_per_token > 0


def test_eos_ends_each_sequence(loaded):
    model, plan = loaded.model, loaded.spec.plan
    free = generate(model, plan, PROMPTS, NEW_TOKENS).tokens
    eos = free[0][3]  # the first sequence's 4th token becomes the end of sequence
    stopped = generate(model, plan, PROMPTS, NEW_TOKENS, eos_ids=[eos]).tokens
    for row, full in zip(stopped, free):
        assert row == (full[: full.index(eos) + 1] if eos in full else full)
    assert stopped[0][-1] == eos and len(stopped[0]) <= 4


def test_top_k_one_is_greedy(loaded):
    greedy = generate(loaded.model, loaded.spec.plan, PROMPTS, NEW_TOKENS).tokens
    top1 = generate(loaded.model, loaded.spec.plan, PROMPTS, NEW_TOKENS, sampling=SamplingParams(temperature=1.5, top_k=1), seed=11)
    assert top1.tokens == greedy


def test_temperature_sampling_is_seeded(loaded):
    hot = SamplingParams(temperature=1.0)
    runs = [generate(loaded.model, loaded.spec.plan, PROMPTS, NEW_TOKENS, sampling=hot, seed=s).tokens for s in (5, 5, 6)]
    assert runs[0] == runs[1]
    assert runs[0] != runs[2]


def test_top_p_keeps_smallest_nucleus():
    probs = torch.tensor([[0.10, 0.50, 0.15, 0.25]])  # sorted: 0.50 (1), 0.25 (3), 0.15 (2), 0.10 (0)
    logits = probs.log()
    kept = lambda p: set(torch.nonzero(top_p_filter(logits, p)[0].isfinite()).flatten().tolist())  # noqa: E731
    assert kept(0.3) == {1}  # 0.50 alone reaches 0.3
    assert kept(0.5) == {1}  # ... and exactly 0.5
    assert kept(0.7) == {1, 3}  # 0.50 + 0.25 = 0.75 >= 0.7
    assert kept(0.8) == {1, 3, 2}  # 0.75 < 0.8 <= 0.90
    assert kept(0.95) == {0, 1, 2, 3}
    assert kept(1.0) == {0, 1, 2, 3}
    # drawing from the 0.7-nucleus: only tokens 1 and 3, renormalised to 2/3 and 1/3
    generator = torch.Generator().manual_seed(0)
    draws = sample_next_token(logits.expand(4000, 4), SamplingParams(temperature=1.0, top_p=0.7), generator)
    counts = torch.bincount(draws, minlength=4)
    assert counts[0] == counts[2] == 0
    assert abs(counts[1].item() / 4000 - 2 / 3) < 0.03


def test_top_k_filter_and_params():
    logits = torch.tensor([[1.0, 4.0, 3.0, 2.0]])
    assert top_k_filter(logits, 2)[0].isfinite().tolist() == [False, True, True, False]
    assert sample_next_token(logits, GREEDY).tolist() == [1]
    for bad in (dict(top_p=0.0), dict(top_p=1.5), dict(temperature=-1.0), dict(top_k=0)):
        with pytest.raises(ConfigError):
            SamplingParams(**bad)


def test_prompt_codec_of_hf_folder(tmp_path):
    config = _tiny_llama3().config
    config.vocab_size = 300  # room for the byte tokenizer's 258 ids
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path)
    codec = load_prompt_codec(tmp_path, 300)
    assert codec.encode("hi") == [256, ord("h"), ord("i")] and codec.add_bos
    assert set(codec.eos_ids) == {257, EOS}  # the tokenizer's EOS and config.json's
    assert codec.decode([ord("o"), ord("k"), EOS]) == "ok"
    with pytest.raises(ConfigError, match="258 tokens, the model 256"):
        load_prompt_codec(tmp_path, 256)


# --- the command, on a real `titan train` checkpoint ---------------------------------------


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory) -> Path:
    """A run folder with checkpoint/step-1 and step-2 from `titan train` (llama3 debugmodel, byte tokenizer)."""
    folder = tmp_path_factory.mktemp("run")
    run_titan(
        folder, *TINY, "--training.steps", "2", "--training.seq_len", "16",
        "--checkpoint.enable", "true", "--checkpoint.interval", "1",
    )
    return folder


def _titan(*args: str):
    return CliRunner().invoke(app, ["generate", *map(str, args)])


def test_cli_generates_from_a_run(trained_run):
    result = _titan(trained_run, "--prompt", "def ", "--prompt", "import os", "-n", "8", "--temperature", "0")
    assert result.exit_code == 0, result.output
    assert "step-2 (dcp)" in result.stderr and "byte tokenizer" in result.stderr  # the newest complete step
    assert "tokens in" in result.stderr and "KV cache" in result.stderr
    # --dtype auto and --compile's default on CPU, said on the summary line; the decode figures apart from the prefill
    assert "cpu float32 (auto: float32 on cpu), compile off (default off on cpu)" in result.stderr
    assert "prefill 2 x " in result.stderr and "decode 7 steps x 2" in result.stderr, result.stderr
    assert result.stdout.startswith("def ") and "\n\nimport os" in result.stdout  # each prompt, continued, then a blank line


def test_resolve_checkpoint_of_a_run(trained_run):
    step2 = trained_run / "checkpoint" / "step-2"
    assert resolve_checkpoint(str(trained_run)) == step2
    assert resolve_checkpoint(str(trained_run / "checkpoint")) == step2
    assert resolve_checkpoint(str(trained_run / "checkpoint" / "step-1")) == trained_run / "checkpoint" / "step-1"
    loaded = load_model(str(step2), model_name="llama3", flavor="debugmodel", device="cpu")
    assert loaded.checkpoint == step2 and loaded.args.vocab_size == 2048
    codec = load_prompt_codec(loaded.checkpoint, loaded.args.vocab_size)
    assert codec.source == "byte tokenizer" and codec.encode("a") == [256, 97] and codec.eos_ids == (257,)


def test_convert_reads_a_run_folder_as_its_newest_complete_step(trained_run, tmp_path):
    """`titan convert RUN ...` and `--average-with RUN` read the run's newest complete step, as `titan generate` does
    (it said "unknown checkpoint format" for a run folder): the same weights as converting step-2 by name."""
    from titan_ckpt.dcp_files import read_dcp_state_dict, read_dcp_tensor_shapes

    step2 = trained_run / "checkpoint" / "step-2"
    result = CliRunner().invoke(app, ["convert", str(trained_run), str(tmp_path / "run.pt"), "--to", "torch"])
    assert result.exit_code == 0, result.output
    assert f"reading dcp checkpoint {step2}" in result.output
    got = torch.load(tmp_path / "run.pt", weights_only=True)
    model_keys = [k for k in read_dcp_tensor_shapes(step2) if not k.startswith(("optimizer.", "lr_scheduler."))]
    expected = read_dcp_state_dict(step2, model_keys)
    assert set(got) == set(expected) and all(torch.equal(got[k], expected[k]) for k in expected)
    step1 = str(trained_run / "checkpoint" / "step-1")
    result = CliRunner().invoke(app, ["convert", step1, str(tmp_path / "avg.pt"), "--to", "torch", "--average-with",
                                      str(trained_run)])  # fmt: skip
    assert result.exit_code == 0 and "averaged 2 checkpoints" in result.output, result.output
    assert f"reading dcp checkpoint {step2}" in result.output


@pytest.mark.parametrize(
    "args, expected",
    [
        (["{run}/missing"], "does not exist"),
        (["{run}", "--top-p", "1.5"], "--top-p 1.5 is outside (0, 1]"),
        (["{run}", "--flavor", "huge"], "unknown model.flavor 'huge'"),
        (["{run}", "--dtype", "int8"], "--dtype int8"),
        (["{run}", "--compile", "--no-kv-cache"], "drop --compile or --no-kv-cache"),
    ],
    ids=["missing-path", "top-p", "flavor", "dtype", "compile-without-cache"],
)
def test_cli_bad_input_is_one_line(trained_run, args, expected):
    result = _titan(*(a.format(run=trained_run) for a in args))
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("titan generate: error: ") and expected in lines[0], result.stderr


def test_help_does_not_import_torch():
    code = (
        "import sys; from typer.testing import CliRunner; from titan_cli.main import app\n"
        "out = CliRunner().invoke(app, ['generate', '--help']).output\n"
        "assert '--no-kv-cache' in out and '--top-p' in out and '--no-compile' in out, out\n"
        "assert 'torch' not in sys.modules, 'titan generate --help imported torch'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
