"""Hugging Face datasets and hub forced offline for a block: nothing is ever downloaded."""
from __future__ import annotations

import contextlib
import os
from typing import Iterator

import datasets


@contextlib.contextmanager
def offline_mode() -> Iterator[None]:
    """Force datasets and huggingface_hub offline for the duration: no request leaves the machine.

    Both libraries read HF_HUB_OFFLINE once at import, so the module constants are switched as well as the
    environment (the environment covers subprocesses and libraries imported later).
    """
    import huggingface_hub.constants as hub_constants

    saved_env = {k: os.environ.get(k) for k in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE")}
    saved = (datasets.config.HF_HUB_OFFLINE, datasets.config.HF_DATASETS_OFFLINE, hub_constants.HF_HUB_OFFLINE)
    os.environ.update({"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"})
    datasets.config.HF_HUB_OFFLINE = datasets.config.HF_DATASETS_OFFLINE = hub_constants.HF_HUB_OFFLINE = True
    try:
        yield
    finally:
        datasets.config.HF_HUB_OFFLINE, datasets.config.HF_DATASETS_OFFLINE, hub_constants.HF_HUB_OFFLINE = saved
        for k, v in saved_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
