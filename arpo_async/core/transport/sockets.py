"""What the ZeroMQ channels share: a bound server socket (with its own context and, under
CurveZMQ, its ZAP authenticator), a client socket with ZMTP heartbeats, and the counter
of rejected input that the socket thread and the ZAP thread both write."""

from __future__ import annotations

import logging
import threading
from collections import Counter
from collections.abc import Iterable
from typing import Any

import zmq
import zmq.asyncio

from arpo_async.core.keys import (
    ClientKeys,
    HandshakeWatch,
    ServerKeys,
    configure_client,
    configure_server,
    start_authenticator,
)

log = logging.getLogger(__name__)

# libzmq itself drops a connection whose single frame exceeds this multiple of max_bytes
# (memory protection); frames between 1x and 2x still arrive and are counted "too_large".
HARD_LIMIT = 2
# ZMTP heartbeats: a silently vanished peer (host down, no FIN) is noticed and reconnected.
_HEARTBEAT_IVL_MS, _HEARTBEAT_TIMEOUT_MS = 2000, 10000


def nbytes(frames: Iterable[Any]) -> int:
    return sum(memoryview(f).nbytes for f in frames)


class Rejections:
    """A Counter of rejected input, shared by the socket thread and the ZAP thread."""

    def __init__(self, where: str):
        self.where, self.counts, self.lock = where, Counter(), threading.Lock()

    def add(self, reason: str, detail: str = "") -> None:
        with self.lock:
            self.counts[reason] += 1
            first = self.counts[reason] == 1
        # the first of each reason is a warning; a flood of them must not flood the log
        log.log(logging.WARNING if first else logging.DEBUG, "%s rejected a message: %s %s",
                self.where, reason, detail)

    def denied(self, key: bytes) -> None:
        self.add("curve_denied", f"client key {key[:8]!r}...")

    def keyless(self, event: int) -> None:
        self.add("handshake_failed", f"monitor event {event}: a peer without CurveZMQ keys")

    def snapshot(self) -> dict[str, int]:
        with self.lock:
            return dict(self.counts)


class BoundSocket:
    """A bound server socket with its own context (with curve: a ZAP authenticator, and
    ``watch``, which counts peers without keys when polled from the socket's thread)."""

    def __init__(self, kind: int, bind: str, max_bytes: int, curve: ServerKeys | None,
                 rejected: Rejections, **options: int):
        self.ctx = zmq.Context()
        self.auth = self.watch = None
        try:
            if curve is not None:
                self.auth = start_authenticator(self.ctx, curve, rejected.denied)
            self.sock = self.ctx.socket(kind)
            if curve is not None:
                self.watch = HandshakeWatch(self.sock, rejected.keyless)
            self.sock.linger = 0
            self.sock.maxmsgsize = max_bytes * HARD_LIMIT
            for name, value in options.items():  # before bind: a listener copies them
                self.sock.set(getattr(zmq, name.upper()), value)
            if curve is not None:
                configure_server(self.sock, curve)
            self.sock.bind(bind)
        except zmq.ZMQError as exc:
            self.close()
            raise OSError(f"cannot bind {bind}: {exc}") from None
        self.endpoint = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)

    def close(self) -> None:
        if self.watch is not None:  # before term(), which waits for every socket
            self.watch.close()
        if getattr(self, "sock", None) is not None and not self.sock.closed:
            self.sock.close(linger=0)
        if self.auth is not None:
            self.auth.stop()
            self.auth = None
        if not self.ctx.closed:
            self.ctx.term()


def client_socket(ctx: zmq.asyncio.Context, kind: int, endpoint: str,
                  curve: ClientKeys | None, **options: int) -> zmq.asyncio.Socket:
    sock = ctx.socket(kind)
    sock.linger = 0
    sock.heartbeat_ivl = _HEARTBEAT_IVL_MS
    sock.heartbeat_timeout = _HEARTBEAT_TIMEOUT_MS
    for name, value in options.items():  # before connect: the pipe copies them
        sock.set(getattr(zmq, name.upper()), value)
    if curve is not None:
        configure_client(sock, curve)
    sock.connect(endpoint)
    return sock
