"""Decode speed of `titan generate`'s static decode step: eager against compiled, at batch 1.

Builds a llama3 flavor with random weights (seeded `init_weights`) on the device in
the dtype `--dtype auto` picks (bfloat16 on CUDA, float32 on CPU), decodes greedily
from one short prompt, and reports per run: decode tokens/s (steps after the first
`WARMUP_STEPS` of a compiled run), prefill and warm-up seconds, bytes read per step
(parameters + KV cache in use) and, on a GPU in `peak_memory_bandwidth`'s table, the
share of its peak bandwidth; then whether the compiled run's greedy tokens equal the
eager run's (in bf16 a near-tie of two logits may round either way, so the first
differing step is given too, with the gap between the two tokens' eager logits there against the
spacing of bf16 values at that logit: `mismatch_margin`).

    uv run python benchmarks/decode_bench.py --smoke                          # CPU, debugmodel, 32 tokens, seconds
    python3 benchmarks/decode_bench.py --flavor 1B --tokens 256 --out decode.json   # on an H100

The compiled run uses Inductor with CUDA graphs on CUDA; on CPU it uses the
`aot_eager` backend (the same capture, no code generation: Inductor's C++ build
takes minutes on a small CPU), unless `--backend inductor`. From Python:
`run_decode_bench(flavor, tokens, device, compile) -> dict`.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
from pathlib import Path
from typing import Any

import torch
from torch._dynamo.utils import counters

from titan_core.generation import GREEDY, generate, parameter_bytes, peak_memory_bandwidth, resolve_dtype
from titan_core.generation.load import build_empty, resolve_device, resolve_tuning
from titan_models import get_model_spec

PROMPT_LEN = 8
"""Tokens of the one prompt (random ids, fixed by the seed)."""


def _cpu_name() -> str:
    """The CPU model from /proc/cpuinfo, else `platform`'s machine name."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        lines = []
    models = [line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")]
    return models[0] if models else platform.machine()


def first_mismatch(a: list[int], b: list[int]) -> int | None:
    """The first index where two token lists differ (a length counts), or None when they are equal."""
    index = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)
    return index if index is not None or len(a) == len(b) else min(len(a), len(b))


def mismatch_margin(model: torch.nn.Module, plan: Any, prompt: list[int], tokens: list[int], other: int) -> dict:
    """Why greedy decoding could pick `other` where the eager run picked `tokens[-1]`: the eager logits of
    that step (the same prefix, `prompt + tokens[:-1]`), the gap between the two tokens' logits, and the
    spacing of the model dtype's values at that logit. A gap within two spacings is a near-tie: a kernel
    that rounds differently (Inductor's fused GEMMs, other reduction orders) may pick either.

    Args:
        model: the model, in eval mode, in the dtype the runs used.
        plan: its family's plan.
        prompt: the prompt both runs started from.
        tokens: the eager run's tokens up to and including the first one the other run did not pick.
        other: the token the other run picked there.
    """
    logits = generate(model, plan, [prompt], len(tokens), GREEDY, return_logits=True).step_logits[-1][0]
    chosen = tokens[-1]
    dtype = next(model.parameters()).dtype
    top = logits[chosen].item()
    spacing = torch.finfo(dtype).eps * 2.0 ** math.floor(math.log2(abs(top))) if top else torch.finfo(dtype).tiny
    gap = top - logits[other].item()
    return {
        "eager_token": chosen,
        "other_token": other,
        "eager_logit": top,
        "logit_gap": gap,
        "dtype_spacing": spacing,
        "near_tie": abs(gap) <= 2 * spacing,
    }


def _run(model: torch.nn.Module, plan: Any, prompt: list[int], tokens: int, **kwargs: Any) -> dict:
    """One greedy generation (`generate`'s `kwargs`); its tokens and figures."""
    result = generate(model, plan, [prompt], tokens, GREEDY, **kwargs)
    timing = result.timing
    assert timing is not None  # tokens >= 1
    params = parameter_bytes(model)
    read = timing.bytes_per_step(params, result.kv_bytes_per_token)
    device = next(model.parameters()).device
    peak = peak_memory_bandwidth(torch.cuda.get_device_name(device)) if device.type == "cuda" else None
    return {
        "tokens": result.tokens[0],
        "decode_tokens_per_s": timing.tokens_per_s,
        "decode_steps": timing.steps,
        "decode_s": timing.decode_s,
        "prefill_s": timing.prefill_s,
        "warmup_steps": timing.warmup_steps,
        "warmup_s": timing.warmup_s,
        "bytes_per_step": read,
        "bandwidth_bytes_per_s": read * timing.steps_per_s,
        "bandwidth_share": read * timing.steps_per_s / peak if peak else None,
    }


def run_decode_bench(
    flavor: str,
    tokens: int,
    device: str,
    compile: bool,
    backend: str | None = None,
    seed: int = 0,
    dynamic: bool = False,
    tune: bool | None = None,
    compare_unfused: bool = False,
) -> dict:
    """Greedy decode of `tokens` tokens at batch 1: eager, then (if `compile`) compiled.

    Args:
        flavor: a llama3 flavor ("debugmodel", "1B", "8B", ...).
        tokens: new tokens per run (the first comes from the prefill, the rest from decode steps).
        device: "cpu", "cuda", "cuda:N" or "auto".
        compile: also run the compiled decode step.
        backend: the compiled run's `torch.compile` backend; None: "inductor" on CUDA, "aot_eager" on CPU.
        seed: seeds the weights and the prompt.
        dynamic: also time the dynamic cache loop (`static_cache=False`), the eager reference.
        tune: compile with Inductor's coordinate-descent tuning too (`generate(compile_tuning=True)`):
            on an H100 the 1B decodes ~25% faster, but the first compile takes ~60 s instead of ~20 s.
            None: `titan generate`'s default (`resolve_tuning`: on for CUDA).
        compare_unfused: also run the compiled step with the model's separate q/k/v and w1/w3 linears
            (`generate(fuse_linears=False)`), run "compiled, separate linears".

    Returns:
        A JSON-ready dict: the setup, `runs` ({"eager": ..., "compiled": ..., "dynamic": ...}: tokens/s,
        seconds, bytes per step, bandwidth share or None), `tokens_match` and `first_mismatch` (compiled
        against eager; None when they match), `compile_error` (one line, or None), `cudagraph_skips`
        (Inductor's count of graphs it could not capture; 0 is what the compiled CUDA run needs).
    """
    target = resolve_device(device)
    dtype, _ = resolve_dtype("auto", target)
    spec = get_model_spec("llama3")
    args = spec.flavors[flavor]
    torch.manual_seed(seed)
    model = build_empty(spec, args, target, dtype).eval().requires_grad_(False)
    prompt = torch.randint(0, args.vocab_size, (PROMPT_LEN,), generator=torch.Generator().manual_seed(seed)).tolist()
    backend = backend or ("inductor" if target.type == "cuda" else "aot_eager")
    tune, _ = resolve_tuning(tune, target, compile)
    counters["inductor"]["cudagraph_skips"] = 0
    runs = {"eager": _run(model, spec.plan, prompt, tokens)}
    compile_error = None
    if compile:
        try:
            compiled = dict(compile=True, compile_backend=backend, compile_tuning=tune)
            runs["compiled"] = _run(model, spec.plan, prompt, tokens, **compiled)
            if compare_unfused:
                runs["compiled, separate linears"] = _run(model, spec.plan, prompt, tokens, **compiled, fuse_linears=False)
        except Exception as err:  # a suite row records why compiling failed and goes on
            lines = str(err).strip().splitlines()
            compile_error = f"{type(err).__name__}: {lines[0] if lines else ''}"[:300]
    if dynamic:
        runs["dynamic"] = _run(model, spec.plan, prompt, tokens, static_cache=False)
    mismatch = first_mismatch(runs["eager"]["tokens"], runs["compiled"]["tokens"]) if "compiled" in runs else None
    margin = None
    if mismatch is not None and mismatch < min(len(runs["eager"]["tokens"]), len(runs["compiled"]["tokens"])):
        eager_tokens = runs["eager"]["tokens"][: mismatch + 1]
        margin = mismatch_margin(model, spec.plan, prompt, eager_tokens, runs["compiled"]["tokens"][mismatch])
    name = torch.cuda.get_device_name(target) if target.type == "cuda" else _cpu_name()
    return {
        "flavor": flavor,
        "tokens": tokens,
        "batch": 1,
        "device": str(target),
        "device_name": name,
        "dtype": str(dtype).removeprefix("torch."),
        "torch": torch.__version__,
        "backend": backend if compile else None,
        "tuned": tune and compile,
        "parameter_bytes": parameter_bytes(model),
        "peak_bandwidth": peak_memory_bandwidth(name) if target.type == "cuda" else None,
        "runs": runs,
        "compile_error": compile_error,
        "tokens_match": mismatch is None and compile_error is None,
        "first_mismatch": mismatch,
        "first_mismatch_margin": margin,
        "separate_linears_first_mismatch": (
            first_mismatch(runs["compiled"]["tokens"], runs["compiled, separate linears"]["tokens"])
            if "compiled, separate linears" in runs else None
        ),
        "cudagraph_skips": counters["inductor"]["cudagraph_skips"],
    }


def _line(label: str, run: dict) -> str:
    share = f", {100 * run['bandwidth_share']:.1f}% of peak bandwidth" if run["bandwidth_share"] is not None else ""
    return (
        f"{label:>27}: {run['decode_tokens_per_s']:9.1f} tokens/s over {run['decode_steps']} steps, "
        f"{run['bytes_per_step'] / 1e9:.3f} GB/step, {run['bandwidth_bytes_per_s'] / 1e9:.1f} GB/s{share}; "
        f"prefill {run['prefill_s']:.3f} s, warm-up {run['warmup_steps']} steps {run['warmup_s']:.2f} s"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--flavor", default="1B", help="llama3 flavor (default 1B)")
    parser.add_argument("--tokens", type=int, default=256, help="new tokens per run (default 256)")
    parser.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto (default)")
    parser.add_argument("--no-compile", action="store_true", help="run the eager step only")
    parser.add_argument("--backend", help="compiled run's backend (default: inductor on CUDA, aot_eager on CPU)")
    parser.add_argument("--dynamic", action="store_true", help="also time the dynamic cache loop (eager reference)")
    parser.add_argument("--tune", action=argparse.BooleanOptionalAction, default=None,
                        help="coordinate-descent tuning (CUDA: faster, slower compile); default: on for CUDA")
    parser.add_argument("--compare-unfused", action="store_true",
                        help="also run the compiled step with the separate q/k/v and w1/w3 linears")
    parser.add_argument("--smoke", action="store_true", help="CPU check in seconds: debugmodel, 32 tokens, cpu")
    parser.add_argument("--out", type=Path, help="write the figures as JSON to this file")
    opts = parser.parse_args()
    if opts.smoke:
        opts.flavor, opts.tokens, opts.device = "debugmodel", 32, "cpu"
    flavors = get_model_spec("llama3").flavors
    if opts.flavor not in flavors:
        parser.error(f"--flavor {opts.flavor} is not a llama3 flavor; pass one of: {', '.join(flavors)}")
    if opts.tokens < 8:
        parser.error(f"--tokens {opts.tokens} leaves too few decode steps to time after the warm-up; pass 8 or more")
    figures = run_decode_bench(
        opts.flavor, opts.tokens, opts.device, not opts.no_compile, opts.backend, dynamic=opts.dynamic, tune=opts.tune,
        compare_unfused=opts.compare_unfused,
    )
    print(
        f"llama3 {figures['flavor']}, {figures['device_name']} ({figures['device']}), {figures['dtype']}, "
        f"torch {figures['torch']}, batch 1, {figures['tokens']} tokens, "
        f"{figures['parameter_bytes'] / 1e9:.3f} GB of parameters"
    )
    for label, run in figures["runs"].items():
        print(_line(label, run))
    if figures["compile_error"]:
        print(f"compiled run failed: {figures['compile_error']}")
    if "compiled" in figures["runs"]:
        speedup = figures["runs"]["compiled"]["decode_tokens_per_s"] / figures["runs"]["eager"]["decode_tokens_per_s"]
        match = "match" if figures["tokens_match"] else f"differ from token {figures['first_mismatch']}"
        margin = figures["first_mismatch_margin"]
        if margin is not None:
            match += (
                f" (eager's logits there: {margin['logit_gap']:.3g} apart, {margin['dtype_spacing']:.3g} between "
                f"neighbouring {figures['dtype']} values: {'a near-tie' if margin['near_tie'] else 'NOT a near-tie'})"
            )
        print(
            f"compiled ({figures['backend']}{', tuned' if figures['tuned'] else ''}) / eager: {speedup:.2f}x; "
            f"greedy tokens {match}; "
            f"{figures['cudagraph_skips']} CUDA graph skips"
        )
    if opts.out:
        opts.out.parent.mkdir(parents=True, exist_ok=True)
        opts.out.write_text(json.dumps(figures, indent=2) + "\n")


if __name__ == "__main__":
    main()
