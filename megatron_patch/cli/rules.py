"""Moved to `megatron_patch.templates.rules` (get_args() applies them to a script's own command line, and the
templates sit below the CLI); this name stays for the scripts and tests that import it from here."""
from megatron_patch.templates.rules import *  # noqa: F401,F403
