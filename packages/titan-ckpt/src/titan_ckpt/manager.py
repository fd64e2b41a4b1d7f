"""`CheckpointManager`: periodic, atomic, verifiable DCP checkpoints of a training run, and resume.

One step folder holds everything needed to continue a run exactly:

    step-N/.metadata, __<rank>_<i>.distcp   model weights and optimizer tensors (DCP, any layout)
    step-N/optimizer.json                   the optimizer's hyperparameters (lr, betas, ...)
    step-N/<name>.json                      each JSON state: lr_scheduler, dataloader, train_state, ...
    step-N/rng.json                         the torch RNG state
    step-N/manifest.json                    written last: every file's size and CRC-32

Saving: every rank writes into `step-N.tmp/`; once all data and DCP's metadata are on
disk, rank 0 writes the manifest and renames the folder to `step-N/` (see
`titan_ckpt.step_folders`). With `async_mode` the training loop waits only while the
state is copied to CPU memory ("staging", into buffers kept between saves: pinned ones
in `async_with_pinned_mem` on CUDA); the files are written in a background thread over
a dedicated gloo group, and the folder is completed at a later step (or at `close`).

Loading: the newest complete `step-N` (or `load_step`) is checked file by file against
its manifest, split over the ranks, then restored into any layout (DCP reshards); with
none, `initial_load_path` is used. Non-tensor state never goes through DCP's pickles.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn

from titan_ckpt import model_state as ms
from titan_ckpt.argument_checks import RESERVED_STATES, AsyncMode, check_arguments
from titan_ckpt.background import BackgroundSaver
from titan_ckpt.dcp_io import ChecksummingWriter
from titan_ckpt.errors import CheckpointError
from titan_ckpt.json_states import (
    JsonStateful,
    TensorStateful,
    rng_state_dict,
    to_json_text,
    write_json_state,
)
from titan_ckpt.manifest import MANIFEST_FILE, read_manifest, write_manifest
from titan_ckpt.options import CheckpointOptions, one_form
from titan_ckpt.restore import load_states, verify_step_folder
from titan_ckpt.step_folders import list_complete_steps, prune, publish, remove_tmp_folders, step_folder, tmp_folder

logger = logging.getLogger("titan")

LoadModelFn = Callable[[Path], Mapping[str, torch.Tensor]]
"""Reads full model weights (the model's own parameter names, unsharded) from a checkpoint in another format."""
SaveModelFn = Callable[[Path, Mapping[str, torch.Tensor]], None]
"""Writes the last model-only save in another format into a folder; called on every rank with its
parts' full weights (under pipeline parallel, only its stages')."""


class CheckpointManager:
    """Saves and restores a run's model, optimizer, JSON states and RNG with torch.distributed.checkpoint.

    Every rank constructs it (it creates a gloo process group) and calls `load`, `save` and `close`
    at the same points.

    Args:
        folder: the run's checkpoint folder; it holds the `step-N` folders (or `options.folder`).
        model_parts: the model, or this rank's pipeline stages (FSDP/TP-sharded or not).
        optimizers: one per model part.
        states: JSON states by name, e.g. {"lr_scheduler": ..., "dataloader": ..., "train_state": ...}:
            objects whose `state_dict()` is plain JSON data, the same on every rank.
        tensor_states: tensor states by name (`TensorStateful`, e.g. {"ema": ...}): their tensors (DTensors
            resharded as the model's) saved under `<name>.<key>`, in model-only saves too (in `export_dtype`),
            and loaded back in place; a checkpoint without one leaves it as it is (logged).
        device: the device the run computes on (picks the RNG state to save).
        options: `folder` and every setting below but the two functions, as one value
            (`CheckpointOptions`); pass either it or `folder` and the setting keywords, not both.
        enable: when False, `load` restores nothing and `save` writes nothing.
        interval: save every this many steps (and at the last step).
        save_first_step: also save after step 1 (an early proof that saving works, and a state to go back to).
        load_only: load as set, never save (e.g. evaluating or debugging from a checkpoint).
        keep_latest_k: keep this many newest complete checkpoints; 0 keeps all.
        keep_interval: also keep every checkpoint whose step is a multiple of this (milestones, e.g. to
            branch a learning-rate decay from later), which `keep_latest_k` never removes; 0: none. A
            multiple of `interval`, so that those steps are saved.
        async_mode: "disabled", "async" (stage into CPU buffers reused between saves, write in a
            background thread) or "async_with_pinned_mem" (the buffers are pinned memory, for fast
            device-to-host copies; on a CPU-only run the same as "async").
        last_save_model_only: the last step saves only the model weights (plus the small JSON states).
        export_dtype: dtype of the weights in that model-only save.
        load_step: step to resume from; -1 = the newest complete one.
        exclude_from_loading: states not restored, from "model", "optimizer", "rng" and the `states` and
            `tensor_states` names.
        initial_load_path: a checkpoint to start from when `folder` has none.
        initial_load_model_only: load only the model weights from `initial_load_path`.
        load_model_fn: reads `initial_load_path` (or an externally saved step) as full weights,
            for formats other than DCP (e.g. Hugging Face safetensors); called on rank 0 only, which hands each
            tensor to the other ranks in turn (one copy of the weights in host memory, not one per rank).
        save_model_fn: writes the last model-only save in another format instead of DCP.
        checksums: record and check CRC-32 of every file (else sizes only).

    Raises:
        CheckpointError: an argument that cannot work; `arguments` names it.
        RuntimeError: torch.distributed is not initialised.
    """

    def __init__(
        self,
        folder: str | Path | None = None,
        *,
        model_parts: Sequence[nn.Module],
        optimizers: Sequence[torch.optim.Optimizer] = (),
        states: Mapping[str, JsonStateful] | None = None,
        tensor_states: Mapping[str, TensorStateful] | None = None,
        device: torch.device = torch.device("cpu"),
        options: CheckpointOptions | None = None,
        enable: bool = True,
        interval: int = 500,
        save_first_step: bool = False,
        load_only: bool = False,
        keep_latest_k: int = 10,
        keep_interval: int = 0,
        async_mode: AsyncMode = "disabled",
        last_save_model_only: bool = False,
        export_dtype: torch.dtype = torch.float32,
        load_step: int = -1,
        exclude_from_loading: Sequence[str] = (),
        initial_load_path: str | Path | None = None,
        initial_load_model_only: bool = True,
        load_model_fn: LoadModelFn | None = None,
        save_model_fn: SaveModelFn | None = None,
        checksums: bool = True,
    ):
        keywords = CheckpointOptions(
            folder="" if folder is None else folder,
            enable=enable,
            interval=interval,
            save_first_step=save_first_step,
            load_only=load_only,
            keep_latest_k=keep_latest_k,
            keep_interval=keep_interval,
            async_mode=async_mode,
            last_save_model_only=last_save_model_only,
            export_dtype=export_dtype,
            load_step=load_step,
            exclude_from_loading=tuple(exclude_from_loading),
            initial_load_path=initial_load_path,
            initial_load_model_only=initial_load_model_only,
            checksums=checksums,
        )
        o = one_form(folder, options, keywords)
        self.options = o
        self.states = dict(states or {})
        self.tensor_states = dict(tensor_states or {})
        check_arguments(
            model_parts,
            optimizers,
            self.states,
            tensor_states=self.tensor_states,
            interval=o.interval,
            keep_latest_k=o.keep_latest_k,
            keep_interval=o.keep_interval,
            async_mode=o.async_mode,
            load_step=o.load_step,
            exclude_from_loading=o.exclude_from_loading,
        )
        if not dist.is_initialized():
            raise RuntimeError(
                "CheckpointManager needs torch.distributed initialised; "
                "call torch.distributed.init_process_group first "
                '(one process: init_process_group("gloo", store=torch.distributed.HashStore(), rank=0, world_size=1))'
            )
        self.folder = Path(o.folder)
        self.model_parts, self.optimizers = list(model_parts), list(optimizers)
        self.device, self.enable = device, o.enable
        self.interval, self.keep_latest_k, self.keep_interval = o.interval, o.keep_latest_k, o.keep_interval
        self.save_first_step, self.load_only = o.save_first_step, o.load_only
        self.last_save_model_only, self.export_dtype = o.last_save_model_only, o.export_dtype
        self.load_step, self.exclude = o.load_step, set(o.exclude_from_loading)
        self.initial_load_path = None if o.initial_load_path is None else Path(o.initial_load_path)
        self.initial_load_model_only = o.initial_load_model_only
        self.load_model_fn, self.save_model_fn = load_model_fn, save_model_fn
        self.checksums = o.checksums
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.async_mode: AsyncMode = o.async_mode
        if o.enable and o.async_mode == "async_with_pinned_mem" and not torch.cuda.is_available():
            logger.warning(
                "checkpoint: async_mode='async_with_pinned_mem' needs CUDA for pinned memory; "
                "this CPU-only run saves as 'async'"
            )
            self.async_mode = "async"
        self._background = BackgroundSaver(pinned=self.async_mode == "async_with_pinned_mem")
        self._pending: tuple[int, Future[Any], Path, dict] | None = None  # (step, future, tmp folder, manifest info)
        self.last_blocked_s = 0.0  # how long the last save held the training loop
        self._saved_step: int | None = None  # the step of the newest save started
        # Checkpoint collectives get their own gloo group: the background writer's
        # collectives must not interleave with the training loop's on the default group.
        self.pg: dist.ProcessGroup | None = None
        if o.enable:
            group = dist.new_group(backend="gloo")
            assert isinstance(group, dist.ProcessGroup)  # every rank is a member
            self.pg = group

    # ---- saving ---------------------------------------------------------------------------------

    def save(self, step: int, *, last_step: bool = False, force: bool = False) -> bool:
        """Call after every training step: saves when `step` is a multiple of `interval`, `last_step`, or step 1
        under `save_first_step`; never under `load_only`.

        Also completes a finished background save. Returns whether a save started.

        Args:
            step: the step just finished (1-based).
            last_step: this is the run's last step (saved synchronously; model-only if asked).
            force: save the full state now, synchronously, whatever the interval (e.g. before the
                job is preempted); a step already saved is not saved again.
        """
        if not self.enable or self.load_only:
            return False
        self._complete_pending(block=force)
        if force and self._saved_step == step:
            return False
        if not force and not self.due(step, last_step=last_step):
            return False
        model_only = last_step and self.last_save_model_only and not force
        dtype = self.export_dtype if model_only else None
        background = self.async_mode != "disabled" and not last_step and not force
        external = model_only and self.save_model_fn is not None
        self._save(step, model_only=model_only, dtype=dtype, background=background, with_json=True, external=external)
        return True

    def due(self, step: int, *, last_step: bool = False) -> bool:
        """Whether `save(step, last_step=...)` writes a checkpoint (enabled, not `load_only`, and `interval`, the
        last step or step 1 under `save_first_step`)."""
        saving = self.enable and not self.load_only
        return saving and (step % self.interval == 0 or last_step or (step == 1 and self.save_first_step))

    def save_seed(self) -> Path:
        """Save the freshly initialised model alone as `step-0` (a seed checkpoint, written by one
        process); every layout can start from it. Returns the folder.

        Raises:
            CheckpointError: the manager is disabled, or `folder` already holds checkpoints.
        """
        if not self.enable:
            raise CheckpointError("a seed checkpoint needs a manager with enable=True", arguments=("enable",))
        if self.load_only:
            raise CheckpointError(
                "a seed checkpoint needs a manager that saves, not load_only", arguments=("load_only",)
            )
        if list_complete_steps(self.folder):
            raise CheckpointError(
                f"{self.folder} already holds checkpoints; "
                "a seed checkpoint goes into an empty one: pick another folder",
                arguments=("folder",),
            )
        remove_tmp_folders(self.folder)  # one process: no other rank is writing
        self._save(0, model_only=True, dtype=None, background=False, with_json=False, external=False)
        return step_folder(self.folder, 0)

    def wait(self) -> None:
        """Block until a background save is on disk and its folder completed (rank 0 completes it:
        other ranks that read the folder afterwards wait for rank 0 first, e.g. with a barrier)."""
        self._complete_pending(block=True)

    def close(self) -> None:
        """Finish any background save; call once at the end of training (also after an error)."""
        if self.enable:
            self.wait()
        self._background.close()

    def _save(
        self,
        step: int,
        *,
        model_only: bool,
        dtype: torch.dtype | None,
        background: bool,
        with_json: bool,
        external: bool,
    ) -> None:
        """Write `step-N.tmp` (DCP, in the background when asked; or the model through `save_model_fn`).

        Then complete it (rename to `step-N` once written).
        """
        self.wait()  # one save in flight at a time
        self._saved_step = step
        start = time.perf_counter()
        tmp = tmp_folder(self.folder, step)
        tensors, texts = self._collect(model_only, dtype, with_dcp=not external, with_json=with_json)
        info = {
            "step": step,
            "contents": sorted(["model", *texts, *([] if external else self.tensor_states)]),
            "model_only": model_only,
            "model_format": "external" if external else "dcp",
            "weights_dtype": str(dtype or next(self.model_parts[0].parameters()).dtype).removeprefix("torch."),
            "world_size": self.world_size,
        }
        if self.rank == 0:
            tmp.mkdir(parents=True, exist_ok=True)
            for name, text in texts.items():
                write_json_state(tmp, name, text)
        if external:
            assert self.save_model_fn is not None  # `external` means there is one
            dist.barrier(group=self.pg)  # the folder exists before any rank writes into it
            self.save_model_fn(tmp, ms.get_full_model_state(self.model_parts, dtype))
            dist.barrier(group=self.pg)
        elif background:
            writer = ChecksummingWriter(tmp, rank=self.rank, checksums=self.checksums)
            future = self._background.save(tensors, writer, self.pg)
            self._pending = (step, future, tmp, info)
            self.last_blocked_s = time.perf_counter() - start
            if self.rank == 0:
                logger.info(
                    "checkpoint: step-%d staged in %.2f s, writing in the background", step, self.last_blocked_s
                )
            return
        else:
            writer = ChecksummingWriter(tmp, rank=self.rank, checksums=self.checksums)
            dcp.save(tensors, checkpoint_id=str(tmp), storage_writer=writer, process_group=self.pg)
        self._finish(step, tmp, info, start)
        self.last_blocked_s = time.perf_counter() - start

    def _collect(
        self, model_only: bool, dtype: torch.dtype | None, *, with_dcp: bool, with_json: bool
    ) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
        """The tensors of a save by DCP key and its JSON texts by state name.

        The tensors are the live ones: DCP stages or writes them.
        """
        tensors: dict[str, torch.Tensor] = {}
        if with_dcp:
            for state in ms.get_part_states(self.model_parts):
                tensors.update(
                    {k: v.to(dtype) if dtype is not None and v.is_floating_point() else v for k, v in state.items()}
                )
        if with_dcp:  # in model-only saves too: weights such as an average of the model's
            for name, obj in self.tensor_states.items():
                tensors.update(
                    {
                        f"{name}.{k}": v.to(dtype) if dtype is not None and v.is_floating_point() else v
                        for k, v in obj.state_dict().items()
                    }
                )
        texts = {}
        if not model_only:
            opt_states = ms.get_optimizer_states(self.model_parts, self.optimizers)
            tensors.update(ms.flatten_optimizer_tensors(opt_states))
            texts["optimizer"] = to_json_text("optimizer", {"param_groups": ms.param_group_settings(opt_states[0])})
        if with_json:
            texts.update({name: to_json_text(name, obj.state_dict()) for name, obj in self.states.items()})
            texts["rng"] = to_json_text("rng", rng_state_dict(self.device))
        return tensors, texts

    def _complete_pending(self, block: bool) -> None:
        """Complete the background save if it is done (or, with `block`, once it is)."""
        if self._pending is None:
            return
        step, future, tmp, info = self._pending
        if not block and not future.done():
            return
        self._pending = None
        future.result()  # re-raises a failed background write
        self._finish(step, tmp, info, None)

    def _finish(self, step: int, tmp: Path, info: dict, start: float | None) -> None:
        """Rank 0: manifest, rename `step-N.tmp` -> `step-N`, drop old checkpoints."""
        if self.rank != 0:
            return
        manifest = write_manifest(tmp, info, self.checksums)
        publish(tmp, step_folder(self.folder, step))
        removed = prune(self.folder, self.keep_latest_k, self.keep_interval)
        size = sum(entry["bytes"] for entry in manifest["files"].values())
        took = f" in {time.perf_counter() - start:.2f} s" if start is not None else ""
        logger.info(
            "checkpoint: saved %s (%s, %.1f MB)%s%s",
            step_folder(self.folder, step),
            "model only" if info["model_only"] else "full",
            size / 1e6,
            took,
            f"; removed step {', '.join(map(str, removed))} (keep_latest_k={self.keep_latest_k}"
            + (f", keep_interval={self.keep_interval})" if self.keep_interval else ")")
            if removed
            else "",
        )

    # ---- loading --------------------------------------------------------------------------------

    def load(self) -> int | None:
        """Restore the newest complete checkpoint (or `load_step`); with none, `initial_load_path`.

        Unfinished `step-N.tmp` folders are removed first, except under `load_only` (another run may be
        writing them). Returns the step restored (0 for an initial load), or None when the run starts fresh.

        Raises:
            CheckpointError: `load_step` not found, or a file missing, truncated or corrupt (named).
        """
        if not self.enable:
            return None
        if self.rank == 0 and not self.load_only:
            remove_tmp_folders(self.folder)
        step = self._choose_step()
        if step is not None:
            self._restore(step_folder(self.folder, step), set(self._all_states()) - self.exclude, verified=True)
            return step
        if self.initial_load_path is None:
            if self.rank == 0:
                logger.info("checkpoint: none in %s, starting fresh", self.folder)
            return None
        self._load_initial(self.initial_load_path)
        return 0

    def restore_latest(self, *, exclude: Sequence[str] = ()) -> int | None:
        """Reload the newest complete checkpoint into the live run now, e.g. to roll back a diverged
        step; returns its step, or None when the folder holds none (nothing is changed then).

        Args:
            exclude: states not restored this time, on top of `exclude_from_loading` (e.g.
                "dataloader", so that the run goes on with the data after the diverged step).
        """
        if not self.enable:
            return None
        self.wait()
        dist.barrier(group=self.pg)  # rank 0 has completed (renamed) the folder of a background save
        step = self._choose_step(load_step=-1)
        if step is not None:
            names = set(self._all_states()) - self.exclude - set(exclude)
            self._restore(step_folder(self.folder, step), names, verified=True)
        return step

    def _all_states(self) -> list[str]:
        return [*RESERVED_STATES, *self.states, *self.tensor_states]

    def _choose_step(self, load_step: int | None = None) -> int | None:
        """Rank 0 picks the step (`load_step`, default the manager's; the ranks might list the folder
        at different moments); all get it."""
        load_step = self.load_step if load_step is None else load_step
        choice = torch.tensor([-1, 0], dtype=torch.int64)  # (step or -1, load_step not found)
        if self.rank == 0:
            steps = list_complete_steps(self.folder)
            if load_step == -1:
                choice[0] = steps[-1] if steps else -1
            elif load_step in steps:
                choice[0] = load_step
            else:
                choice[1] = 1
        dist.broadcast(choice, src=0, group=self.pg)
        if choice[1]:
            steps = list_complete_steps(self.folder)
            raise CheckpointError(
                f"load_step={self.load_step} but {self.folder} has no complete step-{self.load_step}; "
                f"complete checkpoints: {steps or 'none'}; set load_step to one of them, or -1 for the newest",
                arguments=("load_step",),
            )
        return None if choice[0] < 0 else int(choice[0])

    def _load_initial(self, path: Path) -> None:
        """Start from `initial_load_path`: another format through `load_model_fn`, or a DCP folder."""
        names = {"model"} if self.initial_load_model_only else set(self._all_states()) - self.exclude
        if (read := self.load_model_fn) is not None:
            ms.set_full_model_state(self.model_parts, lambda: read(path), str(path), self.pg)
            if self.rank == 0:
                logger.info("checkpoint: initial model weights loaded from %s", path)
            return
        if not (path / ".metadata").is_file():
            raise CheckpointError(
                f"initial_load_path={path} is not a DCP checkpoint folder (no .metadata); point it to a step-N folder, "
                "or set load_model_fn to read another format (e.g. Hugging Face safetensors)",
                arguments=("initial_load_path", "load_model_fn"),
            )
        verified = (path / MANIFEST_FILE).is_file()
        if not verified and names != {"model"}:
            raise CheckpointError(
                f"initial_load_path={path} has no {MANIFEST_FILE}, so only its model weights can be loaded; "
                "set initial_load_model_only=True",
                arguments=("initial_load_path", "initial_load_model_only"),
            )
        if not verified and self.rank == 0:
            logger.warning("checkpoint: %s has no %s; its files are not verified", path, MANIFEST_FILE)
        self._restore(path, names, verified=verified)

    def _restore(self, folder: Path, names: set[str], verified: bool) -> None:
        """Load the `names` states that `folder` holds into the live objects."""
        start = time.perf_counter()
        if verified:
            manifest = read_manifest(folder)
            verify_step_folder(self.folder, folder, manifest, self.checksums, self.pg)
            contents, external = set(manifest.get("contents", ())), manifest.get("model_format") == "external"
        else:
            contents, external = {"model"}, False
        absent = sorted(names - contents)
        names &= contents
        if absent and self.rank == 0:
            logger.warning(
                "checkpoint: %s holds no %s state (model-only save?); those start fresh", folder, ", ".join(absent)
            )
        load_states(
            folder,
            names,
            external=external,
            model_parts=self.model_parts,
            optimizers=self.optimizers,
            states=self.states,
            device=self.device,
            pg=self.pg,
            load_model_fn=self.load_model_fn,
            tensor_states=self.tensor_states,
        )
        if self.rank == 0:
            excluded = sorted(set(self._all_states()) - names - set(absent))
            skipped = f"; not loaded: {', '.join(excluded)}" if excluded else ""
            logger.info(
                "checkpoint: loaded %s (%s) in %.2f s%s",
                folder,
                ", ".join(sorted(names)),
                time.perf_counter() - start,
                skipped,
            )
