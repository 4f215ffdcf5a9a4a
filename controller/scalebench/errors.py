"""The controller's error for bad input, shared by every module that checks it."""


class ConfigError(ValueError):
    """Bad input: reported as one line, exit status 2, nothing started."""
