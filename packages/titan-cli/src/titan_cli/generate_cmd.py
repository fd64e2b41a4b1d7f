"""`titan generate SOURCE --prompt TEXT`: sample text from a Titan run, DCP step or Hugging Face folder.

Imports only typer at start-up; torch and the models load when the command runs,
so `titan --help` stays fast. The library is `titan_core.generation`.
"""

from __future__ import annotations

import time

import typer


def _speculate(loaded, text: str, max_new_tokens: int) -> None:
    """`--speculative`: decode, print the continuation, then the drafts' acceptance and the speed."""
    from titan_core.generation import generate_speculative, load_prompt_codec

    codec = load_prompt_codec(loaded.checkpoint, loaded.args.vocab_size)
    result = generate_speculative(
        loaded.model,
        loaded.spec.plan,
        codec.encode(text),
        max_new_tokens,
        eos_ids=codec.eos_ids,
        max_seq_len=getattr(loaded.args, "max_seq_len", None),
    )
    typer.echo(text + codec.decode(result.tokens))
    typer.echo("")
    typer.echo(
        f"speculative (greedy): {result.accepted} of {result.drafts} drafts accepted ({100 * result.acceptance:.0f}%), "
        f"{result.tokens_per_forward:.2f} tokens per forward; {len(result.tokens)} tokens in {result.seconds:.2f} s "
        f"({len(result.tokens) / max(result.seconds, 1e-9):.1f} tokens/s), model {loaded.spec.name} from "
        f"{loaded.checkpoint}, {loaded.device} {str(loaded.dtype).removeprefix('torch.')}",
        err=True,
    )


def generate(
    source: str = typer.Argument(
        ...,
        help=(
            "A titan train run folder (newest step), a checkpoint/step-N folder,"
            " or a Hugging Face folder or Hub repo id."
        ),
    ),
    prompt: list[str] | None = typer.Option(
        None, "--prompt", "-p", help="Text to continue; repeat for a batch (default: one empty prompt)."
    ),
    max_new_tokens: int = typer.Option(64, "--max-new-tokens", "-n", help="Most tokens to add to each prompt."),
    temperature: float = typer.Option(0.8, "--temperature", help="Divide the logits by this; 0 = greedy."),
    top_k: int | None = typer.Option(None, "--top-k", help="Sample from the k most likely tokens only."),
    top_p: float = typer.Option(
        1.0, "--top-p", help="Sample from the smallest set of tokens whose probability reaches this, in (0, 1]."
    ),
    seed: int = typer.Option(0, "--seed", help="Seed of the sampling."),
    device: str | None = typer.Option(None, "--device", help="cpu, cuda or cuda:N (default: cuda when available)."),
    dtype: str = typer.Option(
        "auto",
        "--dtype",
        help="Parameter dtype: auto (bfloat16 on a CUDA GPU with bf16, else float32), float32, bfloat16.",
    ),
    model_name: str | None = typer.Option(
        None,
        "--model-name",
        help="Model family (default: from config.json's architectures, else the run's model.name, else llama3).",
    ),
    flavor: str | None = typer.Option(
        None, "--flavor", help="Named shape of a DCP checkpoint without a run config.toml beside it."
    ),
    no_kv_cache: bool = typer.Option(
        False, "--no-kv-cache", help="Recompute every sequence at each step (slow; for comparison)."
    ),
    compile: bool | None = typer.Option(
        None,
        "--compile/--no-compile",
        help="Compile the decode step (CUDA graphs on CUDA). Default: on for CUDA, off on CPU.",
    ),
    speculative: bool = typer.Option(
        False,
        "--speculative",
        help="Greedy decoding whose drafts come from the model's multi-token-prediction depth (trained with "
        "mtp.layers), two tokens checked per forward; the same tokens as greedy. One prompt; no sampling options.",
    ),
    tune: bool | None = typer.Option(
        None,
        "--tune/--no-tune",
        help="Tune the compiled step's kernels (coordinate descent): faster decoding, a first compile ~3x as "
        "long, cached for the next run. Default: on for CUDA.",
    ),
) -> None:
    """Continue each --prompt with text sampled from a model.

    Prints each prompt and its continuation, then a blank line. See docs/generate.md.
    """
    from titan_core.launch import USER_ERRORS

    try:
        from titan_core.config.errors import ConfigError
        from titan_core.generation import (
            SamplingParams,
            load_model,
            load_prompt_codec,
            parameter_bytes,
            resolve_compile,
            resolve_tuning,
            speed_summary,
        )
        from titan_core.generation import generate as generate_tokens

        prompts = prompt or [""]
        sampling = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
        if dtype not in ("auto", "float32", "bfloat16"):
            raise ConfigError(f"--dtype {dtype} is not auto, float32 or bfloat16; pass one of them")
        if compile and no_kv_cache:
            raise ConfigError("--compile compiles the KV cache's decode step; drop --compile or --no-kv-cache")
        if speculative and (len(prompts) > 1 or no_kv_cache or compile):
            raise ConfigError(
                "--speculative decodes one prompt through the KV cache, eagerly; pass one --prompt, "
                "without --no-kv-cache or --compile"
            )
        loaded = load_model(
            source, model_name=model_name, flavor=flavor, device=device, dtype=dtype, keep_mtp=speculative
        )
        if speculative:
            _speculate(loaded, prompts[0], max_new_tokens)
            return
        codec = load_prompt_codec(loaded.checkpoint, loaded.args.vocab_size)
        compiled, compile_reason = (False, "--no-kv-cache") if no_kv_cache else resolve_compile(compile, loaded.device)
        tuned, tune_reason = resolve_tuning(tune, loaded.device, compiled)
        started = time.perf_counter()
        result = generate_tokens(
            loaded.model,
            loaded.spec.plan,
            [codec.encode(text) for text in prompts],
            max_new_tokens,
            sampling=sampling,
            eos_ids=codec.eos_ids,
            seed=seed,
            use_kv_cache=not no_kv_cache,
            max_seq_len=getattr(loaded.args, "max_seq_len", None),
            compile=compiled,
            compile_tuning=tuned,
        )
        elapsed = time.perf_counter() - started
    except (*USER_ERRORS, OSError) as err:  # a wrong input or an unreadable file; a bug keeps its traceback
        typer.echo(f"titan generate: error: {err}", err=True)
        raise typer.Exit(2) from None
    for text, tokens in zip(prompts, result.tokens, strict=True):
        typer.echo(text + codec.decode(tokens))
        typer.echo("")
    mode = "CUDA graphs" if loaded.device.type == "cuda" else "Inductor"
    mode += f", tuned ({tune_reason})" if tuned else ""
    typer.echo(
        f"model {loaded.spec.name} from {loaded.checkpoint} ({loaded.checkpoint_format}), "
        f"{loaded.device} {str(loaded.dtype).removeprefix('torch.')} ({loaded.dtype_reason}), "
        f"compile {f'on, {mode}' if compiled else 'off'} ({compile_reason}), {codec.source}",
        err=True,
    )
    if result.timing is not None:
        summary = speed_summary(result.timing, parameter_bytes(loaded.model), result.kv_bytes_per_token, loaded.device)
        typer.echo(summary, err=True)
    n_tokens = sum(len(t) for t in result.tokens)
    cache = (
        f", KV cache {result.kv_bytes_per_token / 1024:.1f} KiB/token" if result.kv_bytes_per_token else ", no KV cache"
    )
    typer.echo(f"{n_tokens} tokens in {elapsed:.2f} s ({n_tokens / max(elapsed, 1e-9):.1f} tokens/s{cache})", err=True)
