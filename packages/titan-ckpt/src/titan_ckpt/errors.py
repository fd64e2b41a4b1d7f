"""`CheckpointError`: a checkpoint, or an argument about one, that cannot be used.

The message is one line: what is wrong and what to change, in this library's own
terms (the `CheckpointManager` / function parameters). `arguments` lists the
parameters the fix concerns, each named in the message as a whole word, so a
program that exposes them under other names (a config file's keys) can rewrite
the message for its users.
"""

from __future__ import annotations


class CheckpointError(ValueError):
    """A checkpoint that cannot be used, or arguments that cannot work; the message names the file and the fix.

    Args:
        message: one line: what is wrong and what to do, e.g. "... pick another with load_step=2".
        arguments: the parameters the fix concerns (e.g. `("load_step",)`), each a whole word of `message`.
    """

    def __init__(self, message: str, *, arguments: tuple[str, ...] = ()):
        super().__init__(message)
        self.arguments: tuple[str, ...] = tuple(arguments)


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """A checkpoint file or folder that does not exist (also a `FileNotFoundError`).

    The message names the path and the fix.

    Args:
        message: one line: what is missing and what to point to instead.
        arguments: the parameters the fix concerns, as for `CheckpointError`.
    """
