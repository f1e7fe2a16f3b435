"""The error every configuration check raises."""


class ConfigError(ValueError):
    """A configuration problem; the message names the key, the source and what would be valid."""
