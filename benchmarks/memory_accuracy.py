"""Estimated against measured peak memory per rank, over a matrix of layouts: the accuracy table of docs/memory.md.

    uv run python benchmarks/memory_accuracy.py                      # prints the table (markdown)
    uv run python benchmarks/memory_accuracy.py --json OUT.json      # and writes every figure
    uv run python benchmarks/memory_accuracy.py --rows fsdp2,tp2     # some rows only

Every row is a real job on the CPU: `titan_core.trainer.Trainer` built and run for
`STEPS` train steps under torchrun's agent (gloo; the ranks forked, `launch`), one launch per world size. What is
measured on each rank is the peak of the bytes the CPU allocator holds, as the
allocator reports them itself: with `torch.profiler.profile(profile_memory=True)`,
c10's CPU allocator reports every allocation and free to the profiler along with
its running total (`total_allocated` of each allocation event). That total is what
a device allocator would have to hold: every tensor storage, the temporaries inside
kernels (which a dispatch-level tracker does not see), and nothing of Python's own
objects. The CPU allocator does not cache, so there is no reserved-but-free memory
to tell apart. The profile starts before the trainer is built, so the total counts
everything the job holds; the peak is taken over the train steps only.

One gap in that total: c10 reports a free only on a thread the profiler runs on, and
a buffer whose last holder is one of gloo's worker threads (a reduce-scatter's copy of
its input, a collective's temporary) is freed there unreported. Under FSDP the total
so drifts up by 2-3 MiB a step (the debugmodel rows, checked by allocations landing on
an address never freed), which is why rows run two steps, not more: the first
allocates the optimizer state, the second is the one with everything in place.
Rows measured by live tensors (`MemTracker`) do not depend on it.

The estimates are made for the same config in this process: the analytic tier
(`estimate_analytic`) and, where torch can trace the layout, the traced tier
(`estimate_traced`). A row's error is the largest over its pipeline stages of
(estimate - measured) / measured, the measured figure of a stage being its largest
rank's.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

STEPS = 2
"""Train steps measured per row: the first allocates the optimizer state, the second runs with it."""

BASE = [
    "--model.flavor", "debugmodel",
    "--training.seq_len", "256",
    "--training.local_batch_size", "4",
    "--training.mixed_precision_param", "float32",
    "--training.dataset", "stdlib",
    "--checkpoint.enable", "false",
    "--metrics.enable_tensorboard", "false",
    "--debug.seed", "7",
]
"""The job every row starts from: Llama 3 debugmodel (dim 256, 6 blocks, vocab 2048), fp32, 4 x 256 tokens."""


@dataclass(frozen=True)
class Row:
    """One layout of the matrix.

    Args:
        name: short name, for `--rows`.
        world: ranks.
        tokens: config overrides on top of `BASE`.
    """

    name: str
    world: int
    tokens: tuple[str, ...] = ()


def _row(name: str, world: int, *tokens: str) -> Row:
    return Row(name, world, tokens)


_AC_OP = ("--activation_checkpoint.mode", "selective", "--activation_checkpoint.selective_ac_option", "op")
_AC_FULL = ("--activation_checkpoint.mode", "full")
_PP2 = ("--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_parallel_microbatch_size", "1")

ROWS: tuple[Row, ...] = (
    _row("single", 1),
    _row("single-ac-op", 1, *_AC_OP),
    _row("single-ac-full", 1, *_AC_FULL),
    # bf16 kept small: an AVX2-only CPU runs bf16 matmuls ~150x slower than fp32
    _row("single-bf16", 1, "--training.mixed_precision_param", "bfloat16", "--training.local_batch_size", "1",
         "--training.seq_len", "128"),
    _row("single-bf16-master", 1, "--training.mixed_precision_param", "bfloat16", "--training.local_batch_size", "1",
         "--training.seq_len", "128", "--optimizer.master_weights", "on"),
    _row("single-bf16-master-float8", 1, "--training.mixed_precision_param", "bfloat16", "--training.local_batch_size",
         "1", "--training.seq_len", "128", "--optimizer.master_weights", "on", "--model.converters", "float8",
         "--float8.auto_filter_small_kn", "false"),
    _row("single-accum2", 1, "--training.global_batch_size", "8"),
    # Attention within each packed document: off CUDA the blocks' SDPA keeps a float copy of the dense mask each
    _row("single-block-causal", 1, "--model.attn_mask_type", "block_causal", "--training.seq_len", "1024",
         "--training.local_batch_size", "2"),
    _row("fsdp2", 2),
    _row("fsdp2-ac-full", 2, *_AC_FULL),
    _row("fsdp2-no-reshard", 2, "--parallelism.fsdp_reshard_after_forward", "never"),
    _row("fsdp2-accum2", 2, "--training.global_batch_size", "16"),
    _row("ddp2", 2, "--parallelism.dp_mode", "ddp", "--parallelism.data_parallel_replicate_degree", "2",
         "--parallelism.data_parallel_shard_degree", "1"),
    _row("tp2", 2, "--parallelism.tensor_parallel_degree", "2"),
    _row("cp2", 2, "--parallelism.context_parallel_degree", "2"),
    _row("cp2-rotate", 2, "--parallelism.context_parallel_degree", "2", "--parallelism.context_parallel_rotate_method",
         "rotate"),
    _row("cp2-ulysses", 2, "--parallelism.context_parallel_degree", "2", "--parallelism.context_parallel_method",
         "ulysses"),
    _row("pp2-1f1b", 2, *_PP2, "--parallelism.pipeline_parallel_schedule", "1F1B"),
    _row("pp2-gpipe", 2, *_PP2, "--parallelism.pipeline_parallel_schedule", "GPipe"),
    _row("pp2-interleaved", 2, *_PP2, "--parallelism.pipeline_parallel_schedule", "Interleaved1F1B"),
    _row("hsdp2x2", 4, "--parallelism.data_parallel_replicate_degree", "2", "--parallelism.data_parallel_shard_degree", "2"),
    _row("fsdp2-tp2", 4, "--parallelism.tensor_parallel_degree", "2", *_AC_OP),
    _row("fsdp2-pp2", 4, *_PP2, "--parallelism.pipeline_parallel_schedule", "1F1B"),
    # Mixture-of-Experts: DeepSeek-V3 debugmodel (BASE's flavor; 1 dense + 3 MoE blocks of 8 experts, top 2)
    _row("moe-single", 1, "--model.name", "deepseek_v3"),
    _row("moe-ep2", 2, "--model.name", "deepseek_v3", "--parallelism.expert_parallel_degree", "2"),
)
"""The matrix: FSDP, HSDP, DDP, TP, CP, PP schedules, AC modes, fp32 and bf16, gradient accumulation, a document
mask, MoE and EP."""

EXTRA_ROWS: tuple[Row, ...] = (
    # A MoE under TP x EP: each expert's hidden dim split over the TP ranks (etp = tp), or the TP ranks in the ep
    # group (etp = 1). Outside the matrix (`--rows` runs them): their estimates fall short of the allocator by more
    # than the matrix's 10% (docs/memory.md, "Mixture-of-Experts and expert parallel").
    _row("moe-ep2-tp2", 4, "--model.name", "deepseek_v3", "--parallelism.expert_parallel_degree", "2",
         "--parallelism.tensor_parallel_degree", "2"),
    _row("moe-ep2-tp2-etp1", 4, "--model.name", "deepseek_v3", "--parallelism.expert_parallel_degree", "2",
         "--parallelism.tensor_parallel_degree", "2", "--parallelism.expert_tensor_parallel_degree", "1"),
)
"""Rows `--rows` can name that the default run (and tests/test_memory_accuracy.py) leaves out."""


@dataclass
class Result:
    """One row's figures (bytes).

    Args:
        row: the layout.
        measured: the reference per rank: the peak of live tensor bytes (`MemTracker` on the real run), or under
            pipeline parallel and for a MoE under TP, where that tracker cannot run, the allocator's peak.
        allocator: the CPU allocator's peak per rank (the profiler's running total).
        stages: pipeline degree.
        analytic: the analytic tier's total per stage.
        traced: the traced tier's total per stage, empty where it cannot trace the layout.
        traced_note: why the row is not traced, if it is not.
        measured_by: "live" or "allocator": which figure `measured` holds.
    """

    row: Row
    measured: list[int]
    allocator: list[int]
    stages: int = 1
    analytic: list[int] = field(default_factory=list)
    traced: list[int] = field(default_factory=list)
    traced_note: str = ""
    measured_by: str = "live"

    def per_stage(self, per_rank: list[int]) -> list[int]:
        """The largest rank's figure of each pipeline stage (ranks are stage-major on the mesh)."""
        per = len(per_rank) // self.stages
        return [max(per_rank[s * per:(s + 1) * per]) for s in range(self.stages)]

    def error(self, estimate: list[int]) -> float:
        """The stage error of largest magnitude, (estimate - measured) / measured."""
        errors = [(e - m) / m for e, m in zip(estimate, self.per_stage(self.measured))]
        return max(errors, key=abs)


@contextlib.contextmanager
def measuring(rows: list[Row]):
    """Run `rows` of one world size for real under torchrun, in the background while the block runs. Yields a
    dict that holds, once the block and the launch have ended, (allocator peak, live-tensor peak) per rank, by row."""
    world = rows[0].world
    peaks: dict[str, list[tuple[int, int]]] = {}
    with tempfile.TemporaryDirectory(prefix="titan-memacc-") as folder:
        spec, out = Path(folder) / "rows.json", Path(folder) / "out.json"
        spec.write_text(json.dumps([dataclasses.asdict(r) for r in rows]))
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
        cmd = [sys.executable, __file__, "--launch", str(world), str(spec), str(out)]
        logs = Path(folder) / "stdout", Path(folder) / "stderr"
        with logs[0].open("w") as stdout, logs[1].open("w") as stderr:
            proc = subprocess.Popen(cmd, stdout=stdout, stderr=stderr, env=env)
            try:
                yield peaks
                proc.wait(timeout=900)
            finally:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
        if proc.returncode != 0 or not out.exists():
            raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{logs[0].read_text()[-3000:]}\n"
                               f"{logs[1].read_text()[-6000:]}")
        peaks.update(json.loads(out.read_text()))


def allocator_peak(prof, mark: str) -> int:
    """The peak of c10's CPU allocator total, in the profile `prof` (`profile_memory=True`), from the start of
    the `record_function(mark)` range on, less the total before the profile's first allocation.

    The allocator's total runs on across profiles (bytes a previous row freed while no profile ran are never
    taken off it): a profile's figures are counted from the total before its first allocation.
    """
    from torch._C._profiler import _EventType

    start, allocations = None, []
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        node = stack.pop()
        if node.tag == _EventType.Allocation:
            allocations.append(node)
        elif node.name == mark:
            start = node.start_time_ns
        stack.extend(node.children)
    assert start is not None, f"no {mark} event in the profile"
    first = min(allocations, key=lambda a: a.start_time_ns).extra_fields
    baseline = first.total_allocated - first.alloc_size
    return max(a.extra_fields.total_allocated for a in allocations if a.start_time_ns >= start) - baseline


def worker(spec: str, out: str) -> None:
    """One rank of a measurement launch: each row's trainer built and stepped under the profiler."""
    import torch
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile, record_function

    from titan_core.config import load_config
    from titan_core.memory.torch_patches import allow_repeated_forwards, peak_tracker
    from titan_core.trainer import Trainer

    results: dict[str, list[int]] = {}
    for item in json.loads(Path(spec).read_text()):
        row = Row(item["name"], item["world"], tuple(item["tokens"]))
        cfg = load_config(None, [*BASE, *row.tokens])
        gc.collect()
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            trainer = Trainer(cfg)
            t = cfg.training
            batches = [(torch.zeros(t.local_batch_size, t.seq_len, dtype=torch.long),) * 2] * trainer.accum_steps
            # MemTracker's module hooks fail inside torch's pipeline backward (autograd.grad): not under PP. Nor for
            # a MoE under TP: it cannot follow the local tensors the MoE's TP style reparametrizes the layer with.
            moe_tp = trainer.dims.tp > 1 and trainer.spec.plan.moe is not None
            tracker = peak_tracker() if trainer.dims.pp == 1 and not moe_tp else None
            if tracker is not None:
                allow_repeated_forwards(tracker, trainer.model.parts)
                tracker.track_external(*trainer.model.parts, *trainer.optimizers)
            with record_function("memory_accuracy::steps"), tracker or contextlib.nullcontext():
                for _ in range(STEPS):
                    trainer.train_step(batches)
                    if tracker is not None:
                        tracker.reset_mod_stats()
        live = int(tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]) if tracker is not None else 0
        del trainer, tracker
        peak = allocator_peak(prof, "memory_accuracy::steps")
        peaks: list[tuple[int, int]] = [(0, 0)] * dist.get_world_size()
        dist.all_gather_object(peaks, (int(peak), live))
        results[row.name] = peaks
        del prof
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps(results))
    dist.barrier()
    dist.destroy_process_group()


def launch(world: int, spec: str, out: str) -> None:
    """A measurement launch: `worker` as each of `world` ranks under torchrun's elastic agent, forked from one
    process that imported the trainer, as `titan train` starts a CPU job (`titan_core.rank_fork`): the imports
    (~13 s of CPU a rank on a 2-core AVX2-only AMD EPYC) are paid once, not once per rank. The ranks' figures are
    unchanged by it: the profile and the live-tensor tracker count from the start of each row, after the fork."""
    from titan_core.launch import RANK_PRELOAD
    from titan_core.rank_fork import run_elastic

    run_elastic(["--standalone", f"--nproc-per-node={world}"], _forked_worker, (spec, out), preload=RANK_PRELOAD)


def _forked_worker(spec: str, out: str) -> None:
    from titan_core.rank_fork import rank_finished, rank_started

    rank_started()
    worker(spec, out)
    rank_finished()


def estimate_row(row: Row) -> Result:
    """The analytic and traced estimates of `row` for the CPU (its measured figures left empty)."""
    from titan_core.config import load_config
    from titan_core.memory.analytic import estimate_analytic
    from titan_core.memory.traced import TraceUnsupported, estimate_traced

    cfg = load_config(None, [*BASE, *row.tokens])
    analytic = estimate_analytic(cfg, row.world, device_type="cpu")
    result = Result(row, measured=[], allocator=[], stages=len(analytic.ranks), analytic=[r.total for r in analytic.ranks])
    try:
        result.traced = [r.total for r in estimate_traced(cfg, row.world, device_type="cpu").ranks]
    except TraceUnsupported as e:
        result.traced_note = str(e).split(";")[0]
    return result


def add_measurement(result: Result, peaks: list[tuple[int, int]]) -> None:
    """Put a row's measured (allocator, live) peaks per rank into its `result`: the live-tensor peaks where every
    rank has one, the allocator's otherwise (pipeline rows)."""
    live = [live for _, live in peaks]
    result.allocator = [total for total, _ in peaks]
    result.measured = live if all(live) else result.allocator
    result.measured_by = "live" if all(live) else "allocator"


def run(names: list[str] | None = None) -> list[Result]:
    """Measure and estimate the rows named (default: all of `ROWS`), one torchrun launch per world size.

    The estimates are made while the one-rank launch runs, on the core it leaves free; the launches of more
    ranks run alone, as the timing of gloo's buffers moves the allocator's figure of the pipeline rows."""
    rows = [r for r in ROWS if names is None or r.name in names] + [r for r in EXTRA_ROWS if r.name in (names or ())]
    unknown = set(names or ()) - {r.name for r in rows}
    if unknown:
        raise SystemExit(f"unknown rows {sorted(unknown)}; rows: {', '.join(r.name for r in ROWS + EXTRA_ROWS)}")
    worlds = sorted({r.world for r in rows})
    measured: dict[str, list[tuple[int, int]]] = {}
    with measuring([r for r in rows if r.world == worlds[0]]) as peaks:
        results = [estimate_row(r) for r in rows]
    measured.update(peaks)
    for world in worlds[1:]:
        with measuring([r for r in rows if r.world == world]) as peaks:
            pass  # nothing else runs beside it
        measured.update(peaks)
    for result in results:
        add_measurement(result, measured[result.row.name])
    return results


def table(results: list[Result]) -> str:
    """The results as the markdown table docs/memory.md publishes (MiB; "a / b" = pipeline stages)."""
    def mib(values: list[int]) -> str:
        return " / ".join(f"{v / 2**20:.1f}" for v in values)

    lines = ["| row | ranks | overrides | measured: live tensors | CPU allocator | analytic | error | traced | error |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        traced = mib(r.traced) if r.traced else "not traced"
        traced_err = f"{r.error(r.traced):+.1%}" if r.traced else r.traced_note
        overrides = " ".join(r.row.tokens).replace("--parallelism.", "").replace("--activation_checkpoint.", "ac.")
        overrides = overrides.replace("--training.", "") or "(base)"
        live = mib(r.per_stage(r.measured)) if r.measured_by == "live" else "n/a (PP, MoE x TP)"
        lines.append(f"| {r.row.name} | {r.row.world} | `{overrides}` | {live} | "
                     f"{mib(r.per_stage(r.allocator))} | {mib(r.analytic)} | {r.error(r.analytic):+.1%} | {traced} | {traced_err} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", help="comma-separated row names (default: all)")
    parser.add_argument("--json", help="write every figure to this file")
    parser.add_argument("--launch", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.launch:
        launch(int(args.launch[0]), *args.launch[1:])
        return
    results = run(args.rows.split(",") if args.rows else None)
    print(table(results))
    if args.json:
        data = [{**dataclasses.asdict(r), "measured_per_stage": r.per_stage(r.measured),
                 "analytic_error": r.error(r.analytic), "traced_error": r.error(r.traced) if r.traced else None}
                for r in results]
        Path(args.json).write_text(json.dumps(data, indent=1))


if __name__ == "__main__":
    main()
