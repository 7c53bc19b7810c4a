"""A free TCP port for a rendezvous (MASTER_PORT), torch-free: the CLI's launcher imports it before torch."""
from __future__ import annotations

import socket


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free now (the OS picks it; another process may take it before use)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
