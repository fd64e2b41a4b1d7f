"""The arithmetic of a valid parallel layout: degrees, and the rule each parallelism sets.

Nothing here imports torch at module level, so a launcher can check a whole
layout before it starts any process; the `apply_*` functions call the same rules
again, so each rule is written once. Every rule raises `ParallelConfigError`,
whose `arguments` name the parameters at fault as the rule's signature names
them, each a whole word of the message, so a caller can rewrite them into its
own terms (a launcher into its config keys).

The pipeline's rules (schedules, stage counts, cuts, microbatches) are in
`titan_parallel.pipeline_layout`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from titan_parallel.mesh import ParallelMesh


class ParallelConfigError(ValueError):
    """A parallel layout that cannot work: one line naming the arguments at fault and the fix.

    Args:
        message: the explanation; names each of `arguments` as a whole word.
        arguments: the parameter names at fault, as the raising function's signature names them.
    """

    def __init__(self, message: str, *, arguments: tuple[str, ...] = ()):
        super().__init__(message)
        self.arguments: tuple[str, ...] = tuple(arguments)

    def __reduce__(self):  # keep `arguments` across pickling (e.g. from a worker process)
        return (self.__class__, (str(self),), {"arguments": self.arguments})


def at_least(minimum: int, **values: int) -> None:
    """Raise `ParallelConfigError` naming the first of `values` below `minimum`.

    Args:
        minimum: the smallest value allowed.
        values: argument name -> value.
    """
    for name, value in values.items():
        if value < minimum:
            raise ParallelConfigError(f"{name}={value} must be >= {minimum}", arguments=(name,))


def _product(named: Sequence[tuple[str, int]]) -> str:
    """`"cp=2 x tp=4 = 8"` for the given (name, value) pairs; `"tp=4"` for one."""
    text = " x ".join(f"{n}={v}" for n, v in named)
    return text if len(named) == 1 else f"{text} = {math.prod(v for _, v in named)}"


# ---- degrees -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class ParallelDims:
    """Degrees of each parallel dimension; their product is the world size.

    Args:
        dp_replicate: data-parallel replicas (HSDP's replicate dim, or DDP).
        dp_shard: FSDP shards; -1 takes what the other degrees leave of the world size.
        cp: context parallel degree (each sequence split over this many ranks).
        tp: tensor parallel degree (with sequence parallel).
        pp: pipeline parallel degree (ranks in one pipeline).
        world_size: number of processes.
        ep: expert parallel degree: Mixture-of-Experts experts split over this many ranks, carved
            from the FSDP x context-parallel ranks (`ep = dp_shard_in_ep x cp`), and from the
            tensor-parallel ranks too when `etp=1`; it adds no processes. 1 = every rank holds every
            expert.
        etp: expert tensor parallel degree, `tp` or 1 (-1 = `tp`). With `tp`, tensor parallel splits each
            expert's hidden dim and every TP rank runs all of its group's token slots through its slice.
            With 1 (torchtitan's ETP=1), the TP ranks join expert parallel instead (`ep = dp_shard_in_ep
            x cp x tp`): each routes and sends only its own sequence shard's tokens, to whole experts. Read
            only when `ep > 1` (as torchtitan reads it): with `ep = 1` TP splits the experts either way.
    """

    dp_replicate: int = 1
    dp_shard: int = -1
    cp: int = 1
    tp: int = 1
    pp: int = 1
    world_size: int = 1
    ep: int = 1
    etp: int = -1

    def __post_init__(self) -> None:
        at_least(1, dp_replicate=self.dp_replicate, cp=self.cp, tp=self.tp, pp=self.pp, world_size=self.world_size)
        if self.dp_shard == 0 or self.dp_shard < -1:
            raise ParallelConfigError(
                f"dp_shard={self.dp_shard} must be >= 1, or -1 for what the other degrees leave of the world size",
                arguments=("dp_shard",),
            )
        others = [(n, getattr(self, n)) for n in ("dp_replicate", "cp", "tp", "pp") if getattr(self, n) > 1]
        product = math.prod(v for _, v in others)
        if self.dp_shard == -1:
            if self.world_size % product:
                raise ParallelConfigError(
                    f"the world size {self.world_size} is not divisible by {_product(others)}; "
                    "change these degrees or the number of processes",
                    arguments=tuple(n for n, _ in others),
                )
            object.__setattr__(self, "dp_shard", self.world_size // product)
        named = [("dp_shard", self.dp_shard), *others]
        if product * self.dp_shard != self.world_size:
            raise ParallelConfigError(
                f"{_product(named)} but the world size is {self.world_size}; "
                f"set dp_shard=-1 (the rest) or launch {product * self.dp_shard} processes",
                arguments=tuple(n for n, _ in named),
            )
        at_least(1, ep=self.ep)
        if self.etp == -1:
            object.__setattr__(self, "etp", self.tp)
        if self.etp not in (1, self.tp):
            raise ParallelConfigError(
                f"etp={self.etp} must be tp={self.tp} (TP splits each expert) or 1 (the TP ranks join expert "
                "parallel); set one of them",
                arguments=("etp", "tp"),
            )
        if self.ep_spans_tp:
            inner = self.cp * self.tp
            if self.ep % inner or self.dp_shard % (self.ep // inner):
                raise ParallelConfigError(
                    f"ep={self.ep} must be cp={self.cp} x tp={self.tp} times a divisor of dp_shard={self.dp_shard}: "
                    "under etp=1 expert parallel is carved from the FSDP x context-parallel x tensor-parallel "
                    f"ranks; change ep (or dp_shard, cp), or set etp={self.tp}",
                    arguments=("ep", "cp", "tp", "dp_shard", "etp"),
                )
        elif self.ep > 1 and (self.ep % self.cp or self.dp_shard % (self.ep // self.cp)):
            raise ParallelConfigError(
                f"ep={self.ep} must be cp={self.cp} times a divisor of dp_shard={self.dp_shard}: expert parallel "
                "is carved from the FSDP x context-parallel ranks; change ep (or dp_shard, cp)",
                arguments=("ep", "cp", "dp_shard"),
            )

    @property
    def ep_spans_tp(self) -> bool:
        """Whether the tensor-parallel ranks are part of each expert-parallel group (`etp=1`, `tp > 1`)."""
        return self.ep > 1 and self.tp > 1 and self.etp == 1

    @property
    def dp_shard_in_ep(self) -> int:
        """FSDP ranks inside one expert-parallel group (`ep / cp`, `ep / (cp x tp)` under `etp=1`; 1 without
        expert parallel)."""
        if self.ep == 1:
            return 1
        return self.ep // (self.cp * self.tp) if self.ep_spans_tp else self.ep // self.cp

    @property
    def dp_shard_mod_ep(self) -> int:
        """FSDP ranks that hold the same experts: what shards the experts' weights (`dp_shard / dp_shard_in_ep`)."""
        return self.dp_shard // self.dp_shard_in_ep

    @property
    def dp(self) -> int:
        """Data-parallel degree: how many different batches are read per step."""
        return self.dp_replicate * self.dp_shard

    def build_mesh(self, device_type: str) -> ParallelMesh:
        """Create the 5-D mesh `(pp, dp_replicate, dp_shard, cp, tp)` (6-D with `dp_shard` split in two
        under expert parallel, see `titan_parallel.mesh`) and its flattened views.

        Args:
            device_type: "cuda" or "cpu"; the process group must be initialised.
        """
        from titan_parallel.mesh import init_parallel_mesh

        return init_parallel_mesh(self, device_type)


# ---- data parallel, context parallel, activation checkpointing, async TP ----------------------

DP_MODES = ("fsdp", "ddp")
ROTATE_METHODS = ("allgather", "rotate")
CP_METHODS = ("ring", "ulysses")
AC_MODES = ("none", "selective", "full", "memory_budget")


def check_data_parallel(dims: ParallelDims, dp_mode: str) -> None:
    """Raise unless `dp_mode` is known and, for DDP, the model is not sharded.

    DDP replicates whole models: it does not combine with FSDP shards, CP or TP.

    Args:
        dims: the parallel degrees (named by their field names in errors).
        dp_mode: "fsdp" (HSDP when `dims.dp_replicate > 1`) or "ddp".
    """
    if dp_mode not in DP_MODES:
        raise ParallelConfigError(f"dp_mode={dp_mode!r} is unknown; choose 'fsdp' or 'ddp'", arguments=("dp_mode",))
    sharded = [(n, getattr(dims, n)) for n in ("dp_shard", "cp", "tp") if getattr(dims, n) > 1]
    if dp_mode == "ddp" and sharded:
        raise ParallelConfigError(
            f"dp_mode='ddp' replicates whole models and does not combine with "
            f"{', '.join(f'{n}={v}' for n, v in sharded)}; set {' and '.join(n for n, _ in sharded)} to 1 "
            "and replicate with dp_replicate, or use dp_mode='fsdp'",
            arguments=("dp_mode", *(n for n, _ in sharded), "dp_replicate"),
        )


def check_cp(seq_len: int, cp: int, tp: int = 1) -> None:
    """Raise unless sequences of `seq_len` tokens split over context and sequence parallel.

    Context parallel cuts each sequence into `2 * cp` equal chunks (the head-tail
    layout), so `seq_len % (2 * cp) == 0`. Sequence parallel (on whenever tp > 1)
    then splits each rank's `seq_len / cp` tokens between the blocks into tp equal
    pieces, so `seq_len % (cp * tp) == 0`: DTensor does not pad an uneven sequence
    shard, and the next collective fails (seq_len 15 at tp 2 aborts in gloo,
    "Received data size doesn't match expected size").

    Args:
        seq_len: tokens per sequence, as the model sees them.
        cp: context parallel degree.
        tp: tensor parallel degree.
    """
    at_least(1, seq_len=seq_len, cp=cp, tp=tp)
    if cp > 1 and seq_len % (2 * cp):
        raise ParallelConfigError(
            f"seq_len={seq_len} is not divisible by 2 x cp={cp} = {2 * cp}: context parallel cuts each sequence "
            "into 2 chunks per rank; change seq_len or cp",
            arguments=("seq_len", "cp"),
        )
    if tp > 1 and seq_len % (cp * tp):
        named = [("cp", cp), ("tp", tp)] if cp > 1 else [("tp", tp)]
        raise ParallelConfigError(
            f"seq_len={seq_len} is not divisible by {_product(named)}: sequence parallel splits each sequence "
            f"into one piece per tensor-parallel rank; change seq_len or {' or '.join(n for n, _ in named)}",
            arguments=("seq_len", *(n for n, _ in named)),
        )


def check_rotate_method(cp_rotate_method: str, qk_head_dim: int | None = None, v_head_dim: int | None = None) -> None:
    """Raise unless `cp_rotate_method` is a known way for context parallel to exchange K/V that fits the model.

    Args:
        cp_rotate_method: "allgather" (gather K/V once) or "rotate" (pass K/V around a ring).
        qk_head_dim: the keys' head dim, where the values' differs (MLA); None = equal.
        v_head_dim: the values' head dim. "rotate" passes keys and values as one tensor, so
            it needs them equal.
    """
    if cp_rotate_method not in ROTATE_METHODS:
        raise ParallelConfigError(
            f"cp_rotate_method={cp_rotate_method!r} is unknown; choose 'allgather' or 'rotate'",
            arguments=("cp_rotate_method",),
        )
    if cp_rotate_method == "rotate" and qk_head_dim is not None and qk_head_dim != v_head_dim:
        raise ParallelConfigError(
            f"cp_rotate_method='rotate' passes keys and values around the ring as one tensor, but the model's key head "
            f"dim is {qk_head_dim} and its value head dim {v_head_dim}; use 'allgather'",
            arguments=("cp_rotate_method",),
        )


def check_cp_method(cp_method: str, n_heads: int | None = None, cp: int = 1, tp: int = 1) -> None:
    """Raise unless `cp_method` is a known context-parallel method that can split the model's heads.

    Args:
        cp_method: "ring" (ring attention: local queries against every rank's K/V, see
            `check_rotate_method`) or "ulysses" (all-to-alls from sequence shards to head shards and
            back around each attention core).
        n_heads: the model's query heads; None = not checked. Ulysses gives each rank
            `n_heads / (tp x cp)` of them (tensor parallel splits them first), so tp x cp must divide
            n_heads. Key/value heads need no rule: where cp does not divide a rank's KV heads, Ulysses
            repeats them (`titan_parallel.ulysses_attention`).
        cp: context parallel degree.
        tp: tensor parallel degree.
    """
    if cp_method not in CP_METHODS:
        raise ParallelConfigError(
            f"cp_method={cp_method!r} is unknown; choose 'ring' or 'ulysses'", arguments=("cp_method",)
        )
    if cp_method == "ulysses" and cp > 1 and n_heads is not None and n_heads % (cp * tp):
        named = [("cp", cp), ("tp", tp)] if tp > 1 else [("cp", cp)]
        raise ParallelConfigError(
            f"cp_method='ulysses' splits the attention heads over tp x cp ranks, but n_heads={n_heads} is not "
            f"divisible by {_product(named)}; change {' or '.join(n for n, _ in named)}, or use cp_method='ring'",
            arguments=("cp_method", "n_heads", *(n for n, _ in named)),
        )


def ulysses_kv_repeats(n_kv_heads: int, cp: int) -> int:
    """Copies of each key/value head Ulysses sends so that cp divides them: `cp / gcd(n_kv_heads, cp)`.

    Query heads are grouped by KV head, so with `n_heads % cp == 0` the block of query heads each rank
    gets reads exactly the KV copies it gets. 1 where cp divides the KV heads (no copies).

    Args:
        n_kv_heads: key/value heads on one rank (after tensor parallel).
        cp: context parallel degree.
    """
    repeats = 1
    while (n_kv_heads * repeats) % cp:  # = cp // math.gcd(n_kv_heads, cp), which Dynamo cannot trace on SymInts
        repeats += 1
    return repeats


def check_ac(
    ac_mode: str, ac_selective_option: str = "2", *, ac_memory_budget: float = 0.5, compile: bool | None = None
) -> None:
    """Raise unless the activation checkpointing mode and its options are known and can run.

    Args:
        ac_mode: "none", "selective", "full" or "memory_budget".
        ac_selective_option: "op" (keep the outputs of costly ops) or a positive int N
            as a string (checkpoint every Nth block); read under "selective" only,
            but checked always.
        ac_memory_budget: under "memory_budget", the share of the compiled blocks' activations to keep, in [0, 1].
        compile: whether the blocks are compiled, which "memory_budget" needs (its partitioner decides what is
            recomputed); None: not checked here (`apply_compile` applies the budget).
    """
    if ac_mode not in AC_MODES:
        raise ParallelConfigError(
            f"ac_mode={ac_mode!r} is unknown; choose 'none', 'selective', 'full' or 'memory_budget'",
            arguments=("ac_mode",),
        )
    option = str(ac_selective_option)
    if option != "op" and not (option.isdigit() and int(option) >= 1):
        raise ParallelConfigError(
            f"ac_selective_option={ac_selective_option!r} is neither 'op' nor a positive int (every Nth block)",
            arguments=("ac_selective_option",),
        )
    if ac_mode != "memory_budget":
        return
    if not 0.0 <= ac_memory_budget <= 1.0:
        raise ParallelConfigError(
            f"ac_memory_budget={ac_memory_budget} is outside [0, 1] (0 recomputes every activation it can, 1 "
            "keeps what the compiler keeps without a budget)",
            arguments=("ac_memory_budget",),
        )
    if compile is False:
        raise ParallelConfigError(
            "ac_mode='memory_budget' needs compile=True: the compiler's partitioner chooses what the compiled "
            "blocks recompute; compile the blocks, or choose ac_mode 'selective' or 'full'",
            arguments=("ac_mode", "compile"),
        )


MIN_CUT_BACKENDS = ("inductor", "aot_eager", "aot_eager_decomp_partition")
"""`torch.compile` backends whose AOTAutograd partitioner is min-cut, which an activation memory budget steers."""


def check_compile_backend(compile_backend: str | None, device_type: str, tp: int = 1, ac_mode: str = "none") -> None:
    """Raise unless the blocks can be compiled with `compile_backend`.

    Args:
        compile_backend: a registered `torch.compile` backend: "inductor", or e.g. "aot_eager" (AOTAutograd without
            code generation) or "eager" (Dynamo alone) to bisect a compile problem; None: the default
            (`titan_parallel.compile.compile_backend`: Inductor, "aot_eager" for TP on CPU).
        device_type: the device type the model runs on.
        tp: tensor parallel degree. On CPU Inductor's C++ code gives a tensor-parallel feed-forward wrong input
            gradients (torch 2.15; see `titan_parallel.compile`), so "inductor" is refused there.
        ac_mode: "memory_budget" needs a backend in `MIN_CUT_BACKENDS`.
    """
    if compile_backend is None:
        return
    if compile_backend != "inductor":
        from torch._dynamo import list_backends

        if compile_backend not in list_backends(exclude_tags=()):
            raise ParallelConfigError(
                f"compile_backend={compile_backend!r} is not a registered torch.compile backend; choose 'inductor', "
                "'aot_eager' or 'eager' (all: torch._dynamo.list_backends(exclude_tags=()))",
                arguments=("compile_backend",),
            )
    if compile_backend == "inductor" and device_type == "cpu" and tp > 1:
        raise ParallelConfigError(
            f"compile_backend='inductor' with tp={tp} on CPU: Inductor's C++ code gives a tensor-parallel "
            "feed-forward wrong input gradients; leave compile_backend unset (aot_eager there) or choose 'aot_eager'",
            arguments=("compile_backend", "tp", "device_type"),
        )
    if ac_mode == "memory_budget" and compile_backend not in MIN_CUT_BACKENDS:
        raise ParallelConfigError(
            f"ac_mode='memory_budget' needs a backend whose partitioner the budget steers "
            f"({', '.join(MIN_CUT_BACKENDS)}), not compile_backend={compile_backend!r}",
            arguments=("ac_mode", "compile_backend"),
        )


def check_async_tp(tp: int, device_type: str, compile: bool) -> None:
    """Raise unless async tensor parallel (`async_tp`) can run: tp > 1, on CUDA, with the blocks compiled.

    It overlaps TP collectives with matmuls inside compiled graphs on CUDA symmetric
    memory; the message names every requirement that is missing, and `async_tp`.

    Args:
        tp: tensor parallel degree.
        device_type: the device type the model runs on, e.g. "cuda".
        compile: whether the blocks are compiled.
    """
    missing = [
        (what, name)
        for what, name, lacking in (
            (f"tp > 1 (got tp={tp})", "tp", tp < 2),
            ("compile=True", "compile", not compile),
            (f"a CUDA device (device_type is {device_type!r})", "device_type", device_type != "cuda"),
        )
        if lacking
    ]
    if missing:
        raise ParallelConfigError(
            f"async_tp needs {' and '.join(w for w, _ in missing)}: it overlaps TP collectives with matmuls "
            "inside compiled graphs on CUDA; provide them or set async_tp=False",
            arguments=("async_tp", *(n for _, n in missing)),
        )
