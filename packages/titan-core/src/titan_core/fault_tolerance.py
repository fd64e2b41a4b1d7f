"""torchft replica groups: data parallel across jobs that fail and rejoin on their own.

Each `titan train` job is one replica group, laid out as any run is (FSDP, TP, CP, pipeline stages inside
it), and the groups together are HSDP whose replicate dimension is torchft's. Each step:

    begin_step         torchft's quorum with the live groups, in the background during forward
    average_gradients  this rank's gradients (local shards) averaged across the groups, one
                       all-reduce per dtype over torchft's reconfigurable gloo (or NCCL) group
    commit             torchft's commit vote (`should_commit`): the optimizer steps only if it passes

A group that starts late or restarts after a crash recovers the model, the optimizer, the
LR schedules, the train state and the data position live from a peer, over torchft's HTTP transport
(`Manager.register_state_dict_fn`): no checkpoint is read. The survivors go on without
restarting; a dropped step (a group died mid-all-reduce) is retried with the next batch.

Why not torchft's `OptimizerWrapper` and `DistributedDataParallel` (or torchtitan's FSDP
all-reduce hook): the step runner owns zero_grad and the optimizer step for every layout
(`titan_core.step`), and the commit vote must also gate the LR schedule and float8's
after-step; one flat all-reduce of the local gradient shards after backward works the
same under FSDP, DDP and one process. `docs/fault_tolerance.md` has the how-to.

With `semi_sync_method` (DiLoCo, local SGD: `titan_core.diloco`) the groups meet every `sync_steps` steps instead:
a synchronous quorum (`quorum`, where a group behind heals), one all-reduce of the weights' change (`start_average`,
waited for then or a few steps later) and the same commit vote.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Protocol

import torch
import torch.nn as nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors
from torch.distributed import ReduceOp
from torch.distributed.tensor import DTensor

from titan_ckpt.model_state import flatten_optimizer_tensors, get_optimizer_states, get_part_states
from titan_core.config.errors import ConfigError, MissingPackageError

if TYPE_CHECKING:
    import torchft

__all__ = ["FaultToleranceOptions", "MISSING_TORCHFT", "ReplicaGroups", "build_replica_groups", "local_shard"]

logger = logging.getLogger("titan")

MISSING_TORCHFT = "fault_tolerance.enable needs torchft: pip install 'titan-core[ft]' (or set it to false)"


class _TrainState(Protocol):
    def state_dict(self) -> dict[str, int]: ...

    def load_state_dict(self, state: dict[str, int]) -> None: ...


class _Loader(Protocol):
    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


@dataclass(frozen=True)
class FaultToleranceOptions:
    """What the replica groups are built from ([fault_tolerance]).

    Args:
        replica_id: this group's number, 0 .. group_size - 1.
        group_size: replica groups in the run.
        min_replica_size: fewest groups that commit a step.
        lighthouse: the lighthouse's address; "" reads $TORCHFT_LIGHTHOUSE.
        timeout_s: cross-group all-reduce, commit vote and recovery timeout.
        quorum_timeout_s: how long the quorum waits for min_replica_size groups.
        semi_sync: the groups meet every few steps (DiLoCo), not every step: synchronous quorums.
        same_init: every group initialises the same weights (one seed): the first step trains on every group.
            Otherwise the first quorum gives each group group 0's weights, and its step trains on group 0's batch.
        backend: the cross-group collectives' backend, "gloo" or "nccl" (torchft's `ProcessGroupNCCL`: CUDA
            tensors, this rank's current CUDA device).
    """

    replica_id: int
    group_size: int
    min_replica_size: int
    lighthouse: str
    timeout_s: float
    quorum_timeout_s: float
    semi_sync: bool = False
    same_init: bool = False
    backend: str = "gloo"


def local_shard(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (sharing its storage), or the tensor itself."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _settings(group: dict[str, Any]) -> dict[str, Any]:
    """An optimizer param group's hyperparameters (lr, betas, ...): all but its parameters."""
    return {k: v for k, v in group.items() if k != "params"}


@contextlib.contextmanager
def _unreachable_lighthouse(address: str, seconds: float) -> Iterator[None]:
    """torchft's "failed to connect to ADDRESS within timeout" as one line naming `fault_tolerance.lighthouse`."""
    try:
        yield
    except RuntimeError as error:
        if "failed to connect" not in str(error):
            raise
        raise ConfigError(
            f"fault_tolerance.lighthouse: no lighthouse answered at {address or '(unset)'} within "
            f"fault_tolerance.quorum_timeout_seconds ({seconds:g} s); start one with `titan lighthouse` (it prints its "
            "address) and give that address, or fix this one"
        ) from None


class ReplicaGroups:
    """This job's seat among the torchft replica groups: quorum, gradient average, commit, live recovery.

    Args:
        options: the [fault_tolerance] settings.
        rank: this process's rank inside its group.
        world_size: the group's process count.
    """

    def __init__(self, options: FaultToleranceOptions, *, rank: int, world_size: int):
        # torchft logs a few INFO lines per quorum and commit vote (every step), from Rust and Python (empty lines
        # to its structured loggers): warnings only (RUST_LOG, when unset)
        os.environ.setdefault("RUST_LOG", "warn")
        for name in ("torchft", "torchft_quorums", "torchft_commits"):
            logging.getLogger(name).setLevel(logging.WARNING)
        try:
            import torchft
        except ImportError as error:
            raise MissingPackageError(MISSING_TORCHFT) from error
        self.options, self.rank = options, rank
        timeout = timedelta(seconds=options.timeout_s)
        # The group's TCPStore (torchrun's, at MASTER_ADDR:MASTER_PORT) hands rank 0's manager address to the
        # others and hosts the cross-group rendezvous, which torchft rebuilds at each new quorum. One
        # process started without torchrun has no TCPStore: it opens its own.
        store_addr, store_port = None, None
        if "MASTER_PORT" not in os.environ:
            self._store = torch.distributed.TCPStore(socket.gethostname(), 0, is_master=True, wait_for_workers=False)
            store_addr, store_port = socket.gethostname(), self._store.port
        if options.backend == "nccl":  # torchft's NCCL group aborts a hung collective after this (it warns unset)
            os.environ.setdefault("TORCH_NCCL_NONBLOCKING_TIMEOUT", str(options.timeout_s))
            pg: Any = torchft.ProcessGroupNCCL(timeout=timeout)
        elif options.backend == "gloo":
            pg = torchft.ProcessGroupGloo(timeout=timeout)
        else:
            raise ValueError(f"replica groups' backend {options.backend!r}: use 'gloo' or 'nccl'")
        lighthouse = options.lighthouse or os.environ.get("TORCHFT_LIGHTHOUSE", "")
        with _unreachable_lighthouse(lighthouse, options.quorum_timeout_s):
            self.manager: torchft.Manager = torchft.Manager(
                pg=pg,
                load_state_dict=None,
                state_dict=None,
                min_replica_size=options.min_replica_size,
                use_async_quorum=not options.semi_sync,  # DiLoCo heals at the quorum, before it reads the weights
                # Unseeded, per step: the groups' first quorum (step 0) gives every group group 0's initial weights
                # (the others heal, and do not train that step). DiLoCo's first quorum comes after its first inner
                # steps, whose weights it must not replace: its groups start from the same seed instead (the job
                # check asks for it).
                init_sync=not (options.semi_sync or options.same_init),
                timeout=timeout,
                quorum_timeout=timedelta(seconds=options.quorum_timeout_s),
                connect_timeout=timedelta(seconds=options.quorum_timeout_s),  # to the lighthouse, at start
                rank=rank,
                world_size=world_size,
                store_addr=store_addr,
                store_port=store_port,
                lighthouse_addr=options.lighthouse or None,
                replica_id=f"titan_{options.replica_id}",
            )
        if rank == 0:
            logger.info(
                "fault tolerance: replica group %d of %d joins the lighthouse %s (at least %d groups per step; "
                "collectives across the groups over %s)",
                options.replica_id,
                options.group_size,
                options.lighthouse or os.environ.get("TORCHFT_LIGHTHOUSE", ""),
                options.min_replica_size,
                "NCCL" if options.backend == "nccl" else "gloo",
            )
        self._start_checked = False  # whether this process's first step compared the groups' initial weights
        self._groups_seen = 0  # groups in the last committed step, for the log line when it changes
        self.recovered_step: int | None = None  # set when a peer's state was loaded, until it is logged
        self.dropped_steps = 0

    def data_slice(self, dp_rank: int, dp_world: int) -> tuple[int, int]:
        """This rank's data-parallel rank and world across all the groups: each group reads its own slice.

        Args:
            dp_rank: the rank inside the group's data-parallel mesh.
            dp_world: the group's data-parallel degree.
        """
        return self.options.replica_id * dp_world + dp_rank, self.options.group_size * dp_world

    def register(
        self,
        model_parts: Sequence[nn.Module],
        optimizers: Sequence[torch.optim.Optimizer],
        lr_schedulers: Sequence[Any],
        train_state: _TrainState,
        loader: _Loader | None = None,
    ) -> None:
        """Give torchft the state a recovering group loads from a live peer (model, optimizer, LR, step, data).

        The optimizer state is created now (a zero-lr step, its step counts set back to 0), so that a
        fresh group has the tensors to receive into and a peer can send before its first step.

        Args:
            model_parts: the model, or this rank's pipeline stages.
            optimizers: one per part.
            lr_schedulers: one per optimizer.
            train_state: the run's progress (`state_dict` / `load_state_dict`).
            loader: the training data; its position is the run's global stream position, the same in every
                group at a step (each group reads its own slice of each global batch, `data_slice`), so a
                recovering group goes on where its slice would be had it never stopped, instead of from the start.
                The peer's is taken after it fetched the step's batch, as the recovering group's own is when it
                loads it, after the step's backward.
        """
        parts, optims, schedulers = list(model_parts), list(optimizers), list(lr_schedulers)
        get_optimizer_states(parts, optims)  # creates an empty optimizer state (torch's zero-lr step)
        with torch.no_grad():
            for optim in optims:
                for per_param in optim.state.values():
                    step = per_param.get("step")
                    if isinstance(step, torch.Tensor):
                        step.zero_()
                    elif step is not None:
                        per_param["step"] = 0
        self._parts, self._optims = parts, optims
        self._find_tensors()

        def state_dict() -> dict[str, Any]:  # torchft's quorum thread, while the main thread runs forward
            return {
                "model": self._tensors["model"],
                "optimizer": self._tensors["optimizer"],
                "optimizer_settings": [[_settings(g) for g in optim.param_groups] for optim in optims],
                "lr_schedulers": [s.state_dict() for s in schedulers],
                "train_state": train_state.state_dict(),
                **({"data": loader.state_dict()} if loader is not None else {}),
            }

        def load_state_dict(state: dict[str, Any]) -> None:  # the main thread, in `commit`
            with torch.no_grad():
                for key, tensor in self._tensors["model"].items():
                    tensor.copy_(state["model"][key])
                for key, tensor in self._tensors["optimizer"].items():
                    tensor.copy_(state["optimizer"][key])
            for optim, settings in zip(optims, state["optimizer_settings"], strict=True):
                for group, sent in zip(optim.param_groups, settings, strict=True):
                    group.update(sent)
            for scheduler, scheduler_state in zip(schedulers, state["lr_schedulers"], strict=True):
                scheduler.load_state_dict(scheduler_state)
            train_state.load_state_dict(state["train_state"])
            if loader is not None:
                loader.load_state_dict(state["data"])
            self.recovered_step = int(state["train_state"]["step"])

        self.manager.register_state_dict_fn("titan", load_state_dict, state_dict)

    def _find_tensors(self) -> None:
        """The model's and optimizer's tensors (local shards) by checkpoint key, found on the main thread.

        torchft sends them from its own thread during forward, when FSDP has swapped the module's
        parameters for unsharded ones: names are looked up here, between steps, and the tensors
        (updated in place by the optimizer) are sent from then on. A checkpoint load replaces the
        optimizer's tensors: `resume_at` looks them up again.
        """
        optim_states = get_optimizer_states(self._parts, self._optims)
        self._tensors: dict[str, dict[str, torch.Tensor]] = {
            "model": {
                f"{i}.{k}": local_shard(v)
                for i, state in enumerate(get_part_states(self._parts))
                for k, v in state.items()
            },
            "optimizer": {k: local_shard(v) for k, v in flatten_optimizer_tensors(optim_states).items()},
        }

    def resume_at(self, step: int) -> None:
        """After the checkpoint load (whether one was loaded): torchft's step follows the run's, so a group
        that resumed behind its peers heals from them; the tensors to send are looked up again.

        Args:
            step: the run's step after the load (0 when starting fresh).
        """
        self.manager.load_state_dict({"step": step, "batches_committed": self.manager.batches_committed()})
        self._find_tensors()

    def begin_step(self) -> None:
        """Start this step's quorum (in torchft's background thread; recovery, if due, starts there too)."""
        self.manager.start_quorum()

    def add_state(self, name: str, tensors: dict[str, torch.Tensor]) -> None:
        """Send `tensors` (live, updated in place) to a recovering group too, which copies them into its own.

        Args:
            name: the state's name, the same in every group.
            tensors: tensors by key (DTensors: their local shards are sent), the same in every group.
        """
        tensors = {key: local_shard(tensor) for key, tensor in tensors.items()}

        def load_state_dict(state: dict[str, torch.Tensor]) -> None:
            with torch.no_grad():
                for key, tensor in tensors.items():
                    tensor.copy_(state[key])

        self.manager.register_state_dict_fn(name, load_state_dict, lambda: tensors)

    def quorum(self, done_steps: int) -> None:
        """A synchronous quorum (`semi_sync`) after `done_steps` steps: a group behind its peers heals here.

        Args:
            done_steps: the steps this group has finished; torchft heals the groups whose count is below the
                highest in the quorum.
        """
        self.manager.load_state_dict({"step": done_steps, "batches_committed": self.manager.batches_committed()})
        self.manager.start_quorum()

    @torch.no_grad()
    def average_gradients(self, params: Iterable[nn.Parameter], also: Sequence[torch.Tensor] = ()) -> None:
        """Average this rank's gradients (its local shards) across the live groups, in place.

        A group that is recovering sends zeros and receives the others' average; after an error the
        gradients may be garbage, and `commit` then votes no.

        Args:
            params: the model's parameters; those without a gradient are skipped (the same on every group).
            also: more tensors averaged in the same all-reduces (e.g. the MoE layers' token counts), the same in
                every group.
        """
        params = list(params)
        buckets: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}  # one all-reduce per dtype
        for tensor in [local_shard(p.grad) for p in params if p.grad is not None] + list(also):
            buckets.setdefault((tensor.dtype, tensor.device), []).append(tensor)
        flats = [_flatten_dense_tensors(grads) for grads in buckets.values()]
        self.average_flat(flats)
        for grads, flat in zip(buckets.values(), flats, strict=True):
            for grad, averaged in zip(grads, _unflatten_dense_tensors(flat, grads), strict=True):
                grad.copy_(averaged)
        if not self._start_checked:  # this process's first step: after the quorum, before the optimizer's step
            self._start_checked = True
            if self.options.same_init and self.manager.current_step() == 0 and self.manager.is_participating():
                self._check_same_start(params)

    def _check_same_start(self, params: Sequence[nn.Parameter]) -> None:
        """The run's first step (every group in the quorum at step 0: none heals, so all of them call this): the
        groups' initial weights, which seeded groups do not sync (`same_init`), must be the same. One all-reduce of
        this rank's fingerprint (the sum and the sum of squares of its shards, fp64), its max against its min."""
        both = torch.zeros(2, dtype=torch.float64, device=params[0].device if params else "cpu")
        with torch.no_grad():
            for p in params:  # one shard at a time: no fp64 copy of the model
                shard = local_shard(p.detach())
                both[0] += shard.sum(dtype=torch.float64)
                both[1] += (shard * shard).sum(dtype=torch.float64)
        extremes = torch.cat([both, -both])  # max over the groups, and minus their min
        self.manager.allreduce(extremes, reduce_op=ReduceOp.MAX).wait()
        if self.manager.errored() is None and not torch.equal(extremes[:2], -extremes[2:]):
            raise ConfigError(
                "fault_tolerance: the replica groups start from different weights (their first step's fingerprints "
                "differ): give every group the same debug.seed and checkpoint.initial_load_path"
            )

    def participants(self) -> int:
        """The groups in this step's quorum whose tensors an average divides by (a healing group's are not)."""
        return self.manager.num_participants()

    @torch.no_grad()
    def average_flat(self, flats: Sequence[torch.Tensor]) -> None:
        """Average flat buffers across the live groups, in place: all-reduces started together, then waited for.

        Args:
            flats: the same buffers (dtype, length, order) in every group.
        """
        self.wait(self.start_average(flats))

    def start_average(self, flats: Sequence[torch.Tensor]) -> list[Any]:
        """Start averaging flat buffers across the live groups, in place; `wait` for the works it returns.

        Args:
            flats: the same buffers (dtype, length, order) in every group.
        """
        return [self.manager.allreduce(flat) for flat in flats]

    def wait(self, works: Sequence[Any]) -> None:
        """Wait for `start_average`'s all-reduces (a failed one is torchft's to report: `errored`, then the vote).

        Args:
            works: what `start_average` returned.
        """
        for work in works:
            work.wait()

    def errored(self) -> bool:
        """Whether a cross-group collective of this quorum failed (the commit vote will drop it)."""
        return self.manager.errored() is not None

    def commit(self, step: int | None = None) -> bool:
        """torchft's commit vote for this step (a peer's recovered state is applied first); True: step the optimizer.

        Args:
            step: the step the log lines name; None: torchft's step counter, which follows the run's (`resume_at`,
                recovery). DiLoCo names the step of its outer step, which a delayed sync votes for after its quorum.
        """
        committed = self.manager.should_commit()
        groups = self.manager.num_participants()
        if step is None:
            step = self.manager.current_step() + (0 if committed else 1)  # should_commit counted a committed step
        if self.rank == 0:
            if self.recovered_step is not None:
                logger.info(
                    "fault tolerance: recovered step %d live from a peer replica group (model, optimizer, "
                    "LR schedule, step, data position): no checkpoint read",
                    self.recovered_step,
                )
            if not committed and self.options.semi_sync:
                logger.warning(
                    "fault tolerance: the sync after step %d was dropped by the commit vote; the weights go back to "
                    "the last sync's",
                    step,
                )
            elif not committed:
                logger.warning("fault tolerance: step %d dropped by the commit vote; it runs again", step)
            elif groups != self._groups_seen:
                logger.info(
                    "fault tolerance: step %d %s %d of %d replica groups",
                    step,
                    "syncs" if self.options.semi_sync else "trains on",
                    groups,
                    self.options.group_size,
                )
        self.recovered_step = None
        if committed:
            self._groups_seen = groups
        else:
            self.dropped_steps += 1
        return committed

    def metrics(self) -> dict[str, int]:
        """`ft/replica_groups` (in the last quorum; not before a semi-sync run's first sync) and `ft/dropped_steps`
        (`ft/dropped_syncs` with `semi_sync`) so far, host ints."""
        if self.options.semi_sync:
            groups = self.manager.num_participants()  # 0 before the first quorum
            return {**({"ft/replica_groups": groups} if groups else {}), "ft/dropped_syncs": self.dropped_steps}
        return {"ft/replica_groups": self.manager.num_participants(), "ft/dropped_steps": self.dropped_steps}

    def close(self) -> None:
        """Leave the quorum: stop torchft's manager server and checkpoint server."""
        self.manager.shutdown(wait=False)


def build_replica_groups(
    section: Any, *, rank: int, world_size: int, same_init: bool = False, device_type: str = "cpu"
) -> ReplicaGroups | None:
    """This job's `ReplicaGroups` from the [fault_tolerance] section; None when it is off.

    Args:
        section: the config's `fault_tolerance` section.
        rank: this process's rank inside its group.
        world_size: the group's process count.
        same_init: every group initialises the same weights (the run is seeded).
        device_type: where the run trains ("cuda", "cpu"): `process_group = 'auto'` picks NCCL on CUDA.
    """
    if not section.enable:
        return None
    options = FaultToleranceOptions(
        replica_id=section.replica_id,
        group_size=section.group_size,
        min_replica_size=section.min_replica_size,
        lighthouse=section.lighthouse,
        timeout_s=section.timeout_seconds,
        quorum_timeout_s=section.quorum_timeout_seconds,
        semi_sync=section.semi_sync_method != "none",
        same_init=same_init,
        backend=section.process_group if section.process_group != "auto" else _auto_backend(device_type),
    )
    return ReplicaGroups(options, rank=rank, world_size=world_size)


def _auto_backend(device_type: str) -> str:
    """`process_group = 'auto'`: NCCL for CUDA tensors, gloo for the rest."""
    return "nccl" if device_type == "cuda" else "gloo"
