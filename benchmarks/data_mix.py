"""What shuffling and mixing cost per rank: one `next()` in file order, shuffled, and from a 70/30 mix.

    uv run python benchmarks/data_mix.py                 # about 20 s on 2 CPU cores

Tokenizes two corpora once with the byte tokenizer (the Shakespeare plays of
../shared/data split in two halves when present, else Python stdlib files), then times
one `next()` of the last rank (`dp_rank = W - 1`, batch 4 x 1024, prefetch off so the
read itself is timed) at W = 1 and W = 1024 for:

- `TokenShardLoader` on one folder, file order (one contiguous read per batch);
- the same folder shuffled (`training.shuffle`: 4 window reads + a Feistel permutation);
- a 70/30 shuffled mix of the two folders (`training.dataset_mix`).

It also times a resume deep into a run: `load_state_dict` at 10**12 global samples and
the first batch after it (O(1): no corpus-sized table, no replay).

Experiments, not part of the package; no guarantees. Timings are wall clock on whatever
machine runs it: a busy machine only adds time.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from itertools import islice
from pathlib import Path

from cpu_peers import cpu_description  # benchmarks/ is this script's folder, hence on sys.path

from titan_core.config.schema import DatasetSource
from titan_core.data import ByteTokenizer, StdlibSource, TokenShardLoader, build_loader, write_token_shards

SHAKESPEARE = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "shakespeare"
SEQ_LEN, BATCH, REPEATS = 1024, 4, 200


class Texts:
    def __init__(self, texts):
        self.texts = texts

    def __iter__(self):
        return iter(self.texts)

    def skip(self, n):
        return iter(self.texts[n:])


def corpora(folder: Path) -> tuple[Path, Path, str]:
    """Two token-shard folders and what they hold."""
    if SHAKESPEARE.is_dir():
        texts = [p.read_text(encoding="utf-8", errors="replace") for p in sorted(SHAKESPEARE.glob("*.txt"))]
        what = f"{len(texts)} Shakespeare plays, split in two folders"
    else:
        texts = list(islice(StdlibSource(), 200))
        what = "200 Python stdlib files, split in two folders"
    half = len(texts) // 2
    for name, part in (("a", texts[:half]), ("b", texts[half:])):
        write_token_shards(Texts(part), ByteTokenizer(), folder / name, shard_tokens=1_000_000)
    return folder / "a", folder / "b", what


def time_next(loader, repeats: int = REPEATS) -> float:
    """Median milliseconds of one `next()`."""
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        next(loader)
        times.append(time.perf_counter() - started)
    return 1000 * statistics.median(times)


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        a, b, what = corpora(Path(tmp))
        print(f"{what}; batch {BATCH} x {SEQ_LEN}, byte tokenizer; {cpu_description()}")
        mix = [DatasetSource(path=str(a), weight=0.7), DatasetSource(path=str(b), weight=0.3)]
        print("| loader | W = 1 | W = 1024 |\n|---|---|---|")
        for label, make in (
            ("file order (`TokenShardLoader`)", lambda w: TokenShardLoader(a, SEQ_LEN, BATCH, w - 1, w, prefetch=0)),
            ("shuffled", lambda w: loader(w, dataset_path=str(a))),
            ("70/30 mix, shuffled", lambda w: loader(w, mix=mix)),
        ):
            print(f"| {label} | {time_next(make(1)):.3f} ms | {time_next(make(1024)):.3f} ms |")
        deep = loader(1024, mix=mix)
        state = deep.state_dict() | {"samples_consumed": 10**12}
        started = time.perf_counter()
        deep.load_state_dict(state)
        next(deep)
        print(f"resume at 10**12 global samples + first batch: {1000 * (time.perf_counter() - started):.3f} ms")


def loader(world: int, **data):
    """A shuffled loader of the last of `world` ranks over `dataset_path=` or `mix=`."""
    path = data.pop("dataset_path", None)
    return build_loader(
        "stdlib", path, "text", ByteTokenizer(), seq_len=SEQ_LEN, local_batch_size=BATCH,
        dp_rank=world - 1, dp_world=world, prefetch=0, shuffle=True, **data,
    )  # fmt: skip


if __name__ == "__main__":
    main()
