"""Stateful tools and MCP entries as pure logic: the cache keys a session call by its
history (a result is never served to another state, a hit moves the session on), a
ToolState forks and closes its sessions, the history digest, the tools.mcp entries'
errors naming the key, and how an MCP tool reads its call's text. A fake in-memory
interpreter stands for the sandbox here (tests/integration/test_python_session.py has
the real one)."""

from __future__ import annotations

import pytest

from arpo_async.core.config import SPINE_CONFIG, ConfigError, load_config
from toolenv.base import ToolResult, ToolSpec
from toolenv.cache import ToolCache
from toolenv.runner import ToolRunner
from toolenv.session import next_digest


class _Session:
    def __init__(self, history=(), digest=""):
        self.history, self.digest, self.closed = list(history), digest, ""

    def advance(self, code):
        self.history.append(code)
        self.digest = next_digest(self.digest, code)

    async def fork(self):
        return _Session(self.history, self.digest)

    def close(self, reason="finished"):
        self.closed = reason


class _Counter:
    """A 'python' whose state is how many calls ran: ``n += 1`` prints the new count."""

    name, description, version = "python", "a fake interpreter", "1"
    parameters = {"type": "object", "properties": {"code": {"type": "string"}}}
    stateful = True

    def __init__(self):
        self.executed = 0

    def open_session(self):
        return _Session()

    async def call(self, args):
        raise AssertionError("a stateful call always comes with its session here")

    async def call_in(self, session, args):
        self.executed += 1
        session.advance(args)
        return ToolResult(str(len(session.history)), ok=True)


def test_the_digest_follows_the_history_in_the_cache_form():
    one = next_digest("", "x = 1")
    assert one == next_digest("", "x = 1\r\n  ")  # trailing whitespace and \r\n: same code
    assert next_digest(one, "y = 2") != next_digest(next_digest("", "y = 2"), "x = 1")
    assert ToolCache.key("python", "1", "x", "") == ToolCache.key("python", "1", "x")
    assert ToolCache.key("python", "1", "x", one) != ToolCache.key("python", "1", "x")


async def test_a_cached_result_is_served_only_to_the_same_history(tmp_path):
    tool = _Counter()
    runner = ToolRunner({"python": tool}, ToolCache(tmp_path), rate_per_s=0, concurrency=4,
                        timeout_s=5, retries=0)
    a, b = runner.open_state(), runner.open_state()
    assert [(await runner.call("python", "n += 1", state=a)).text for _ in range(2)] == \
        ["1", "2"]  # same code, different histories: both run
    first = await runner.call("python", "n += 1", state=b)
    assert (first.text, first.cached) == ("1", True)  # b's history is a's first one
    assert b.sessions["python"].history == ["n += 1"]  # moved on as if it had run
    second = await runner.call("python", "n += 1", state=b)
    assert (second.text, second.cached, tool.executed) == ("2", True, 2)
    fork = await b.fork()
    assert fork.sessions["python"].digest == b.sessions["python"].digest
    third = await runner.call("python", "n += 1", state=fork)
    assert (third.text, third.cached, tool.executed) == ("3", False, 3)
    assert b.sessions["python"].history == ["n += 1"] * 2  # the fork's call is its own
    b.close("dropped")
    assert b.sessions["python"].closed == "dropped"
    stateless = ToolRunner({"calc": _Calc()}, None, rate_per_s=0, concurrency=1,
                           timeout_s=5, retries=0)
    assert stateless.open_state() is None  # no stateful tool: nothing to carry
    runner.cache.close()


class _Calc:
    name, description, version = "calc", "no state", "1"
    parameters = {"type": "object", "properties": {}}

    async def call(self, args):
        return ToolResult("0", ok=True)


@pytest.mark.parametrize(("value", "needle"), [
    ("[{name: a}]", "tools.mcp[0]: give either command (a stdio server) or url"),
    ("[{name: a, command: 3}]", "tools.mcp[0].command: Input should be a valid string"),
    ("[{name: a, command: x, bogus: 1}]", "tools.mcp[0].bogus: unknown key"),
    ("[{name: a, command: x}, {name: a, url: u}]", "tools.mcp[1].name: 'a' is used"),
    ("[{name: 1a, command: x}]", "tools.mcp[0].name: '1a' must match"),
    ("3", "tools.mcp: expected a list of servers, got 3"),
])
def test_mcp_entries_are_refused_naming_the_key(value, needle):
    with pytest.raises(ConfigError) as err:
        load_config(SPINE_CONFIG, [f"tools.mcp={value}"])
    assert needle in str(err.value) and "\n" not in str(err.value)


def test_mcp_entries_are_typed_by_their_keys(tmp_path):
    from arpo_async.core.config import McpHttpServer, McpStdioServer, save_config

    cfg = load_config(SPINE_CONFIG, ["tools.mcp=[{name: a, command: srv, args: [-v]}, "
                                     "{name: b, url: 'http://h:1/mcp'}]",
                                     "tools.python.state=session"])
    stdio, http = cfg.tools.mcp
    assert isinstance(stdio, McpStdioServer) and stdio.args == ["-v"]
    assert isinstance(http, McpHttpServer) and cfg.tools.offered
    save_config(cfg, tmp_path / "c.yaml")
    assert load_config(tmp_path / "c.yaml").tools.mcp == cfg.tools.mcp
    with pytest.raises(ConfigError, match="tools.python.state"):
        load_config(SPINE_CONFIG, ["tools.python.state=sessions"])


def test_an_mcp_tool_reads_its_call_text_as_arguments():
    from types import SimpleNamespace

    from toolenv.mcp_tools import McpTool, offered_name

    server = SimpleNamespace(entry=SimpleNamespace(name="srv"), server_version="1")

    def tool(props):
        spec = ToolSpec(offered_name("srv", "a.b"), "d", {"type": "object",
                                                         "properties": props})
        return McpTool(server, SimpleNamespace(name="a.b"), spec)

    assert tool({}).name == "srv_a_b"
    assert tool({"q": {"type": "string"}}).arguments('{"not": "json-parsed"}') == {
        "q": '{"not": "json-parsed"}'}
    assert tool({"n": {"type": "integer"}}).arguments("3") == {"n": 3}
    both = tool({"a": {}, "b": {}})
    assert both.arguments('{"a": 1, "b": 2}') == {"a": 1, "b": 2}
    assert both.arguments("[1]").startswith("Error: the arguments of srv_a_b are a JSON "
                                            "object (keys: a, b); got list")
    assert tool({}).arguments("") == {}
    assert tool({"q": {"type": "string"}}).version != tool({"q": {"type": "number"}}).version
