"""Hangs become errors: a collective that times out or loses a peer names the rank at fault.

gloo's timeout says `Timed out waiting 5000ms for recv operation to complete` and a dead peer
`Connection closed by peer`; NCCL's watchdog names the collective. None says which rank never
came, and torch has no such report, hence this module. `CommWatch` keeps in the job's store the
last step each rank finished. When a collective fails on a rank, that rank marks itself failed
and asks every rank, through the store, to dump its flight recorder (gloo) and its Python stack
(a thread of each rank answers, even while its main thread is stuck). After a short grace it
raises `CollectiveError` naming the ranks that did not fail in a collective themselves: the
ranks the others were waiting for. A stuck rank whose thread answered leaves a few seconds
later (exit code 1), so that the job ends even where nothing kills it (torchrun's SIGTERM
may be caught for a graceful stop, and waits 30 s before SIGKILL).
"""

from __future__ import annotations

import datetime
import faulthandler
import os
import sys
import threading
import time
from pathlib import Path

import torch.distributed as dist

from titan_parallel.flight_recorder import dump_gloo_trace

# The messages of a collective that failed because of another rank (gloo) or DETAIL's monitored barrier.
_FAILURE_MARKERS = ("Timed out waiting", "Connection closed by peer", "Connection reset by peer", "monitoredBarrier")
_PREFIX = "titan/comm_watch"
DOCS = "see docs/debugging.md"


class CollectiveError(RuntimeError):
    """A collective timed out or lost a peer; the message names the ranks the others waited for."""


def set_collective_timeout(seconds: float) -> None:
    """Set the timeout of every process group of this process: the default one and every subgroup.

    Subgroups (the DeviceMesh's, a checkpointer's) keep their own timeout, torch's default unless
    given one, so each is set here. Under `TORCH_DISTRIBUTED_DEBUG=DETAIL` the checks run before
    each collective on a hidden helper group that keeps the timeout the default group was created with.

    Args:
        seconds: the new timeout of every collective.
    """
    timeout = datetime.timedelta(seconds=seconds)
    set_timeout = getattr(dist, "set_timeout", None) or dist.distributed_c10d._set_pg_timeout  # public from torch 2.12
    for group in list(dist.distributed_c10d._world.pg_map):
        set_timeout(timeout, group)


def is_collective_failure(error: BaseException) -> bool:
    """Whether `error` is a collective that timed out or lost a peer (NCCL's DistError, or gloo's messages).

    Args:
        error: what the training loop raised.
    """
    return isinstance(error, dist.DistError) or any(m in str(error) for m in _FAILURE_MARKERS)


class CommWatch:
    """Watches the job's collectives from one rank: timeouts, heartbeats and the report of a hang.

    Args:
        rank, world_size: this process's place in the default group.
        init_timeout_s: the collective timeout until this process's first step ends (set on every group now).
        train_timeout_s: the collective timeout after it.
        stack_folder: where each rank writes its Python stack (`rank_<N>.txt`) when a collective fails.
        gloo_trace: dump the gloo flight recorder too (torch does not on gloo); NCCL dumps its own.
        grace_s: how long a failed rank waits for the others' answers before it raises; None = a quarter
            of the timeout, between 1 and 5 s. A rank that answered but did not fail leaves 5 s after that.
        poll_s: how often each rank's thread looks for a request to dump.
    """

    def __init__(
        self,
        rank: int,
        world_size: int,
        *,
        init_timeout_s: float,
        train_timeout_s: float,
        stack_folder: Path,
        gloo_trace: bool = False,
        grace_s: float | None = None,
        poll_s: float = 0.25,
    ):
        self.rank, self.world_size = rank, world_size
        self.train_timeout_s, self.timeout_s = train_timeout_s, init_timeout_s
        self.stack_folder, self.gloo_trace = stack_folder, gloo_trace
        self.grace_s, self.poll_s = grace_s, poll_s
        self._first_step_done = self._failed = False
        set_collective_timeout(init_timeout_s)
        self.store: dist.Store | None = None
        if world_size > 1:
            world = dist.group.WORLD
            assert world is not None  # the default process group is initialised
            self.store = world.get_group_store()
        self._stop = threading.Event()
        self._answerer = None
        if self.store is not None:
            self._answerer = threading.Thread(
                target=self._answer_dump_request, args=(self.store,), name="titan-comm-watch", daemon=True
            )
            self._answerer.start()

    def step_done(self, step: int) -> None:
        """Record that this rank finished `step`; after its first, the collective timeout becomes the train timeout.

        One store write per step, in the step: published later by the answerer thread, the step of a rank
        that dies right after finishing it would be reported one behind.
        """
        if self.store is not None:
            self.store.set(f"{_PREFIX}/step/{self.rank}", f"{step} {time.time()}")
        if not self._first_step_done:
            self._first_step_done = True
            set_collective_timeout(self.train_timeout_s)
            self.timeout_s = self.train_timeout_s

    def explain(self, error: BaseException, step: int) -> None:
        """Raise `CollectiveError` naming the ranks at fault if `error` is a failed collective in `step`.

        Any other error returns, for the caller to re-raise.
        """
        store = self.store
        if store is None or not is_collective_failure(error):
            return
        self._failed = True
        try:
            report = self._report(store, error, step)
        except Exception as store_error:  # the store went down with the job: say what is known
            report = f"{self._what(error)} in step {step} ({DOCS}); the job's store did not answer: {store_error}"
        raise CollectiveError(report) from error

    def close(self) -> None:
        self._stop.set()

    def _grace_s(self) -> float:
        return self.grace_s if self.grace_s is not None else min(5.0, max(1.0, self.timeout_s / 4))

    def _what(self, error: BaseException) -> str:
        if "Connection closed" in str(error) or "Connection reset" in str(error):
            return "a collective lost its connection to a peer (a rank died?)"
        return f"a collective timed out after {self.timeout_s:g} s"

    def _report(self, store: dist.Store, error: BaseException, step: int) -> str:
        failed_key = f"{_PREFIX}/failed"
        # one key for all: one read per poll, whatever the world size (torch's stub lacks `Store.append`)
        store.append(failed_key, f"{self.rank},")  # type: ignore[attr-defined]
        store.set(f"{_PREFIX}/dump", str(self.rank))  # every rank's answerer dumps its stack
        deadline = time.monotonic() + self._grace_s()
        while True:  # the others waiting in the same collective fail about now too
            failed = {int(r) for r in store.get(failed_key).decode().split(",") if r}
            if len(failed) == self.world_size or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        waited_for = [r for r in range(self.world_size) if r not in failed]
        lines = [f"{self._what(error)} in step {step} on rank {self.rank}"]
        if not waited_for:
            lines.append(
                "every rank failed in a collective: ranks called different collectives (rerun with "
                "TORCH_DISTRIBUTED_DEBUG=DETAIL) or the network failed"
            )
        for r in waited_for[:8]:
            lines.append(f"rank {r} is stuck or dead: {self._last_seen(store, r)}")
        if len(waited_for) > 8:
            lines.append(f"... and {len(waited_for) - 8} more ranks: {waited_for[8:]}")
        lines.append(f"Python stacks: {self.stack_folder}; {DOCS}")
        return "\n  ".join(lines)

    def _last_seen(self, store: dist.Store, rank: int) -> str:
        key = f"{_PREFIX}/step/{rank}"
        if store.check([key]):
            step, when = store.get(key).decode().split()
            seen = f"it finished step {step} {time.time() - float(when):.1f} s ago"
        else:
            seen = "it finished no step"
        if store.check([f"{_PREFIX}/stack/{rank}"]):
            return f"{seen}; it is alive, its stack is in {store.get(f'{_PREFIX}/stack/{rank}').decode()}"
        return f"{seen}; it did not answer (dead, or stuck holding the GIL)"

    def _answer_dump_request(self, store: dist.Store) -> None:
        """Thread: when a rank asks (a collective failed), dump this rank's stack and gloo trace, once;
        then leave unless this rank failed too (it raises) or finished."""
        key = f"{_PREFIX}/dump"
        while not self._stop.wait(self.poll_s):
            try:
                if not store.check([key]):
                    continue
                failed_rank = store.get(key).decode()
                self.stack_folder.mkdir(parents=True, exist_ok=True)
                path = self.stack_folder / f"rank_{self.rank}.txt"
                with open(path, "w") as f:
                    faulthandler.dump_traceback(f, all_threads=True)
                if self.gloo_trace:
                    dump_gloo_trace(self.rank)
                store.set(f"{_PREFIX}/stack/{self.rank}", str(path))
            except Exception:  # the store or the folder is gone: the job is ending anyway
                failed_rank = "?"
            if self._stop.wait(self._grace_s() + 5.0) or self._failed:
                return
            print(
                f"[rank {self.rank}] leaving: a collective failed on rank {failed_rank}, whose error says why",
                file=sys.stderr,
                flush=True,
            )
            os._exit(1)
