"""`titan tokenize`'s speed against the tokenizer's own batch encoding, per core.

    uv run python benchmarks/tokenize_speed.py                       # Shakespeare (../shared/data), GPT-2 BPE
    uv run python benchmarks/tokenize_speed.py --corpus DIR --tiktoken FILE --repeat 3

The baseline is what the tokenizer library does alone, on one thread: tiktoken's
`encode_ordinary_batch(docs, num_threads=1)` (no BOS/EOS, nothing written). Titan's figure is
the whole of `titan_core.data.token_shards.write_token_shards` (what `titan tokenize` runs):
encoding, wrapping each document in BOS/EOS, the vocabulary check and writing the shards, with
1 to `--max-workers` worker processes. Each is the best of `--trials` runs (the least disturbed by
other work on the machine), each run in a fresh process, the runs interleaved. Printed: MB of UTF-8 text per second, per core (MB/s divided by the
workers, or by 1 for the baseline), Titan's per-core rate over the baseline's (target >= 0.9) and
the speed-up over one worker (near-linear is the target). The load average at the start is printed
too: on a busy machine the scaling figure is not the code's.
"""

from __future__ import annotations

import argparse
import os
import platform
import subprocess
import sys
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


def one_run(corpus: Path, tiktoken: Path, repeat: int, what: str, workers: int) -> float:
    """Seconds of one run of `what` ("baseline" or "titan" with `workers`), in this process."""
    from titan_core.data.tiktoken_tokenizer import TiktokenTokenizer
    from titan_core.data.token_shards import write_token_shards

    tokenizer = TiktokenTokenizer(tiktoken)
    docs = [p.read_text(encoding="utf-8") for p in sorted(corpus.glob("*.txt"))] * repeat
    with tempfile.TemporaryDirectory() as folder:
        start = time.perf_counter()
        if what == "baseline":
            tokenizer._encoding.encode_ordinary_batch(docs, num_threads=1)  # tiktoken's Encoding: the library alone
        else:
            write_token_shards(docs, tokenizer, Path(folder) / "shards", workers=workers, force=True)
        return time.perf_counter() - start


def fresh_process_seconds(args: argparse.Namespace, what: str, workers: int) -> float:
    """`one_run` in a new Python process: tiktoken's speed depends on what ran before it in the same process
    (measured: whichever of the library's batch call and Titan's loop runs first is ~25% faster, whichever it
    is), so no run inherits another's state."""
    command = [sys.executable, __file__, "--corpus", str(args.corpus), "--tiktoken", str(args.tiktoken),
               "--repeat", str(args.repeat), "--one", what, str(workers)]
    out = subprocess.run(command, check=True, capture_output=True, text=True).stdout
    return float(out.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--corpus", type=Path, default=SHARED / "shakespeare", help="folder of .txt documents")
    parser.add_argument("--tiktoken", type=Path, default=SHARED / "tokenizers" / "gpt2.tiktoken")
    parser.add_argument("--repeat", type=int, default=2, help="the corpus this many times over")
    parser.add_argument("--max-workers", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--one", nargs=2, metavar=("WHAT", "WORKERS"), help=argparse.SUPPRESS)  # a child run
    args = parser.parse_args()
    if args.one:
        print(one_run(args.corpus, args.tiktoken, args.repeat, args.one[0], int(args.one[1])))
        return

    docs = sorted(args.corpus.glob("*.txt"))
    megabytes = args.repeat * sum(len(p.read_text(encoding="utf-8").encode("utf-8")) for p in docs) / 1e6
    print(f"{cpu_name()}; load average {os.getloadavg()[0]:.2f}")
    print(f"corpus: {len(docs) * args.repeat} documents, {megabytes:.1f} MB ({args.corpus}), tokenizer {args.tiktoken.name}")
    runs = [("baseline", 1)] + [("titan", w) for w in range(1, args.max_workers + 1)]
    best = {run: float("inf") for run in runs}
    for _ in range(args.trials):  # interleaved: a change in the machine's load touches every run alike
        for run in runs:
            best[run] = min(best[run], fresh_process_seconds(args, *run))
    baseline = megabytes / best[("baseline", 1)]
    print(f"best of {args.trials} runs each, each in a fresh process, interleaved")
    print("\n| what | workers | MB/s | MB/s per core | per core / baseline | speed-up over 1 worker |")
    print("|---|---|---|---|---|---|")
    print(f"| tiktoken encode_ordinary_batch (baseline) | 1 thread | {baseline:.2f} | {baseline:.2f} | 1.00 | |")
    one = megabytes / best[("titan", 1)]
    for workers in range(1, args.max_workers + 1):
        rate = megabytes / best[("titan", workers)]
        print(
            f"| titan tokenize (write_token_shards) | {workers} | {rate:.2f} | {rate / workers:.2f} | "
            f"{rate / workers / baseline:.2f} | {rate / one:.2f}x |"
        )


if __name__ == "__main__":
    main()
