"""Where a process runs: the loopback check and the machine's identity.

``is_loopback`` decides whether a bind address needs CurveZMQ keys and whether a plan's
hosts are this machine; ``machine_id`` tells an NCCL weight server whether an actor shares
its machine. One definition each, used by the launcher, the learner and the actors."""

from __future__ import annotations

import ipaddress
import socket
from pathlib import Path

_BOOT_ID = Path("/proc/sys/kernel/random/boot_id")


def is_loopback(host: str) -> bool:
    """True for localhost, 127.0.0.0/8 and ::1; hostnames other than localhost are not."""
    host = host.strip().strip("[]")
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def machine_id() -> str:
    """The kernel's boot id: equal for processes on one machine (containers included),
    different across machines. The hostname stands in where /proc lacks it."""
    try:
        return _BOOT_ID.read_text().strip()
    except OSError:
        return "host:" + socket.gethostname()
