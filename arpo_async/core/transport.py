"""ZeroMQ transport between actors and the learner: four small classes over two sockets.

- trajectory channel: actors' ``TrajectorySender`` (PUSH, asyncio) -> the learner's
  ``TrajectoryReceiver`` (PULL, plain zmq). High-water marks on both ends make a slow
  learner block the actors (backpressure); nothing is dropped.
- control channel: actors' ``ControlClient`` (DEALER, asyncio) <-> the learner's
  ``ControlServer`` (ROUTER, served by its own thread): Hello handshake, heartbeats,
  tickets, Bye, and weights. A request is ``[req_id (8 bytes), *frames]``; the ROUTER sees
  ``[identity, req_id, *frames]`` and answers ``[identity, req_id, *reply]``, so many
  coroutines of one actor share one socket and a late reply is recognised and discarded.

Weights are encoded once per version and every request for them is answered with the
same buffers (``send_multipart(copy=False)``: no copy per actor). Malformed input never
raises in the learner: it is counted in ``rejected`` by the ProtocolError reason. DEALER
and PUSH reconnect by themselves when a learner restarts on the same port.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import struct
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np
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
from arpo_async.core.protocol import (
    DEFAULT_MAX_BYTES,
    Ack,
    Hello,
    ProtocolError,
    TrajectoryGroup,
    WeightsRequest,
    WeightsUpdate,
    decode,
    encode,
)

log = logging.getLogger(__name__)

_REQ_ID = struct.Struct(">Q")
_DROP_GRACE_S = 1.0  # after a dropped connection, pending requests fail after this long
_POLL_MS = 100  # how often the server thread looks at its stop flag
# libzmq itself drops a connection whose single frame exceeds this multiple of max_bytes
# (memory protection); frames between 1x and 2x still arrive and are counted "too_large".
_HARD_LIMIT = 2
# ZMTP heartbeats: a silently vanished peer (host down, no FIN) is noticed and reconnected.
_HEARTBEAT_IVL_MS, _HEARTBEAT_TIMEOUT_MS = 2000, 10000


class TransportTimeout(TimeoutError):
    """No reply (or no room to send) within the timeout."""


def _nbytes(frames: Iterable[Any]) -> int:
    return sum(memoryview(f).nbytes for f in frames)


class _Rejections:
    """A Counter of rejected input, shared by the socket thread and the ZAP thread."""

    def __init__(self, where: str):
        self.where, self.counts, self._lock = where, Counter(), threading.Lock()

    def add(self, reason: str, detail: str = "") -> None:
        with self._lock:
            self.counts[reason] += 1
            first = self.counts[reason] == 1
        # the first of each reason is a warning; a flood of them must not flood the log
        log.log(logging.WARNING if first else logging.DEBUG, "%s rejected a message: %s %s",
                self.where, reason, detail)

    def denied(self, key: bytes) -> None:
        self.add("curve_denied", f"client key {key[:8]!r}...")

    def keyless(self, event: int) -> None:
        self.add("handshake_failed", f"monitor event {event}: a peer without CurveZMQ keys")


class _BoundSocket:
    """A bound server socket with its own context (with curve: a ZAP authenticator, and
    ``watch``, which counts peers without keys when polled from the socket's thread)."""

    def __init__(self, kind: int, bind: str, max_bytes: int, curve: ServerKeys | None,
                 rejected: _Rejections, **options: int):
        self.ctx = zmq.Context()
        self.auth = self.watch = None
        try:
            if curve is not None:
                self.auth = start_authenticator(self.ctx, curve, rejected.denied)
            self.sock = self.ctx.socket(kind)
            if curve is not None:
                self.watch = HandshakeWatch(self.sock, rejected.keyless)
            self.sock.linger = 0
            self.sock.maxmsgsize = max_bytes * _HARD_LIMIT
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


# ----------------------------------------------------------------------------- learner side


class TrajectoryReceiver:
    """PULL socket of the learner (rank 0); ``recv`` is called from one learner thread."""

    def __init__(self, bind: str, hwm: int = 64, max_bytes: int = DEFAULT_MAX_BYTES,
                 curve: ServerKeys | None = None):
        self.max_bytes = max_bytes
        self._rejections = _Rejections("trajectory receiver")
        self.rejected: Counter = self._rejections.counts
        self.received = 0
        self.bytes_received = 0
        self._bound = _BoundSocket(zmq.PULL, bind, max_bytes, curve, self._rejections,
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
                    self.bytes_received += _nbytes(frames)
                    return msg
                self._rejections.add("wrong_kind", type(msg).__name__)
            if time.monotonic() >= deadline:
                return None

    def stats(self) -> dict:
        with self._rejections._lock:
            rejected = dict(self.rejected)
        return {"received": self.received, "bytes_received": self.bytes_received,
                "rejected": rejected}

    def close(self) -> None:
        self._bound.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class ControlServer:
    """ROUTER socket of the learner, served by a background thread.

    ``handler(msg, peer_identity)`` answers every request but WeightsRequest and runs in
    the server thread; a None answer becomes ``Ack()``, an exception becomes
    ``Ack(ok=False, reason=...)``. Weights come from ``publish_weights``.
    """

    def __init__(self, bind: str, handler: Callable[[object, bytes], object],
                 max_bytes: int = DEFAULT_MAX_BYTES, curve: ServerKeys | None = None):
        self.handler, self.max_bytes = handler, max_bytes
        self._rejections = _Rejections("control server")
        self.rejected: Counter = self._rejections.counts
        self._bound = _BoundSocket(zmq.ROUTER, bind, max_bytes, curve, self._rejections)
        self._bound.sock.router_mandatory = True  # an unroutable reply raises: we count it
        self.endpoint: str = self._bound.endpoint
        self._weights_lock = threading.Lock()
        self._published: tuple[int, list | None, int] = (-1, None, 0)  # version, frames, bytes
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.requests = 0
        self.weights_requests = 0
        self.bytes_served = 0
        self.served: Counter = Counter()  # weights version -> replies carrying it
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

    def publish_weights(self, version: int, tensors: dict[str, np.ndarray],
                        bf16_names: Iterable[str] = (), copy: bool = True) -> None:
        """Serve ``tensors`` as ``version`` from now on (thread-safe; encoded once).

        ``copy=False`` hands the arrays over: they must not change afterwards, since every
        reply sends their memory as it is at that moment.
        """
        if copy:
            tensors = {n: np.array(a, copy=True, order="C") for n, a in tensors.items()}
        frames = encode(WeightsUpdate(version=version, tensors=tensors,
                                      bf16_names=list(bf16_names)))
        with self._weights_lock:
            if version <= self._published[0]:
                raise ValueError(f"weights version {version} published after "
                                 f"{self._published[0]}: versions must increase")
            self._published = (version, frames, _nbytes(frames))

    @property
    def version(self) -> int:
        return self._published[0]

    def stats(self) -> dict:
        with self._rejections._lock:
            rejected = dict(self.rejected)
        return {"requests": self.requests, "weights_requests": self.weights_requests,
                "bytes_served": self.bytes_served, "served": dict(self.served),
                "dropped_replies": dict(self.dropped_replies), "rejected": rejected,
                "version": self.version}

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
            reply = (self._weights_reply(msg) if isinstance(msg, WeightsRequest)
                     else self._handle(msg, identity))
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
            return encode(Ack() if reply is None else reply)
        except Exception as exc:
            log.exception("control handler failed on %s", type(msg).__name__)
            return encode(Ack(ok=False, reason=f"handler error: {type(exc).__name__}: {exc}"[:200]))

    def _weights_reply(self, msg: WeightsRequest) -> list:
        self.weights_requests += 1
        with self._weights_lock:
            version, frames, nbytes = self._published
        if frames is None or msg.have_version >= version:
            return encode(Ack(ok=True, learner_version=version))
        self.bytes_served += nbytes
        self.served[version] += 1
        return frames

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


# ----------------------------------------------------------------------------- actor side


def _client_socket(ctx: zmq.asyncio.Context, kind: int, endpoint: str,
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


class TrajectorySender:
    """PUSH socket of an actor: ``send`` waits while the queue is full, never drops."""

    def __init__(self, endpoint: str, hwm: int = 4, timeout_s: float = 30.0,
                 curve: ClientKeys | None = None):
        self.endpoint, self.timeout_s = endpoint, timeout_s
        self._ctx = zmq.asyncio.Context()
        self._sock = _client_socket(self._ctx, zmq.PUSH, endpoint, curve, sndhwm=hwm)
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
        self.bytes_sent += _nbytes(frames)

    def close(self, linger_s: float = 5.0) -> None:
        """Close, giving queued groups up to ``linger_s`` to leave (blocks that long at most)."""
        if not self._sock.closed:
            self._sock.close(linger=int(linger_s * 1000))
            self._ctx.term()


class ControlClient:
    """DEALER socket of an actor; any number of coroutines may ``request`` at once."""

    def __init__(self, endpoint: str, timeout_s: float = 30.0, curve: ClientKeys | None = None,
                 max_bytes: int = DEFAULT_MAX_BYTES):
        self.endpoint, self.timeout_s, self.max_bytes = endpoint, timeout_s, max_bytes
        self._ctx = zmq.asyncio.Context()
        self._sock = _client_socket(self._ctx, zmq.DEALER, endpoint, curve,
                                    maxmsgsize=max_bytes * _HARD_LIMIT)
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
        if self._reader is None or self._reader.done():
            self._reader = asyncio.get_running_loop().create_task(self._read_replies())
        if self._watcher is None or self._watcher.done():
            if self._monitor is None:
                self._monitor = self._sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
            self._watcher = asyncio.get_running_loop().create_task(self._watch_connection())
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
        reaches the restarted learner. Waiting for ``timeout_s`` instead kept every slot
        of every actor idle that long after each learner restart (chaos soak, issue 17)."""
        from zmq.utils.monitor import parse_monitor_message

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

    async def hello(self, hello: Hello, timeout_s: float | None = None) -> Ack:
        """The handshake: the learner answers with an Ack (check ``ok``)."""
        reply = await self.request(hello, timeout_s)
        if not isinstance(reply, Ack):
            raise ProtocolError("wrong_kind", f"hello answered with {type(reply).__name__}")
        return reply

    async def fetch_weights(self, have_version: int, actor_id: int,
                            timeout_s: float | None = None) -> WeightsUpdate | None:
        """Weights newer than ``have_version``, or None when there are none."""
        reply = await self.request(WeightsRequest(actor_id=actor_id, have_version=have_version),
                                   timeout_s)
        if isinstance(reply, WeightsUpdate):
            return reply
        if isinstance(reply, Ack) and reply.ok:
            return None
        detail = reply.reason if isinstance(reply, Ack) else type(reply).__name__
        raise ProtocolError("refused", f"weights request: {detail}")

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
