"""`titan tokenize`'s speed against the tokenizer's own batch encoding, per core.

    uv run python benchmarks/tokenize_speed.py                       # Shakespeare (../shared/data), GPT-2 BPE
    uv run python benchmarks/tokenize_speed.py --corpus DIR --tiktoken FILE --repeat 3

The baseline is what the tokenizer library does alone, on one thread: tiktoken's
`encode_ordinary_batch(docs, num_threads=1)` (no BOS/EOS, nothing written). Titan's figure is
the whole of `titan_core.data.token_shards.write_token_shards` (what `titan tokenize` runs):
encoding, wrapping each document in BOS/EOS, the vocabulary check and writing the shards, with
1 to `--max-workers` worker processes. Each is the best of `--trials` runs (the least disturbed by
other work on the machine). Printed: MB of UTF-8 text per second, per core (MB/s divided by the
workers, or by 1 for the baseline), Titan's per-core rate over the baseline's (target >= 0.9) and
the speed-up over one worker (near-linear is the target). The load average at the start is printed
too: on a busy machine the scaling figure is not the code's.
"""

from __future__ import annotations

import argparse
import os
import platform
import tempfile
import time
from pathlib import Path

SHARED = Path(__file__).resolve().parents[1] / ".." / "shared" / "data"


def cpu_name() -> str:
    """The CPU's model name and whether it has AVX-512 / AMX (the kind docs name beside a speed figure)."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or "unknown CPU"
    model = next((line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model name")), "?")
    flags = next((line for line in info.splitlines() if line.startswith("flags")), "")
    kind = "AMX" if "amx_tile" in flags else "AVX-512" if "avx512f" in flags else "AVX2" if "avx2" in flags else "?"
    return f"{model} ({kind}, {os.cpu_count()} cores)"


def best_seconds(fn, trials: int) -> float:
    times = []
    for _ in range(trials):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--corpus", type=Path, default=SHARED / "shakespeare", help="folder of .txt documents")
    parser.add_argument("--tiktoken", type=Path, default=SHARED / "tokenizers" / "gpt2.tiktoken")
    parser.add_argument("--repeat", type=int, default=2, help="the corpus this many times over")
    parser.add_argument("--max-workers", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--trials", type=int, default=3)
    args = parser.parse_args()

    from titan_core.data.tiktoken_tokenizer import TiktokenTokenizer
    from titan_core.data.token_shards import write_token_shards

    tokenizer = TiktokenTokenizer(args.tiktoken)
    docs = [p.read_text(encoding="utf-8") for p in sorted(args.corpus.glob("*.txt"))] * args.repeat
    megabytes = sum(len(d.encode("utf-8")) for d in docs) / 1e6
    print(f"{cpu_name()}; load average {os.getloadavg()[0]:.2f}")
    print(f"corpus: {len(docs)} documents, {megabytes:.1f} MB ({args.corpus}), tokenizer {args.tiktoken.name}")

    encoding = tokenizer._encoding  # tiktoken's Encoding: the library alone
    baseline = megabytes / best_seconds(lambda: encoding.encode_ordinary_batch(docs, num_threads=1), args.trials)
    print("\n| what | workers | MB/s | MB/s per core | per core / baseline | speed-up over 1 worker |")
    print("|---|---|---|---|---|---|")
    print(f"| tiktoken encode_ordinary_batch (baseline) | 1 thread | {baseline:.2f} | {baseline:.2f} | 1.00 | |")
    one = None
    with tempfile.TemporaryDirectory() as folder:
        for workers in range(1, args.max_workers + 1):
            out = Path(folder) / "shards"

            def run(workers: int = workers, out: Path = out) -> None:
                write_token_shards(docs, tokenizer, out, workers=workers, force=True)

            rate = megabytes / best_seconds(run, args.trials)
            one = one or rate
            print(
                f"| titan tokenize (write_token_shards) | {workers} | {rate:.2f} | {rate / workers:.2f} | "
                f"{rate / workers / baseline:.2f} | {rate / one:.2f}x |"
            )


if __name__ == "__main__":
    main()
