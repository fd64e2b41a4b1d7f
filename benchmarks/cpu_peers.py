"""Titan's training step vs a hand-written PyTorch loop vs transformers' `LlamaForCausalLM`, on CPU.

One process; the same weights (Titan's seeded init, converted to Hugging Face
names and RoPE layout with titan_models' adapter; the fp32 logits of the three
are compared before anything is timed), the same batches, the same AdamW
(foreach, Titan's hyperparameters), the same global-norm clip and the same
dtype (bf16: autocast for the hand-written loop and transformers, whatever
Titan's own bf16 path is for Titan). Titan runs through `Trainer.train_step`;
the hand-written loop is the nanoGPT-style minimum on titan_models' own
`Transformer`. Single steps are interleaved (A, B, C, then B, C, A, ...) so
drifts in machine speed hit all three alike.

    uv run python benchmarks/cpu_peers.py --flavor 25M --seq-len 256 --batch 4 --steps 4 --rounds 3
    uv run python benchmarks/cpu_peers.py --flavor 110M --seq-len 256 --batch 4 --steps 2 --rounds 3
    uv run python benchmarks/cpu_peers.py --flavor 25M --dtype bfloat16

`--flavor` is a Titan llama3 flavor or a shape of this script (`BENCH_SHAPES`:
25M = dim 288, 8 layers, 6 heads, 2 KV heads, vocab 32768: 26.0M parameters);
`--dim`, `--n-layers`, `--n-heads`, `--n-kv-heads` change it. Other arguments
are Titan config overrides (e.g. `--parallelism.fsdp_reshard_after_forward never`).
Prints tokens/s, GFLOP/s and the share of the measured matmul peak of each (from
the median step, and from the best step: on a shared machine noise only adds
time), and the ratios titan / hand-written (target >= 0.97) and titan /
transformers (target >= 1.0): median and interquartile range over paired steps,
and the ratio of best steps. `--threads` sets torch's CPU threads; `--clock cpu`
times steps by process CPU time, which other processes on a shared machine
hardly change (use it with `--threads 1`: with more threads, OpenMP's spinning
waits count too).
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

import torch
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from titan_core.config import load_config
from titan_core.metrics.peak_flops import cpu_peak_flops, measure_cpu_matmul_flops
from titan_core.trainer import Trainer
from titan_models import get_model_spec, register_model_spec

# Shapes no Titan flavor has: a base flavor and the fields changed.
BENCH_SHAPES = {"25M": {"base": "50M", "dim": 288, "n_layers": 8, "n_heads": 6, "n_kv_heads": 2}}
SHAPE_FLAGS = ("dim", "n_layers", "n_heads", "n_kv_heads")
TARGETS = {"hand-written": 0.97, "transformers": 1.0}  # titan / peer, paired-step median


def model_name_and_flavor(args) -> tuple[str, str]:
    """Titan's `model.name` / `model.flavor` for the requested shape.

    A named flavor is used as is; any other shape is registered as the only
    flavor of a `llama3-bench` model spec (the llama3 spec with other flavors).
    """
    spec = get_model_spec("llama3")
    preset = dict(BENCH_SHAPES.get(args.flavor, {"base": args.flavor}))
    base = preset.pop("base")
    if base not in spec.flavors:
        choices = ", ".join([*spec.flavors, *BENCH_SHAPES])
        raise SystemExit(f"--flavor {args.flavor!r} is neither a llama3 flavor nor a BENCH_SHAPES entry; choose one of {choices}")
    preset.update({flag: getattr(args, flag) for flag in SHAPE_FLAGS if getattr(args, flag) is not None})
    if not preset:
        return "llama3", args.flavor
    label = args.flavor if all(getattr(args, flag) is None for flag in SHAPE_FLAGS) else "custom"
    shape = dataclasses.replace(spec.flavors[base], **preset)
    register_model_spec(dataclasses.replace(spec, name="llama3-bench", flavors={label: shape}))
    return "llama3-bench", label


def cpu_description() -> str:
    """CPU model, threads, and the kernels torch picks (AVX-512 / AMX or AVX2)."""
    model = "unknown CPU"
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), model)
    except OSError:
        pass
    kind = [torch.backends.cpu.get_cpu_capability()]  # "AVX512", "AVX2", "DEFAULT", ...
    for flag, check in (("AVX512-BF16", "_is_avx512_bf16_supported"), ("AMX", "_is_amx_tile_supported")):
        if getattr(torch.cpu, check, lambda: False)():
            kind.append(flag)
    return f"{model}, {torch.get_num_threads()} threads, kernels {'+'.join(kind)}"


def full_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Full (unsharded) fp32 copies of a model's weights, Titan names, whatever the wrapping."""
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    return {name: tensor.detach().clone() for name, tensor in state.items()}


def build_transformers(spec, model_args, state):
    """transformers' model class for this family, with Titan's weights converted by the spec's adapter."""
    import transformers

    adapter = spec.hf_adapter
    config = transformers.LlamaConfig(**adapter.hf_config_from_args(model_args, "float32"))
    config.use_cache = False  # training: no KV cache
    model = getattr(transformers, adapter.hf_architecture)._from_config(config, attn_implementation="sdpa")
    model.load_state_dict(adapter.to_hf(state, model_args), strict=True)
    return model.float().train()


def adamw(params, opt_cfg) -> torch.optim.AdamW:
    """AdamW (foreach) with Titan's configured hyperparameters."""
    return torch.optim.AdamW(
        params, lr=opt_cfg.lr, betas=(opt_cfg.beta1, opt_cfg.beta2), eps=opt_cfg.eps,
        weight_decay=opt_cfg.weight_decay, foreach=True,
    )


def loop_step(forward, model, opt, inputs, labels, dtype, max_norm):
    """The nanoGPT-style step: autocast forward, fp32 cross-entropy, backward, clip, AdamW."""
    opt.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
        logits = forward(inputs)  # (bs, seqlen, vocab)
    loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm, foreach=True)
    opt.step()
    return loss


@torch.no_grad()
def max_logit_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.double() - b.double()).abs().max().item()


def timed(fn, batch, clock=time.perf_counter) -> float:
    start = clock()
    fn(*batch)
    return clock() - start


def quartiles(values: list[float]) -> tuple[float, float, float]:
    if len(values) < 2:
        return values[0], values[0], values[0]
    q1, q2, q3 = statistics.quantiles(values, n=4)
    return q1, q2, q3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--flavor", default="25M", help="llama3 flavor or a BENCH_SHAPES name")
    parser.add_argument("--dim", type=int)
    parser.add_argument("--n-layers", type=int)
    parser.add_argument("--n-heads", type=int)
    parser.add_argument("--n-kv-heads", type=int)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--steps", type=int, default=4, help="distinct batches per round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps of each contender first")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--max-diff", type=float, default=1e-4, help="largest fp32 logits difference allowed")
    parser.add_argument("--threads", type=int, help="torch CPU threads (default: torch's choice)")
    parser.add_argument("--clock", default="wall", choices=["wall", "cpu"],
                        help="time steps by wall clock, or by this process's CPU time (with --threads 1: "
                        "what each step costs, whatever else runs on a shared machine)")
    args, titan_overrides = parser.parse_known_args()  # the rest: Titan config overrides
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    model_name, flavor = model_name_and_flavor(args)

    cfg = load_config(None, [
        "--model.name", model_name, "--model.flavor", flavor, "--training.device", "cpu",
        "--training.seq_len", str(args.seq_len), "--training.local_batch_size", str(args.batch),
        "--training.steps", "1000", "--training.mixed_precision_param", args.dtype,
        "--optimizer.name", "AdamW", "--optimizer.implementation", "foreach", "--lr_scheduler.warmup_steps", "0",
        "--metrics.enable_tensorboard", "false", "--job.dump_folder", "/tmp/titan-bench",
        *titan_overrides,
    ])
    trainer = Trainer(cfg)
    spec, model_args = trainer.spec, trainer.model_args
    data = iter(trainer.loader)
    batches = [next(data) for _ in range(args.steps)]

    # The same weights everywhere: Titan's init, copied and converted.
    state = full_state(trainer.model.parts[0])
    plain = spec.build(model_args)
    plain.load_state_dict(state, strict=True)
    hf = build_transformers(spec, model_args, state)
    tokens = batches[0][0][:1]  # (1, seqlen)
    with torch.no_grad():
        plain_logits = plain(tokens)
        diff_hf = max_logit_diff(hf(input_ids=tokens).logits, plain_logits)
        diff_titan = max_logit_diff(trainer.model.parts[0](tokens), plain_logits)
    print(f"logits max |diff| (fp32 weights, 1 x {args.seq_len} tokens): transformers vs hand-written {diff_hf:.2e}, "
          f"titan's model (outside its train step) vs hand-written {diff_titan:.2e}")
    if diff_hf > args.max_diff or (dtype == torch.float32 and diff_titan > args.max_diff):
        raise SystemExit(f"logits differ by more than --max-diff {args.max_diff:g}: the three do not run the same model")

    max_norm = cfg.training.max_norm
    plain_opt, hf_opt = adamw(plain.parameters(), cfg.optimizer), adamw(hf.parameters(), cfg.optimizer)
    contenders = {
        "titan": lambda inputs, labels: trainer.train_step([(inputs, labels)]),
        "hand-written": lambda inputs, labels: loop_step(plain, plain, plain_opt, inputs, labels, dtype, max_norm),
        "transformers": lambda inputs, labels: loop_step(
            lambda x: hf(input_ids=x).logits, hf, hf_opt, inputs, labels, dtype, max_norm
        ),
    }
    names = list(contenders)
    peak_before = measure_cpu_matmul_flops(dtype)
    for name in names:  # warm-up: allocator, thread pools, optimizer state
        for i in range(args.warmup):
            contenders[name](*batches[i % len(batches)])
    times: dict[str, list[float]] = {name: [] for name in names}
    clock = time.perf_counter if args.clock == "wall" else time.process_time
    slot = 0
    for _ in range(args.rounds):
        for batch in batches:
            k = slot % len(names)
            for name in names[k:] + names[:k]:  # rotate who goes first
                times[name].append(timed(contenders[name], batch, clock))
            slot += 1
    # A busy machine only lowers a measured peak: keep the best of before, after and Titan's cache.
    peak = max(peak_before, measure_cpu_matmul_flops(dtype), cpu_peak_flops(dtype))

    tokens_per_step = args.batch * args.seq_len
    flops_per_token = spec.flops_per_token(model_args, args.seq_len)
    n_params = spec.count_params(model_args)
    print(f"model llama3/{flavor} ({n_params / 1e6:.1f}M params, {flops_per_token / 1e6:.0f} MFLOP/token)  "
          f"batch {args.batch} x {args.seq_len}  {args.dtype}  {len(times['titan'])} timed steps each ({args.clock} clock)")
    print(f"torch {torch.__version__}  CPU: {cpu_description()}")
    titan_param = next(trainer.model.parts[0].parameters())
    kind = type(titan_param).__name__
    print(f"titan's parameters: {kind}, {titan_param.dtype}" + (" (FSDP2 on a one-rank mesh)" if kind == "DTensor" else ""))
    print(f"matmul peak ({args.dtype}, best of before/after the timing and titan's cache): {peak / 1e9:.1f} GFLOP/s")
    # Median steps say what a run sees on this machine; best steps what each code costs when
    # no other process takes the cores (noise on a shared machine only ever adds time).
    print(f"  {'':<13} {'tokens/s':>9} {'GFLOP/s':>8} {'% peak':>7}   {'best-step tokens/s':>18} {'% peak':>7}")
    median_tps, best_tps = {}, {}
    for name in names:
        median_tps[name] = tokens_per_step / statistics.median(times[name])
        best_tps[name] = tokens_per_step / min(times[name])
        gflops, best_gflops = median_tps[name] * flops_per_token / 1e9, best_tps[name] * flops_per_token / 1e9
        print(f"  {name:<13} {median_tps[name]:9.1f} {gflops:8.1f} {100 * gflops * 1e9 / peak:6.1f}%   "
              f"{best_tps[name]:18.1f} {100 * best_gflops * 1e9 / peak:6.1f}%")
    row = [f"{n_params / 1e6:.1f}M", f"{args.batch} x {args.seq_len}", args.dtype,
           *(f"{median_tps[n]:.0f} / {best_tps[n]:.0f}" for n in names)]
    for peer, target in TARGETS.items():
        ratios = [t_peer / t_titan for t_titan, t_peer in zip(times["titan"], times[peer])]
        q1, median, q3 = quartiles(ratios)
        best = min(times[peer]) / min(times["titan"])
        verdict = "met" if median >= target else "NOT met"
        print(f"titan / {peer}: {median:.3f} (paired steps: median, interquartile {q1:.3f}-{q3:.3f}; best steps {best:.3f})  "
              f"target >= {target}: {verdict}")
        row.append(f"{median:.3f} ({q1:.2f}-{q3:.2f}); best {best:.3f}")
    row.append(" / ".join(f"{100 * best_tps[n] * flops_per_token / peak:.0f}%" for n in names))
    print("markdown row: | " + " | ".join(row) + " |")


if __name__ == "__main__":
    main()
