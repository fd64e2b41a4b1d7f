"""The error types of Titan's config and inputs: each is told in one line, with no traceback.

`ConfigError` is the one type; the other two are also the built-in error a library
caller would catch for the same fault (`except ImportError`, `except FileNotFoundError`).
"""


class ConfigError(ValueError):
    """A config problem, told in one line that names the key (or file) and the fix.

    Args:
        message: the line.
        keys: the config keys the message names as the ones to change, where known (e.g. a
            library error's arguments looked up by `titan_core.job.naming.config_error`).
    """

    def __init__(self, message: str = "", *, keys: tuple[str, ...] = ()):
        super().__init__(message)
        self.keys: tuple[str, ...] = tuple(keys)


class MissingPackageError(ConfigError, ImportError):
    """An optional package the config needs is not installed; the message names the key and the `pip install`."""


class MissingFileError(ConfigError, FileNotFoundError):
    """A file or folder a key names does not exist; the message names the key and what to point it at."""
