"""What an estimate says: per-rank memory by component, a verdict against a budget.

Every tier (`titan_core.memory.analytic`, `.traced`, `.measured`) returns a
`MemoryEstimate`; `render_text` and `MemoryEstimate.to_json` are what
`titan estimate-memory` prints.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

GiB = 1024**3

COMPONENTS = ("parameters", "gradients", "optimizer", "activations", "communication", "temporary")
"""The device-memory components of a rank, in the order they are printed."""


@dataclass
class RankMemory:
    """Peak device memory of one rank, by component (bytes).

    Ranks of one pipeline stage hold the same amounts, so one `RankMemory` stands
    for every rank of its stage.

    Args:
        stage: the pipeline rank (0 without pipeline parallel).
        parameters: sharded fp32 (master) parameters, plus buffers.
        gradients: sharded gradients.
        optimizer: optimizer states (AdamW: two per parameter).
        activations: tensors saved for backward at the peak (all micro-batches in flight).
        communication: unsharded FSDP all-gather / reduce-scatter buffers and TP/CP exchange buffers live at the peak.
        temporary: other transient tensors at the peak: logits and the loss over the vocab, float8 scales, the
            backward of the block being recomputed.
        cpu_offloaded: bytes kept in host memory by CPU offload (not in `total`).
        detail: finer terms behind the components, by name (bytes), for `--json` readers and the docs.
    """

    stage: int = 0
    parameters: int = 0
    gradients: int = 0
    optimizer: int = 0
    activations: int = 0
    communication: int = 0
    temporary: int = 0
    cpu_offloaded: int = 0
    detail: dict[str, int] = field(default_factory=dict)

    @property
    def total(self) -> int:
        """Device bytes at the peak: the sum of the components (CPU-offloaded bytes excluded)."""
        return sum(getattr(self, name) for name in COMPONENTS)


@dataclass
class MemoryEstimate:
    """Per-rank peak memory of one job layout, and whether it fits.

    Args:
        tier: "analytic", "traced" or "measured".
        world_size: number of ranks.
        layout: the parallel degrees, e.g. "dp_shard=8" or "dp_shard=4, tp=2, pp=2".
        ranks: one entry per pipeline stage.
        budget: usable device memory per rank in bytes, None when no budget was given.
        device_memory: the device's total memory in bytes, None when no budget was given.
        notes: what the estimate assumed or could not cover, one line each.
        fix: the cheapest change that makes the layout fit (set by `titan_core.memory.advise`), or None.
    """

    tier: str
    world_size: int
    layout: str
    ranks: list[RankMemory]
    budget: int | None = None
    device_memory: int | None = None
    notes: list[str] = field(default_factory=list)
    fix: str | None = None

    @property
    def peak(self) -> int:
        """The largest rank's total bytes."""
        return max(r.total for r in self.ranks)

    @property
    def fits(self) -> bool | None:
        """Whether every rank's peak is within the budget; None without a budget."""
        return None if self.budget is None else self.peak <= self.budget

    def to_json(self) -> dict[str, Any]:
        """The estimate as plain JSON types: bytes per component, per stage."""
        out = asdict(self)
        for rank, r in zip(out["ranks"], self.ranks, strict=True):
            rank["total"] = r.total
        out["peak"] = self.peak
        out["fits"] = self.fits
        return out


def format_bytes(n: int) -> str:
    """`n` bytes in GiB (or MiB below 1 GiB), e.g. '71.93 GiB'."""
    if abs(n) >= GiB:
        return f"{n / GiB:.2f} GiB"
    return f"{n / 2**20:.1f} MiB"


PEAK_MOMENTS = {
    "loss_backward": "the loss's backward",
    "output_backward": "the output projection's backward",
    "block_backward": "the last block's backward",
    "optimizer_step": "the optimizer step",
    "replica_all-reduce": "the replica groups' gradient all-reduce",
}
"""The moments of a step the analytic tier compares (`detail["peak_moment_<key>"]` names the largest), as printed."""


def _peak_moment(rank: RankMemory) -> str | None:
    key = next((k.removeprefix("peak_moment_") for k in rank.detail if k.startswith("peak_moment_")), None)
    return None if key is None else PEAK_MOMENTS.get(key, key.replace("_", " "))


def render_text(estimate: MemoryEstimate, title: str) -> str:
    """The estimate as a table: one column per pipeline stage, one row per component, then the verdict."""
    e = estimate
    heads = [f"stage {r.stage}" for r in e.ranks] if len(e.ranks) > 1 else ["per rank"]
    rows = [(name, [getattr(r, name) for r in e.ranks]) for name in COMPONENTS]
    rows.append(("total", [r.total for r in e.ranks]))
    if any(r.cpu_offloaded for r in e.ranks):
        rows.append(("CPU-offloaded (host)", [r.cpu_offloaded for r in e.ranks]))
    width = max(len(name) for name, _ in rows) + 2
    ranks = "1 rank" if e.world_size == 1 else f"{e.world_size} ranks"
    lines = [title, f"{e.tier} estimate, {ranks}: {e.layout}", ""]
    lines.append(" " * width + "".join(f"{h:>14}" for h in heads))
    for name, values in rows:
        if name == "total":
            lines.append(" " * width + "".join(f"{'-' * 12:>14}" for _ in heads))
        lines.append(f"{name:<{width}}" + "".join(f"{format_bytes(v):>14}" for v in values))
    lines.append("")
    moments = [_peak_moment(r) for r in e.ranks]
    if any(moments):  # the analytic tier's: where the components above are taken (gradients are 0 before backward)
        at = dict.fromkeys(m for m in moments if m)
        if len(e.ranks) > 1 and len(at) > 1:
            lines.append(
                "at the peak: "
                + ", ".join(f"{m} (stage {r.stage})" for r, m in zip(e.ranks, moments, strict=True) if m)
            )
        else:
            lines.append(f"at the peak: {next(iter(at))}")
    if e.budget is not None:
        verdict = "fits" if e.fits else "does NOT fit"
        lines.append(
            f"peak {format_bytes(e.peak)} per rank of {format_bytes(e.budget)} usable "
            f"({format_bytes(e.device_memory or e.budget)} device): {verdict}"
        )
        if not e.fits:
            lines.append(f"cheapest fix: {e.fix}" if e.fix else "no single change of the layout makes it fit: add GPUs")
    else:
        lines.append(f"peak {format_bytes(e.peak)} per rank (give --gpu-memory for a verdict)")
    lines.extend(f"note: {n}" for n in e.notes)
    return "\n".join(lines)
