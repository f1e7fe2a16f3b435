"""The error every configuration check raises."""


class ConfigError(ValueError):
    """A configuration problem; the message names the key, the source and what would be valid."""


PRE_LAUNCH_ERRORS = (ConfigError, FileNotFoundError, ValueError)
"""What the checks before any process starts raise (a bad key or value, a missing model or dataset file): ``megarl
train`` and ``python -m megarl.launch`` report them as one config error line, exit 2."""
