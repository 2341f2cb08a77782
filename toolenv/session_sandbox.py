"""One live Python session sandbox, seen from the host: start it, wait for READY, send it
requests one at a time and read each reply (tools.python_state=session; toolenv/session.py).

The sandbox is an ordinary ``Sandbox.spawn`` process (bubblewrap namespaces, its own uid in
setuid mode, prlimit, nice) running ``toolenv/session_child.py``. A request is a 4-byte
length, a JSON header (``op``: exec, dump or load; ``end``: a fresh nonce; ``n``: payload
bytes) and the payload. The reply is whatever the call printed (stdout and stderr on one
pipe), then ``END + nonce + NUL``, a JSON status line and ``n`` payload bytes (a dump's
checkpoint). The host never parses anything but that status line, and never unpickles: a
checkpoint is opaque bytes carried from one sandbox to another.

Output is kept up to ``max_bytes`` (the child drops a call's Python-level output past the
cap itself; what it writes to the file descriptor directly is read and thrown away here).
A request is bounded by ``timeout_s``: past it, or on cancellation, or when output floods
past ``_FLOOD_FACTOR`` times the cap, the whole sandbox is killed and the reply says so
(``timeout``, ``flood``); a sandbox that dies on its own gives ``dead`` at once (EOF),
never a hang.
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import select
import signal
import struct
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from toolenv.pool import READY, PoolError, read_some, write_all

END = b"\x00arpo-end-"
_READ_CHUNK = 1 << 16
_READY_CAP = 1 << 16  # what preparation may print before READY (warnings of an import)
_REAP_TIMEOUT_S = 5.0
# Bytes written straight to the file descriptor past the output cap are read and dropped;
# this many times the cap means a flood, not a chatty call: the host stops paying for it.
_FLOOD_FACTOR = 64


@dataclass
class Reply:
    output: bytes
    status: dict = field(default_factory=dict)  # kind: ok|exception|exit|killed|error (the
    # child's), timeout|flood|dead (the host's); kept: the call's changes are in the state
    payload: bytes = b""
    truncated: bool = False
    wall_s: float = 0.0

    @property
    def kind(self) -> str:
        return self.status.get("kind", "dead")


class SessionSandbox:
    """A started session sandbox: ``ready`` once, then ``request`` any number of times."""

    def __init__(self, proc: subprocess.Popen, release: Callable[[], None]):
        self.proc, self._release = proc, release
        self._out, self._in = proc.stdout.fileno(), proc.stdin.fileno()
        os.set_blocking(self._out, False)
        os.set_blocking(self._in, False)
        self._buf = bytearray()  # read but not yet consumed
        self._closed = False
        self.requests = 0

    @property
    def alive(self) -> bool:
        return not self._closed and self.proc.poll() is None

    async def _read(self) -> bytes:
        return await read_some(self._out)

    async def ready(self, timeout_s: float) -> None:
        """Wait for READY; ``PoolError`` when the sandbox exits or stalls first."""

        async def until_ready() -> None:
            while READY not in self._buf:
                chunk = await self._read()
                if not chunk or len(self._buf) > _READY_CAP:
                    raise PoolError(f"session sandbox exited before it was ready: "
                                    f"{bytes(self._buf[-500:])!r}")
                self._buf += chunk

        try:
            await asyncio.wait_for(until_ready(), timeout_s)
        except asyncio.TimeoutError:
            raise PoolError(f"session sandbox not ready after {timeout_s:g} s") from None
        del self._buf[:self._buf.index(READY) + len(READY)]

    async def _write_all(self, data: bytes) -> bool:
        try:
            await write_all(self._in, data)
        except (BrokenPipeError, ConnectionResetError):
            return False
        return True

    async def request(self, op: str, payload: bytes = b"", *, timeout_s: float,
                      max_bytes: int, **fields) -> Reply:
        """Send one request and read its reply; never raises for what the session does.
        A reply of kind timeout, flood or dead leaves the sandbox killed."""
        start = time.monotonic()
        nonce = secrets.token_hex(8)
        head = json.dumps({"op": op, "end": nonce, "n": len(payload), **fields}).encode()
        reply = Reply(b"")
        self.requests += 1
        try:
            reply = await asyncio.wait_for(
                self._exchange(struct.pack(">I", len(head)) + head + payload,
                               END + nonce.encode() + b"\x00", max_bytes, reply), timeout_s)
        except asyncio.TimeoutError:
            reply.status = {"kind": "timeout"}
        except BaseException:
            self.kill()  # cancelled mid-request: the session's state is unknown
            raise
        if reply.kind in ("timeout", "flood", "dead"):
            self.kill()
        reply.wall_s = time.monotonic() - start
        return reply

    async def _exchange(self, frame: bytes, marker: bytes, max_bytes: int,
                        reply: Reply) -> Reply:
        out, dropped = bytearray(), 0
        if not await self._write_all(frame):
            reply.status = {"kind": "dead"}
            return reply
        while True:
            at = self._buf.find(marker)
            if at >= 0:
                line_end = self._buf.find(b"\n", at + len(marker))
                if line_end >= 0:
                    self._keep(out, at, max_bytes, reply)  # the marker now starts the buffer
                    reply.output = bytes(out)
                    return await self._finish(reply, len(marker), line_end - at)
            else:  # all but a possible start of the marker is output
                dropped += self._keep(out, max(0, len(self._buf) - len(marker) + 1),
                                      max_bytes, reply)
                if dropped > _FLOOD_FACTOR * max(max_bytes, _READ_CHUNK):
                    reply.output, reply.status = bytes(out), {"kind": "flood"}
                    return reply
            chunk = await self._read()
            if not chunk:
                reply.output, reply.status = bytes(out) + bytes(self._buf), {"kind": "dead"}
                return reply
            self._buf += chunk

    def _keep(self, out: bytearray, upto: int, max_bytes: int, reply: Reply) -> int:
        """Move ``self._buf[:upto]`` to ``out`` up to ``max_bytes``; bytes dropped."""
        room = max(0, max_bytes - len(out))
        out += self._buf[:min(upto, room)]
        dropped = max(0, upto - room)
        if dropped:
            reply.truncated = True
        del self._buf[:upto]
        return dropped

    async def _finish(self, reply: Reply, start: int, line_end: int) -> Reply:
        try:
            reply.status = json.loads(self._buf[start:line_end])
        except ValueError:
            reply.status = {"kind": "error", "message": "unreadable status line"}
        del self._buf[:line_end + 1]
        if reply.status.get("truncated"):
            reply.truncated = True
        need = int(reply.status.get("n", 0))
        while len(self._buf) < need:
            chunk = await self._read()
            if not chunk:
                reply.status = {"kind": "dead"}
                return reply
            self._buf += chunk
        reply.payload = bytes(self._buf[:need])
        del self._buf[:need]
        return reply

    def kill(self) -> None:
        """Stop the whole sandbox now, and return once everything in it is gone: the
        request pipe is closed, so the keeper (the sandbox's init) exits; the kernel kills
        and reaps every other process of the pid namespace before that exit completes,
        and only then does bwrap, waiting for it, exit. A sandbox that does not end so
        within the reap timeout is killed through bwrap and its uid kept locked (never
        handed out again while a process of it might remain)."""
        if self._closed:
            return
        self._closed = True
        self.proc.stdin.close()
        try:
            self.proc.wait(_REAP_TIMEOUT_S)
            gone = True
        except subprocess.TimeoutExpired:
            gone = False
        try:  # without a sandbox (mode none) the keeper's group is all there is to kill
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        gone = self._drain(time.monotonic() + _REAP_TIMEOUT_S) and gone
        try:
            self.proc.wait(_REAP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            gone = False
        self.proc.stdout.close()
        if gone:
            self._release()

    def _drain(self, deadline: float) -> bool:
        while (left := deadline - time.monotonic()) > 0:
            if select.select([self._out], [], [], left)[0]:
                try:
                    if not os.read(self._out, _READ_CHUNK):
                        return True
                except BlockingIOError:
                    pass
        return False
