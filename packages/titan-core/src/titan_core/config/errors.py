"""The error types of Titan's config and inputs: each is told in one line, with no traceback.

`ConfigError` is the one type; the other two are also the built-in error a library
caller would catch for the same fault (`except ImportError`, `except FileNotFoundError`).
"""


class ConfigError(ValueError):
    """A config problem, told in one line that names the key (or file) and the fix."""


class MissingPackageError(ConfigError, ImportError):
    """An optional package the config needs is not installed; the message names the key and the `pip install`."""


class MissingFileError(ConfigError, FileNotFoundError):
    """A file or folder a key names does not exist; the message names the key and what to point it at."""
