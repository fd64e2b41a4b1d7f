"""Sampling text from a trained model: `titan generate`'s library.

- `kv_cache.py`: `kv_cache(model, plan, ...)` swaps each block's attention core
  (`ModelPlan.attention`) for a `CachedAttention`, or an MLA attention (one with a `latent_forward`)
  for a `LatentCachedAttention` that caches its latent; no model code changes.
- `sampling.py`: `SamplingParams` and `sample_next_token` (greedy, temperature, top-k, top-p).
- `generate.py`: `generate(model, plan, prompts, max_new_tokens, ...)`, the decode loops.
- `speculative.py`: `generate_speculative`, greedy decoding whose drafts come from the model's own
  multi-token-prediction depth, checked by the main model two tokens per forward.
- `static_decode.py`: the fixed-shape decode step that `torch.compile` captures in a CUDA graph.
- `decode_speed.py`: `DecodeTiming`, `speed_summary`, `peak_memory_bandwidth`: tokens/s and bandwidth share.
- `load.py`: `load_model(source, ...)` from a run, a DCP step, or a Hugging Face folder; `resolve_dtype`.
- `text.py`: `load_prompt_codec(checkpoint, vocab_size)`, the tokenizer with BOS/EOS rules.

Example:
    loaded = load_model("outputs")                        # newest step of a titan train run
    codec = load_prompt_codec(loaded.checkpoint, loaded.args.vocab_size)
    result = generate(loaded.model, loaded.spec.plan, [codec.encode("def ")], 32, eos_ids=codec.eos_ids)
    print(codec.decode(result.tokens[0]))
"""

from titan_core.generation.decode_speed import DecodeTiming, parameter_bytes, peak_memory_bandwidth, speed_summary
from titan_core.generation.generate import GREEDY, GenerationResult, generate
from titan_core.generation.kv_cache import CachedAttention, KVCache, LatentCachedAttention, kv_cache
from titan_core.generation.load import LoadedModel, load_model, resolve_compile, resolve_dtype, resolve_tuning
from titan_core.generation.sampling import SamplingParams, sample_next_token, top_k_filter, top_p_filter
from titan_core.generation.speculative import SpeculativeResult, generate_speculative
from titan_core.generation.text import PromptCodec, load_prompt_codec

__all__ = [
    "GREEDY",
    "CachedAttention",
    "DecodeTiming",
    "GenerationResult",
    "KVCache",
    "LatentCachedAttention",
    "LoadedModel",
    "PromptCodec",
    "SamplingParams",
    "SpeculativeResult",
    "generate",
    "generate_speculative",
    "kv_cache",
    "load_model",
    "load_prompt_codec",
    "parameter_bytes",
    "peak_memory_bandwidth",
    "resolve_compile",
    "resolve_tuning",
    "resolve_dtype",
    "sample_next_token",
    "speed_summary",
    "top_k_filter",
    "top_p_filter",
]
