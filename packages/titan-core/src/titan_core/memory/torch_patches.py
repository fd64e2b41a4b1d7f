"""Every change the memory estimates make to torch's behaviour, in one module, each with its reason.

The analytic tier measures blocks on fake tensors as a CUDA target runs them, without a GPU
(`titan_core.memory.fake_run`); two patches make that possible, for the measurement's duration:

- `cuda_devices_without_gpu`: `torch.cuda.device_count`, `is_available` and `set_device` answer as
  a node of that many GPUs would, so that `DeviceMesh` builds a CUDA mesh over a fake process group.
- `as_hopper`: `torch.cuda.get_device_capability` answers (9, 0), so that bf16 experts take
  `torch._grouped_mm` as on an H100, and `F.scaled_dot_product_attention` is the given function
  (`fake_run._cuda_sdpa`: cuDNN's, flash's or the memory-efficient kernel, as an H100 picks), since
  SDPA's own choice asks the GPU and without one falls to the math path no GPU runs.

The traced tier (`titan_core.memory.traced`) runs the real `Trainer` on fake tensors. Four of
torch's habits stand in its way there; each is undone only inside the trace, by the context
managers and the tracker below, and restored on exit. Written against torch 2.15 and run on
torch 2.11 (2026-11-26); where a private name they use is missing, the trace fails with
torch's own error and `titan estimate-memory` says so.

- `building`: while the model builds, the fake mode's tensor memo
  (`fake_tensor_converter.meta_converter.tensor_memo`, private) is a plain dict, because
  `Module.to_empty` refuses to swap a parameter the weak-value memo refers to; and
  `torch.nn.init`'s public initialisers are no-ops (`titan_core.job.meta_model.skip_init`):
  `trunc_normal_` asks a fake tensor for a Python bool.
- `real_device_meshes`: `DeviceMesh.__init__` (a public class's method) runs outside the fake
  mode: FSDP2 over a TP-sharded model builds a joined mesh whose constructor calls `nonzero` on
  its rank tensor, a data-dependent shape a fake tensor cannot know.
- `own_propagation_mode`: `torch.distributed.tensor._sharding_prop.detect_fake_mode` (private)
  returns a mode of its own: DTensor propagates shardings on global-shape fake tensors in the
  active fake mode, which the tracker would count as memory of the step.
- `peak_tracker`, `allow_repeated_forwards`, `pipeline_tracker`: `MemTracker._update_peak_stats`
  and `MemTracker._track` are overridden, `MemTracker._pre_fw_hook` wrapped and, under a pipeline
  schedule, `MemTracker._mod_tracker` replaced (private): the per-module peaks cost most of the
  trace's time, the tracker refuses a root module's second forward (gradient accumulation), its
  module hooks fail inside the `torch.autograd.grad` a pipeline stage runs, and torch 2.11's
  tracker counts the tensors of ops run under another fake mode than its own (below). The
  measured tier (`titan_core.memory.measure_run`) uses these trackers on CPU too.

Both estimating tiers also run torch under `quiet_torch_logs`: torch's logged warnings there (DTensor's
advice on redistributions in the trace; when the analytic tier compiles a selective-AC block, the warning
that the checkpointed region must not hold in-place ops) speak of the run, which the user sees when it runs.

Torch 2.11's `MemTracker` counts every op's outputs, those of an op run under a fake mode that
was not active when the tracker was entered included: the fake tensors Dynamo makes while it
compiles (the master-weight optimizer step, the loss) and those of DTensor's sharding
propagation. The single-rank bf16 debugmodel run so read 176 MiB where the CPU allocator held
92 (its optimizer states three times over), full AC 132 MiB against 89. Later torch skips those
ops itself (`MemTracker._fake_mode_on_entry`); `peak_tracker` skips them on every version.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any
from unittest import mock


@contextlib.contextmanager
def quiet_torch_logs() -> Iterator[None]:
    """torch's loggers below ERROR dropped inside the block (see the module docstring), restored on exit."""
    import logging

    torch_logger = logging.getLogger("torch")
    level = torch_logger.level
    torch_logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        torch_logger.setLevel(level)


@contextlib.contextmanager
def cuda_devices_without_gpu(count: int) -> Iterator[None]:
    """CUDA's device queries answered as a node of `count` GPUs would (no GPU is touched)."""
    with (
        mock.patch("torch.cuda.device_count", return_value=count),
        mock.patch("torch.cuda.is_available", return_value=True),
        mock.patch("torch.cuda.set_device"),
    ):
        yield


@contextlib.contextmanager
def as_hopper(sdpa: Callable[..., Any]) -> Iterator[None]:
    """Compute capability 9.0, and `sdpa` as `F.scaled_dot_product_attention`."""
    with (
        mock.patch("torch.cuda.get_device_capability", return_value=(9, 0)),
        mock.patch("torch.nn.functional.scaled_dot_product_attention", sdpa),
    ):
        yield


@contextlib.contextmanager
def building(mode) -> Iterator[None]:
    """`mode` while the trainer builds, with two of torch's fake-tensor habits undone for that time.

    `nn.init`'s initialisers are skipped (their values do not matter, and `trunc_normal_`
    asks a fake tensor for a Python bool); device meshes are built from real tensors
    (`_real_device_meshes`). The fake mode memoises every tensor it makes in a
    weak-value dict, and `Module.to_empty` refuses to swap a parameter that has a weak
    reference: while building, the memo is a plain dict (dropped after, nothing is tracked yet).
    """
    from titan_core.job.meta_model import skip_init

    converter = mode.fake_tensor_converter.meta_converter
    memo = converter.tensor_memo
    converter.tensor_memo = {}
    try:
        with mode, skip_init(), real_device_meshes():
            yield
    finally:
        converter.tensor_memo = memo


@contextlib.contextmanager
def real_device_meshes() -> Iterator[None]:
    """Build every `DeviceMesh` from real tensors, outside the fake mode.

    FSDP2 over a TP-sharded model joins the two meshes into a new `DeviceMesh`, whose
    constructor finds this rank's coordinates with `nonzero` on its rank tensor: an
    output shape a fake tensor cannot know. The trainer's own mesh is made by
    `titan_parallel.mesh.init_parallel_mesh` (torch's `init_device_mesh` makes its rank
    tensor before the constructor runs), which runs outside the fake mode too. A mesh is a
    few integers, not memory of the step.
    """
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from torch.distributed.device_mesh import DeviceMesh

    import titan_parallel.mesh as titan_mesh

    init, init_parallel = DeviceMesh.__init__, titan_mesh.init_parallel_mesh

    def real_init(self, *args, **kwargs):
        with unset_fake_temporarily():
            init(self, *args, **kwargs)

    def real_parallel_mesh(*args, **kwargs):
        with unset_fake_temporarily():
            return init_parallel(*args, **kwargs)

    # Patching the constructors for the trace is the point; restored below.
    DeviceMesh.__init__ = real_init  # type: ignore[method-assign]
    titan_mesh.init_parallel_mesh = real_parallel_mesh
    try:
        yield
    finally:
        DeviceMesh.__init__ = init  # type: ignore[method-assign]
        titan_mesh.init_parallel_mesh = init_parallel


def peak_tracker():
    """A `MemTracker` that keeps the global peak (by category) and not its per-module peaks.

    After every op `MemTracker` walks every module it has seen to update their own peaks:
    for an 8B model that is most of the trace's time (hundreds of modules x tens of thousands
    of ops). The estimate needs only the global peak, which this keeps exactly as
    `MemTracker` does. It counts the ops of the fake mode active when it is entered only
    (none in eager), as torch does from 2.12 (module docstring); where this torch's tracker
    lacks the fields it reads, the tracker is torch's own, unchanged.
    """
    from copy import deepcopy

    from torch._guards import active_fake_mode
    from torch.distributed._tools import mem_tracker

    class PeakTracker(mem_tracker.MemTracker):
        def __enter__(self):
            if self._depth == 0:  # the fake mode of the ops to count: None in eager, the trace's own when tracing
                self._titan_entry_mode = active_fake_mode()
            return super().__enter__()

        def _track(self, reftype, t) -> None:
            if active_fake_mode() is self._titan_entry_mode:
                super()._track(reftype, t)

        def _update_peak_stats(self, peak_state) -> None:
            for device, snapshot in self._curr_mem_snap.items():
                if self._peak_mem.get(device, 0) < snapshot[mem_tracker._TOTAL_KEY]:
                    self._peak_mem[device] = snapshot[mem_tracker._TOTAL_KEY]
                    self._peak_mem_snap[device] = deepcopy(snapshot)

    tracker = PeakTracker()
    fields = ("_curr_mem_snap", "_peak_mem", "_peak_mem_snap", "_depth", "_track")
    if not hasattr(mem_tracker, "_TOTAL_KEY") or not all(hasattr(tracker, f) for f in fields):
        return mem_tracker.MemTracker()
    return tracker


def allow_repeated_forwards(tracker, roots) -> None:
    """Let `tracker` see a model part's forward more than once per step (gradient-accumulation micro-batches).

    `MemTracker` keeps per-module statistics and refuses a second forward of a top-level module
    ("multiple iterative calls"); the trace needs only its global peak, so the module
    statistics are cleared whenever a root module starts its forward again, and a top-level module's
    own when it is called again within a step (the fused loss's head, per multi-token-prediction depth).
    """
    roots = {id(module) for module in roots}
    track = tracker._pre_fw_hook

    def pre_forward(module, inputs):
        if module in tracker.memory_tracking and not tracker._mod_tracker.is_bw:
            if id(module) in roots:
                tracker.reset_mod_stats()
            elif set(tracker._mod_tracker.parents) - {tracker._mod_tracker.get_known_fqn(module)} == {"Global"}:
                # Another top-level module called again in the step: the fused loss's output projection, once for
                # the main rows and once per multi-token-prediction depth. Its own statistics start over.
                del tracker.memory_tracking[module]
        track(module, inputs)

    tracker._pre_fw_hook = pre_forward  # read when the tracker is entered and registers its hooks


@contextlib.contextmanager
def own_propagation_mode() -> Iterator[None]:
    """Give DTensor's sharding propagation its own fake mode, as it has outside a fake mode.

    DTensor works out each op's output shape by running it on global-shape fake tensors in
    the active fake mode; the tracker skips ops of a fake mode other than the one it was
    entered in, but under the trace's own mode it would count those tensors (an unsharded
    copy of every argument of every optimizer op).
    """
    import torch.distributed.tensor._sharding_prop as sharding_prop
    from torch._subclasses.fake_tensor import FakeTensorMode

    own = FakeTensorMode()
    saved = sharding_prop.detect_fake_mode
    sharding_prop.detect_fake_mode = lambda *args: own
    try:
        yield
    finally:
        sharding_prop.detect_fake_mode = saved


def pipeline_tracker() -> Any:
    """`peak_tracker()` without module hooks, which fail under a pipeline schedule.

    `MemTracker` follows the modules with torch's `ModTracker`, whose backward hooks fail inside
    the `torch.autograd.grad` a pipeline stage runs ("A leaf node was passed to
    _will_engine_execute_node ...", torch 2.15). The global peak does not need them: with no
    module tracking every storage is still counted from the op that makes it to its free, and
    only the split between activations, gradients and temporaries is lost (all are counted as
    activations; parameters, buffers and optimizer states keep their categories).
    """

    class NoModules:
        is_bw = False
        parents: set[str] = set()

        def register_user_hooks(self, *hooks: Any) -> None:
            return None

        def clear_user_hooks(self) -> None:
            return None

        def __enter__(self) -> NoModules:
            return self

        def __exit__(self, *args: Any) -> None:
            return None

    tracker = peak_tracker()
    tracker._mod_tracker = NoModules()
    return tracker
