"""One rank of `titan estimate-memory --measure`: the real trainer at a few depths, two steps each, and its peak.

    python -m titan_core.memory.measure_run SPEC OUT            # one process
    torchrun --nproc-per-node N -m titan_core.memory.measure_run SPEC OUT

SPEC is a JSON file: `{"runs": [{"config": <a JobConfig as JSON>, "n_layers": N, "layers_per_stage": K}, ...]}`
(`layers_per_stage` null: the config's own pipeline cut). For each run the rank builds the same
`Trainer` a training run builds, from the config with the model cut to `n_layers` blocks (the
flavor's shape otherwise), runs two train steps on random tokens (the first makes the optimizer
state, the second runs with it) and records the peak of the two. Each rank writes
`OUT/rank<R>.json`: a list of records, one per run, or `{"error": line}` when a run failed on
bad input or ran out of device memory.

What "peak" means per device:

- CUDA: `torch.cuda.max_memory_allocated` over the two steps, less what was allocated before the
  trainer was built: every byte the caching allocator handed out, kernel workspaces included.
- CPU: the peak of live tensor storage bytes seen by torch's `MemTracker`
  (`torch.distributed._tools.mem_tracker`), by category. It counts each storage once from the op
  that creates it until it is freed and follows FSDP's storage resizes, which is what a device
  allocator must hold for the step's tensors, and it gives the same figure on every run (the
  CPU allocator's own total, which the profiler reports, also counts gloo's transient buffers
  and moves by a few MiB between runs with their timing: too noisy to fit a line through two
  depths). The accuracy table in docs/memory.md compares the two.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import json
import os
import sys
from pathlib import Path
from typing import Any, cast

import torch
from torch import nn

from titan_core.config.schema import JobConfig

STEPS = 2
"""Train steps per depth: the first allocates the optimizer state, the second runs with it."""


def cut_config(cfg: JobConfig, n_layers: int, layers_per_stage: int | None) -> JobConfig:
    """`cfg` with its model cut to `n_layers` blocks, `layers_per_stage` blocks on every pipeline stage.

    The cut shape is registered as a new flavor of the family in this process's registry (the job
    names its shape by `model.flavor`; nothing else runs in a measuring process), e.g. 'debugmodel@2'.
    The run writes nothing: no checkpoints, metrics, profiles or validation; the data are random tokens
    (the trainer's loader is built, as in a run, from the stdlib corpus), and a tokenizer folder that is
    not on this host is dropped (the flavor's vocab is kept).

    Args:
        cfg: the job config.
        n_layers: blocks of the cut model.
        layers_per_stage: blocks on every pipeline stage; None keeps the config's pipeline cut.
    """
    from titan_core.memory.traced import drop_side_outputs
    from titan_models import get_model_args, get_model_spec

    flavors = get_model_spec(cfg.model.name).flavors
    args = get_model_args(cfg.model.name, cfg.model.flavor)
    name = f"{cfg.model.flavor}@{n_layers}"
    if not isinstance(flavors, dict):
        raise TypeError(f"model.name={cfg.model.name!r} keeps its flavors in a {type(flavors).__name__}, not a dict")
    flavors[name] = dataclasses.replace(args, n_layers=n_layers)
    out = cfg.model_copy(deep=True)
    out.model.flavor = name
    p = out.parallelism
    if layers_per_stage is not None:
        p.pipeline_parallel_layers_per_stage = layers_per_stage
        p.pipeline_parallel_first_stage_less_layers = 0
        p.pipeline_parallel_last_stage_less_layers = 0
        p.module_fqns_per_model_part = None
    drop_side_outputs(out)
    return out


def measure_depth(cfg: JobConfig, n_layers: int, layers_per_stage: int | None) -> dict[str, Any]:
    """Build the trainer of `cfg` cut to `n_layers` blocks, run `STEPS` steps, and return this rank's peak.

    Returns:
        `{"n_layers", "pp_rank", "blocks" (held by this rank), "device", "peak" (bytes),
        "categories" (bytes at the peak by `MemTracker` category on CPU; on CUDA the rank's parameters,
        buffers and optimizer states, and the peak as 'Total'), "sharded_params" (bytes of this rank's
        parameter shards)}`.
    """
    from titan_core.memory.torch_patches import allow_repeated_forwards, peak_tracker, pipeline_tracker
    from titan_core.memory.traced import _storage_bytes
    from titan_core.trainer import Trainer

    gc.collect()
    cuda = cfg.training.device != "cpu" and torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))  # as the trainer will: its GPU's counters
        torch.cuda.empty_cache()
        before = torch.cuda.memory_allocated()
    trainer = Trainer(cut_config(cfg, n_layers, layers_per_stage))
    t, parts = cfg.training, trainer.model.parts
    generator = torch.Generator().manual_seed(trainer.seed + trainer.rank)
    vocab, accum_steps = trainer.model_args.vocab_size, trainer.accum_steps

    def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
        shape = (t.local_batch_size, t.seq_len + 1)
        tokens = [torch.randint(vocab, shape, generator=generator) for _ in range(accum_steps)]
        return [(x[:, :-1], x[:, 1:]) for x in tokens]  # inputs, labels: (bs, seqlen) each, as the loader cuts them

    tracker = None
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    else:
        if trainer.dims.pp == 1:
            tracker = peak_tracker()
            allow_repeated_forwards(tracker, parts)
        else:
            tracker = pipeline_tracker()
        tracker.track_external(*parts, *trainer.optimizers)
    with tracker if tracker is not None else contextlib.nullcontext():
        for _ in range(STEPS):
            trainer.train_step(batches())
            if tracker is not None:
                tracker.reset_mod_stats()
    sharded = _storage_bytes(p for part in parts for p in part.parameters())
    if tracker is not None:
        snapshot = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]
        categories = {str(getattr(k, "value", k)): int(v) for k, v in snapshot.items()}
        peak = categories["Total"]
    else:
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - before
        buffers = _storage_bytes(b for part in parts for b in part.buffers())
        states = [v for o in trainer.optimizers for s in o.state.values() for v in s.values()]
        categories = {
            "Parameter": sharded,
            "Buffer": buffers,
            "Optstate": _storage_bytes(v for v in states if isinstance(v, torch.Tensor)),
            "Total": int(peak),
        }
    blocks_name = trainer.spec.plan.blocks
    record = {
        "n_layers": n_layers,
        "pp_rank": trainer.mesh["pp"].get_local_rank() if trainer.dims.pp > 1 else 0,
        "blocks": sum(len(cast("nn.ModuleDict", part.get_submodule(blocks_name))) for part in parts),
        "device": trainer.device.type,
        "peak": int(peak),
        "categories": categories,
        "sharded_params": sharded,
    }
    trainer.loader.close()
    del trainer, tracker
    gc.collect()
    return record


def main(spec_file: str, out_folder: str) -> int:
    """Measure every run of `spec_file` on this rank; write `out_folder/rank<R>.json`. Returns the exit code."""
    from titan_core.launch import USER_ERRORS, error_line

    runs = json.loads(Path(spec_file).read_text())["runs"]
    rank = int(os.environ.get("RANK", 0))
    out = Path(out_folder) / f"rank{rank}.json"
    code = 0
    try:
        result: Any = [
            measure_depth(JobConfig.model_validate(run["config"]), run["n_layers"], run["layers_per_stage"])
            for run in runs
        ]
    except USER_ERRORS as e:
        result, code = {"error": error_line(e)}, 2
    except torch.OutOfMemoryError as e:
        first = str(e).splitlines()[0] if str(e) else "out of memory"
        result, code = {"error": f"titan: error: rank {rank} ran out of device memory ({first})"}, 1
    finally:
        if "titan_parallel.distributed" in sys.modules:
            sys.modules["titan_parallel.distributed"].shutdown_distributed()
    out.write_text(json.dumps(result))
    return code


if __name__ == "__main__":
    exit_code = main(*sys.argv[1:3])
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(exit_code)  # gloo's threads can abort interpreter teardown on multi-rank runs
