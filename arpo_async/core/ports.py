"""Choosing a TCP port now for a process that binds it later.

``bind(0)`` hands out a port from the kernel's ephemeral range, the same range every
outgoing connection takes its local port from. Between choosing such a port and the learner
binding it (seconds later, after DeepSpeed starts), a gloo rendezvous or any client on the
machine may take it: CI failed so once ("cannot bind tcp://127.0.0.1:37351: Address already
in use", through both restarts). Ports chosen here lie below the ephemeral range, where only
explicit binds land, and are drawn at random so that processes choosing at the same moment
(parallel tests, several launches) do not walk the same sequence.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
_LOW = 20000  # above the well-known and most registered services' ports
_draw = random.SystemRandom()


def _ephemeral_low() -> int | None:
    try:
        return int(_RANGE_FILE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None  # not Linux: fall back to the kernel's choice


def free_port(host: str = "127.0.0.1") -> int:
    """A port free on every address now (so free on ``host`` too), outside the ephemeral
    range when the kernel says where that is and leaves at least 1000 ports below it above
    20000."""
    low = _ephemeral_low()
    if low is not None and low - _LOW >= 1000:
        for _ in range(200):
            port = _draw.randrange(_LOW, low)
            with socket.socket() as s:
                try:
                    s.bind(("0.0.0.0", port))
                except OSError:
                    continue
            return port
    with socket.socket() as s:
        s.bind(("127.0.0.1" if host in ("0.0.0.0", "*", "") else host, 0))
        return s.getsockname()[1]


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """``n`` distinct ports from :func:`free_port`."""
    ports: list[int] = []
    while len(ports) < n:
        port = free_port(host)
        if port not in ports:
            ports.append(port)
    return ports
