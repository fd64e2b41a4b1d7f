"""One process of `titan train` (the real `Trainer`), its peak CPU memory over a train step, for
tests/test_memory_compiled.py.

    python tests/workers/compiled_peak_worker.py OUT.json [titan train args ...]

Under `torch.profiler.profile(profile_memory=True)` (as benchmarks/memory_accuracy.py measures), builds
the trainer of the config the arguments give, runs one train step (compiling the blocks and making the
optimizer state) and one more, and writes `{"peak": bytes, "compile_s": seconds of the first step,
"step_s": seconds of the second}`. The peak is the largest running total c10's CPU allocator reports
during the second step, counted from the total before the profile's first allocation: every tensor
storage alive, Inductor's buffers and kernels' temporaries included. What compiled code allocates never
passes through a Python-level tracker such as `MemTracker`; it does pass through the allocator.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from titan_core.config import load_config
from titan_core.trainer import Trainer

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from memory_accuracy import allocator_peak  # noqa: E402  # the accuracy matrix's reading of the allocator


MARK = "compiled_peak::measured_step"


def main(out: str, args: list[str]) -> None:
    cfg = load_config(None, args)
    t = cfg.training
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        trainer = Trainer(cfg)
        vocab = trainer.model_args.vocab_size
        tokens = torch.randint(
            vocab, (2, t.local_batch_size, t.seq_len + 1), generator=torch.Generator().manual_seed(7)
        )
        batches = [[(x[:, :-1], x[:, 1:])] for x in tokens]  # per step: inputs, labels, (bs, seqlen) each
        start = time.perf_counter()
        trainer.train_step(batches[0])
        compile_s = time.perf_counter() - start
        start = time.perf_counter()
        with record_function(MARK):
            trainer.train_step(batches[1])
        step_s = time.perf_counter() - start
    Path(out).write_text(json.dumps({"peak": allocator_peak(prof, MARK), "compile_s": compile_s, "step_s": step_s}))
    trainer.loader.close()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
