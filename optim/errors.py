"""The error type for bad optimizer settings: the message names the key, the value and the fix."""


class OptimConfigError(ValueError):
    """An `optim.*` value breaks a rule."""
