"""The GPU figures of docs/performance.md: Titan's training step on one GPU, row by row.

Titan's defaults first (what a user gets: fused AdamW, cuDNN attention on Hopper, the fused
chunked loss, bf16 through FSDP's mixed precision), with compile, then one change at a time,
each a fresh `Trainer` in this one process (a row that fails, by OOM or a missing feature, is
recorded with its one-line reason and the suite goes on):

- llama3 "1B" (the Llama 3.2 1B shape) at seq 2048, batch 4: defaults eager; defaults + compile;
  compile with the plain loss (`training.fused_loss = false`), with FlashAttention-2 pinned, with
  the foreach AdamW kernel, with float8 (torchao, tensorwise), with selective op AC, with memory budgets of 0.5
  and 0.75.
- The 8B-shaped model with 8 blocks and the real 128256 vocabulary (2.8B parameters) at seq 8192,
  batch 1, compile + selective op AC: bf16 and float8; compile + a memory budget of 0.3.
- Titan vs the hand-written loop (titan_models' `Transformer`, bf16 autocast, fp32 cross-entropy,
  `clip_grad_norm_`, AdamW with Titan's kernel) from the same weights on the same batches, single
  steps interleaved (A, B, then B, A, ...).
- `transformers`' LlamaForCausalLM at the 1B shape, sdpa, bf16 autocast, whole-model compile, fused AdamW.
- Decoding: `benchmarks/decode_bench.py`, 1B, batch 1, 256 tokens, compiled with CUDA graphs.

Per row: tokens/s (median step), TFLOP/s (titan_models' flops_per_token), MFU against
titan_core.metrics.peak_flops (the bf16 datasheet peak, float8 rows too, as torchtitan reports
them) and peak memory (max_memory_allocated). The targets of issue 20 are printed at the end.

    benchmarks/run_gpu_suite.sh [OUT_DIR]             # on the GPU machine: wheels, then this
    python3 benchmarks/gpu_suite.py --out DIR         # titan and its deps importable
    uv run python benchmarks/gpu_suite.py --smoke --out /tmp/gpu-smoke   # CPU: debugmodel, seq 128, 2 steps, fp32

Writes DIR/results.json (after every row, so a run cut short keeps what it measured) and DIR/results.md.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import gc
import json
import platform
import statistics
import subprocess
import tempfile
import time
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from titan_core.config import ConfigError, load_config
from titan_core.metrics import device_peak_flops
from titan_core.trainer import Trainer
from titan_models import get_model_spec, register_model_spec

BENCH_MODEL = "llama3-bench"  # the llama3 spec with the flavors below added
COMPILE = ("--compile.enable", "true")
FLOAT8 = ("--model.converters", "float8")
OUTPUT_FLOAT8 = ("--float8.filter_fqns", "[]")  # the output projection too: its GEMMs in float8 inside the fused loss
AC_OP = ("--activation_checkpoint.mode", "selective", "--activation_checkpoint.selective_ac_option", "op")
AC_FULL = ("--activation_checkpoint.mode", "full")
AC_BUDGET = ("--activation_checkpoint.mode", "memory_budget", "--activation_checkpoint.memory_budget")  # + the budget
PLAIN_LOSS = ("--training.fused_loss", "false")
FLASH = ("--training.attention_backend", "flash")
FOREACH = ("--optimizer.implementation", "foreach")
BLOCK_CAUSAL = ("--model.attn_mask_type", "block_causal")  # attention within each document (FlexAttention on CUDA)
ONE_RANK_FSDP = ("--optimizer.master_weights", "off")  # bf16 through FSDP on one rank, as before master weights
FLOAT8_OUTPUT = ("--float8.filter_fqns", "[]", *PLAIN_LOSS)  # the output projection in float8 too (a module call)


def _complex_rope(x: torch.Tensor, rope_cache: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
    """Llama 3's RoPE as it was before round 3: one complex product, also under compile (where Inductor has no
    complex kernels and calls eager ones)."""
    bs, seqlen, _, head_dim = x.shape
    rope = rope_cache[:seqlen] if positions is None else rope_cache[positions]
    cos, sin = (half.float() for half in rope.view(-1, seqlen, 1, head_dim).chunk(2, dim=-1))
    pairs = torch.view_as_complex(x.float().reshape(bs, seqlen, -1, head_dim // 2, 2))
    return torch.view_as_real(pairs * torch.complex(cos, sin)).flatten(3).type_as(x)


@contextlib.contextmanager
def before(name: str, trainer: Trainer | None = None):
    """Within the context, the paths in `name` (comma-separated) that this round replaced: "complex_rope" (RoPE
    as a complex product under compile too), "clip_in_place" (`clip_grad_norm_` scaling every gradient, not the
    fused AdamW kernel)."""
    import titan_models.llama3.model as llama3

    rope, names = llama3.apply_rotary_emb, name.split(",")
    if "complex_rope" in names:
        llama3.apply_rotary_emb = _complex_rope
    if "clip_in_place" in names and trainer is not None:
        trainer.runner.clip_in_optimizer = False
    try:
        yield
    finally:
        llama3.apply_rotary_emb = rope
TARGET_MFU_1B, TARGET_MFU_8B, TARGET_FLOAT8, TARGET_VS_HAND, TARGET_VS_HF, TARGET_DECODE = 50.0, 55.0, 1.25, 0.98, 1.1, 0.5
RUN_FOLDER = Path(tempfile.gettempdir()) / "titan-gpu-suite"  # Titan's job.dump_folder (nothing is saved)


@dataclasses.dataclass(frozen=True)
class Row:
    """One measurement: a model shape, a batch, and Titan config overrides."""

    name: str
    flavor: str
    seq_len: int
    batch: int
    overrides: tuple[str, ...] = ()
    before: str = ""  # a path this round replaced (`BEFORE`), run again to measure what the change gave


@dataclasses.dataclass(frozen=True)
class Suite:
    """The rows, by how each is measured."""

    rows: list[Row]  # Titan's step (`measure_row`)
    pair: Row  # Titan vs the hand-written loop
    layers: tuple[Row, ...]  # bf16, then float8 variants, on the 8B-shaped model (the first two: the target)
    hf: Row  # transformers' LlamaForCausalLM, compiled
    decode: Row  # `titan generate`'s decode path (batch 1)


def bench_flavors(smoke: bool) -> dict:
    """Shapes the suite needs besides llama3's flavors: the 8B-shaped model with 8 blocks (tiny in smoke mode)."""
    flavors = dict(get_model_spec("llama3").flavors)
    if smoke:
        flavors["8B-x8"] = dataclasses.replace(flavors["debugmodel"], n_layers=2)
    else:
        flavors["8B-x8"] = dataclasses.replace(flavors["8B"], n_layers=8, max_seq_len=8192)
    return flavors


def suite(smoke: bool) -> Suite:
    """Titan's defaults (+ compile, which every GPU user turns on), then one change at a time."""
    if smoke:
        # float8 emulated (fp32 matmuls of float8-rounded operands): checks the path, not its speed.
        float8 = FLOAT8 + ("--float8.emulate", "true", "--float8.auto_filter_small_kn", "false")
        flavor, seq, batch = "debugmodel", 128, 2
        return Suite(
            rows=[
                Row("defaults (eager)", flavor, seq, batch),
                Row("defaults + compile", flavor, seq, batch, COMPILE),
                Row("eager, plain loss", flavor, seq, batch, PLAIN_LOSS),
                Row("eager, before: clip in place, complex RoPE", flavor, seq, batch, before="clip_in_place,complex_rope"),
                Row("eager, foreach AdamW", flavor, seq, batch, FOREACH),
                Row("eager + AC selective op", flavor, seq, batch, AC_OP),
                Row("eager + AC full", flavor, seq, batch, AC_FULL),
                Row("eager, block-causal", flavor, seq, batch, BLOCK_CAUSAL),
            ],
            pair=Row("titan vs hand-written (eager)", flavor, seq, batch),
            layers=(Row("tiny 8B stand-in eager", "8B-x8", seq, batch),
                    Row("tiny 8B stand-in float8 (emulated)", "8B-x8", seq, batch, float8),
                    Row("tiny 8B stand-in float8 (emulated), output in float8", "8B-x8", seq, batch,
                        float8 + OUTPUT_FLOAT8)),
            hf=Row("transformers LlamaForCausalLM (eager)", flavor, seq, batch),
            decode=Row("decode batch 1 (eager; compiled path aot_eager)", flavor, 16, 1),
        )
    one_b = ("1B", 2048, 4)
    return Suite(
        rows=[
            Row("1B s2048 defaults (eager)", *one_b),
            Row("1B s2048 defaults + compile", *one_b, COMPILE),
            Row("1B s2048 compile, before: one-rank FSDP", *one_b, COMPILE + ONE_RANK_FSDP),
            Row("1B s2048 compile, plain loss", *one_b, COMPILE + PLAIN_LOSS),
            Row("1B s2048 compile, flash attention", *one_b, COMPILE + FLASH),
            Row("1B s2048 compile, one-rank FSDP, foreach AdamW", *one_b, COMPILE + ONE_RANK_FSDP + FOREACH),
            Row("1B s2048 compile + float8", *one_b, COMPILE + FLOAT8),
            Row("1B s2048 compile + float8, before: one-rank FSDP", *one_b, COMPILE + FLOAT8 + ONE_RANK_FSDP),
            Row("1B s2048 compile + float8, output in float8", *one_b, COMPILE + FLOAT8 + OUTPUT_FLOAT8),
            Row("1B s2048 compile + AC selective op", *one_b, COMPILE + AC_OP),
            Row("1B s2048 compile + AC memory budget 0.5", *one_b, (*COMPILE, *AC_BUDGET, "0.5")),
            # titan plan costs 0.75's recompute (element-wise ops only, fused into the backward) at nothing: time it
            Row("1B s2048 compile + AC memory budget 0.75", *one_b, (*COMPILE, *AC_BUDGET, "0.75")),
            Row("1B s2048 compile, block-causal (FlexAttention)", *one_b, COMPILE + BLOCK_CAUSAL),
        ],
        pair=Row("1B s2048 titan vs hand-written (eager)", "1B", 2048, 2),
        layers=(Row("8B x8 s8192 compile + AC op", "8B-x8", 8192, 1, COMPILE + AC_OP),
                Row("8B x8 s8192 compile + AC op + float8", "8B-x8", 8192, 1, COMPILE + AC_OP + FLOAT8),
                Row("8B x8 s8192 compile + AC op, before: one-rank FSDP", "8B-x8", 8192, 1,
                    COMPILE + AC_OP + ONE_RANK_FSDP),
                Row("8B x8 s8192 compile + AC op + float8, before: one-rank FSDP", "8B-x8", 8192, 1,
                    COMPILE + AC_OP + FLOAT8 + ONE_RANK_FSDP),
                Row("8B x8 s8192 compile + AC op + float8, output in float8", "8B-x8", 8192, 1,
                    COMPILE + AC_OP + FLOAT8 + OUTPUT_FLOAT8),
                Row("8B x8 s8192 compile + AC op, plain loss", "8B-x8", 8192, 1, COMPILE + AC_OP + PLAIN_LOSS),
                Row("8B x8 s8192 compile + AC memory budget 0.3", "8B-x8", 8192, 1, (*COMPILE, *AC_BUDGET, "0.3")),
                Row("8B x8 s8192 compile + AC op, block-causal (FlexAttention)", "8B-x8", 8192, 1,
                    COMPILE + AC_OP + BLOCK_CAUSAL)),
        hf=Row("1B s2048 transformers LlamaForCausalLM compile", *one_b, COMPILE),
        decode=Row("1B decode batch 1, 256 tokens (compiled, CUDA graphs)", "1B", 256, 1),
    )


def one_line(error: BaseException) -> str:
    """`Type: first line of the message`, at most 300 characters."""
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}"[:300]


def why_not(row: Row, device: torch.device, cpu_compile: bool) -> str | None:
    """The reason a row cannot run here, or None."""
    if FLOAT8[0] in row.overrides and "--float8.emulate" not in row.overrides:
        if device.type != "cuda" or torch.cuda.get_device_capability(device) < (8, 9):
            return "float8 needs a CUDA GPU with compute capability >= 8.9 (H100, H200, L4, L40S, B200)"
    if COMPILE[0] in row.overrides and device.type == "cpu" and not cpu_compile:
        return "compile rows are skipped on CPU (inductor's C++ build takes minutes on a small CPU); pass --cpu-compile"
    return None


def row_config(row: Row, dtype: str, device: torch.device, dump: Path):
    """Titan's config for `row`; a ConfigError naming `model.converters` means this Titan has no float8 yet."""
    return load_config(None, [
        "--model.name", BENCH_MODEL, "--model.flavor", row.flavor, "--training.device", device.type,
        "--training.seq_len", str(row.seq_len), "--training.local_batch_size", str(row.batch),
        "--training.steps", "1000", "--training.mixed_precision_param", dtype,
        "--lr_scheduler.warmup_steps", "0", "--metrics.enable_tensorboard", "false",
        "--job.dump_folder", str(dump), *row.overrides,
    ])


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_step(fn, batch, device: torch.device) -> float:
    sync(device)
    start = time.perf_counter()
    fn(*batch)
    sync(device)
    return time.perf_counter() - start


def free_memory(device: torch.device) -> None:
    """Drop what the last row left: Python garbage, cached CUDA blocks, compiled graphs."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    torch._dynamo.reset()


def throughput(row: Row, seconds: float, trainer: Trainer, peak: float | None) -> dict:
    """tokens/s, TFLOP/s and MFU of one step of `row` taking `seconds`."""
    tokens_per_s = row.batch * row.seq_len / seconds
    tflops = tokens_per_s * trainer.spec.flops_per_token(trainer.model_args, row.seq_len) / 1e12
    return {
        "tokens_per_s": round(tokens_per_s, 1),
        "tflops": round(tflops, 3),
        "mfu_pct": None if peak is None else round(100 * tflops * 1e12 / peak, 2),
    }


def measure_row(row: Row, args, device: torch.device, dtype: str, peak: float | None) -> dict:
    """Warm up, then time single steps of Titan's `train_step` on prefetched batches."""
    trainer = Trainer(row_config(row, dtype, device, RUN_FOLDER))
    data = iter(trainer.loader)
    batches = [tuple(t.to(device) for t in next(data)) for _ in range(min(args.steps, 4))]

    def step(inputs, labels):
        trainer.train_step([(inputs, labels)])

    with before(row.before, trainer):
        for i in range(args.warmup):  # compile happens here
            timed_step(step, batches[i % len(batches)], device)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        times = [timed_step(step, batches[i % len(batches)], device) for i in range(args.steps)]
    result = {"status": "ok", "params_m": round(trainer.n_params / 1e6, 1), "median_step_s": round(statistics.median(times), 4)}
    result.update(throughput(row, statistics.median(times), trainer, peak))
    if device.type == "cuda":
        result["peak_mem_gib"] = round(torch.cuda.max_memory_allocated(device) / 2**30, 2)
    return result


def measure_pair(row: Row, args, device: torch.device, dtype: str, peak: float | None) -> dict:
    """Titan's step vs the hand-written loop from Titan's initial weights, steps interleaved."""
    trainer = Trainer(row_config(row, dtype, device, RUN_FOLDER))
    state = get_model_state_dict(trainer.model.parts[0], options=StateDictOptions(full_state_dict=True))
    with torch.device(device):
        plain = trainer.spec.build(trainer.model_args)
    plain.load_state_dict(state, strict=True)
    del state
    o = trainer.cfg.optimizer
    opt = torch.optim.AdamW(plain.parameters(), lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps,
                            weight_decay=o.weight_decay,  # the same step kernel as Titan's row
                            foreach=o.implementation == "foreach", fused=o.implementation == "fused")
    compute_dtype = getattr(torch, dtype)
    max_norm = trainer.cfg.training.max_norm

    def hand_written(inputs, labels):
        opt.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=compute_dtype, enabled=compute_dtype != torch.float32):
            logits = plain(inputs)  # (bs, seqlen, vocab)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(plain.parameters(), max_norm, foreach=True)
        opt.step()

    def titan(inputs, labels):
        trainer.train_step([(inputs, labels)])

    data = iter(trainer.loader)
    batches = [tuple(t.to(device) for t in next(data)) for _ in range(4)]
    contenders = [("titan", titan), ("hand-written", hand_written)]
    for _, fn in contenders:
        for i in range(args.warmup):
            timed_step(fn, batches[i % len(batches)], device)
    times: dict[str, list[float]] = {"titan": [], "hand-written": []}
    for i in range(args.pair_steps):
        for name, fn in contenders if i % 2 == 0 else contenders[::-1]:
            times[name].append(timed_step(fn, batches[i % len(batches)], device))
    ratios = sorted(hand / mine for mine, hand in zip(times["titan"], times["hand-written"]))
    q1, median, q3 = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else ratios * 3
    result = {"status": "ok", "params_m": round(trainer.n_params / 1e6, 1),
              "ratio_titan_over_hand": round(median, 4), "ratio_interquartile": [round(q1, 4), round(q3, 4)]}
    for name in times:
        result[name] = {"median_step_s": round(statistics.median(times[name]), 4),
                        **throughput(row, statistics.median(times[name]), trainer, peak)}
    return result


def measure_transformers(row: Row, args, device: torch.device, dtype: str, peak: float | None) -> dict:
    """`transformers`' LlamaForCausalLM at the row's shape: sdpa, bf16 autocast, `torch.compile` of the whole
    model (where the row compiles), fused AdamW, the fp32 cross-entropy of the hand-written loop."""
    from transformers import LlamaConfig, LlamaForCausalLM

    shape = get_model_spec(BENCH_MODEL).flavors[row.flavor]
    config = LlamaConfig(
        vocab_size=shape.vocab_size, hidden_size=shape.dim, intermediate_size=shape.ffn_hidden_dim,
        num_hidden_layers=shape.n_layers, num_attention_heads=shape.n_heads, num_key_value_heads=shape.kv_heads,
        head_dim=shape.attention_head_dim, rms_norm_eps=shape.norm_eps, rope_theta=shape.rope_theta,
        max_position_embeddings=row.seq_len, tie_word_embeddings=shape.tie_word_embeddings,
    )
    config._attn_implementation = "sdpa"
    with torch.device(device):
        model = LlamaForCausalLM(config)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, fused=device.type in ("cuda", "cpu"))
    forward = torch.compile(model) if COMPILE[0] in row.overrides else model
    compute_dtype = getattr(torch, dtype)
    g = torch.Generator().manual_seed(0)
    batches = [tuple(torch.randint(0, shape.vocab_size, (row.batch, row.seq_len), generator=g).to(device)
                     for _ in range(2)) for _ in range(2)]

    def step(inputs, labels):
        opt.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=compute_dtype, enabled=compute_dtype != torch.float32):
            logits = forward(input_ids=inputs).logits  # (bs, seqlen, vocab)
        F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten()).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)
        opt.step()

    for i in range(args.warmup):
        timed_step(step, batches[i % 2], device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times = [timed_step(step, batches[i % 2], device) for i in range(args.steps)]
    seconds = statistics.median(times)
    tokens_per_s = row.batch * row.seq_len / seconds
    tflops = tokens_per_s * get_model_spec(BENCH_MODEL).flops_per_token(shape, row.seq_len) / 1e12
    result = {"status": "ok", "params_m": round(sum(p.numel() for p in model.parameters()) / 1e6, 1),
              "median_step_s": round(seconds, 4), "tokens_per_s": round(tokens_per_s, 1), "tflops": round(tflops, 3),
              "mfu_pct": None if peak is None else round(100 * tflops * 1e12 / peak, 2)}
    if device.type == "cuda":
        result["peak_mem_gib"] = round(torch.cuda.max_memory_allocated(device) / 2**30, 2)
    return result


def measure_decode(row: Row, args, device: torch.device, dtype: str, peak: float | None) -> dict:
    """`benchmarks/decode_bench.py`: greedy decode at batch 1, eager then compiled (CUDA graphs on a GPU)."""
    from decode_bench import run_decode_bench

    report = run_decode_bench(row.flavor, row.seq_len, str(device), compile=True, compare_unfused=not args.smoke)
    runs = report["runs"]
    best = runs.get("compiled") or runs["eager"]
    unfused = runs.get("compiled, separate linears")
    return {
        "status": "ok",
        "tuned": report["tuned"],
        "decode_tokens_per_s": round(best["decode_tokens_per_s"], 1),
        "separate_linears_tokens_per_s": None if unfused is None else round(unfused["decode_tokens_per_s"], 1),
        "separate_linears_first_mismatch": report["separate_linears_first_mismatch"],
        "eager_tokens_per_s": round(runs["eager"]["decode_tokens_per_s"], 1),
        "bandwidth_share": None if best["bandwidth_share"] is None else round(best["bandwidth_share"], 3),
        "greedy_tokens_match_eager": report["tokens_match"],
        "first_mismatch_with_eager": report["first_mismatch"],
        "first_mismatch_margin": report["first_mismatch_margin"],
        "compile_error": report["compile_error"],
        "dtype": report["dtype"],
    }


def run(row: Row, measure, args, device: torch.device, dtype: str, peak: float | None) -> dict:
    """One row, never raising: ok, skipped (with why) or failed (with the error's first line)."""
    result: dict = {"row": row.name, "flavor": row.flavor, "seq_len": row.seq_len, "batch": row.batch,
                    "overrides": " ".join(row.overrides)}
    started = time.perf_counter()
    try:
        row_config(row, dtype, device, RUN_FOLDER)  # the config first: does this Titan know every key?
        reason = why_not(row, device, args.cpu_compile)
    except ConfigError as e:
        missing = FLOAT8[0] in row.overrides and "converters" in str(e)
        reason = "this Titan's config has no model.converters key (float8 not wired in yet)" if missing else None
        if not missing:
            result.update(status="failed", reason=one_line(e))
    if reason is not None:
        result.update(status="skipped", reason=reason)
    elif "status" not in result:
        try:
            result.update(measure(row, args, device, dtype, peak))
        except Exception as e:  # OOM, a compile error, a missing package: record it and go on
            result.update(status="failed", reason=one_line(e))
            traceback.print_exc()  # into log.txt: a failed row is debugged from one run
    free_memory(device)
    result["wall_s"] = round(time.perf_counter() - started, 1)
    if "tokens_per_s" in result:
        shown = f"{result['tokens_per_s']:.0f} tokens/s, MFU {result.get('mfu_pct')}%"
    elif "decode_tokens_per_s" in result:
        shown = f"decode {result['decode_tokens_per_s']:.0f} tokens/s, bandwidth share {result['bandwidth_share']}"
    else:
        shown = f"titan / hand-written {result.get('ratio_titan_over_hand')}"
    shown = result.get("reason") or shown
    print(f"[{result['status']}] {row.name}: {shown} ({result['wall_s']} s)", flush=True)
    return result


def environment(device: torch.device, dtype: str, peak: float | None) -> dict:
    def git(*cmd: str) -> str:
        try:
            return subprocess.run(["git", *cmd], capture_output=True, text=True, timeout=10).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""

    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "CPU"
    if device.type == "cpu":
        try:
            with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
                name = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), name)
        except OSError:
            pass
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "device": name,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "memory_gib": round(torch.cuda.get_device_properties(device).total_memory / 2**30, 1) if device.type == "cuda" else None,
        "dtype": dtype,
        "peak_tflops": None if peak is None else round(peak / 1e12, 1),
        "git": git("log", "-1", "--oneline") or "unknown",
        "uncommitted_files": len(git("status", "--short").splitlines()),
    }


def _target(lines: list[str], what: str, value: float | None, target: float, unit: str = "", why: str = "") -> None:
    """One verdict line: met, NOT met, or not measured (and why)."""
    if value is None:
        lines.append(f"{what} (target >= {target}{unit}): not measured{f' ({why})' if why else ''}")
    else:
        lines.append(f"{what} {value:.3g}{unit} (target >= {target}{unit}): {'met' if value >= target else 'NOT met'}")


def verdicts(results: dict) -> list[str]:
    """One line per target of issue 20 (the smoke run's lines check the code, not the figures)."""
    by_name = {r["row"]: r for r in results["rows"]}
    names = results["names"]
    lines: list[str] = []

    def get(name: str, key: str):
        row = by_name.get(name) or {}
        return row.get(key) if row.get("status") == "ok" else None

    def why(name: str) -> str:
        return (by_name.get(name) or {}).get("reason") or "row not run"

    default = names["default_compile"]
    _target(lines, "1B defaults + compile MFU", get(default, "mfu_pct"), TARGET_MFU_1B, "%", why(default))
    bf16, fp8 = names["layers"][:2]
    _target(lines, "8B x8 s8192 bf16 MFU", get(bf16, "mfu_pct"), TARGET_MFU_8B, "%", why(bf16))
    speedup = None
    if get(bf16, "tokens_per_s") and get(fp8, "tokens_per_s"):
        speedup = results["float8_speedup"] = round(get(fp8, "tokens_per_s") / get(bf16, "tokens_per_s"), 3)
    _target(lines, "float8 / bf16 on 8B x8", speedup, TARGET_FLOAT8, "x", why(fp8) if speedup is None else "")
    def speed_ratio(over: str, under: str) -> float | None:
        a, b = get(over, "tokens_per_s"), get(under, "tokens_per_s")
        return round(a / b, 3) if a and b else None

    if len(names["layers"]) >= 4:  # the same two rows through one-rank FSDP, as before master weights
        fsdp_bf16, fsdp_fp8 = names["layers"][2:4]
        _target(lines, "float8 / bf16 on 8B x8 through one-rank FSDP (before)", speed_ratio(fsdp_fp8, fsdp_bf16),
                TARGET_FLOAT8, "x", why(fsdp_fp8))
        gains = [(default, "1B s2048 compile, before: one-rank FSDP"), (bf16, fsdp_bf16), (fp8, fsdp_fp8),
                 ("1B s2048 compile + float8", "1B s2048 compile + float8, before: one-rank FSDP")]
        for after, before_name in gains:
            lines.append(f"master weights / one-rank FSDP, {after}: {speed_ratio(after, before_name)}x")
    output_rows = [name for name in names["layers"] if name.endswith("output in float8")]
    if output_rows:  # float8 with the output projection in float8 too (inside the fused loss): not the default
        _target(lines, "float8 with the output projection in float8 / bf16 on 8B x8", speed_ratio(output_rows[0], bf16),
                TARGET_FLOAT8, "x", why(output_rows[0]))
    pair = by_name.get(names["pair"]) or {}
    ratio = pair.get("ratio_titan_over_hand") if pair.get("status") == "ok" else None
    _target(lines, "Titan / hand-written loop", ratio, TARGET_VS_HAND, "x", why(names["pair"]))
    hf = get(names["hf"], "tokens_per_s")
    titan = get(default if not results["smoke"] else names["default_eager"], "tokens_per_s")
    _target(lines, "Titan / transformers compiled", None if not (hf and titan) else round(titan / hf, 3), TARGET_VS_HF,
            "x", why(names["hf"]))
    _target(lines, "decode share of the memory-bandwidth limit", get(names["decode"], "bandwidth_share"), TARGET_DECODE,
            "", why(names["decode"]) if get(names["decode"], "status") is None else "no bandwidth figure on CPU")
    if results["smoke"]:
        lines = [f"{line} [smoke: not a speed figure]" for line in lines]
    return lines


def markdown(results: dict) -> str:
    env = results["environment"]
    out = [
        f"### Titan GPU suite, {env['date']}",
        "",
        f"{env['device']}, torch {env['torch']} (CUDA {env['cuda']}), Python {env['python']}, {env['dtype']}, "
        f"peak {env['peak_tflops']} TFLOP/s; Titan at `{env['git']}` ({env['uncommitted_files']} uncommitted files).",
        "",
        "| row | status | tokens/s | TFLOP/s | MFU % | peak mem GiB | step s | note |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in results["rows"]:
        if r["status"] != "ok":
            out.append(f"| {r['row']} | {r['status']} | | | | | | {r['reason']} |")
        elif "titan" in r:  # the pair row
            for name in ("titan", "hand-written"):
                m = r[name]
                out.append(f"| {r['row']}: {name} | ok | {m['tokens_per_s']:.0f} | {m['tflops']:.3g} | {m['mfu_pct']} | "
                           f"| {m['median_step_s']} | |")
            out.append(f"| {r['row']}: ratio | ok | | | | | | titan / hand-written {r['ratio_titan_over_hand']:.3f} "
                       f"(interquartile {r['ratio_interquartile'][0]:.3f}-{r['ratio_interquartile'][1]:.3f}) |")
        elif "decode_tokens_per_s" in r:
            note = (f"eager {r['eager_tokens_per_s']:.0f} tokens/s; {r['dtype']}; tuned {r.get('tuned')}; bandwidth share "
                    f"{r['bandwidth_share']}; greedy tokens equal eager's: {r['greedy_tokens_match_eager']} "
                    f"(first differing: {r.get('first_mismatch_with_eager')})")
            margin = r.get("first_mismatch_margin")
            if margin:
                note += (f"; there eager's two logits are {margin['logit_gap']:.3g} apart, bf16 spacing "
                         f"{margin['dtype_spacing']:.3g}: {'a near-tie' if margin['near_tie'] else 'NOT a near-tie'}")
            if r.get("separate_linears_tokens_per_s"):
                note += (f"; separate q/k/v, w1/w3 linears: {r['separate_linears_tokens_per_s']:.0f} tokens/s "
                         f"(first token differing from the fused run's: {r['separate_linears_first_mismatch']})")
            if r.get("compile_error"):
                note += f"; compile failed: {r['compile_error']}"
            out.append(f"| {r['row']} | ok | {r['decode_tokens_per_s']:.0f} | | | | | {note} |")
        else:
            out.append(f"| {r['row']} | ok | {r['tokens_per_s']:.0f} | {r['tflops']:.3g} | {r['mfu_pct']} | "
                       f"{r.get('peak_mem_gib', '')} | {r['median_step_s']} | |")
    out += ["", "Targets:", ""] + [f"- {line}" for line in results["verdicts"]]
    return "\n".join(out) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("outputs/gpu-suite"), help="folder for results.json / results.md")
    parser.add_argument("--smoke", action="store_true", help="tiny CPU-sized run: debugmodel, seq 128, 2 steps")
    parser.add_argument("--steps", type=int, help="measured steps per row (default 10; 2 in --smoke)")
    parser.add_argument("--warmup", type=int, help="untimed steps first (default 3; 1 in --smoke)")
    parser.add_argument("--pair-steps", type=int, help="interleaved steps of each in the Titan vs hand-written row")
    parser.add_argument("--only", nargs="*", default=[], help="run only rows whose name contains one of these")
    parser.add_argument("--skip", nargs="*", default=[], help="skip rows whose name contains one of these")
    parser.add_argument("--cpu-compile", action="store_true", help="run the compile rows on CPU too")
    parser.add_argument("--budget-s", type=float, default=0, help="skip the rows left once this many seconds passed")
    args = parser.parse_args()
    args.steps = args.steps or (2 if args.smoke else 10)
    args.warmup = args.warmup or (1 if args.smoke else 3)
    args.pair_steps = args.pair_steps or (2 if args.smoke else 10)
    args.out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu" and not args.smoke:
        raise SystemExit("no CUDA device: the full suite needs a GPU; pass --smoke for the tiny CPU run")
    dtype = "float32" if device.type == "cpu" else "bfloat16"
    register_model_spec(dataclasses.replace(get_model_spec("llama3"), name=BENCH_MODEL, flavors=bench_flavors(args.smoke)))
    peak = device_peak_flops(device, getattr(torch, dtype))
    plan = suite(args.smoke)
    names = {"default_eager": plan.rows[0].name, "default_compile": plan.rows[1].name, "pair": plan.pair.name,
             "layers": [r.name for r in plan.layers], "hf": plan.hf.name, "decode": plan.decode.name}
    results: dict = {"environment": environment(device, dtype, peak), "smoke": args.smoke, "rows": [], "names": names}
    print(json.dumps(results["environment"]), flush=True)
    # The target rows first, so that a run cut short by its budget keeps them.
    order = ([(plan.rows[1], measure_row), *[(r, measure_row) for r in plan.layers], (plan.decode, measure_decode),
              (plan.hf, measure_transformers), (plan.pair, measure_pair)]
             + [(r, measure_row) for i, r in enumerate(plan.rows) if i != 1])
    for row, measure in order:
        if args.only and not any(word in row.name for word in args.only):
            continue
        if any(word in row.name for word in args.skip):
            continue
        if args.budget_s and time.perf_counter() - started > args.budget_s:
            results["rows"].append({"row": row.name, "status": "skipped", "reason": "the suite's time budget ran out"})
            continue
        results["rows"].append(run(row, measure, args, device, dtype, peak))
        (args.out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    results["verdicts"] = verdicts(results)
    (args.out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    (args.out / "results.md").write_text(markdown(results))
    print(markdown(results))


if __name__ == "__main__":
    main()
