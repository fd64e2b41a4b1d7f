"""Counts the host reads of device values in training steps, for tests/test_host_sync.py.

    python -m torch.distributed.run --nproc-per-node N tests/workers/host_sync_worker.py [titan train args ...]

Builds the real `Trainer` from the arguments and runs 4 steps through the same
`Trainer.train_step` and `RunGuard` the loop uses, with every way the host can read a
tensor's value counted: `Tensor.item`, `tolist`, `__float__`, `__int__`, `__bool__`,
`__index__`, `numpy` and copies to the CPU (`cpu`, `to("cpu")`). On CUDA the steps also
run under `torch.cuda.set_sync_debug_mode("error")`, which raises on any synchronisation.
Step 3's loss is poisoned with NaN on the last rank: its update must be dropped on the
device (the state checksum unchanged), still without a host read, and the guard's poll
afterwards must report it. Rank 0 prints one line:

    HOST-SYNC {"reads": [0, 0, 0, 0], "dropped": 1, "first_bad_step": 3, "unchanged": true, "where": []}
"""

from __future__ import annotations

import contextlib
import json
import sys
import traceback

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from titan_core.config import load_config
from titan_core.run_guard import RunGuard
from titan_core.trainer import Trainer

READS = ("item", "tolist", "__float__", "__int__", "__bool__", "__index__", "numpy", "cpu")


@contextlib.contextmanager
def counting(sites: list[str]):
    """Patch every host-read method of `torch.Tensor` to record where it was called from."""
    saved = {name: getattr(torch.Tensor, name) for name in READS + ("to",)}

    def wrap(name):
        original = saved[name]

        def counted(self, *args, **kwargs):
            if self.device.type != "meta":
                sites.append(f"{name} at {traceback.format_stack(limit=3)[0].strip()}")
            return original(self, *args, **kwargs)

        return counted

    def to(self, *args, **kwargs):
        target = kwargs.get("device", args[0] if args else None)
        if isinstance(target, (str, torch.device)) and torch.device(target).type == "cpu" and self.device.type != "cpu":
            sites.append(f"to(cpu) at {traceback.format_stack(limit=3)[0].strip()}")
        return saved["to"](self, *args, **kwargs)

    try:
        for name in READS:
            setattr(torch.Tensor, name, wrap(name))
        torch.Tensor.to = to
        yield
    finally:
        for name, fn in saved.items():
            setattr(torch.Tensor, name, fn)


def checksum(trainer: Trainer) -> float:
    total = 0.0
    for part in trainer.model.parts:
        for p in part.parameters():
            local = p.to_local() if isinstance(p, DTensor) else p
            total += local.detach().double().abs().sum().item()
    return total


def main(argv: list[str]) -> None:
    trainer = Trainer(load_config(None, argv))
    rank, last = dist.get_rank(), dist.get_world_size() - 1
    cpu_device = trainer.device.type == "cpu"
    loss_fn = trainer.loss.fn
    poison = {"on": False}
    trainer.loss.fn = lambda logits, labels: loss_fn(logits, labels) * (float("nan") if poison["on"] else 1.0)
    data = iter(trainer.loader)
    reads, before_bad, after_bad = [], None, None
    where: list[str] = []
    with RunGuard(trainer.device) as guard:
        for step in range(1, 5):
            batches = [next(data) for _ in range(trainer.accum_steps)]
            poison["on"] = step == 3 and rank == last
            if step == 3:
                before_bad = checksum(trainer)
            sites: list[str] = []
            sync_mode = contextlib.nullcontext()
            if not cpu_device:
                torch.cuda.synchronize()
                torch.cuda.set_sync_debug_mode("error")
            with counting(sites), sync_mode:
                trainer.train_step(batches, guard)
            if not cpu_device:
                torch.cuda.set_sync_debug_mode("default")
            trainer.state.step += 1
            reads.append(len(sites))
            where += sites
            if step == 3:
                after_bad = checksum(trainer)
        report = guard.poll()
    if rank == 0:
        print("HOST-SYNC " + json.dumps({
            "reads": reads, "dropped": report.dropped, "first_bad_step": report.first_bad_step,
            "unchanged": before_bad == after_bad, "where": where[:10],
        }), flush=True)
    dist.barrier()


if __name__ == "__main__":
    from rank_exit import leave  # here: tests/test_loss_spike.py imports this module from tests/

    main(sys.argv[1:])
    leave(0)
