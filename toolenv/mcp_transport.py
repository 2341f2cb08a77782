"""The transports of the ``tools.mcp`` servers (toolenv/mcp_tools.py), bounded: no message
over ``limit`` bytes is held in memory, and a misbehaving server cannot wedge the reader.

HTTP (``http_transport``): the SDK's ``streamable_http_client`` with its SSE event limit
set to ``limit`` and an httpx client whose other response bodies (JSON answers) stop at
``limit`` bytes; either way the request gets an error (``is_too_large`` tells it apart
from a lost connection).

Stdio (``stdio_transport``): the SDK's ``stdio_client``, with a reader of our own.

The SDK's reader (mcp 2.3) decodes the server's stdout strictly, and one invalid UTF-8
byte sent it into draining the pipe for good: every later call timed out while the
server counted as up. It also joins the pending text to each new 64 KiB chunk, so a
50 MB line cost quadratic copying (18.8 s in which the server's other tools got no
answer) and then one parse holding the GIL (the caller's loop stalled 1.5 s). Here:

- each line is decoded on its own with ``errors="replace"``: a bad byte costs a
  character (or that line, if it is no longer JSON), never the connection;
- a line longer than ``limit`` bytes is not kept: its first and last bytes find the id
  of the request it answers, which gets a JSON-RPC error (``TOO_LARGE``) at once, and the
  rest is read past in constant memory and time per byte;
- the server's stderr passes on to ours as before, and its last ``_STDERR_TAIL`` bytes and
  its exit code are kept (``ServerProcess.report``) so that a server that dies, at start
  or later, is reported by what it said;
- stopping follows the SDK's order (close stdin, wait, SIGTERM then SIGKILL the process
  group), with bounded waits.
"""

from __future__ import annotations

import json
import logging
import re
import subprocess
import sys
from contextlib import asynccontextmanager, suppress
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)

TOO_LARGE = -32099  # JSON-RPC code (implementation-defined range) of a dropped answer
# How the SDK reports an HTTP answer over the limit: an SSE event (its own text, in a
# CONNECTION_CLOSED error) or a JSON body (ours, in a PARSE_ERROR).
_HTTP_TOO_LARGE = re.compile(r"SSE stream failed: .*exceeded the \d+ byte limit|"
                             r"response body is over the limit of \d+ bytes")
_KEEP = 512  # bytes kept of each end of an oversized line, to find its id
_STDERR_TAIL = 2048  # bytes of a server's stderr kept for the report of its end
_EXIT_GRACE_S = 2.0  # for the server to exit once its stdin closes (the SDK's grace)
_KILL_GRACE_S = 1.0  # between SIGTERM and SIGKILL of its process group
# The id of a JSON-RPC answer: its first key (after "jsonrpc"), or its last; a nested
# object's key never matches either (a nested one is followed by more than "}").
_ID_FIRST = re.compile(rb'\s*\{\s*(?:"jsonrpc"\s*:\s*"2\.0"\s*,\s*)?"id"\s*:\s*(-?\d+|"[^"\\]*")')
_ID_LAST = re.compile(rb'"id"\s*:\s*(-?\d+|"[^"\\]*")\s*\}\s*$')


@dataclass(frozen=True)
class Oversized:
    """A line over the limit: its size and the bytes kept of each end."""

    head: bytes
    tail: bytes
    size: int

    def request_id(self) -> int | str | None:
        """The id of the request this line answers, when one of its ends shows it."""
        found = _ID_FIRST.match(self.head) or _ID_LAST.search(self.tail)
        return json.loads(found.group(1)) if found else None


class LineReader:
    """Splits a byte stream into lines of at most ``limit`` bytes (a longer one comes out
    as ``Oversized``); each byte is copied at most twice, whatever the line's length."""

    def __init__(self, limit: int):
        self.limit = limit
        self._line = bytearray()
        self._size = 0
        self._head: bytes | None = None  # set once the line is over the limit
        self._tail = b""

    def feed(self, chunk: bytes) -> list[bytes | Oversized]:
        out: list[bytes | Oversized] = []
        start = 0
        while (at := chunk.find(b"\n", start)) >= 0:
            self._add(chunk[start:at])
            out.append(self._take())
            start = at + 1
        self._add(chunk[start:])
        return out

    def _add(self, part: bytes) -> None:
        self._size += len(part)
        if self._head is None:
            self._line += part
            if self._size <= self.limit:
                return
            self._head, part = bytes(self._line[:_KEEP]), bytes(self._line[-_KEEP:])
            self._line = bytearray()
        self._tail = (self._tail + part[-_KEEP:])[-_KEEP:]

    def _take(self) -> bytes | Oversized:
        line: bytes | Oversized = bytes(self._line)
        if self._head is not None:
            line = Oversized(self._head, self._tail, self._size)
        self._line, self._size, self._head, self._tail = bytearray(), 0, None, b""
        return line


def parse(item: bytes | Oversized, limit: int) -> Any:
    """A line as what the SDK's session reads: a ``SessionMessage``, the parse error (the
    session logs it and goes on), or None for a blank line or an answer to nothing."""
    import mcp_types  # comes with mcp
    from mcp.shared.message import SessionMessage

    if isinstance(item, Oversized):
        request = item.request_id()
        if request is None:
            log.warning("MCP server: dropped a %d-byte message that answers no request "
                        "(over the %d-byte limit)", item.size, limit)
            return None
        error = mcp_types.ErrorData(code=TOO_LARGE, message=(
            f"the server's answer is {item.size} bytes, over the limit of {limit} bytes "
            "(set by tools.max_result_chars); it was dropped unread"))
        return SessionMessage(mcp_types.JSONRPCError(jsonrpc="2.0", id=request, error=error))
    text = item.decode("utf-8", errors="replace")
    if not text.strip():
        return None
    try:
        return SessionMessage(mcp_types.jsonrpc_message_adapter.validate_json(
            text, by_name=False))
    except ValueError as exc:  # pydantic's ValidationError included
        return exc


class ServerProcess:
    """A stdio server's process as its reports need it: exit code and the end of stderr."""

    def __init__(self) -> None:
        self.process: Any = None
        self.stderr_tail = b""

    async def pass_stderr(self) -> None:
        import anyio

        try:
            while True:
                chunk = await self.process.stderr.receive()
                self.stderr_tail = (self.stderr_tail + chunk)[-_STDERR_TAIL:]
                sys.stderr.write(chunk.decode("utf-8", errors="replace"))
        except (anyio.EndOfStream, anyio.ClosedResourceError, anyio.BrokenResourceError,
                OSError):
            return

    def report(self) -> str:
        """"exited with code N; its stderr ends: ..." once it has exited, else ""."""
        code = None if self.process is None else self.process.returncode
        if code is None:
            return ""
        said = self.stderr_tail.decode("utf-8", errors="replace").strip()
        return f"the server exited with code {code}; " + (
            f"its stderr ends: {said[-500:]}" if said else "it wrote nothing to stderr")


@asynccontextmanager
async def stdio_transport(entry: Any, limit: int, proc: ServerProcess):
    """The server of a ``tools.mcp`` stdio entry, started, as the (read, write) streams the
    SDK's ``Client`` takes; ``proc`` gets its process. Stopped when the block ends."""
    import anyio
    from mcp.client.stdio import get_default_environment

    proc.process = process = await anyio.open_process(
        [entry.command, *entry.args], env=get_default_environment() | dict(entry.env),
        stderr=subprocess.PIPE, start_new_session=True)
    to_client, from_server = anyio.create_memory_object_stream(0)
    to_server, from_client = anyio.create_memory_object_stream(0)
    async with anyio.create_task_group() as tasks:
        tasks.start_soon(_read_stdout, process.stdout, to_client, limit)
        tasks.start_soon(_write_stdin, process.stdin, from_client, to_client)
        tasks.start_soon(proc.pass_stderr)
        try:
            yield from_server, to_server
        finally:
            with anyio.CancelScope(shield=True):  # the server must not outlive the block
                await _stop(process)
            tasks.cancel_scope.cancel()


async def _read_stdout(stdout: Any, sink: Any, limit: int) -> None:
    import anyio

    lines = LineReader(limit)
    async with sink:  # closing it tells the session that the connection ended
        try:
            while True:
                for item in lines.feed(await stdout.receive()):
                    message = parse(item, limit)
                    if message is not None:
                        await sink.send(message)
        except (anyio.EndOfStream, anyio.ClosedResourceError, anyio.BrokenResourceError,
                OSError):
            return


async def _write_stdin(stdin: Any, source: Any, to_client: Any) -> None:
    import anyio

    try:
        async with source:
            async for message in source:
                data = message.message.model_dump_json(by_alias=True, exclude_unset=True)
                await stdin.send((data + "\n").encode())
    except (anyio.ClosedResourceError, anyio.BrokenResourceError, OSError):
        await to_client.aclose()  # the server stopped reading: its calls must not hang


async def _stop(process: Any) -> None:
    import anyio
    from mcp.os.posix.utilities import terminate_posix_process_tree

    with suppress(OSError, anyio.BrokenResourceError, anyio.ClosedResourceError):
        await process.stdin.aclose()  # a well-behaved server exits on EOF
    if not await _exited(process, _EXIT_GRACE_S):
        await terminate_posix_process_tree(process, _KILL_GRACE_S)
        await _exited(process, _EXIT_GRACE_S)
    for pipe in (process.stdout, process.stderr):
        with suppress(OSError, anyio.BrokenResourceError, anyio.ClosedResourceError):
            await pipe.aclose()


async def _exited(process: Any, timeout_s: float) -> bool:
    """Polls the exit code (``process.wait()`` would also wait for the pipes' EOF, which a
    grandchild holding them open withholds)."""
    import anyio

    with anyio.move_on_after(timeout_s):
        while process.returncode is None:
            await anyio.sleep(0.01)
    return process.returncode is not None


def is_too_large(code: int, message: str) -> bool:
    """Whether a JSON-RPC error says an answer was over the limit (and dropped)."""
    return code == TOO_LARGE or bool(_HTTP_TOO_LARGE.search(message))


@asynccontextmanager
async def http_transport(url: str, limit: int):
    """The streamable HTTP connection to ``url`` with no answer over ``limit`` bytes read."""
    import httpx2  # comes with mcp
    from mcp.client.streamable_http import streamable_http_client

    class Capped(httpx2.AsyncHTTPTransport):
        async def handle_async_request(self, request: Any) -> Any:
            response = await super().handle_async_request(request)
            if not response.headers.get("content-type", "").startswith("text/event-stream"):
                response.stream = _capped_body(httpx2, response.stream, limit)
            return response  # an SSE stream lives long: its limit is per event

    # The SDK's own client's timeouts (mcp.shared._httpx_utils): 30 s, 300 s to read SSE.
    timeout = httpx2.Timeout(30.0, read=300.0)
    async with httpx2.AsyncClient(timeout=timeout, transport=Capped()) as client:
        async with streamable_http_client(url, http_client=client,
                                          max_sse_event_size=limit) as streams:
            yield streams


def _capped_body(httpx2: Any, stream: Any, limit: int) -> Any:
    class Body(httpx2.AsyncByteStream):
        async def __aiter__(self):
            size = 0
            async for chunk in stream:
                size += len(chunk)
                if size > limit:  # a StreamError is what the SDK answers the request for
                    raise httpx2.StreamError(f"the response body is over the limit of {limit} "
                                             "bytes (set by tools.max_result_chars)")
                yield chunk

        async def aclose(self) -> None:
            await stream.aclose()

    return Body()
