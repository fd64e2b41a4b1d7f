"""Torch warnings a Titan command cannot act on, left out of its output (imports only `logging`, so that the CLI
installs the filters before any command loads torch)."""

from __future__ import annotations

import logging

__all__ = ["TORCH_NOISE", "DropStarting", "drop_torch_noise"]

TORCH_NOISE = (
    ("torch._library.opaque_object", "is_opaque_value is deprecated"),
    ("torch.utils.cpp_extension", "No CUDA runtime is found"),
    ("torch.utils._pytree", "<enum '"),
)
"""(logger, message start) of torch warnings a run cannot act on: torch 2.15's Dynamo calling its own deprecated
`is_opaque_value` when it compiles tensor-parallel blocks, once per rank; Inductor's CPU compile looking for CUDA
with torch's CUDA build on a host without a GPU; torch 2.15 saying, twice per process, that torchao (imported by
float8 or by `transformers` in `titan convert` and `titan eval`) registers its enums with the deprecated
`register_constant`."""


class DropStarting(logging.Filter):
    """A logging filter dropping the records whose message starts with `start`."""

    def __init__(self, start: str) -> None:
        super().__init__()
        self.start = start

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(self.start)


def drop_torch_noise() -> None:
    """Leave `TORCH_NOISE` out of every handler's output; installed once however often it is called."""
    for name, start in TORCH_NOISE:
        logger = logging.getLogger(name)
        if not any(isinstance(f, DropStarting) and f.start == start for f in logger.filters):
            logger.addFilter(DropStarting(start))
