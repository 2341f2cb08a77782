"""The trajectory channel: an actor's ``TrajectorySender`` (PUSH, asyncio) -> the
learner's ``TrajectoryReceiver`` (PULL, plain zmq, rank 0).

High-water marks on both ends make a slow learner block the actors (backpressure):
``send`` waits for room and never drops a group. Malformed input is counted by reason
and skipped; the next valid group is returned."""

from __future__ import annotations

import asyncio
import logging
import time

import zmq
import zmq.asyncio

from arpo_async.core.keys import ClientKeys, ServerKeys
from arpo_async.core.protocol import (
    DEFAULT_MAX_BYTES,
    ProtocolError,
    TrajectoryGroup,
    decode,
    encode,
)
from arpo_async.core.transport.sockets import BoundSocket, Rejections, client_socket, nbytes

log = logging.getLogger(__name__)


class TrajectoryReceiver:
    """PULL socket of the learner (rank 0); ``recv`` is called from one learner thread."""

    def __init__(self, bind: str, hwm: int = 64, max_bytes: int = DEFAULT_MAX_BYTES,
                 curve: ServerKeys | None = None):
        self.max_bytes = max_bytes
        self._rejections = Rejections("trajectory receiver")
        self.rejected = self._rejections.counts
        self.received = 0
        self.bytes_received = 0
        self._bound = BoundSocket(zmq.PULL, bind, max_bytes, curve, self._rejections,
                                  rcvhwm=hwm)
        self.endpoint: str = self._bound.endpoint

    def recv(self, timeout_s: float) -> TrajectoryGroup | None:
        """The next valid group, or None after ``timeout_s``; bad messages are skipped."""
        sock = self._bound.sock
        if self._bound.watch is not None:
            self._bound.watch.poll()
        deadline = time.monotonic() + timeout_s
        while True:
            wait_ms = max(0, int((deadline - time.monotonic()) * 1000))
            if not sock.poll(wait_ms, zmq.POLLIN):
                return None
            try:  # poll can report a message that is gone again (e.g. dropped oversize)
                frames = sock.recv_multipart(flags=zmq.NOBLOCK, copy=False)
            except zmq.Again:
                continue
            try:
                msg = decode(frames, self.max_bytes)
            except ProtocolError as exc:
                self._rejections.add(exc.reason, str(exc)[:120])
            else:
                if isinstance(msg, TrajectoryGroup):
                    self.received += 1
                    self.bytes_received += nbytes(frames)
                    return msg
                self._rejections.add("wrong_kind", type(msg).__name__)
            if time.monotonic() >= deadline:
                return None

    def stats(self) -> dict:
        return {"received": self.received, "bytes_received": self.bytes_received,
                "rejected": self._rejections.snapshot()}

    def close(self) -> None:
        self._bound.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class TrajectorySender:
    """PUSH socket of an actor: ``send`` waits while the queue is full, never drops."""

    def __init__(self, endpoint: str, hwm: int = 4, timeout_s: float = 30.0,
                 curve: ClientKeys | None = None):
        self.endpoint, self.timeout_s = endpoint, timeout_s
        self._ctx = zmq.asyncio.Context()
        self._sock = client_socket(self._ctx, zmq.PUSH, endpoint, curve, sndhwm=hwm)
        self.sent = 0
        self.bytes_sent = 0
        self.blocked_s = 0.0  # time spent waiting for room in the queue
        self.stalls = 0  # waits longer than timeout_s (each logged)

    async def send(self, group: TrajectoryGroup) -> None:
        """Queue ``group`` (stamping ``sent_at``); do not modify it afterwards."""
        group.sent_at = time.time()
        frames = encode(group)
        fut = self._sock.send_multipart(frames, copy=False)
        if not fut.done():
            t0 = time.perf_counter()
            try:
                while not (await asyncio.wait({fut}, timeout=self.timeout_s))[0]:
                    self.stalls += 1
                    log.warning("trajectory send to %s blocked for %.0f s (learner behind or "
                                "down); still waiting, group %s kept", self.endpoint,
                                time.perf_counter() - t0, group.group_id)
            except asyncio.CancelledError:
                fut.cancel()
                raise
            finally:
                self.blocked_s += time.perf_counter() - t0
        fut.result()
        self.sent += 1
        self.bytes_sent += nbytes(frames)

    def close(self, linger_s: float = 5.0) -> None:
        """Close, giving queued groups up to ``linger_s`` to leave (blocks that long at most)."""
        if not self._sock.closed:
            self._sock.close(linger=int(linger_s * 1000))
            self._ctx.term()
