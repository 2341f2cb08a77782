"""Ports chosen for a later bind lie below the kernel's ephemeral range, where no outgoing
connection's local port can take them meanwhile."""

from __future__ import annotations

import socket

from arpo_async.core import ports


def test_chosen_ports_are_free_and_below_the_ephemeral_range():
    low = ports._ephemeral_low()
    chosen = ports.free_ports(50)
    assert len(set(chosen)) == 50
    if low is not None and low - ports._LOW >= 1000:
        assert all(ports._LOW <= p < low for p in chosen)
    for p in chosen[:5]:
        with socket.socket() as s:
            s.bind(("127.0.0.1", p))


class _Sequence:
    def __init__(self, values):
        self.values = list(values)

    def randrange(self, lo, hi):
        return self.values.pop(0)


def test_a_port_in_use_is_skipped(monkeypatch):
    with socket.socket() as a, socket.socket() as b:
        a.bind(("127.0.0.1", 0))
        b.bind(("127.0.0.1", 0))
        held, free = a.getsockname()[1], b.getsockname()[1]
        b.close()
        monkeypatch.setattr(ports, "_ephemeral_low", lambda: 65000)
        monkeypatch.setattr(ports, "_draw", _Sequence([held, free]))
        assert ports.free_port() == free


def test_without_a_known_range_the_kernel_chooses(monkeypatch):
    monkeypatch.setattr(ports, "_ephemeral_low", lambda: None)
    assert 0 < ports.free_port() < 65536
