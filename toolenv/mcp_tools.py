"""Tools from Model Context Protocol servers (``tools.mcp``), called through the same
``ToolRunner`` as every other tool (cache, rate limit, concurrency limit, timeout, retries).

An entry is ``{name, command, args, env}`` (stdio: each actor starts the server as a child
process and speaks to it over its stdin/stdout) or ``{name, url}`` (streamable HTTP: a
running server). ``McpServer`` holds one connection, made with the ``mcp`` package's
``Client`` on an event loop of its own in a daemon thread: the callers may run on any loop
(the actor's, or each test's own), and ``build_tools``, which is synchronous, can wait for
the first listing. A call crosses to that loop and back (``run_coroutine_threadsafe``);
the runner's timeout cancels it there too.

Names and arguments. Tool ``t`` of server ``s`` is offered as ``s_t`` (characters outside
``[A-Za-z0-9_-]`` become ``_``): the arpo tag ``<s_t>...</s_t>`` and the hermes function
``s_t`` with the server's own JSON schema as its parameters. The call's text (toolenv/
base.py) becomes the arguments: for a schema with one property, the text itself (parsed as
JSON unless that property is a string); with several, a JSON object. The result is the
text of its content items (``[image content]`` for what is not text; the structured
content as JSON when there is no text).

Failures. A server's error result (``isError``) or a JSON-RPC error is an error result
(``mcp_error``; never cached, never retried). An answer over the message limit (16 bytes
per character of ``tools.max_result_chars``, plus 64 KiB: ``message_limit``) is dropped as
it arrives (toolenv/mcp_transport.py) and answered ``too_large``; a result under it is cut
to ``tools.max_result_chars`` while its text is built (and by the runner, like every
tool's).

A call that finds the connection gone (the server died, the HTTP endpoint went away)
returns an error result at once (``mcp_down``, transient, so the runner's retries may
reach the restarted server) and wakes the connection task, which reconnects (stdio:
starts the server again) after ``tools.mcp_restart_backoff_s``, doubling per failed
attempt up to ``tools.mcp_restart_max_s``. A connection gone silent counts as lost too:
after ``_SILENT_TIMEOUTS`` calls in a row were cancelled (the runner's timeout) with no
answer between, a probe (a tool listing) with no answer within ``tools.timeout_s`` ends
it (stdio: the server is stopped and started again). A server that exits is reported
with its exit code and the end of its stderr (at start: in the ConfigError). Counted in
each of the server's tools' stats: ``mcp_up``, ``mcp_deaths`` (connections lost),
``mcp_restarts`` (reconnections that listed the tools again), ``mcp_failed_restarts``.
The server's process ends with the runner (``close``), or with the actor: a stdio server
reads EOF when its parent dies.

Threat model. A configured server is trusted code, like a ``tools.custom`` class: it runs
unsandboxed as the actor's user, with the environment its entry gives. What it returns is
untrusted text for the model (defused by the syntax like any result); what the model sends
it is untrusted input, which the server must validate (its schema is checked by the hermes
syntax before the call, not under arpo). A tool whose input schema jsonschema cannot use
(toolenv/tool_classes.py, ``schema_problem``) stops the start with a ConfigError naming it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import hashlib
import json
import logging
import re
import threading
from typing import Any

from arpo_async.core.config import ConfigError
from toolenv.base import ToolResult, ToolSpec
from toolenv.mcp_transport import ServerProcess, http_transport, is_too_large, stdio_transport
from toolenv.tags import RESERVED, TAG_NAME
from toolenv.tool_classes import schema_problem

log = logging.getLogger(__name__)

_NOT_TAG = re.compile(r"[^A-Za-z0-9_-]")
_CLOSE_TIMEOUT_S = 10.0  # for the server's process to end when the runner closes
# Timed-out calls in a row, none answered between, before the connection is probed: one
# slow call is the tool's business, but a second in a row with nothing heard may be a
# server that stopped reading (or answering), which only a restart ends.
_SILENT_TIMEOUTS = 2
# What a process lists once: the syntax (stop tags, schemas) and the runner need the same
# tools, and starting a server twice to list them would cost a second start.
_LISTED: dict[str, list[ToolSpec]] = {}


def offered_name(server: str, tool: str) -> str:
    return f"{server}_{_NOT_TAG.sub('_', tool)}"


def _entry_key(entry: Any) -> str:
    return json.dumps(entry.model_dump(), sort_keys=True)


def message_limit(max_result_chars: int) -> int:
    """Bytes of one MCP message read at most: JSON escapes take up to 6 bytes a character
    (``\\uXXXX``, 12 outside the BMP) and a server may send a text twice (as content and as
    structured content); 64 KiB for the rest of the message."""
    return 16 * max_result_chars + 65536


class McpServer:
    """One MCP server's connection on its own loop and thread (see the module docstring);
    ``cfg`` is the ``ToolsConfig`` (its mcp_*, timeout_s and max_result_chars)."""

    def __init__(self, entry: Any, where: str, cfg: Any):
        self.entry, self.where = entry, where
        self.backoff_s, self.max_backoff_s = cfg.mcp_restart_backoff_s, cfg.mcp_restart_max_s
        self.probe_timeout_s, self.max_chars = cfg.timeout_s, cfg.max_result_chars
        self.counts = dict.fromkeys(("deaths", "restarts", "failed_restarts"), 0)
        self.tools: list[Any] = []  # the server's listing (mcp Tool objects)
        self.server_version = ""
        self._client: Any = None
        self._process = ServerProcess()  # stdio: the current connection's process
        self._closing = False
        self._error = ""
        self._silent = 0  # calls cancelled in a row with no answer between
        self._probe_task: asyncio.Task | None = None
        self._listed = threading.Event()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True,
                                        name=f"mcp-{entry.name}")
        self._thread.start()
        self._wake: asyncio.Event | None = None
        self._serving: asyncio.Task | None = None
        self._task = asyncio.run_coroutine_threadsafe(self._serve(), self._loop)
        self._started(cfg.mcp_connect_timeout_s)

    def _started(self, timeout_s: float) -> None:
        """Waits for the first listing; ConfigError naming the entry (and the tool whose
        schema is unusable) when there is none, after closing what was started."""
        error = ""
        if not self._listed.wait(timeout_s) or self._client is None:
            error = "cannot start or reach the MCP server: " + (
                self._error or f"no tool listing within {timeout_s:g} s")
        for tool, spec in zip(self.tools, self.specs()) if not error else []:
            problem = schema_problem(spec.parameters)
            if problem:
                error = (f"tool {tool.name!r} has an input schema that calls cannot be "
                         f"checked against: {problem}")
                break
        if error:
            self.close()
            raise ConfigError(f"{self.where} ({self.entry.name}): {error}")
        _LISTED[_entry_key(self.entry)] = self.specs()

    @property
    def up(self) -> bool:
        return self._client is not None

    # ------------------------------------------------------------------ on its own loop
    def _target(self) -> Any:
        """The transport of a new connection (stdio: a new process, read with bounds)."""
        limit = message_limit(self.max_chars)
        if hasattr(self.entry, "url"):
            return http_transport(self.entry.url, limit)
        self._process = ServerProcess()
        return stdio_transport(self.entry, limit, self._process)

    async def _serve(self) -> None:
        from mcp import Client

        self._wake = asyncio.Event()
        self._serving = asyncio.current_task()
        delay, first = self.backoff_s, True
        while not self._closing:
            connected = False
            self._wake.clear()
            try:
                async with Client(self._target(), cache=None) as client:
                    listing = await _list_all(client)
                    info = client.server_info
                    self.server_version = getattr(info, "version", "") or ""
                    self.tools, self._client, connected = listing, client, True
                    self._silent = 0
                    if not first:
                        self.counts["restarts"] += 1
                    first, delay = False, self.backoff_s  # a good connection resets it
                    self._listed.set()
                    if not self._closing:
                        await self._wake.wait()  # a call found the connection gone, or close
            except Exception as exc:  # could not start, or the connection broke
                self._error = _describe(exc)
                if not first and not connected:
                    self.counts["failed_restarts"] += 1
            self._client = None
            said = self._process.report()  # stdio: a dead server's exit code and last words
            self._error = f"{self._error}; {said}" if said and self._error else said or \
                self._error
            if first:  # start-up failed: the constructor reports it
                self._listed.set()
                return
            if self._closing:
                return
            if connected:
                self.counts["deaths"] += 1
                log.warning("MCP server %s: connection lost (%s); reconnecting in %.1f s",
                            self.entry.name, self._error or "closed", delay)
            await asyncio.sleep(delay)
            delay = min(2 * delay, self.max_backoff_s)

    async def _call(self, tool: str, arguments: dict[str, Any]) -> ToolResult:
        from mcp.shared.exceptions import MCPError
        from mcp_types import CONNECTION_CLOSED  # mcp_types: comes with mcp

        client = self._client
        if client is None:
            return self._down()
        try:
            result = await client.call_tool(tool, arguments)
        except asyncio.CancelledError:  # the runner's timeout (or the rollout's end)
            self._unanswered(client)
            raise
        except MCPError as exc:
            self._silent = 0
            if is_too_large(exc.code, exc.message):
                return ToolResult(f"Error: {exc.message}", ok=False, error="too_large",
                                  truncated=True)
            if exc.code != CONNECTION_CLOSED:
                return ToolResult(f"Error: {exc}", ok=False, error="mcp_error")
            return self._lost(exc)
        except (OSError, EOFError) as exc:
            return self._lost(exc)
        except Exception as exc:  # anyio's closed streams, httpx's transport errors, ...
            if _is_transport_error(exc):
                return self._lost(exc)
            raise
        self._silent = 0
        text = _result_text(result, self.max_chars)
        if result.is_error:
            return ToolResult(text or "Error: the MCP tool failed", ok=False, error="mcp_error")
        return ToolResult(text, ok=True)

    def _unanswered(self, client: Any) -> None:
        """A call was cancelled unanswered; the second in a row has the connection probed."""
        self._silent += 1
        if self._silent >= _SILENT_TIMEOUTS and (
                self._probe_task is None or self._probe_task.done()):
            self._probe_task = self._loop.create_task(self._probe(client))

    async def _probe(self, client: Any) -> None:
        """Asks the server for its tools: no answer within a call's time limit means the
        connection is lost."""
        from mcp.shared.exceptions import MCPError
        from mcp_types import CONNECTION_CLOSED

        try:
            # list_tools, not ping: every server answers it (ping ends with 2026-07-28)
            await asyncio.wait_for(_list_all(client), self.probe_timeout_s)
        except MCPError as exc:
            if exc.code != CONNECTION_CLOSED:  # an error is an answer too
                self._silent = 0
                return
        except Exception:  # asyncio's timeout, or the connection ending meanwhile
            pass
        else:
            self._silent = 0
            return
        if client is self._client:
            self._lost(TimeoutError(f"{self._silent} calls in a row got no answer, nor did a "
                                    f"tool listing within {self.probe_timeout_s:g} s"))

    def _lost(self, exc: BaseException) -> ToolResult:
        self._error = _describe(exc)
        if self._client is not None and self._wake is not None:
            self._client = None
            self._wake.set()
        return self._down()

    def _down(self) -> ToolResult:
        return ToolResult(f"Error: MCP server {self.entry.name!r} is not running "
                          f"({self._error or 'starting'}); it is being restarted", ok=False,
                          error="mcp_down", transient=True)

    async def _shutdown(self) -> None:
        self._closing = True
        if self._probe_task is not None:
            self._probe_task.cancel()
        if self._client is not None:
            self._wake.set()  # leave the connection the way it came (stdio: stop the server)
        elif self._serving is not None:
            self._serving.cancel()  # starting or waiting to restart: stop that now

    # ------------------------------------------------------------------ from any thread
    async def call(self, tool: str, arguments: dict[str, Any]) -> ToolResult:
        """One call, from the caller's loop; cancelling it cancels it on the server's."""
        if self._closing:
            return ToolResult(f"Error: MCP server {self.entry.name!r} is closed", ok=False,
                              error="mcp_down")
        if self._client is None:
            return self._down()
        future = asyncio.run_coroutine_threadsafe(self._call(tool, arguments), self._loop)
        return await asyncio.wrap_future(future)

    def specs(self) -> list[ToolSpec]:
        return [ToolSpec(offered_name(self.entry.name, t.name),
                         t.description or f"{t.name} (MCP server {self.entry.name})",
                         dict(t.input_schema or {"type": "object", "properties": {}}))
                for t in self.tools]

    def stats(self) -> dict[str, float]:
        return {"mcp_up": float(self.up)} | {f"mcp_{k}": v for k, v in self.counts.items()}

    def close(self) -> None:
        """End the connection (stdio: the server's process) and the thread; idempotent."""
        if not self._thread.is_alive():
            return
        try:
            asyncio.run_coroutine_threadsafe(self._shutdown(), self._loop).result(5)
            self._task.result(_CLOSE_TIMEOUT_S)
        except concurrent.futures.CancelledError:
            pass
        except Exception as exc:  # a server slow to stop is left to its EOF
            log.warning("MCP server %s: closing: %s", self.entry.name, exc)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(_CLOSE_TIMEOUT_S)


async def _list_all(client: Any) -> list[Any]:
    tools, cursor = [], None
    while True:
        page = await client.list_tools(cursor=cursor)
        tools += page.tools
        cursor = page.next_cursor
        if not cursor:
            return tools


def _is_transport_error(exc: BaseException) -> bool:
    import anyio  # anyio: comes with mcp (not a dependency of ours)

    closed = (anyio.ClosedResourceError, anyio.BrokenResourceError, anyio.EndOfStream)
    return isinstance(exc, closed) or type(exc).__module__.startswith(("httpx", "httpcore"))


def _describe(exc: BaseException) -> str:
    """One line for an error, the first error of an exception group (anyio's task groups
    wrap what a connection's tasks raise) rather than "unhandled errors in a TaskGroup"."""
    while getattr(exc, "exceptions", None):  # a (Base)ExceptionGroup
        exc = exc.exceptions[0]
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


def _result_text(result: Any, limit: int) -> str:
    """The result's text, built no further than just past ``limit`` characters (the runner
    cuts it there with its marker)."""
    parts: list[str] = []
    size = 0
    for item in result.content or []:
        if size > limit:
            break
        text = item.text if getattr(item, "type", "") == "text" else f"[{item.type} content]"
        parts.append(text[:limit + 1 - size])
        size += len(parts[-1]) + 1
    if not parts and result.structured_content is not None:
        parts.append(json.dumps(result.structured_content, sort_keys=True)[:limit + 1])
    return "\n".join(parts)


class McpTool:
    """One tool of an MCP server, as a project tool (toolenv/base.py)."""

    def __init__(self, server: McpServer, remote: Any, spec: ToolSpec):
        self.server, self.remote = server, remote.name
        self.name, self.description, self.parameters = spec.name, spec.description, \
            spec.parameters
        digest = hashlib.sha256(json.dumps(
            [spec.description, spec.parameters, server.server_version],
            sort_keys=True).encode()).hexdigest()[:12]
        self.version = f"mcp1:{server.entry.name}:{digest}"

    def arguments(self, args: str) -> dict[str, Any] | str:
        """The call's text as the tool's arguments, or the error the model reads."""
        props = self.parameters.get("properties") or {}
        if len(props) == 1:
            (key, schema), = props.items()
            if isinstance(schema, dict) and schema.get("type") == "string":
                return {key: args}
            try:
                return {key: json.loads(args)}
            except ValueError:
                return {key: args}  # the server's own validation answers
        if not props and not args.strip():
            return {}
        try:
            value = json.loads(args)
        except ValueError as exc:
            value, problem = None, f"not valid JSON ({exc})"
        else:
            problem = "" if isinstance(value, dict) else f"got {type(value).__name__}"
        if problem:
            keys = ", ".join(props) or "none"
            return (f"Error: the arguments of {self.name} are a JSON object (keys: {keys}); "
                    f"{problem}")
        return value

    async def call(self, args: str) -> ToolResult:
        arguments = self.arguments(args)
        if isinstance(arguments, str):
            return ToolResult(arguments, ok=False, error="invalid_arguments")
        return await self.server.call(self.remote, arguments)

    def stats(self) -> dict[str, float]:
        """The server's connection counts (the same on each of its tools)."""
        return self.server.stats()

    async def close(self) -> None:
        await asyncio.to_thread(self.server.close)


def mcp_tools(cfg: Any, taken: set[str]) -> dict[str, McpTool]:
    """The tools of every ``tools.mcp`` server (each started or reached now); ConfigError
    naming ``tools.mcp[i]`` when one cannot be, or when a name is taken or reserved."""
    out: dict[str, McpTool] = {}
    servers: list[McpServer] = []
    try:
        for i, entry in enumerate(cfg.mcp):
            where = f"tools.mcp[{i}]"
            server = McpServer(entry, where, cfg)
            servers.append(server)
            for remote, spec in zip(server.tools, server.specs()):
                _check_name(spec.name, where, taken | set(out))
                out[spec.name] = McpTool(server, remote, spec)
    except ConfigError:
        for server in servers:
            server.close()
        raise
    return out


def _check_name(name: str, where: str, taken: set[str]) -> None:
    if not TAG_NAME.fullmatch(name) or name in RESERVED:
        raise ConfigError(f"{where}: tool name {name!r} is not usable as a tag (reserved: "
                          f"{', '.join(sorted(RESERVED))})")
    if name in taken:
        raise ConfigError(f"{where}: tool name {name!r} is already taken by another tool")


def mcp_specs(cfg: Any) -> list[ToolSpec]:
    """What the model is told about the ``tools.mcp`` tools: the listing this process
    already has (``build_tools`` ran), else a connection made to list them and closed."""
    specs: list[ToolSpec] = []
    for i, entry in enumerate(cfg.mcp):
        listed = _LISTED.get(_entry_key(entry))
        if listed is None:
            server = McpServer(entry, f"tools.mcp[{i}]", cfg)
            listed = server.specs()
            server.close()
        specs += listed
    return specs

