"""`ModelConfigError`: a model name, shape or checkpoint config that Titan's models cannot build."""


class ModelConfigError(ValueError):
    """A model config that cannot work.

    One line naming the key (`model.flavor`) or file (`config.json`) and the fix.
    """
