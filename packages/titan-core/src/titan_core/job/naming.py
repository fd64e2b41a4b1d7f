"""A library's error as a config error: the keys to change are found by lookup, never by rewriting text.

titan-parallel and titan-ckpt name the arguments at fault in their own terms, as
data (`ParallelConfigError.arguments`, `CheckpointError.arguments`). The caller
of the library knows which config key set each argument: every rule declares a
table (`Rule.keys`), made from the options tables of `titan_core.job.options`.
`config_error` keeps the library's message as it is and adds the keys:

    tp=3 does not divide n_heads=16; choose a tp that divides it (tp set by parallelism.tensor_parallel_degree)

An argument one library name gives two keys (`recipe_name` of [float8] and [mx],
`enable`, `folder`, `interval`) is looked up only in the table of the call that
raised it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping

from titan_core.config.errors import ConfigError
from titan_core.job.options import CHECKPOINT_KEYS, DEVICE_KEY, DIMS_KEYS, PARALLEL_OPTION_KEYS, PIPELINE_KEYS

RUN_KEYS: dict[str, str] = {
    "seq_len": "training.seq_len",
    "local_batch_size": "training.local_batch_size",
    "device": DEVICE_KEY,
    "device_type": DEVICE_KEY,
    "n_layers": "model.flavor",
    "n_heads": "model.flavor",
}
"""Arguments of titan-parallel's rules that are neither a degree nor an option: the run's shape and device."""

PARALLEL_KEYS: dict[str, str] = {**DIMS_KEYS, **PARALLEL_OPTION_KEYS, **PIPELINE_KEYS, **RUN_KEYS}
"""A `ParallelConfigError` raised outside a rule (while the trainer builds the run): what titan-parallel's
`parallelize`, `build_pipeline` and `resolve_device` take. The float8 / MXFP8 names are left out: they are
ambiguous outside their rule."""


def library_keys(error: BaseException) -> Mapping[str, str]:
    """The table for an error raised outside a rule, by the library that raised it.

    Args:
        error: a `ParallelConfigError` (`PARALLEL_KEYS`) or `CheckpointError` (`CHECKPOINT_KEYS`); others: none.
    """
    from titan_ckpt import CheckpointError
    from titan_parallel import ParallelConfigError

    if isinstance(error, CheckpointError):
        return CHECKPOINT_KEYS
    if isinstance(error, ParallelConfigError):
        return PARALLEL_KEYS
    return {}


def config_error(error: BaseException, keys: Mapping[str, str] | None = None, *, prefix: str = "") -> ConfigError:
    """`error`'s message, unchanged, followed by the config key behind each argument it names.

    Args:
        error: a library error carrying `arguments` (the parameter or field names at fault).
        keys: argument -> config key, the table of the call that raised `error`; None: `library_keys(error)`.
        prefix: put before the message (e.g. the key that chose the library call).

    Returns:
        A `ConfigError`, one line: `"<prefix><message> (tp set by parallelism.tensor_parallel_degree, ...)"`;
        its `keys` attribute holds the keys named, in order.
    """
    table = library_keys(error) if keys is None else keys
    arguments = dict.fromkeys(getattr(error, "arguments", ()))  # in order, once each
    named = {argument: table[argument] for argument in arguments if argument in table}
    sources = ", ".join(f"{argument} set by {key}" for argument, key in named.items())
    return ConfigError(
        f"{prefix}{error}" + (f" ({sources})" if sources else ""), keys=tuple(dict.fromkeys(named.values()))
    )


@contextlib.contextmanager
def naming(keys: Mapping[str, str], *, prefix: str = "") -> Iterator[None]:
    """Raise a library error from the block as `config_error(error, keys, prefix=prefix)`.

    Args:
        keys: argument -> config key for the library calls in the block.
        prefix: put before the message.
    """
    from titan_ckpt import CheckpointError
    from titan_parallel import ParallelConfigError

    try:
        yield
    except (ParallelConfigError, CheckpointError) as e:
        raise config_error(e, keys, prefix=prefix) from None
