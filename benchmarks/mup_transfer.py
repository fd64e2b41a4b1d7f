"""Does the best learning rate hold as the model widens? The usual parametrization against muP, on Shakespeare.

    uv run python benchmarks/mup_transfer.py                                   # the table of docs/optimizers.md
    uv run python benchmarks/mup_transfer.py --widths 128,512 --lrs 1e-3,1e-2 --steps 40   # quicker

For each width of `--widths` (heads of 16 more or fewer, `n_kv_heads` half the heads, `--layers` blocks of the
Llama 3 debug model, byte tokenizer) and each learning rate of `--lrs`, one `titan_core.trainer.Trainer` run of
`--steps` AdamW steps (warmup a tenth of them, then linear decay; fp32; seed 1) on 34 plays and poems of
`../shared/data/shakespeare/[a-s]*_gut.txt`, scored by the validation loss after the last step on the same
`--val-batches` batches of the 8 held-out ones (`[t-w]*_gut.txt`). Twice: the usual parametrization, then
`mup.enable` with `mup.base_dim` the first width (so both are the same model there). Printed: the final
validation loss of every run and, per width, the best learning rate. Under muP the best rate should stay where it
is at the base width; under the usual parametrization it drifts down as the width grows.
The data is the benchmark's: the product never reads it. Experiments, not part of the package; no guarantees.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DATA = REPO.parent / "shared" / "data" / "shakespeare"


def job_args(width: int, lr: float, mup: bool, a: argparse.Namespace) -> list[str]:
    heads = width // 16
    shape = f"dim={width},n_heads={heads},n_kv_heads={max(1, heads // 2)},n_layers={a.layers}"
    args = [
        "--model.shape", shape, "--optimizer.lr", str(lr), "--debug.seed", "1",
        "--training.steps", str(a.steps), "--training.seq_len", str(a.seq_len),
        "--training.local_batch_size", str(a.batch), "--training.mixed_precision_param", "float32",
        "--training.dataset_path", str(DATA / "[a-s]*_gut.txt"),
        "--lr_scheduler.warmup_steps", str(max(1, a.steps // 10)),
        "--validation.enable", "true", "--validation.dataset_path", str(DATA / "[t-w]*_gut.txt"),
        "--validation.freq", str(a.steps), "--validation.steps", str(a.val_batches),
        "--metrics.log_freq", str(a.steps), "--metrics.enable_tensorboard", "false",
    ]  # fmt: skip
    if mup:
        args += ["--mup.enable", "true", "--mup.base_dim", str(a.base)]
    return args


def final_validation_loss(args: list[str], folder: Path) -> float:
    """Train one job here; its validation loss after the last step."""
    from titan_core.config import load_config
    from titan_core.trainer import Trainer

    Trainer(load_config(None, [*args, "--job.dump_folder", str(folder)])).train()
    records = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    return [r["validation/loss"] for r in records if "validation/loss" in r][-1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--widths", default="128,256,512", help="model widths (dim); the first is muP's base")
    parser.add_argument("--lrs", default="3e-4,1e-3,3e-3,1e-2,3e-2", help="AdamW learning rates swept at each width")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch", type=int, default=8, help="sequences per step")
    parser.add_argument("--val-batches", type=int, default=8)
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    parser.add_argument("--json", help="write every final loss here")
    a = parser.parse_args()
    if not DATA.is_dir():
        raise SystemExit(f"{DATA} not found: this benchmark reads the shared Shakespeare corpus")
    import torch

    torch.set_num_threads(a.threads)
    os.environ.setdefault("OMP_NUM_THREADS", str(a.threads))
    widths = [int(x) for x in a.widths.split(",")]
    lrs = [float(x) for x in a.lrs.split(",")]
    a.base = widths[0]
    finals: dict[str, dict[int, dict[float, float]]] = {"usual": {}, "muP": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for kind in finals:
            for width in widths:
                for lr in lrs:
                    folder = Path(tmp) / f"{kind}-{width}-{lr:g}"
                    loss = final_validation_loss(job_args(width, lr, kind == "muP", a), folder)
                    finals[kind].setdefault(width, {})[lr] = loss
                    print(f"{kind:<5} width {width:<5} lr {lr:<8g} final validation loss {loss:.4f}", flush=True)
    print()
    print("final validation loss (best of each row marked *)")
    print(f"{'':>5} {'width':>5}  " + "  ".join(f"{lr:>8g}" for lr in lrs) + "   best lr")
    for kind, by_width in finals.items():
        for width, by_lr in by_width.items():
            best = min(by_lr, key=by_lr.__getitem__)
            cells = "  ".join(f"{by_lr[lr]:>7.4f}{'*' if lr == best else ' '}" for lr in lrs)
            print(f"{kind:>5} {width:>5}  {cells}   {best:g}")
    if a.json:
        Path(a.json).write_text(json.dumps({k: {str(w): v for w, v in d.items()} for k, d in finals.items()}, indent=1))


if __name__ == "__main__":
    main()
