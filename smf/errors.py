"""ConfigError: the one exception for bad user input, importable without the trainer or the suite."""


class ConfigError(ValueError):
    """A bad option value, path or combination; the CLI prints it as one line and exits with code 2."""
