"""The task and tool sections: ``task`` (prompt source) and ``tools`` (with its MCP
server entries, ``tools.mcp``, and each built-in tool's own section: ``tools.search``, and
``tools.python``, one class per ``state``)."""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import Field, ValidationError, field_validator

from arpo_async.core.config.base import Tagged, _Section

_SERVER_NAME = re.compile(r"[A-Za-z][A-Za-z0-9_-]*")  # the prefix of its tools' names (tags)


class DifficultyConfig(_Section):
    """Pass over prompts the recent policy always solves or never does (actors/difficulty.py):
    a prompt is skipped with probability max_skip * the share of its kind's recent groups
    without reward variance (1 for a prompt whose last group had none)."""

    enabled: bool = Field(False, description="skip prompts by their kind's recent "
                          "share of groups without reward variance")
    max_skip: float = Field(
        0.75, ge=0, lt=1, description="the largest chance a prompt is passed over: each is "
        "still drawn at least 1 - max_skip of the times the stream offers it")
    window: int = Field(
        32, ge=1, description="groups of a kind the estimate averages over (an exponential "
        "moving average with rate 1/window)")
    min_groups: int = Field(8, ge=1, description="groups of a kind seen before it is skipped")
    max_prompt_skips: int = Field(
        3, ge=1, description="a prompt passed over this many times in a row is taken the next "
        "time it comes up")
    max_consecutive: int = Field(
        16, ge=1, description="prompts one draw may pass over before it takes the next one")


class TaskConfig(_Section):
    name: Literal["arith", "synthetic_tools", "file"] = Field(
        "arith",
        description="prompt source: built-in arithmetic, synthetic tool suite, or data file"
    )
    data: str = Field("", description="JSONL/parquet file when task.name=file")
    on_bad_row: Literal["raise", "skip"] = Field(
        "raise", description="a data row without question or answer: stop, or log and skip it"
    )
    seed: int = Field(0, description="seed of the generated task")
    num_prompts: int = Field(2000, description="prompts generated for built-in tasks")
    difficulty: DifficultyConfig = Field(
        default_factory=lambda: DifficultyConfig(), description="budget by prompt "
        "difficulty: skip prompts whose groups would teach nothing (off by default)")


class McpStdioServer(_Section):
    """An MCP server started as a child process of each actor, spoken to over stdio."""

    name: str = Field(description="server name: its tools are offered as <name>_<tool>")
    command: str = Field(description="executable that starts the server (PATH is searched)")
    args: list[str] = Field(default_factory=list, description="its command-line arguments")
    env: dict[str, str] = Field(
        default_factory=dict, description="environment variables added to the MCP SDK's "
        "minimal default environment (HOME, PATH, USER, ...), name to value")


class McpHttpServer(_Section):
    """A running MCP server reached over streamable HTTP."""

    name: str = Field(description="server name: its tools are offered as <name>_<tool>")
    url: str = Field(description="the server's MCP endpoint, e.g. http://127.0.0.1:8000/mcp")


def _mcp_entries(entries: Any) -> list[McpStdioServer | McpHttpServer]:
    """Each entry typed by its keys (command: stdio, url: http), errors naming
    ``tools.mcp[i]``; server names unique and usable as tag prefixes."""
    if not isinstance(entries, list):
        raise ValueError(f"expected a list of servers, got {entries!r}")
    out, seen = [], set()
    for i, entry in enumerate(entries):
        where = f"tools.mcp[{i}]"
        if isinstance(entry, (McpStdioServer, McpHttpServer)):
            entry = entry.model_dump()
        if not isinstance(entry, dict) or ("command" in entry) == ("url" in entry):
            raise ValueError(f"{where}: give either command (a stdio server) or url (an HTTP "
                             f"server), got {entry!r}")
        kind = McpStdioServer if "command" in entry else McpHttpServer
        try:
            server = kind.model_validate(entry)
        except ValidationError as err:
            first = err.errors()[0]
            key = ".".join(str(p) for p in first["loc"])
            msg = "unknown key" if first["type"] == "extra_forbidden" else first["msg"]
            raise ValueError(f"{where}.{key}: {msg}") from None
        if not _SERVER_NAME.fullmatch(server.name):
            raise ValueError(f"{where}.name: {server.name!r} must match {_SERVER_NAME.pattern}")
        if server.name in seen:
            raise ValueError(f"{where}.name: {server.name!r} is used by another server")
        seen.add(server.name)
        out.append(server)
    return out


class SearchConfig(_Section):
    """``tools.search``: the search tool's keys."""

    retriever_url: str = Field(
        "", description="retriever endpoint (POST /retrieve; the pipeline starts a local one "
        "over its corpus when empty)")
    topk: int = Field(3, ge=1, description="snippets per search")
    snippet_chars: int = Field(
        200, ge=0, description="characters kept per snippet (0: the whole passage)")


class _PythonBase(_Section):
    """``tools.python``: the keys of the python tool in either state."""

    cpu_s: int = Field(5, gt=0, description="sandbox CPU-time limit, seconds")
    memory_mb: int = Field(512, gt=0, description="sandbox address-space limit, MiB")
    max_procs: int = Field(32, gt=0, description="sandbox process limit")
    max_output: int = Field(4096, gt=0, description="characters of tool output kept")
    allow_unsandboxed: bool = Field(False, description="run Python without bubblewrap (unsafe)")
    pool: int = Field(
        2, ge=0, description="warm sandboxes kept ready per actor, count (0: a cold sandbox "
        "per call; session: sandboxes ready for new sessions); each holds one idle "
        "interpreter (~20 MiB RSS with math) and a uid")
    preload: list[str] = Field(
        default_factory=lambda: ["math"], description="modules each warm sandbox imports "
        "before its call, names (numpy ~0.1, sympy ~0.25 CPU-s per call, used or not)")


_STATE = ("stateless: every python call runs in a fresh sandbox; session: each trajectory "
          "keeps a live interpreter in a sandbox of its own, which a fork of the trajectory "
          "copies (docs/design.md, 'Python sessions')")


class PythonStateless(_PythonBase):
    state: Literal["stateless"] = Field("stateless", description=_STATE)
    holder: bool = Field(
        False, description="fork each call from one prepared holder sandbox per actor, each "
        "call in namespaces, a /tmp and a uid of its own (toolenv/fork_server.py; setuid "
        "mode, host root; elsewhere as false): 5x less CPU per call, a burst of 12 at 0.4x "
        "the pool's p50, a single call 3.7x slower (bench/tools.py --paths warm holder); "
        "not yet measured in the job, so off by default; false: a sandbox per call, from "
        "the warm pool (tools.python.pool)")


class PythonSession(_PythonBase):
    state: Literal["session"] = Field("session", description=_STATE)
    max_sessions: int = Field(
        32, ge=1, description="live session sandboxes per actor, count (each a keeper and a "
        "holder, ~17 MiB RSS with math, mostly shared, and a uid); past it the least "
        "recently used idle one is stopped (its state is replayed when used)")
    session_idle_s: float = Field(
        120.0, gt=0, description="seconds a session's sandbox may sit unused before it is "
        "stopped (its state is replayed at its next call)")
    checkpoint_mb: int = Field(
        64, ge=1, description="largest fork checkpoint (namespace and /tmp files), MiB; a "
        "bigger state is copied by replaying its calls instead")


PYTHON_STATES: dict[str, type[_PythonBase]] = {"stateless": PythonStateless,
                                               "session": PythonSession}
PYTHON = Tagged("tools.python", "state", PYTHON_STATES, "stateless", "python state")
PythonConfig = PYTHON.annotation


class ToolsConfig(_Section):
    enabled: list[str] = Field(default_factory=list, description="tools offered: python, search")
    custom: list[str] = Field(
        default_factory=list, description="your own tools, offered too: module:Class import "
        "paths of classes following the tool protocol (toolenv/base.py, docs/tools.md)")
    syntax: Literal["arpo", "hermes", "auto", "qwen3_coder", "qwen3_xml", "glm45", "glm47",
                    "deepseek_v31"] = Field(
        "arpo", description="tool-call format: arpo tags (<python>code</python>, results in "
        "<result>); hermes (<tool_call>{\"name\": ..., \"arguments\": {...}}</tool_call>, "
        "results as the chat template's tool message, schemas via its tools= argument); a "
        "vLLM tool parser's name (the model family's own format, results and schemas through "
        "its chat template: toolenv/vllm_syntax.py); or auto (read from the chat template)")
    parallel_calls: int = Field(
        1, ge=1, le=64, description="most tool calls one assistant turn makes (1: a round "
        "stops at the end of the first call; more: at the end of the turn, its calls run "
        "together and one branch decision follows their results; templated syntaxes only)")
    cache_dir: str = Field(
        "", description="shared tool-result cache folder ('' = run_dir/tool_cache)")
    cache_ttl_s: float = Field(0.0, description="tool cache entry lifetime (0: forever)")
    rate_per_s: float = Field(100.0, description="tool calls per second per actor")
    concurrency: int = Field(16, ge=1, description="tool calls in flight per actor")
    timeout_s: float = Field(10.0, description="wall-clock limit per tool call")
    retries: int = Field(2, ge=0, description="retries of a transient tool error")
    max_result_chars: int = Field(
        8192, ge=1, description="longest tool result the model reads or the cache keeps, "
        "characters, for every tool (python, search, custom, MCP); longer ones are cut with "
        "a marker (an MCP answer far larger is dropped unread: toolenv/mcp_tools.py)")
    python: PythonConfig = Field(
        default_factory=lambda: PythonStateless(), description="the python tool's settings "
        "(tools.python.state: stateless or session, each with its own keys)")
    mcp: list[McpStdioServer | McpHttpServer] = Field(
        default_factory=list, description="MCP servers whose tools are offered: {name, "
        "command, args, env} (stdio) or {name, url} (streamable HTTP); docs/tools.md")
    mcp_connect_timeout_s: float = Field(
        30.0, gt=0, description="seconds to start or reach an MCP server and list its tools")
    mcp_restart_backoff_s: float = Field(
        0.5, ge=0, description="seconds before reconnecting to (restarting) an MCP server "
        "that died; doubles per failed attempt, at most tools.mcp_restart_max_s")
    mcp_restart_max_s: float = Field(
        30.0, ge=0, description="longest wait between reconnection attempts, seconds")
    search: SearchConfig = Field(
        default_factory=lambda: SearchConfig(), description="the search tool's settings")

    @field_validator("custom")
    @classmethod
    def _import_paths(cls, paths: list[str]) -> list[str]:
        # Only the form here: the classes are imported and checked where the run is
        # resolved (toolenv/tool_classes.py), not while a config is read.
        for i, path in enumerate(paths):
            module, sep, attr = path.partition(":")
            if not (sep and module and attr):
                raise ValueError(f"tools.custom[{i}]={path}: expected module:Class")
        return paths

    @field_validator("mcp", mode="before")
    @classmethod
    def _mcp_servers(cls, entries: Any) -> list[McpStdioServer | McpHttpServer]:
        return _mcp_entries(entries)

    @property
    def offered(self) -> bool:
        """Any tool offered (built-in, custom or from an MCP server)?"""
        return bool(self.enabled or self.custom or self.mcp)
