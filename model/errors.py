"""The error type for bad configuration values (shared by configs and registries)."""


class ConfigError(ValueError):
    """A configuration value breaks a rule; the message names the key, the value and the fix."""
