"""Context parallel's methods side by side on CPU processes: ring (allgather, rotate) and Ulysses, ms per step.

One torchrun launch of `--cp` gloo processes (one CPU thread each). Each rank builds one
`titan_core.trainer.Trainer` per method from the same seeded init (`parallelism.context_parallel_degree`
= cp, so FSDP shards over the cp ranks, as `titan train` runs it) and times its `train_step` on the same
batches, the methods interleaved (A, B, C, then B, C, A, ...) so drifts in machine speed hit all alike.
It also times one block's attention alone, forward and backward (the swapped module: ring attention, or
Ulysses' all-to-alls around the model's SDPA), on that block's q/k/v shapes, and counts the bytes a rank sends
in that module's forward at the collective calls (docs/parallelism.md derives them, and the backward's).
Before timing, every method's first-step loss is checked against the first's (the methods compute the same
function).

`--block-causal` trains with attention within each packed document (`model.attn_mask_type block_causal`,
the documents of the default corpus: whole files) and times the attention modules under a mask of 8
documents of seeded random lengths per sequence: Ulysses hands it to SDPA over whole sequences, ring attention reads it per block.

    uv run python benchmarks/cp_methods.py                                   # debugmodel, 1 x 2048 tokens, cp 2
    uv run python benchmarks/cp_methods.py --block-causal --seq-len 1024     # under a document mask
    uv run python benchmarks/cp_methods.py --flavor 50M --seq-len 4096 --rounds 5
    uv run python benchmarks/cp_methods.py --seq-len 256 --steps 1 --rounds 1 --warmup 1   # smoke

Prints, per method, the median and best ms per step and per attention call (best: noise on a shared
machine only adds time), and the ratios to the first method timed (ring allgather, Titan's default, unless
`--methods` leaves it out).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

METHODS = {
    "ring allgather": ("ring", "allgather"),
    "ring rotate": ("ring", "rotate"),
    "ulysses": ("ulysses", "allgather"),
}
"""Label -> (parallelism.context_parallel_method, parallelism.context_parallel_rotate_method)."""


def overrides(args: argparse.Namespace, method: str) -> list[str]:
    """The Titan config of one method's trainer."""
    cp_method, rotate = METHODS[method]
    return [
        "--model.flavor", args.flavor, "--training.device", "cpu", "--training.seq_len", str(args.seq_len),
        "--training.local_batch_size", str(args.batch), "--training.mixed_precision_param", args.dtype,
        "--training.steps", "1000", "--lr_scheduler.warmup_steps", "0", "--metrics.enable_tensorboard", "false",
        "--debug.seed", "7", "--job.dump_folder", str(Path(tempfile.gettempdir()) / "titan-cp-methods"),
        "--parallelism.context_parallel_degree", str(args.cp), "--parallelism.context_parallel_method", cp_method,
        "--parallelism.context_parallel_rotate_method", rotate,
        "--model.attn_mask_type", "block_causal" if args.block_causal else "causal",
    ]


def time_attention(core, q, k, v, repeats: int, mask=None) -> list[float]:
    """Wall seconds of `repeats` forward + backward calls of one block's attention module on q, k, v (and mask)."""
    import torch
    import torch.distributed as dist

    times = []
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        out = core(q, k, v) if mask is None else core(q, k, v, mask=mask)
        out.backward(torch.ones_like(out))
        dist.barrier()
        times.append(time.perf_counter() - start)
    return times


@contextlib.contextmanager
def counting_sent_bytes(cp: int):
    """Count the bytes this rank sends to other ranks in context parallel's collectives (forward calls only: the
    backward's run inside autograd). Patches the three entry points the CP modules call, for the duration."""
    import titan_parallel.ring_attention as ring
    import titan_parallel.ulysses_attention as ulysses

    sent = [0.0]
    saved = ulysses.all_to_all_single_autograd, ring._all_gather_autograd, ring._exchange

    def all_to_all(x, output_splits, input_splits, group):  # keeps 1 / cp of its buffer
        sent[0] += x.numel() * x.element_size() * (cp - 1) / cp
        return saved[0](x, output_splits, input_splits, group)

    def all_gather(x, dim, group):  # ring all-gather: its shard goes to the cp - 1 others
        sent[0] += x.numel() * x.element_size() * (cp - 1)
        return saved[1](x, dim, group)

    def exchange(x, group):  # one hop of the ring
        sent[0] += x.numel() * x.element_size()
        return saved[2](x, group)

    ulysses.all_to_all_single_autograd, ring._all_gather_autograd, ring._exchange = all_to_all, all_gather, exchange
    try:
        yield sent
    finally:
        ulysses.all_to_all_single_autograd, ring._all_gather_autograd, ring._exchange = saved


def worker(args: argparse.Namespace, out: str) -> None:
    """One rank: build every method's trainer, check their first losses agree, time interleaved steps."""
    import torch
    import torch.distributed as dist

    from titan_core.config import load_config
    from titan_core.trainer import Trainer

    trainers = {m: Trainer(load_config(None, overrides(args, m))) for m in chosen(args)}
    first = next(iter(trainers.values()))
    data = iter(first.loader)
    batches = [next(data) for _ in range(args.steps)]
    names = list(trainers)
    losses = {m: trainers[m].train_step([batches[0]]).loss for m in names}  # also a warm-up step
    reference = losses[names[0]].detach().clone()
    for m in names:
        diff = (losses[m].detach() - reference).abs()
        dist.all_reduce(diff, op=dist.ReduceOp.MAX)
        if diff.item() > 1e-4:
            raise SystemExit(f"{m}'s first loss differs from {names[0]}'s by {diff.item():.2e}: not the same model")
    for m in names:
        for i in range(args.warmup - 1):
            trainers[m].train_step([batches[i % len(batches)]])
    step_times: dict[str, list[float]] = {m: [] for m in names}
    slot = 0
    for _ in range(args.rounds):
        for batch in batches:
            k = slot % len(names)
            for m in names[k:] + names[:k]:  # rotate who goes first
                dist.barrier()
                start = time.perf_counter()
                result = trainers[m].train_step([batch])
                result.loss.item()  # the step is done
                dist.barrier()
                step_times[m].append(time.perf_counter() - start)
            slot += 1

    # One block's attention module alone, on its q/k/v shapes: (bs, heads, seqlen / cp, head_dim).
    model_args = first.model_args
    heads, kv_heads, head_dim = model_args.n_heads, model_args.kv_heads, model_args.attention_head_dim
    local = args.seq_len // args.cp
    dtype = getattr(torch, args.dtype)
    gen = torch.Generator().manual_seed(dist.get_rank())
    q = torch.randn(args.batch, heads, local, head_dim, generator=gen, dtype=dtype, requires_grad=True)
    k = torch.randn(args.batch, kv_heads, local, head_dim, generator=gen, dtype=dtype, requires_grad=True)
    v = torch.randn(args.batch, kv_heads, local, head_dim, generator=gen, dtype=dtype, requires_grad=True)
    mask = None
    if args.block_causal:  # 8 documents per sequence, the whole sequence's mask, as the model builds it
        from titan_models.document_mask import block_causal_mask

        # 8 documents of seeded random lengths: their boundaries fall inside the cp chunks, not on them
        starts = torch.randperm(args.seq_len - 1, generator=torch.Generator().manual_seed(0))[:7] + 1
        ids = torch.zeros(args.seq_len, dtype=torch.long).index_fill_(0, starts, 1).cumsum(0)
        mask = block_causal_mask(ids.expand(args.batch, -1), flex=False)
    attention_times, sent_bytes = {}, {}
    for m in names:
        core = next(iter(trainers[m].model.parts[0].layers.values())).attention.sdpa
        with counting_sent_bytes(args.cp) as sent:
            core(q, k, v) if mask is None else core(q, k, v, mask=mask)
        sent_bytes[m] = sent[0]
        time_attention(core, q, k, v, 1, mask)  # warm-up
        attention_times[m] = time_attention(core, q, k, v, args.rounds * len(batches), mask)
    if dist.get_rank() == 0:
        cores = {m: " ".join(repr(next(iter(trainers[m].model.parts[0].layers.values())).attention.sdpa).split())
                 for m in names}
        Path(out).write_text(json.dumps({
            "steps": step_times, "attention": attention_times, "sent": sent_bytes, "cores": cores,
            "torch": torch.__version__,
            "params": first.spec.count_params(model_args),
            "shape": {"heads": heads, "kv_heads": kv_heads, "head_dim": head_dim, "dim": model_args.dim,
                      "layers": model_args.n_layers},
        }))
    dist.barrier()


def chosen(args: argparse.Namespace) -> list[str]:
    """The methods to time, in `METHODS`' order; the first is the baseline of the ratios."""
    names = [m.strip() for m in args.methods.split(",")]
    unknown = [m for m in names if m not in METHODS]
    if unknown:
        raise SystemExit(f"--methods: unknown {unknown}; choose from {', '.join(METHODS)}")
    return [m for m in METHODS if m in names]


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").exists() else []:
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown CPU"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--flavor", default="debugmodel", help="llama3 flavor")
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=1, help="sequences per step")
    parser.add_argument("--cp", type=int, default=2, help="context parallel degree (= processes)")
    parser.add_argument("--steps", type=int, default=2, help="distinct batches per round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps of each method first (>= 1)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--methods", default=",".join(METHODS), help=f"comma-separated, of: {', '.join(METHODS)}")
    parser.add_argument("--block-causal", action="store_true", help="attention within each packed document")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args, args.worker)
        return
    with tempfile.TemporaryDirectory(prefix="titan-cp-methods-") as folder:
        out = Path(folder) / "out.json"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(args.cp),
               __file__, *sys.argv[1:], "--worker", str(out)]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=3600)
        if proc.returncode != 0 or not out.exists():
            tail = f"{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
            raise SystemExit(f"{' '.join(cmd)} failed ({proc.returncode}):\n{tail}")
        results = json.loads(out.read_text())
    s = results["shape"]
    print(f"llama3/{args.flavor}: {results['params'] / 1e6:.1f}M params, dim {s['dim']}, {s['layers']} layers, "
          f"{s['heads']} heads / {s['kv_heads']} KV heads of {s['head_dim']}; batch {args.batch} x {args.seq_len} "
          f"tokens, {args.dtype}, cp {args.cp} ({args.cp} gloo processes, 1 thread each)"
          + (", block-causal (attention alone: 8 documents per sequence)" if args.block_causal else ""))
    print(f"torch {results['torch']}  CPU: {cpu_name()} ({os.cpu_count()} cores)")
    steps, attention = results["steps"], results["attention"]
    base = chosen(args)[0]
    print(f"  {'method':<15} {'ms/step':>9} {'best':>9} {'vs ' + base:>18}   {'attention ms':>13} {'best':>9}"
          f" {'sent MB':>8}   core")
    for m in chosen(args):
        med, best = statistics.median(steps[m]) * 1e3, min(steps[m]) * 1e3
        ratio = statistics.median(steps[m]) / statistics.median(steps[base])
        a_med, a_best = statistics.median(attention[m]) * 1e3, min(attention[m]) * 1e3
        print(f"  {m:<15} {med:9.1f} {best:9.1f} {ratio:17.2f}x   {a_med:13.2f} {a_best:9.2f}"
              f" {results['sent'][m] / 1e6:8.3f}   {results['cores'][m]}")
    print(f"({len(steps[base])} timed steps and attention calls each: median and best; sent MB: what one rank sends "
          "in one attention forward, counted at the collective calls)")


if __name__ == "__main__":
    main()
