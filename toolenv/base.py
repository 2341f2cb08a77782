"""The tool protocol: what a tool is and what one call returns.

A tool is a class with

- ``name``: its tag under the arpo syntax (``<name>...</name>``) and its function name
  under hermes (``{"name": ..., "arguments": ...}``); letters, digits, ``_`` and ``-``;
- ``description`` and ``parameters`` (a JSON schema of type object): what the model is
  told about it (the chat template's ``tools=`` under hermes, a line of the system prompt
  under arpo for tools the task's prompt does not describe);
- ``version``: a str, part of the result cache key; bump it when results would change;
- ``async call(args: str) -> ToolResult``: one call. ``args`` is the call's text: under
  arpo the tag's body; under hermes the value of the schema's only property, or the
  arguments object as JSON (sorted keys) when the schema has several (``call_text``);
- optionally ``async close()`` and ``stats() -> dict[str, float]`` (added to the tool
  metrics as ``<name>.<key>``);
- optionally ``canonical(args: str) -> str``: the form of the arguments the result cache
  keys on, so that calls that must give the same result share an entry (``python``:
  line endings; ``search``: case and spacing); without it the arguments as given;
- optionally, a *stateful* tool (``python`` with ``tools.python.state=session``):
  ``stateful = True``, ``open_session()`` (a trajectory's session: ``digest``, the state
  part of the cache key; ``advance(args)``, a cached result stood for a call;
  ``async fork()``; ``close(reason)``; a ``history`` list, if it has one, is kept in
  the actor's journal) and ``async call_in(session, args)``, and, to carry a session
  across an actor's restart, ``restore_session(history)``
  (``toolenv.runner.ToolState`` carries a trajectory's sessions).

Every result is cut to ``tools.max_result_chars`` characters by the runner (``cap_text``)
before the model or the cache sees it; a tool may stop reading earlier (an MCP server's
oversized messages are dropped as they arrive: toolenv/mcp_tools.py).

A custom tool (``tools.custom``, docs/tools.md) is constructed without arguments; the
class is checked before a run starts (``toolenv.tool_classes``). Every call
goes through ``toolenv.runner.ToolRunner`` (cache, rate limit, concurrency limit,
timeout, retries, metrics); ``toolenv.runner.build_tools`` wires the configured tools.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Protocol


@dataclass
class ToolResult:
    text: str  # what the model reads: inside <result>...</result>, or the tool message
    ok: bool  # False on error/timeout
    latency_s: float = 0.0
    cached: bool = False
    error: str = ""  # short error kind: "timeout", "http_503", "sandbox", ...
    transient: bool = False  # worth retrying (HTTP 5xx/429, connection reset); never timeouts
    truncated: bool = False  # cut at the runner's tools.max_result_chars (cap_text)


def canonical(tool: Any, args: str) -> str:
    """``tool.canonical(args)`` where the tool has one, else ``args``."""
    fn = getattr(tool, "canonical", None)
    return fn(args) if fn is not None else args


def cap_text(text: str, limit: int) -> tuple[str, bool]:
    """``text`` cut to ``limit`` characters with a marker the model reads, and whether it
    was cut. The runner applies it to every tool's result (``tools.max_result_chars``), so
    no tool, however its server misbehaves, hands the model or the cache more than that."""
    if len(text) <= limit:
        return text, False
    return f"{text[:limit]}\n... [result truncated at {limit} characters]", True


class Tool(Protocol):
    name: str  # "python", "search", "calculator"
    description: str  # one or two sentences for the model
    parameters: dict[str, Any]  # JSON schema of the arguments: {"type": "object", ...}
    version: str  # bump when results would change; part of the cache key

    async def call(self, args: str) -> ToolResult: ...


@dataclass(frozen=True)
class ToolSpec:
    """What the model is told about a tool (pure data: picklable, no tool instance)."""

    name: str
    description: str
    parameters: dict[str, Any]

    @classmethod
    def of(cls, tool: Any) -> ToolSpec:
        return cls(tool.name, tool.description, tool.parameters)

    def chat_tool(self) -> dict[str, Any]:
        """The OpenAI/Hermes function entry a chat template's ``tools=`` takes."""
        return {"type": "function", "function": {"name": self.name,
                "description": self.description, "parameters": self.parameters}}

    def call_text(self, arguments: dict[str, Any]) -> str:
        """A JSON call's arguments as the tool's ``args``: the value of the only
        property (str as is, anything else as JSON), else the object as JSON."""
        props = list(self.parameters.get("properties", {}))
        if len(props) == 1 and set(arguments) <= set(props):
            value = arguments.get(props[0], "")
            return value if isinstance(value, str) else json.dumps(value)
        return json.dumps(arguments, sort_keys=True)
