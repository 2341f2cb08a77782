"""One live Python session sandbox, seen from the host: start it, wait for READY, send it
requests one at a time and read each reply (tools.python.state=session; toolenv/session.py).

The sandbox is an ordinary ``Sandbox.spawn`` process (bubblewrap namespaces, its own uid in
setuid mode, prlimit, nice) running ``toolenv/session_child.py``. A request is a 4-byte
length, a JSON header (``op``: exec, dump or load; ``end``: a fresh nonce; ``n``: payload
bytes) and the payload. The reply is ``BEGIN + nonce + NUL``, whatever the call printed
(stdout and stderr on one pipe), then ``END + nonce + NUL``, a JSON status line and ``n``
payload bytes (a dump's checkpoint). The host never parses anything but that status line,
and never unpickles: a checkpoint is opaque bytes carried from one sandbox to another.

The sandbox is not trusted to keep to this: a call can read the nonce from its own stack
and forge an end. So every read is bounded and yields to the event loop: bytes before
this request's BEGIN (an earlier call's rest) are dropped, the status line must end within
``_STATUS_CAP`` bytes and be an object of a kind the child writes, and its declared
payload may not pass what the request allows (``max_payload``: 0 but for a dump). A reply
that breaks this (``protocol``) kills the sandbox like a timeout: a forgery costs only the
forging session's state, which is rebuilt from its history.

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
import logging
import os
import secrets
import select
import signal
import struct
import subprocess
import time
from dataclasses import dataclass, field

from toolenv.pool import READY, PoolError, read_some, write_all
from toolenv.sandbox import Lease

log = logging.getLogger(__name__)

BEGIN = b"\x00arpo-begin-"
END = b"\x00arpo-end-"
# The kinds the child writes; the host adds timeout, flood, dead and protocol.
CHILD_KINDS = frozenset({"ok", "exception", "exit", "killed", "error"})
LOST = ("timeout", "flood", "dead", "protocol")  # replies after which the sandbox is gone
_STATUS_CAP = 4096  # the longest status line the host reads
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

    def __init__(self, proc: subprocess.Popen, lease: Lease):
        self.proc, self._lease = proc, lease
        self._out, self._in = proc.stdout.fileno(), proc.stdin.fileno()
        os.set_blocking(self._out, False)
        os.set_blocking(self._in, False)
        self._buf = bytearray()  # read but not yet consumed
        self._closed = False
        self._lost: dict = {"kind": "dead"}  # why the last read gave up: dead or flood
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
                      max_bytes: int, max_payload: int = 0, **fields) -> Reply:
        """Send one request and read its reply; never raises for what the session does.
        ``max_payload``: the most payload bytes the reply may declare (a dump's limit).
        A reply of kind timeout, flood, dead or protocol leaves the sandbox killed."""
        start = time.monotonic()
        nonce = secrets.token_hex(8).encode()
        head = json.dumps({"op": op, "end": nonce.decode(), "n": len(payload),
                           **fields}).encode()
        reply = Reply(b"")
        self.requests += 1
        try:
            reply = await asyncio.wait_for(
                self._exchange(struct.pack(">I", len(head)) + head + payload, nonce,
                               max_bytes, max_payload, reply), timeout_s)
        except asyncio.TimeoutError:
            reply.status = {"kind": "timeout"}
        except BaseException:
            self.kill()  # cancelled mid-request: the session's state is unknown
            raise
        if reply.kind in LOST:
            self.kill()
        reply.wall_s = time.monotonic() - start
        return reply

    async def _exchange(self, frame: bytes, nonce: bytes, max_bytes: int, max_payload: int,
                        reply: Reply) -> Reply:
        if not await self._write_all(frame):
            reply.status = {"kind": "dead"}
            return reply
        flood = _FLOOD_FACTOR * max(max_bytes, _READ_CHUNK)
        # What comes before this request's BEGIN is what an earlier call left behind (one
        # that forged its end): dropped, never shown as this call's output.
        if not await self._until(BEGIN + nonce + b"\x00", bytearray(), 0, flood, None):
            reply.status = self._lost
            return reply
        out = bytearray()
        found = await self._until(END + nonce + b"\x00", out, max_bytes, flood, reply)
        reply.output = bytes(out)
        if not found:
            reply.status = self._lost
            return reply
        while (line_end := self._buf.find(b"\n")) < 0:
            if len(self._buf) > _STATUS_CAP:
                return _broken(reply, "a status line without an end")
            if not await self._more():
                reply.status = self._lost
                return reply
        return await self._finish(reply, self._buf[:line_end], max_payload)

    async def _until(self, marker: bytes, out: bytearray, max_bytes: int, flood: int,
                     reply: Reply | None) -> bool:
        """Move the buffer to ``out`` (up to ``max_bytes``; past it ``reply`` is marked
        truncated) until ``marker``, then drop the marker; False on a flood or the
        sandbox's end (``self._lost`` says which)."""
        dropped = 0
        while (at := self._buf.find(marker)) < 0:
            # all but a possible start of the marker is output
            dropped += self._keep(out, max(0, len(self._buf) - len(marker) + 1), max_bytes,
                                  reply)
            if dropped > flood:
                self._lost = {"kind": "flood"}
                return False
            if not await self._more():
                return False
        self._keep(out, at, max_bytes, reply)
        del self._buf[:len(marker)]
        return True

    async def _more(self) -> bool:
        """Read once more (yielding to the loop, so the request's timeout can fire while
        the pipe never runs dry); False at the pipe's end."""
        chunk = await self._read()
        await asyncio.sleep(0)
        if not chunk:
            self._lost = {"kind": "dead"}
            return False
        self._buf += chunk
        return True

    def _keep(self, out: bytearray, upto: int, max_bytes: int, reply: Reply | None) -> int:
        """Move ``self._buf[:upto]`` to ``out`` up to ``max_bytes``; bytes dropped."""
        room = max(0, max_bytes - len(out))
        out += self._buf[:min(upto, room)]
        dropped = max(0, upto - room)
        if dropped and reply is not None:
            reply.truncated = True
        del self._buf[:upto]
        return dropped

    async def _finish(self, reply: Reply, line: bytes, max_payload: int) -> Reply:
        """The status line, checked (an object of a kind the child writes, a payload no
        larger than the request allows), then its payload."""
        try:
            status = json.loads(line)
        except ValueError:
            return _broken(reply, "an unreadable status line")
        if not isinstance(status, dict) or status.get("kind") not in CHILD_KINDS:
            return _broken(reply, "a status that is not one the session writes")
        need = status.get("n", 0)
        if not isinstance(need, int) or not 0 <= need <= max_payload:
            return _broken(reply, f"a payload of {need!r} bytes (at most {max_payload})")
        del self._buf[:len(line) + 1]
        reply.status = status
        if status.get("truncated"):
            reply.truncated = True
        while len(self._buf) < need:
            if not await self._more():
                reply.status = self._lost
                return reply
        reply.payload = bytes(self._buf[:need])
        del self._buf[:need]
        return reply

    def kill(self) -> None:
        """Stop the whole sandbox now, and return once everything in it is gone: the
        request pipe is closed, so the keeper (the sandbox's init) exits; the kernel kills
        and reaps every other process of the pid namespace before that exit completes,
        and only then does bwrap, waiting for it, exit. A sandbox that does not end so
        within the reap timeout is killed through its uid (setuid mode) and then through
        bwrap's group; its uid is unlocked once bwrap is gone."""
        if self._closed:
            return
        self._closed = True
        self.proc.stdin.close()
        if not self._exited():
            log.warning("session sandbox %d: still running %.0f s after its session was "
                        "closed; killing it", self.proc.pid, _REAP_TIMEOUT_S)
            # through its uid first (setuid mode): bwrap then reaps the keeper and exits
            # by itself (toolenv/sandbox.py, Lease.kill)
            if self._lease.kill():
                self._exited()
        try:  # without a sandbox (mode none) the keeper's group is all there is to kill
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        if not self._exited():
            log.warning("session sandbox %d: not reaped after SIGKILL", self.proc.pid)
        self._drain(time.monotonic() + _REAP_TIMEOUT_S)
        self._lease.release()
        self.proc.stdout.close()

    def _exited(self) -> bool:
        try:
            self.proc.wait(_REAP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            return False
        return True

    def _drain(self, deadline: float) -> bool:
        while (left := deadline - time.monotonic()) > 0:
            if select.select([self._out], [], [], left)[0]:
                try:
                    if not os.read(self._out, _READ_CHUNK):
                        return True
                except BlockingIOError:
                    pass
        return False


def _broken(reply: Reply, what: str) -> Reply:
    reply.status = {"kind": "protocol", "message": f"the session's reply broke the protocol: "
                                                   f"{what}"}
    return reply
