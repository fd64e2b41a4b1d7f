"""What `titan plan` prints and writes: the ranked table, its JSON, the hint when nothing fits, the winner's config.

`titan_core.memory.plan` searches; this module only reads its `Plan`.
"""

from __future__ import annotations

import math
import os
import shlex
import tempfile
from pathlib import Path
from typing import Any

from titan_core.config import ConfigError, dump_toml
from titan_core.memory.plan import Plan, Ranked, layout_config
from titan_core.memory.plan_bounds import STATE_BYTES_PER_PARAM
from titan_core.memory.plan_space import layout_overrides
from titan_core.memory.report import format_bytes

COLUMNS = (
    "#",
    "dp_rep",
    "dp_shard",
    "cp",
    "tp",
    "pp",
    "ep",
    "etp",
    "schedule",
    "mbs",
    "local x accum",
    "AC",
    "offload",
    "peak/GPU",
    "step",
    "tok/s/GPU",
    "why",
)
"""The table's columns: the degrees, the pipeline, the batch split, checkpointing, offload, the estimates. "ep" and
"etp" (`parallelism.expert_tensor_parallel_degree`: tp, or 1 where the TP ranks join expert parallel) are shown for
Mixture-of-Experts models only (`columns`)."""


def columns(plan: Plan) -> tuple[str, ...]:
    """The table's columns for `plan`: `COLUMNS`, without "ep" and "etp" for a dense model (whose ep is always 1)."""
    return COLUMNS if plan.workload.moe.num_experts else tuple(c for c in COLUMNS if c not in ("ep", "etp"))


def format_seconds(seconds: float) -> str:
    """A step time, e.g. '73.46 s', '1.11 s', '0.61 ms'."""
    return f"{seconds:.2f} s" if seconds >= 1 else f"{seconds * 1e3:.3g} ms"


def _row(i: int, ranked: Ranked, names: tuple[str, ...]) -> list[str]:
    """The cells of table row `i`, one per column of `names` (of `COLUMNS`)."""
    t, piped = ranked.layout, ranked.layout.pp > 1
    cells = [
        str(i),
        str(t.dp_replicate),
        str(t.dp_shard),
        str(t.cp),
        str(t.tp),
        str(t.pp),
        str(t.ep),
        str(t.etp),
        t.schedule if piped else "-",
        str(t.microbatch) if piped else "-",
        f"{t.local_batch} x {t.accum}",
        t.ac_name,
        "yes" if t.offload else "no",
        format_bytes(ranked.peak),
        format_seconds(ranked.cost.seconds),
        f"{ranked.tokens_per_gpu:,.0f}",
        ranked.cost.dominant(),
    ]
    return [cell for name, cell in zip(COLUMNS, cells, strict=True) if name in names]


def describe_request(plan: Plan) -> str:
    """The first line: model, GPUs, memory, sequence and batch."""
    cfg, c, w = plan.base, plan.cluster, plan.workload
    nodes = f"{c.gpus // c.gpus_per_node} nodes of {c.gpus_per_node}" if c.gpus > c.gpus_per_node else "1 node"
    return (
        f"{cfg.model.name} {cfg.model.flavor} on {c.gpus} x {plan.request.gpu} ({nodes}), "
        f"{format_bytes(plan.device_memory)} per GPU ({format_bytes(plan.usable)} usable); "
        f"seq {w.seq_len}, global batch {w.global_batch} = {w.seq_len * w.global_batch:,} tokens per step"
        + (f" ({plan.global_batch_from})" if plan.global_batch_from else "")
    )


def describe_counts(plan: Plan) -> str:
    """How many layouts the search considered, and what became of them."""
    n = plan.counts
    skipped = n["skipped"] + n["not_estimated"]
    return (
        f"searched {n['layouts']} layouts: {n['rule']} refused by rule, {n['lower_bound']} over memory by the "
        f"lower bound, {n['estimated']} estimated ({n['fit']} fit, {n['memory']} over memory), {skipped} not "
        "estimated (slower than a row shown, or needing at least the memory of one over it)"
    )


def render_plan(plan: Plan) -> str:
    """The ranked layouts as a table, then the search's counts and the cost model's figures."""
    names = columns(plan)
    rows = [list(names)] + [_row(i, r, names) for i, r in enumerate(plan.fits, 1)]
    widths = [max(len(row[j]) for row in rows) for j in range(len(names))]
    left = {"schedule", "AC", "offload", "why"}
    lines = [describe_request(plan), ""]
    for row in rows:
        cells = [c.ljust(w) if name in left else c.rjust(w) for name, c, w in zip(names, row, widths, strict=True)]
        lines.append("  ".join(cells).rstrip())
    lines += ["", describe_counts(plan)]
    if plan.rule_errors:
        message, count = plan.rule_errors.most_common(1)[0]
        lines.append(f"most frequent rule refusal ({count} layouts): {message}")
    c = plan.cluster
    lines.append(
        f"cost model (docs/memory.md, 'titan plan'): matmuls at {c.mfu:.0%} of {c.peak_flops / 1e12:,.0f} "
        f"TFLOP/s; NVLink {c.intra_node_bw / 1e9:.0f} GB/s, network {c.inter_node_bw / 1e9:.0f} GB/s per GPU"
    )
    return "\n".join(lines)


def plan_json(plan: Plan) -> dict[str, Any]:
    """The plan as plain JSON types: the request, each ranked layout with its terms and overrides, the counts."""
    c, w = plan.cluster, plan.workload
    layouts = []
    for i, r in enumerate(plan.fits, 1):
        t = r.layout
        layouts.append(
            {
                "rank": i,
                "dp_replicate": t.dp_replicate,
                "dp_shard": t.dp_shard,
                "cp": t.cp,
                "tp": t.tp,
                "pp": t.pp,
                "ep": t.ep,
                "etp": t.etp,
                "schedule": t.schedule if t.pp > 1 else None,
                "microbatch": t.microbatch if t.pp > 1 else None,
                "local_batch": t.local_batch,
                "accum": t.accum,
                "ac": t.ac,
                "memory_budget": t.memory_budget,
                "offload": t.offload,
                "peak_bytes": r.peak,
                "step_seconds": r.cost.seconds,
                "tokens_per_second_per_gpu": r.tokens_per_gpu,
                "terms_seconds": r.cost.terms,
                "links": r.cost.notes,
                "why": r.cost.dominant(),
                "overrides": layout_overrides(t, w.global_batch),
            }
        )
    return {
        "model": f"{plan.base.model.name} {plan.base.model.flavor}",
        "gpus": c.gpus,
        "gpus_per_node": c.gpus_per_node,
        "gpu": plan.request.gpu,
        "device_memory": plan.device_memory,
        "usable": plan.usable,
        "seq_len": w.seq_len,
        "global_batch": w.global_batch,
        "global_batch_from": plan.global_batch_from,  # None: --global-batch-size or the config's
        "cost_model": {
            "peak_flops": c.peak_flops,
            "mfu": c.mfu,
            "intra_node_bw": c.intra_node_bw,
            "inter_node_bw": c.inter_node_bw,
        },
        "layouts": layouts,
        "counts": dict(plan.counts),
        "rule_errors": [{"message": m, "layouts": n} for m, n in plan.rule_errors.most_common()],
        "hint": None if plan.fits else fix_hint(plan),
    }


def fix_hint(plan: Plan) -> str:
    """One line for when no layout fits: the closest layout's memory and what would help."""
    c, w = plan.closest, plan.workload
    gpus = plan.cluster.gpus
    if c is None:
        message = plan.rule_errors.most_common(1)[0][0] if plan.rule_errors else "none has whole batches per rank"
        return (
            f"no layout of {gpus} GPUs passes the rules (most often: {message}); "
            "change --gpus, --seq-len or --global-batch-size"
        )
    need = math.ceil(STATE_BYTES_PER_PARAM * w.n_params / plan.usable)
    t = c.layout
    what = f"{t.describe()}, AC {t.ac_name}{', offload' if t.offload else ''}"
    host = ""
    if plan.host_needed is not None:
        host = (
            f"; with CPU offload a layout fits in GPU memory but needs at least {format_bytes(plan.host_needed)} of "
            f"host memory per node (--host-memory {format_bytes(plan.host_memory)})"
        )
    return (
        f"no layout fits {gpus} GPUs of {format_bytes(plan.usable)} usable: the closest ({what}) needs "
        f"{'' if c.estimated else 'at least '}{format_bytes(c.peak)} per GPU; use more GPUs (the model states "
        f"alone need {need} without offload), more memory per GPU (--gpu-memory) or a shorter --seq-len{host}"
    )


def train_command(path: str, gpus: int, gpus_per_node: int) -> str:
    """The `titan train` line that runs the config at `path` on `gpus` GPUs."""
    nodes = max(1, gpus // gpus_per_node)
    line = f"titan train --config {shlex.quote(path)} --nproc-per-node {min(gpus, gpus_per_node)}"
    return line + (f" --nnodes {nodes} --rdzv-endpoint HOST:PORT" if nodes > 1 else "")


def check_emit_path(path: str, force: bool) -> None:
    """Raise `ConfigError` naming --emit-config unless `path` may be written: its folder exists, and it does not
    (or `force`)."""
    target = Path(path)
    if target.is_dir():
        raise ConfigError(f"--emit-config {path} is a folder; give a file name, e.g. {target / 'plan.toml'}")
    if not target.parent.is_dir():
        raise ConfigError(f"--emit-config {path}: folder {target.parent} does not exist; create it first")
    if target.exists() and not force:
        raise ConfigError(f"--emit-config {path} exists; choose another file or add --force to overwrite it")


def emit_config(plan: Plan, ranked: Ranked, path: str, force: bool = False) -> str:
    """Write `ranked`'s job config as TOML to `path` atomically; returns the `titan train` line that runs it.

    The file is the user's config and overrides with the layout's keys set (`layout_config`):
    `titan train --config path` runs it unchanged.

    Raises:
        ConfigError: `path` exists and `force` is False, or its folder does not exist.
    """
    check_emit_path(path, force)
    command = train_command(path, plan.cluster.gpus, plan.cluster.gpus_per_node)
    t = ranked.layout
    header = (
        f"# Written by titan plan: {t.describe()}, AC {t.ac_name} on {plan.cluster.gpus} GPUs; "
        f"peak {format_bytes(ranked.peak)} per GPU, ~{format_seconds(ranked.cost.seconds)} per step estimated.\n"
        f"# Start it with: {command}\n"
    )
    text = header + dump_toml(layout_config(plan, ranked.layout))
    target = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    try:
        os.fchmod(fd, 0o644)  # mkstemp's 0600 would hide the config from the other users of a shared cluster
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return command
