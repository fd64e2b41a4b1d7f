"""Titan's training step against a minimal hand-written PyTorch loop: what does the framework cost?

Same model (titan_models' Llama), same batches, same dtype, same optimizer and
clipping. Titan's step runs through the full trainer (FSDP2 on a one-process
mesh, DTensor parameters, the global-norm clip); the plain loop is the
nanoGPT-style minimum. Single steps alternate A/B so machine noise hits both alike.

    uv run python benchmarks/step_overhead.py --flavor 10M --seq-len 256 --batch 8 --steps 8 --rounds 3

Other arguments are Titan config overrides (e.g. `--parallelism.fsdp_reshard_after_forward never`).
Prints tokens/s of each and the ratio titan / plain (target >= 0.97).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F
from titan_core.config import load_config
from titan_core.trainer import Trainer
from titan_models import get_model_args, get_model_spec


def plain_setup(args, seed):
    spec = get_model_spec("llama3")
    model_args = get_model_args("llama3", args.flavor)
    model = spec.build(model_args)
    torch.manual_seed(seed)
    model.init_weights()
    opt = torch.optim.AdamW(model.parameters(), lr=8e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, foreach=True)
    return model, opt


def plain_step(model, opt, inputs, labels, dtype):
    opt.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
        logits = model(inputs)
    loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)
    opt.step()
    return loss


def timed(fn, batches) -> float:
    start = time.perf_counter()
    for inputs, labels in batches:
        fn(inputs, labels)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--flavor", default="10M")
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=8, help="distinct batches per round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    args, titan_overrides = parser.parse_known_args()  # the rest: Titan config overrides
    dtype = getattr(torch, args.dtype)

    cfg = load_config(None, [
        "--model.flavor", args.flavor, "--training.seq_len", str(args.seq_len),
        "--training.local_batch_size", str(args.batch), "--training.steps", "1000",
        "--training.mixed_precision_param", args.dtype, "--lr_scheduler.warmup_steps", "0",
        "--metrics.enable_tensorboard", "false", "--job.dump_folder", "/tmp/titan-bench",
        *titan_overrides,
    ])
    trainer = Trainer(cfg)
    data = iter(trainer.loader)
    batches = [next(data) for _ in range(args.steps)]
    model, opt = plain_setup(args, seed=0)

    def titan(inputs, labels):
        trainer.train_step([(inputs, labels)])

    def plain(inputs, labels):
        plain_step(model, opt, inputs, labels, dtype)

    timed(titan, batches[:2])  # warm-up: allocator, thread pools
    timed(plain, batches[:2])
    # Interleave single steps (titan, plain, plain, titan, ...) so drifts in machine speed hit both alike.
    t_titan, t_plain = [], []
    for r in range(args.rounds):
        for i, batch in enumerate(batches):
            order = [(titan, t_titan), (plain, t_plain)]
            for fn, times in order if (r + i) % 2 == 0 else order[::-1]:
                times.append(timed(fn, [batch]))
    tokens_per_step = args.batch * args.seq_len
    titan_tps, plain_tps = tokens_per_step / statistics.median(t_titan), tokens_per_step / statistics.median(t_plain)
    ratios = sorted(b / a for a, b in zip(t_titan, t_plain))
    print(f"model llama3/{args.flavor}  batch {args.batch} x {args.seq_len}  {args.dtype}  torch {torch.__version__}  "
          f"threads {torch.get_num_threads()}")
    print(f"plain loop : {plain_tps:10.1f} tokens/s (median of {len(t_plain)} steps)")
    print(f"titan step : {titan_tps:10.1f} tokens/s (median of {len(t_titan)} steps)")
    q = len(ratios) // 4
    print(f"ratio titan/plain: {titan_tps / plain_tps:.3f}  (paired steps: median {statistics.median(ratios):.3f}, "
          f"interquartile {ratios[q]:.3f}-{ratios[-q - 1]:.3f})")


if __name__ == "__main__":
    main()
