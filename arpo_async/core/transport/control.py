"""The control channel: actors' ``ControlClient`` (DEALER, asyncio) <-> the learner's
``ControlServer`` (ROUTER, served by its own thread).

A request is ``[req_id (8 bytes), *frames]``; the ROUTER sees ``[identity, req_id,
*frames]`` and answers ``[identity, req_id, *reply]``, so many coroutines of one actor
share one socket and a late reply is recognised and discarded. Every request goes to one
handler (learner/service.py); a handler may answer with ``Encoded`` frames, which the
server sends as they are: the ZeroMQ weight channel (arpo_async/core/weights/zeromq.py) encodes
each version once and answers every request for it with the same buffers.

``expect(reply, kind)`` is the one reading of a reply that may carry something: the
message of that kind, None for ``Ack(ok=True)`` (nothing to send), a ProtocolError
otherwise.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import struct
import threading
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from arpo_async.core.keys import ClientKeys, ServerKeys
from arpo_async.core.protocol import (
    DEFAULT_MAX_BYTES,
    Ack,
    Hello,
    ProtocolError,
    decode,
    encode,
)
from arpo_async.core.transport.sockets import HARD_LIMIT, BoundSocket, Rejections, client_socket

log = logging.getLogger(__name__)

_REQ_ID = struct.Struct(">Q")
_DROP_GRACE_S = 1.0  # after a dropped connection, pending requests fail after this long
_POLL_MS = 100  # how often the server thread looks at its stop flag

T = TypeVar("T")


class TransportTimeout(TimeoutError):
    """No reply (or no room to send) within the timeout."""


@dataclass(frozen=True)
class Encoded:
    """A reply already encoded (``protocol.encode``): sent as these frames, uncopied."""

    frames: list


def expect(reply: Any, kind: type[T], asked: str) -> T | None:
    """``reply`` when it is a ``kind``; None for ``Ack(ok=True)`` (the learner has nothing
    newer); ProtocolError("refused") naming ``asked`` and the reason otherwise."""
    if isinstance(reply, kind):
        return reply
    if isinstance(reply, Ack) and reply.ok:
        return None
    detail = reply.reason if isinstance(reply, Ack) else type(reply).__name__
    raise ProtocolError("refused", f"{asked}: {detail}")


class ControlServer:
    """ROUTER socket of the learner, served by a background thread.

    ``handler(msg, peer_identity)`` answers every request and runs in the server thread;
    a None answer becomes ``Ack()``, an exception becomes ``Ack(ok=False, reason=...)``.
    """

    def __init__(self, bind: str, handler: Callable[[object, bytes], object],
                 max_bytes: int = DEFAULT_MAX_BYTES, curve: ServerKeys | None = None):
        self.handler, self.max_bytes = handler, max_bytes
        self._rejections = Rejections("control server")
        self.rejected = self._rejections.counts
        self._bound = BoundSocket(zmq.ROUTER, bind, max_bytes, curve, self._rejections)
        self._bound.sock.router_mandatory = True  # an unroutable reply raises: we count it
        self.endpoint: str = self._bound.endpoint
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.requests = 0
        self.dropped_replies: Counter = Counter()  # "unroutable" / "hwm"

    def start(self) -> None:
        if self._thread is not None:
            raise RuntimeError("ControlServer.start() called twice")
        self._thread = threading.Thread(target=self._run, name="control-server", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                log.error("control server thread did not stop within %.1f s", timeout_s)
                return
        self._bound.close()

    def stats(self) -> dict:
        return {"requests": self.requests, "dropped_replies": dict(self.dropped_replies),
                "rejected": self._rejections.snapshot()}

    # ------------------------------------------------------------------ server thread
    def _run(self) -> None:
        sock = self._bound.sock
        try:
            while not self._stop.is_set():
                if self._bound.watch is not None:
                    self._bound.watch.poll()
                if not sock.poll(_POLL_MS, zmq.POLLIN):
                    continue
                try:
                    frames = sock.recv_multipart(flags=zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    continue
                try:
                    self._serve(frames)
                except Exception:
                    log.exception("control server: request failed")
                    self._rejections.add("server_error")
        finally:
            sock.close(linger=0)

    def _serve(self, frames: list) -> None:
        if len(frames) < 3 or len(frames[1]) != _REQ_ID.size:
            self._rejections.add("bad_envelope", f"{len(frames)} frames")
            return
        identity, req_id = frames[0].bytes, frames[1].bytes
        try:
            msg = decode(frames[2:], self.max_bytes)
        except ProtocolError as exc:
            self._rejections.add(exc.reason, str(exc)[:120])
            reply = encode(Ack(ok=False, reason=f"rejected: {exc}"[:200]))
        else:
            self.requests += 1
            reply = self._handle(msg, identity)
        try:
            self._bound.sock.send_multipart([identity, req_id, *reply], flags=zmq.NOBLOCK,
                                            copy=False)
        except zmq.Again:
            self.dropped_replies["hwm"] += 1
        except zmq.ZMQError as exc:
            if exc.errno != zmq.EHOSTUNREACH:
                raise
            self.dropped_replies["unroutable"] += 1  # the peer went away meanwhile

    def _handle(self, msg: object, identity: bytes) -> list:
        try:
            reply = self.handler(msg, identity)
            if isinstance(reply, Encoded):
                return reply.frames
            return encode(Ack() if reply is None else reply)
        except Exception as exc:
            log.exception("control handler failed on %s", type(msg).__name__)
            return encode(Ack(ok=False, reason=f"handler error: {type(exc).__name__}: {exc}"[:200]))

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


class ControlClient:
    """DEALER socket of an actor; any number of coroutines may ``request`` at once."""

    def __init__(self, endpoint: str, timeout_s: float = 30.0, curve: ClientKeys | None = None,
                 max_bytes: int = DEFAULT_MAX_BYTES):
        self.endpoint, self.timeout_s, self.max_bytes = endpoint, timeout_s, max_bytes
        self._ctx = zmq.asyncio.Context()
        self._sock = client_socket(self._ctx, zmq.DEALER, endpoint, curve,
                                   maxmsgsize=max_bytes * HARD_LIMIT)
        self._ids = itertools.count(1)
        self._pending: dict[bytes, asyncio.Future] = {}
        self._reader: asyncio.Task | None = None
        self._watcher: asyncio.Task | None = None
        self._monitor: zmq.Socket | None = None
        self.requests = 0
        self.timeouts = 0
        self.disconnects = 0  # the connection dropped (the learner died): pending requests failed
        self.late_replies = 0  # replies to requests that had already timed out
        self.malformed: Counter = Counter()  # ProtocolError reason -> replies

    async def request(self, msg: Any, timeout_s: float | None = None) -> Any:
        """Send ``msg`` and return the decoded reply; TransportTimeout after ``timeout_s``."""
        if self._sock.closed:
            raise RuntimeError(f"ControlClient({self.endpoint}) is closed")
        timeout = self.timeout_s if timeout_s is None else timeout_s
        self._start_tasks()
        req_id = _REQ_ID.pack(next(self._ids))
        fut = asyncio.get_running_loop().create_future()
        self._pending[req_id] = fut
        self.requests += 1
        try:
            return await asyncio.wait_for(self._exchange([req_id, *encode(msg)], fut), timeout)
        except TransportTimeout:  # the connection dropped (_watch_connection)
            self.timeouts += 1
            raise
        except asyncio.TimeoutError:
            self.timeouts += 1
            raise TransportTimeout(f"no reply to {msg.KIND} from {self.endpoint} within "
                                   f"{timeout:.1f} s") from None
        finally:
            self._pending.pop(req_id, None)

    async def hello(self, hello: Hello, timeout_s: float | None = None) -> Ack:
        """The handshake: the learner answers with an Ack (check ``ok``)."""
        reply = await self.request(hello, timeout_s)
        if not isinstance(reply, Ack):
            raise ProtocolError("wrong_kind", f"hello answered with {type(reply).__name__}")
        return reply

    def _start_tasks(self) -> None:
        """The reply reader and the connection watcher, on the caller's event loop."""
        loop = asyncio.get_running_loop()
        if self._reader is None or self._reader.done():
            self._reader = loop.create_task(self._read_replies())
        if self._watcher is None or self._watcher.done():
            if self._monitor is None:
                self._monitor = self._sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
            self._watcher = loop.create_task(self._watch_connection())

    async def _exchange(self, frames: list, fut: asyncio.Future) -> Any:
        await self._sock.send_multipart(frames, copy=False)
        return await fut

    async def _read_replies(self) -> None:
        try:
            while True:
                frames = await self._sock.recv_multipart(copy=False)
                if len(frames) < 2:
                    self.malformed["bad_envelope"] += 1
                    continue
                fut = self._pending.get(frames[0].bytes)
                if fut is None or fut.done():
                    self.late_replies += 1
                    continue
                try:
                    fut.set_result(decode(frames[1:], self.max_bytes))
                except ProtocolError as exc:
                    self.malformed[exc.reason] += 1
                    fut.set_exception(exc)
        except Exception as exc:
            for fut in self._pending.values():
                if not fut.done():
                    fut.set_exception(exc)
            if not self._sock.closed:
                log.exception("control client reader stopped")

    async def _watch_connection(self) -> None:
        """A dropped connection (the learner process died; a frozen one keeps it) fails
        the requests pending then, ``_DROP_GRACE_S`` later, with TransportTimeout: a reply
        from the dead learner will never come, and the caller's retry (then its Hello)
        reaches the restarted learner at once instead of after ``timeout_s``, which would
        keep every slot of every actor idle that long after each learner restart."""
        try:
            while True:
                event = parse_monitor_message(await self._monitor.recv_multipart())
                if event["event"] != zmq.EVENT_DISCONNECTED:
                    continue
                self.disconnects += 1
                # a request still queued (sent after the drop) reaches a learner back
                # within the grace; what is pending after it went to the dead one
                waiting = [f for f in self._pending.values() if not f.done()]
                await asyncio.sleep(_DROP_GRACE_S)
                for fut in waiting:
                    if not fut.done():
                        fut.set_exception(TransportTimeout(
                            f"connection to {self.endpoint} lost before the reply"))
        except (asyncio.CancelledError, zmq.ZMQError):
            pass

    def close(self) -> None:
        for task in (self._reader, self._watcher):
            if task is not None and not task.done() and not task.get_loop().is_closed():
                task.cancel()
        if self._monitor is not None:  # before term(), which waits for every socket
            if not self._sock.closed:
                self._sock.disable_monitor()
            self._monitor.close(linger=0)
            self._monitor = None
        if not self._sock.closed:
            self._sock.close(linger=0)
            self._ctx.term()
