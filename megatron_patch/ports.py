"""A free TCP port for a rendezvous (MASTER_PORT), torch-free: the CLI's launcher imports it before torch."""
from __future__ import annotations

import random
import socket
from typing import Tuple


def _ephemeral_range() -> Tuple[int, int]:
    """The ports the OS hands to outgoing connections (Linux: ip_local_port_range; its default elsewhere)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            lo, hi = map(int, f.read().split())
        return lo, hi
    except (OSError, ValueError):
        return 32768, 60999


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free now. Chosen at random outside the OS's ephemeral range: a port the OS
    picks (bind to port 0) comes from that range, where any outgoing connection (gloo opens many) may take it before
    the rendezvous listens on it (seen as EADDRINUSE with several jobs on one machine). Another process may still
    take it; the OS's own choice is the fallback."""
    lo, hi = _ephemeral_range()
    ranges = [r for r in ((max(1024, lo - 16384), lo), (hi + 1, 65536)) if r[1] - r[0] >= 1024]
    pick = random.SystemRandom()
    for _ in range(100 if ranges else 0):
        port = pick.randrange(*pick.choice(ranges))
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
