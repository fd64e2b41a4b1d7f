"""A DCP save written in the background: the tensors staged into CPU memory, then written by DCP's thread.

    saver = BackgroundSaver(pinned=False)
    future = saver.save(tensors, writer, process_group)   # returns once staged; the write goes on
    future.result()                                        # on disk (re-raises a failed write)
    saver.close()

`dcp.async_save` stages through a `DefaultStager`. Torch 2.15 keeps the stager's CPU
buffers from one save to the next, so only the first save allocates them; torch 2.11's stager
closes itself after each staging (its copy table cleared: a second save with it failed with
"KeyError: <class 'type'>"), so there a new one stages each save.
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict_saver import AsyncSaveResponse

from titan_ckpt.dcp_io import ChecksummingWriter

__all__ = ["BackgroundSaver"]


class BackgroundSaver:
    """Background DCP saves, one at a time, with the CPU staging buffers kept between them where torch allows.

    Args:
        pinned: stage into pinned memory (faster device-to-host copies; needs CUDA).
    """

    def __init__(self, pinned: bool):
        self.pinned = pinned
        self._stager: DefaultStager | None = None

    def save(
        self, tensors: dict[str, torch.Tensor], writer: ChecksummingWriter, process_group: dist.ProcessGroup | None
    ) -> Future[Any]:
        """Stage `tensors` (returns once they are copied) and write them through `writer` in the background.

        Args:
            tensors: the save's tensors by DCP key (the live ones: staging copies them).
            writer: the storage writer of the step's folder.
            process_group: the group DCP's collectives run on (None: the default group).

        Returns:
            The future of the write: its result re-raises a failed write.
        """
        if self._stager is None:
            self._stager = DefaultStager(
                StagingOptions(
                    use_pinned_memory=self.pinned,
                    use_shared_memory=False,
                    use_async_staging=False,
                    use_non_blocking_copy=False,
                )
            )
        result = dcp.async_save(
            tensors,
            checkpoint_id=str(writer.path),
            storage_writer=writer,
            process_group=process_group,
            async_stager=self._stager,
        )
        if not _stages_again(self._stager):
            self._stager = None  # torch 2.11: it closed itself
        return result.upload_completion if isinstance(result, AsyncSaveResponse) else result

    def close(self) -> None:
        """Free the staging buffers."""
        if self._stager is not None:
            self._stager.close()
            self._stager = None


def _stages_again(stager: DefaultStager) -> bool:
    """Whether `stager` can stage another save: torch 2.11's closes its `StateDictStager` after each one,
    which empties the copy table that torch 2.15 keeps (both private; an unknown layout counts as reusable)."""
    inner = getattr(stager, "_state_dict_stager", None)
    table = getattr(inner, "_deepcopy_dispatch", None)
    return table is None or len(table) > 0
