"""Profiling: torch.profiler traces (of the last `profiler_active` steps of each window, after `profiler_warmup`
steps profiled unrecorded) and CUDA memory snapshots every `profile_freq` steps.

Traces go to `<dump_folder>/<save_traces_folder>/iteration_<step>/rank<r>_trace.json`
(open them in Perfetto or chrome://tracing); memory snapshots (CUDA only) to
`<dump_folder>/<save_memory_snapshot_folder>/iteration_<step>/rank<r>_memory_snapshot.pickle`
(open them at pytorch.org/memory_viz).
"""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger("titan")


class Profiler:
    """Call `step(step)` after every training step; `close()` at the end.

    Args:
        folder: where traces go (None = no traces).
        memory_folder: where CUDA memory snapshots go (None = none).
        freq: profile the last `active` steps of every `freq` steps (`profiling.profile_freq`), after `warmup` steps
            run under the profiler unrecorded; `freq` >= `warmup + active` (`titan_core.job.run_rules.profiling`).
        rank: this process's rank, in file names.
        device: the training device; memory snapshots need CUDA.
        warmup: `profiling.profiler_warmup`.
        active: `profiling.profiler_active`.
    """

    def __init__(
        self,
        folder: Path | None,
        memory_folder: Path | None,
        freq: int,
        rank: int,
        device: torch.device,
        warmup: int = 1,
        active: int = 1,
    ):
        self.rank, self.freq, self.active = rank, freq, active
        self.folder, self.memory_folder = folder, memory_folder
        self._step = 0
        self._torch_profiler = None
        if folder is not None:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if device.type == "cuda":
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self._torch_profiler = torch.profiler.profile(
                activities=activities,
                schedule=torch.profiler.schedule(wait=freq - warmup - active, warmup=warmup, active=active),
                on_trace_ready=self._save_trace,
                record_shapes=True,
            )
            self._torch_profiler.start()
        if memory_folder is not None:
            torch.cuda.memory._record_memory_history(max_entries=100_000)

    def _save_trace(self, prof) -> None:
        assert self.folder is not None  # the trace profiler exists only with a folder
        out = self.folder / f"iteration_{self._step}"
        out.mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(out / f"rank{self.rank}_trace.json"))
        if self.rank == 0:
            first = self._step - self.active + 1
            steps = f"step {self._step}" if first == self._step else f"steps {first}-{self._step}"
            logger.info("profiler trace of %s saved in %s", steps, out)

    def step(self, step: int) -> None:
        self._step = step
        if self._torch_profiler is not None:
            self._torch_profiler.step()
        if self.memory_folder is not None and step % self.freq == 0:
            out = self.memory_folder / f"iteration_{step}"
            out.mkdir(parents=True, exist_ok=True)
            torch.cuda.memory._dump_snapshot(str(out / f"rank{self.rank}_memory_snapshot.pickle"))

    def close(self) -> None:
        if self._torch_profiler is not None:
            with contextlib.suppress(RuntimeError):  # stopped before its first active window
                self._torch_profiler.stop()
            self._torch_profiler = None
        if self.memory_folder is not None:
            torch.cuda.memory._record_memory_history(enabled=None)


def build_profiler(section: Any, run_folder: Path, rank: int, device: torch.device) -> Profiler | None:
    """The run's `Profiler` from the [profiling] section; None when it neither traces nor snapshots.

    Args:
        section: the config's `profiling` section.
        run_folder: the run's `job.dump_folder` (the trace and snapshot folders are relative to it).
        rank: this process's rank.
        device: the training device.
    """
    if not (section.enable_profiling or section.enable_memory_snapshot):
        return None
    return Profiler(
        run_folder / section.save_traces_folder if section.enable_profiling else None,
        run_folder / section.save_memory_snapshot_folder if section.enable_memory_snapshot else None,
        section.profile_freq,
        rank,
        device,
        section.profiler_warmup,
        section.profiler_active,
    )
