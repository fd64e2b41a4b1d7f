"""Data loading cost per rank as data parallelism grows: on-the-fly `PackedLoader` vs `TokenShardLoader`.

    uv run python benchmarks/loader_scaling.py                       # about a minute on 2 CPU cores
    uv run python benchmarks/loader_scaling.py --max-world 4096 --packed-max-world 256 --steps 10 --train-steps 0
    uv run python benchmarks/loader_scaling.py --hf-assets-path ../shared/data/tokenizers/gpt2.tiktoken

Part 1 tokenizes a corpus once (`titan tokenize`'s writer; the Shakespeare plays of
../shared/data, else the Python stdlib), then times one `next()` of the LAST rank
(`dp_rank = W - 1` of `dp_world = W`) at W = 1, 2, 4, ..., `--max-world`:

- `PackedLoader` reads and tokenizes the whole global batch (W x B samples) on every
  rank, so its cost grows linearly with W (capped at `--packed-max-world` to keep the
  default run short);
- `TokenShardLoader` (prefetch off, so the read itself is timed) reads only its own
  B samples from the memmapped shards, so its cost stays flat.

Part 2 trains a tiny model in this process (`Trainer(cfg).train()`, one rank, CPU) on
the same data three ways (batch B x `--train-seq-len`), and reports the median step time against the median time the
loop waited for data (`time/data_wait_ms` in metrics.jsonl): shards with prefetch
off, shards with prefetch on, and text tokenized on the fly.

Experiments, not part of the package; no guarantees. Timings are wall clock on
whatever machine runs it: a busy machine only adds time.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import tempfile
import time
from itertools import islice
from pathlib import Path

import torch
from titan_core.data import (
    LocalFileSource,
    PackedLoader,
    StdlibSource,
    TokenShardLoader,
    build_tokenizer,
    write_token_shards,
)
from titan_core.data.local_files import expand_pattern

from cpu_peers import cpu_description  # benchmarks/ is this script's folder, hence on sys.path

SHAKESPEARE = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "shakespeare"


def corpus(max_files: int):
    """The benchmark's documents: Shakespeare's plays when present, else the stdlib's files."""
    if SHAKESPEARE.is_dir():
        files = expand_pattern(str(SHAKESPEARE), "corpus")[:max_files]
        return LocalFileSource(files), f"{len(files)} Shakespeare plays"
    return TextsSource(list(islice(StdlibSource(), max_files))), f"{max_files} Python stdlib files"


class TextsSource:
    """Documents held in memory (a `DocumentSource`): the stdlib fallback's first files."""

    def __init__(self, texts: list[str]):
        self.texts = texts

    def __iter__(self):
        return iter(self.texts)

    def skip(self, n_docs: int):
        return iter(self.texts[n_docs:])


def time_next(loader, steps: int) -> float:
    """Mean seconds of one `next(loader)` over `steps` calls, after one warm-up call.

    The mean, not the median: `PackedLoader` tokenizes a whole document when it reaches
    one and then slices it for several steps, so its cost comes in bursts (hence also
    `--min-tokens`: enough steps that several documents are tokenized).
    """
    next(loader)
    start = time.perf_counter()
    for _ in range(steps):
        next(loader)
    return (time.perf_counter() - start) / steps


def scaling_table(source, tokenizer, folder: Path, args) -> None:
    """Part 1: per-rank `next()` cost of both loaders at W = 1, 2, 4, ..., max_world."""
    print(f"\nPart 1: one next() on rank W-1 of W, batch {args.batch} x {args.seq_len} tokens, mean of >= {args.steps} "
          f"steps and >= {args.min_tokens:,} global tokens")
    print(f"  {'W':>5} {'PackedLoader ms':>16} {'TokenShardLoader ms':>20} {'ratio':>8}")
    packed, shard, world = {}, {}, 1
    while world <= args.max_world:
        steps = max(args.steps, -(-args.min_tokens // (world * args.batch * (args.seq_len + 1))))
        loader = TokenShardLoader(folder, args.seq_len, args.batch, world - 1, world, prefetch=0)
        shard[world] = time_next(loader, steps)
        if world <= args.packed_max_world:
            packed[world] = time_next(PackedLoader(source, tokenizer, args.seq_len, args.batch, world - 1, world), steps)
        cell = f"{1000 * packed[world]:16.2f}" if world in packed else f"{'(skipped)':>16}"
        ratio = f"{packed[world] / shard[world]:7.0f}x" if world in packed else ""
        print(f"  {world:>5} {cell} {1000 * shard[world]:20.3f} {ratio:>8}")
        world *= 2
    top_packed, top_shard = max(packed), max(shard)
    print(f"  growth from W=1: PackedLoader x{packed[top_packed] / packed[1]:.0f} at W={top_packed}, "
          f"TokenShardLoader x{shard[top_shard] / shard[1]:.1f} at W={top_shard}")


def data_wait_table(folder: Path, shakespeare: bool, tokenizer_path: str | None, args) -> None:
    # The on-the-fly run reads all of ../shared/data/shakespeare (or the stdlib): the timing, not
    # the exact stream, is what is compared here (the tests prove the streams equal).
    """Part 2: a tiny model's training step against the time the loop waits for data."""
    from titan_core.config import load_config
    from titan_core.trainer import Trainer

    print(f"\nPart 2: training llama3/{args.flavor} in this process (1 rank, CPU), batch {args.batch} x "
          f"{args.train_seq_len}, {args.train_steps} steps, medians after the first step")
    print(f"  {'data':<32} {'step ms':>9} {'data wait ms':>13} {'wait / step':>12}")
    text = ["--training.dataset_path", str(SHAKESPEARE)] if shakespeare else ["--training.dataset", "stdlib"]
    runs = [
        ("token shards, prefetch off", ["--training.dataset_path", str(folder)], 0),
        ("token shards, prefetch 2", ["--training.dataset_path", str(folder)], 2),
        ("text tokenized on the fly", text, 0),
    ]
    for (label, dataset, prefetch), name in zip(runs, ("shards-no-prefetch", "shards-prefetch", "text"), strict=True):
        dump = folder.parent / name  # beside the shards, in main's temporary folder
        cfg = load_config(None, [
            "--model.flavor", args.flavor, "--training.device", "cpu", *dataset,
            "--training.seq_len", str(args.train_seq_len), "--training.local_batch_size", str(args.batch),
            "--training.steps", str(args.train_steps), "--training.prefetch_batches", str(prefetch),
            "--training.mixed_precision_param", "float32", "--lr_scheduler.warmup_steps", "1",
            "--metrics.log_freq", "1", "--metrics.enable_tensorboard", "false", "--metrics.peak_tflops", "1",
            "--job.dump_folder", str(dump),
            *(["--model.hf_assets_path", tokenizer_path] if tokenizer_path else []),
        ])
        trainer = Trainer(cfg)
        logging.disable(logging.INFO)  # the step lines: the table says it all
        try:
            trainer.train()
        finally:
            logging.disable(logging.NOTSET)
        close = getattr(trainer.loader, "close", None)
        if close is not None:
            close()
        records = [json.loads(line) for line in (dump / "metrics.jsonl").read_text().splitlines()][1:]
        if not records or "time/data_wait_ms" not in records[0]:
            raise SystemExit("metrics.jsonl has no time/data_wait_ms: this benchmark needs a trainer that logs it")
        wait = statistics.median(r["time/data_wait_ms"] for r in records)
        step = statistics.median(1000 * args.batch * args.train_seq_len / r["throughput/tokens_per_s"] for r in records)
        print(f"  {label:<32} {step:9.1f} {wait:13.3f} {100 * wait / step:11.2f}%")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-len", type=int, default=1024, help="tokens per sample (default 1024)")
    parser.add_argument("--batch", type=int, default=4, help="samples per rank per step, B (default 4)")
    parser.add_argument("--steps", type=int, default=8, help="timed next() calls per world size (default 8)")
    parser.add_argument("--min-tokens", type=int, default=1_000_000,
                        help="time at least this many global tokens per W, so PackedLoader tokenizes several documents")
    parser.add_argument("--max-world", type=int, default=1024, help="largest simulated data-parallel size (default 1024)")
    parser.add_argument("--packed-max-world", type=int, default=1024,
                        help="largest W timed for PackedLoader (default 1024; lower it for a slow --hf-assets-path)")
    parser.add_argument("--max-files", type=int, default=42, help="corpus files to tokenize (default 42: all the plays)")
    parser.add_argument("--hf-assets-path", default=None, help="tokenizer (as model.hf_assets_path); default: bytes")
    parser.add_argument("--flavor", default="debugmodel", help="llama3 flavor for part 2 (default debugmodel)")
    parser.add_argument("--train-seq-len", type=int, default=256, help="tokens per sample in part 2 (default 256)")
    parser.add_argument("--train-steps", type=int, default=6, help="training steps per part-2 run (default 6; 0 skips part 2)")
    args = parser.parse_args()

    tokenizer = build_tokenizer(args.hf_assets_path)
    source, described = corpus(args.max_files)
    with tempfile.TemporaryDirectory(prefix="titan-loader-bench-") as scratch:  # the shards and part 2's runs
        folder = Path(scratch) / "shards"
        start = time.perf_counter()
        manifest = write_token_shards(iter(source), tokenizer, folder, source=described)
        print(f"loader_scaling: {described}, {manifest.total_tokens:,} {manifest.dtype} tokens ({tokenizer!r}), "
              f"tokenized once in {time.perf_counter() - start:.1f}s")
        print(f"torch {torch.__version__}, Python {sys.version.split()[0]}, CPU: {cpu_description()}")
        start = time.perf_counter()
        scaling_table(source, tokenizer, folder, args)
        print(f"  (part 1 took {time.perf_counter() - start:.0f}s)")
        if args.train_steps > 0:
            start = time.perf_counter()
            data_wait_table(folder, SHAKESPEARE.is_dir(), args.hf_assets_path, args)
            print(f"  (part 2 took {time.perf_counter() - start:.0f}s)")


if __name__ == "__main__":
    main()
