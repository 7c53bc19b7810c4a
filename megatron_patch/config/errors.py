"""The configuration's error, in a module of its own: the checks (validate.py, resume.py, model_source.py) raise it
without importing the `Config` class, which calls them."""


class ConfigError(ValueError):
    """An impossible or contradictory setting; the message names the flags and the fix."""
