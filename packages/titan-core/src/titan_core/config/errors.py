"""The one error type of Titan's config handling."""


class ConfigError(ValueError):
    """A config problem, told in one line that names the key (or file) and the fix."""
