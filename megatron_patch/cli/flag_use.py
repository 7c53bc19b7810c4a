"""Moved to `megatron_patch.config.flag_use` (below both the templates and the CLI, which read it); this name
stays for the scripts and tests that import it from here."""
from megatron_patch.config.flag_use import *  # noqa: F401,F403
