"""MCP servers that misbehave (issue 36), each forced with the test server of
tests/integration/mcp_server.py started for real and called through the real ToolRunner:
a byte that is not UTF-8 on stdout, a server that stops answering, answers far over the
result cap (stdio and HTTP), input schemas jsonschema cannot use, a server that exits at
start. Each test failed before the fix it names."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time

import pytest

from arpo_async.core.config import ConfigError, ToolsConfig
from tests.integration.test_mcp_tools import SERVER, _free_port, _listening, _servers, _wait
from toolenv.runner import build_tools
from toolenv.syntax import tool_specs

pytestmark = pytest.mark.integration

CAP = 1000  # tools.max_result_chars here: the message limit is 16 * CAP + 64 KiB
MARKER = f"\n... [result truncated at {CAP} characters]"


def _stdio(*flags: str) -> dict:
    return {"name": "testsrv", "command": sys.executable, "args": [SERVER, *flags]}


async def test_a_byte_that_is_not_utf8_costs_a_line_not_the_connection(tmp_path):
    """The SDK's strict decoding sent its reader into draining stdout for good: the call
    that wrote the byte, and every later one, timed out while the server counted as up."""
    cfg = ToolsConfig(mcp=[_stdio("--misbehave")], timeout_s=3.0)
    runner = build_tools(cfg, tmp_path)
    try:
        for i in range(2):
            got = await runner.call("testsrv_garbage", f"after garbage {i}")
            assert (got.ok, got.text) == (True, f"after garbage {i}"), got
        assert (await runner.call("testsrv_slow", '{"text": "up"}')).text == "UP"
        assert runner.stats()["testsrv_slow.mcp_deaths"] == 0
    finally:
        await runner.close()
    assert _servers() == []


async def test_calls_that_go_unanswered_count_as_a_lost_connection(tmp_path):
    """A server that stops reading (here: SIGSTOP) was never restarted: every call timed
    out and the server counted as up. Now two timeouts in a row and an unanswered ping
    count as a death, and the server is stopped and started again."""
    cfg = ToolsConfig(mcp=[_stdio("--misbehave")], timeout_s=1.0, retries=0,
                      mcp_restart_backoff_s=0.1)
    runner = build_tools(cfg, tmp_path)
    try:
        slow = runner.tools["testsrv_slow"]
        first = [p.pid for p in _servers()]
        assert (await runner.call("testsrv_stall", "")).error == "timeout"
        assert (await runner.call("testsrv_slow", '{"text": "a"}')).error == "timeout"
        assert _wait(lambda: slow.stats()["mcp_restarts"] == 1, 20), slow.stats()
        assert (await runner.call("testsrv_slow", '{"text": "back"}')).text == "BACK"
        assert slow.stats()["mcp_deaths"] == 1
        assert [p.pid for p in _servers()] != first
    finally:
        await runner.close()
    assert _servers() == []


async def test_one_slow_call_is_not_a_lost_connection(tmp_path):
    """The other side of the rule above: a single timeout of a slow tool, with the
    server answering afterwards, restarts nothing."""
    cfg = ToolsConfig(mcp=[_stdio()], timeout_s=0.5, retries=0)
    runner = build_tools(cfg, tmp_path)
    try:
        late = await runner.call("testsrv_slow", '{"text": "x", "seconds": 30}')
        assert late.error == "timeout"
        assert (await runner.call("testsrv_slow", '{"text": "y"}')).text == "Y"
        await asyncio.sleep(1.0)  # a probe, had one started, would have ended by now
        assert runner.tools["testsrv_slow"].stats()["mcp_deaths"] == 0
    finally:
        await runner.close()


async def _check_caps(runner, prefix: str) -> None:
    """A result over the cap is cut with the marker, counted and cached cut; one over
    the message limit is refused at once, and the server's other tools still answer."""
    cut = await runner.call(f"{prefix}_big", "5000")
    assert cut.ok and cut.truncated and cut.text == "x" * CAP + MARKER
    again = await runner.call(f"{prefix}_big", "5000")
    assert again.cached and again.text == cut.text  # the cache holds the cut text
    start = time.monotonic()
    huge = await runner.call(f"{prefix}_big", "5000000")
    assert (huge.ok, huge.error, huge.truncated) == (False, "too_large", True), huge
    assert "over the" in huge.text and len(huge.text) < 500
    assert time.monotonic() - start < 5.0
    assert (await runner.call(f"{prefix}_slow", '{"text": "still"}')).text == "STILL"
    stats = runner.stats()
    assert stats[f"{prefix}_big.truncated"] == 2 and stats["truncated"] == 2
    assert stats[f"{prefix}_big.mcp_deaths"] == 0


async def test_results_over_the_cap_over_stdio(tmp_path):
    """Before: a 5 MB result reached the model whole and was cached as a 5 MiB entry."""
    runner = build_tools(ToolsConfig(mcp=[_stdio("--misbehave")], max_result_chars=CAP,
                                     timeout_s=20.0), tmp_path)
    try:
        await _check_caps(runner, "testsrv")
    finally:
        await runner.close()


async def test_results_over_the_cap_over_http(tmp_path):
    port = _free_port()
    proc = subprocess.Popen([sys.executable, SERVER, "--misbehave", "--http", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        assert _wait(lambda: _listening(port) or proc.poll() is not None)
        cfg = ToolsConfig(mcp=[{"name": "web", "url": f"http://127.0.0.1:{port}/mcp"}],
                          max_result_chars=CAP, timeout_s=20.0)
        runner = build_tools(cfg, tmp_path)
        try:
            await _check_caps(runner, "web")
        finally:
            await runner.close()
    finally:
        proc.kill()
        proc.wait()


async def test_a_huge_answer_blocks_neither_the_server_nor_the_caller(tmp_path):
    """Before: a 50 MB answer kept the server's other tools from answering for 18.8 s
    (the SDK's reader copied the pending text once per chunk) and stalled the caller's
    loop for up to 1.5 s (one parse of it holding the GIL). Now it is read past."""
    runner = build_tools(ToolsConfig(mcp=[_stdio("--misbehave")], max_result_chars=CAP,
                                     timeout_s=30.0), tmp_path)
    gaps = []

    async def tick() -> None:
        while True:
            before = time.monotonic()
            await asyncio.sleep(0.01)
            gaps.append(time.monotonic() - before)

    ticker = asyncio.create_task(tick())
    try:
        start = time.monotonic()
        huge = await runner.call("testsrv_big", "50000000")
        took = time.monotonic() - start
        assert huge.error == "too_large"
        quick = time.monotonic()
        assert (await runner.call("testsrv_slow", '{"text": "next"}')).text == "NEXT"
        assert time.monotonic() - quick < 1.0
    finally:
        ticker.cancel()
        await runner.close()
    assert took < 8.0, took  # 0.65 s here: mostly the server making 100 MB of JSON
    assert max(gaps) < 0.3, max(gaps)  # 14 ms here


@pytest.mark.parametrize("kind", ["pattern", "type", "ref"])
def test_a_schema_jsonschema_cannot_use_is_refused_at_start(tmp_path, kind):
    """Before: accepted, then HermesSyntax.find_call raised re.error, UnknownType or a
    referencing error in the middle of a rollout."""
    cfg = ToolsConfig(mcp=[_stdio("--bad-schema", kind)])
    needle = r"tools.mcp\[0\] \(testsrv\): tool 'slow' has an input schema"
    with pytest.raises(ConfigError, match=needle):
        build_tools(cfg, tmp_path)
    with pytest.raises(ConfigError, match=needle):
        tool_specs(cfg)
    assert _servers() == []


def test_a_server_that_exits_at_start_says_why(tmp_path):
    """Before: "ExceptionGroup: unhandled errors in a TaskGroup (1 sub-exception)"."""
    cfg = ToolsConfig(mcp=[_stdio("--exit-at-start", "7")])
    with pytest.raises(ConfigError) as caught:
        build_tools(cfg, tmp_path)
    message = str(caught.value)
    assert "exited with code 7" in message, message
    assert "refusing to start (asked to)" in message and "ExceptionGroup" not in message
    assert _servers() == []


@pytest.mark.parametrize("schema, text", [
    ({"type": "object", "properties": {"text": {"type": "string", "pattern": "(?P<"}}}, '"a"'),
    ({"type": "object", "properties": {"text": {"type": "strin"}}}, '"a"'),
    ({"type": "object", "properties": {"text": {"$ref": "#/$defs/nowhere"}}}, '"a"'),
    ({"type": "object", "properties": {"text": {"minimum": "a"}}}, "1"),
])
def test_find_call_answers_a_schema_it_cannot_use_instead_of_raising(tiny_model_dir, schema,
                                                                     text):
    """Before: re.error, UnknownType, a referencing error or TypeError out of find_call,
    unguarded in actors/rollout/path.py (a custom tool's schema is not checked at start)."""
    from transformers import AutoTokenizer

    from toolenv.base import ToolSpec
    from toolenv.syntax import HermesSyntax

    hermes = HermesSyntax([ToolSpec("bad", "a tool", schema)],
                          AutoTokenizer.from_pretrained(tiny_model_dir))
    body = json.dumps({"name": "bad", "arguments": {"text": json.loads(text)}})
    call = hermes.find_call(f"<tool_call>{body}</tool_call>")
    assert call.name == "bad" and call.error.startswith("Error: the schema of bad cannot be "
                                                        "checked ("), call
