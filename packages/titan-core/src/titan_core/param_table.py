"""`titan params`: every parameter of a job's model, and what the job does with it.

For each parameter of the whole model (built on the meta device: no memory, any size): its
shape and element count, the optimizer that updates it (Muon's rule, `titan_core.muon_groups`),
the weight decay it trains with (`optimizer.weight_decay_exclude`, `titan_core.weight_decay`)
and, with `model.converters = ["float8"]`, whether its linear computes in float8 and if not why
(`titan_parallel.float8.float8_skip_reason`). Each column comes from the function the trainer
itself calls, so the table cannot disagree with the run. `--match` keeps the rows whose names
match shell-style patterns, matched as `optimizer.weight_decay_exclude` matches them: the way to
try a pattern before training with it.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch.nn as nn

    from titan_core.job import Job
    from titan_parallel.float8 import Float8Options

__all__ = ["ParamRow", "parameter_rows", "render_rows"]


@dataclass(frozen=True)
class ParamRow:
    """One parameter of the model.

    Args:
        name: its name in the whole model, e.g. `layers.0.attention.wq.weight`.
        shape: its full shape (unsharded).
        numel: its elements.
        optimizer: "AdamW", "Adam" or "Muon" (under Muon, "AdamW" for the parameters Muon leaves to AdamW).
        weight_decay: the weight decay it trains with.
        lr: the peak learning rate it trains at (under Muon, `optimizer.adamw_lr` for AdamW's; under muP, the
            blocks' matrices at `optimizer.lr` / width multiplier).
        float8: with float8 converters: "yes", or why its linear is not converted ("-": not a linear's); None
            without them.
    """

    name: str
    shape: tuple[int, ...]
    numel: int
    optimizer: str
    weight_decay: float
    lr: float
    float8: str | None = None

    def to_json(self) -> dict[str, object]:
        """The row as a JSON object."""
        return {**asdict(self), "shape": list(self.shape)}


def parameter_rows(job: Job, patterns: Sequence[str] = ()) -> list[ParamRow]:
    """The job's parameters in model order (those matching one of `patterns` when given).

    Args:
        job: a resolved job (`titan_core.job.resolve`; the world size may be unknown).
        patterns: shell-style patterns of parameter names; () = every parameter.
    """
    from titan_core.muon_groups import takes_muon
    from titan_core.weight_decay import excluded
    from titan_parallel import canonical_name

    cfg, model = job.cfg, job.meta_model()
    opt = cfg.optimizer
    float8 = job.converters.float8
    modules = dict(model.named_modules())
    rows = []
    for raw, p in model.named_parameters():
        name = canonical_name(raw)
        if patterns and not any(fnmatch.fnmatchcase(name, pattern) for pattern in patterns):
            continue
        optimizer, decay, lr = opt.name, opt.weight_decay, opt.lr
        matrix = takes_muon(name, p.ndim, job.spec.plan)
        if opt.name == "Muon" and not matrix:
            optimizer = "AdamW"
            decay = opt.adamw_weight_decay if opt.adamw_weight_decay is not None else opt.weight_decay
            lr = opt.adamw_lr if opt.adamw_lr is not None else opt.lr
        if matrix:
            lr *= job.optimizer.hidden_lr_scale  # muP's; 1 without it
        if excluded(name, opt.weight_decay_exclude):
            decay = 0.0
        f8 = _float8(modules, name, float8) if float8 else None
        rows.append(ParamRow(name, tuple(p.shape), p.numel(), optimizer, decay, lr, f8))
    return rows


def _float8(modules: dict[str, nn.Module], name: str, options: Float8Options) -> str:
    """'yes', or why the parameter's linear stays in high precision; '-' for a parameter of another module."""
    import torch.nn as nn

    from titan_parallel.float8 import float8_skip_reason

    owner = name.rsplit(".", 1)[0] if "." in name else ""
    if not isinstance(modules[owner], nn.Linear):
        return "-"
    reason = float8_skip_reason(modules[owner], owner, options)
    return "yes" if reason is None else f"no: {reason}"


def render_rows(rows: Sequence[ParamRow], title: str) -> str:
    """The rows as an aligned table under `title`, then their totals by optimizer, decay and float8."""
    if not rows:
        return f"{title}\n(no parameter)"
    with_float8 = rows[0].float8 is not None
    table = [("name", "shape", "params", "optimizer", "lr", "decay", *(("float8",) if with_float8 else ()))]
    for r in rows:
        shape = " x ".join(str(d) for d in r.shape)
        extra = (r.float8,) if with_float8 else ()
        table.append((r.name, shape, f"{r.numel:,}", r.optimizer, f"{r.lr:.3g}", f"{r.weight_decay:g}", *extra))
    widths = [max(len(str(row[i])) for row in table) for i in range(len(table[0]))]
    lines = []
    for row in table:  # the counts (column 2) right-aligned
        pairs = enumerate(zip(row, widths, strict=True))
        cells = [str(c).rjust(w) if i == 2 else str(c).ljust(w) for i, (c, w) in pairs]
        lines.append("  ".join(cells).rstrip())
    total = sum(r.numel for r in rows)
    summary = [f"{len(rows)} tensors, {total:,} elements"]
    by = (
        ("optimizer", lambda r: r.optimizer),
        ("lr", lambda r: f"{r.lr:.3g}"),
        ("decay", lambda r: f"{r.weight_decay:g}"),
    )
    for label, key in by:
        groups: dict[str, int] = {}
        for r in rows:
            groups[key(r)] = groups.get(key(r), 0) + r.numel
        summary.append(f"{label}: " + ", ".join(f"{k} {v:,}" for k, v in groups.items()))
    if with_float8:
        converted = sum(r.numel for r in rows if r.float8 == "yes")
        summary.append(f"float8: {converted:,} of {total:,} elements ({100 * converted / max(total, 1):.1f}%)")
    return "\n".join([title, *lines, "", *summary])
