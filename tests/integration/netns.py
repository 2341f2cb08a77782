"""Hosts in network namespaces for the multi-host tests (tests/integration/test_netns.py).

Each host is a network namespace with one interface, ``eth0``, the end of a veth pair
whose other end sits on a bridge inside a further namespace (the "switch"); nothing is
made in this machine's own namespace, so the hosts' private addresses (``SUBNET``) and
ports can clash with nothing here. ``link(host, "down")`` pulls a host's cable.

Every namespace is named ``arpons<pid>-<host>`` after the test process that made it:
``clear_leftovers`` removes those of processes that are gone (a killed test run), with
the processes still inside them, before new hosts are made; ``down`` removes this run's.
Processes run on a host through ``command``: in its network namespace, with a UTS
namespace of their own so that the host has its own hostname.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
from collections.abc import Iterator

PREFIX = "arpons"
SUBNET = "10.226.0"  # a private /24 that exists only between these namespaces
_NAME = re.compile(rf"^{PREFIX}(\d+)-\S+")


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    res = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and res.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {res.stderr.strip()}")
    return res


def _namespaces() -> list[str]:
    return [line.split()[0] for line in ip("netns", "list").stdout.splitlines() if line.strip()]


def _remove(ns: str) -> None:
    """Kill what still runs in ``ns`` (processes a killed test left), then delete it."""
    for pid in ip("netns", "pids", ns, check=False).stdout.split():
        try:
            os.kill(int(pid), signal.SIGKILL)
        except (ProcessLookupError, ValueError):
            pass
    ip("netns", "del", ns, check=False)


def clear_leftovers() -> list[str]:
    """Remove the hosts of test processes that no longer run; their names."""
    gone = []
    for ns in _namespaces():
        m = _NAME.match(ns)
        if m and int(m.group(1)) != os.getpid() and not os.path.exists(f"/proc/{m.group(1)}"):
            _remove(ns)
            gone.append(ns)
    return gone


class Hosts:
    def __init__(self, names: list[str]):
        self.tag = f"{PREFIX}{os.getpid()}"
        self.names = list(names)
        self.switch = f"{self.tag}-switch"
        self.ns = {n: f"{self.tag}-{n}" for n in self.names}
        self.addr = {n: f"{SUBNET}.{i + 1}" for i, n in enumerate(self.names)}

    def up(self) -> Hosts:
        ip("netns", "add", self.switch)
        ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
        ip("-n", self.switch, "link", "set", "br0", "up")
        for i, name in enumerate(self.names):
            ns, port = self.ns[name], f"port{i}"
            ip("netns", "add", ns)
            ip("-n", ns, "link", "set", "lo", "up")
            ip("link", "add", "eth0", "netns", ns, "type", "veth", "peer", "name", port,
               "netns", self.switch)
            ip("-n", self.switch, "link", "set", port, "master", "br0")
            ip("-n", self.switch, "link", "set", port, "up")
            ip("-n", ns, "addr", "add", f"{self.addr[name]}/24", "dev", "eth0")
            ip("-n", ns, "link", "set", "eth0", "up")
        return self

    def link(self, name: str, state: str) -> None:
        """``up`` or ``down``: the host's cable."""
        ip("-n", self.ns[name], "link", "set", "eth0", state)

    def hostname(self, name: str) -> str:
        return f"{name}-host"

    def command(self, name: str, argv: list[str]) -> list[str]:
        """``argv`` as run on host ``name`` (the same process: every step execs)."""
        return ["nsenter", f"--net=/run/netns/{self.ns[name]}", "unshare", "--uts", "sh", "-c",
                'hostname "$0" && exec "$@"', self.hostname(name), *argv]

    def down(self) -> None:
        for ns in [*self.ns.values(), self.switch]:
            if ns in _namespaces():
                _remove(ns)


def hosts_or_skip(names: list[str]) -> Iterator[Hosts]:
    """The hosts ``names``, up, for a module fixture (``yield from``); the test is skipped
    with the reason where namespaces cannot be made; removed afterwards."""
    import pytest

    if os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("nsenter") is None:
        pytest.skip("network namespaces need root, ip (iproute2) and nsenter (util-linux)")
    clear_leftovers()
    h = Hosts(names)
    try:
        try:
            h.up()
        except RuntimeError as exc:
            pytest.skip(f"cannot make network namespaces here: {str(exc).splitlines()[0]}")
        yield h
    finally:
        h.down()
