"""MCP servers as tools (tools.mcp), with the small server of tests/integration/
mcp_server.py (a slow tool and one that fails) started for real, over stdio and over
streamable HTTP, and called through the real ToolRunner: names and schemas under both
syntaxes, the cache, the runner's timeout, error results, a server that dies answered
with an error and restarted with backoff, and nothing left running after close. The
rollout on vLLM is in test_hermes_rollout.py."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from arpo_async.core.config import ConfigError, ToolsConfig
from arpo_async.core.ports import free_port
from toolenv.runner import build_tools
from toolenv.syntax import ArpoSyntax, HermesSyntax, tool_specs

pytestmark = pytest.mark.integration

SERVER = str(Path(__file__).with_name("mcp_server.py"))
STDIO = {"name": "testsrv", "command": sys.executable, "args": [SERVER]}


def _servers() -> list[psutil.Process]:
    """The test servers among this process's children; a child that is a zombie (an
    earlier test's vLLM EngineCore), exits while listed, or is not ours to read is not one."""
    found = []
    for proc in psutil.Process().children(recursive=True):
        try:
            if SERVER in " ".join(proc.cmdline()):
                found.append(proc)
        except (psutil.NoSuchProcess, psutil.ZombieProcess, psutil.AccessDenied):
            continue
    return found


def _wait(predicate, timeout_s: float = 60.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


async def test_stdio_server_through_the_runner(tmp_path, tiny_model_dir):
    from transformers import AutoTokenizer

    cfg = ToolsConfig(mcp=[STDIO], timeout_s=1.0, mcp_restart_backoff_s=1.0)
    runner = build_tools(cfg, tmp_path)
    try:
        assert sorted(runner.tools) == ["testsrv_fails", "testsrv_slow"]
        slow = runner.tools["testsrv_slow"]
        assert slow.parameters["required"] == ["text"]
        assert set(slow.parameters["properties"]) == {"text", "seconds"}
        # both syntaxes: an arpo tag per tool, hermes functions with the server's schema
        specs = tool_specs(cfg)
        assert "</testsrv_slow>" in ArpoSyntax(specs).stop_strings
        hermes = HermesSyntax(specs, AutoTokenizer.from_pretrained(tiny_model_dir))
        system, _ = hermes.prompt("s")
        assert json.dumps(slow.parameters) in system
        bad = hermes.find_call('<tool_call>{"name": "testsrv_slow", "arguments": {}}'
                               '</tool_call>')
        assert "invalid arguments" in bad.error and "'text' is a required property" in bad.error
        good = hermes.find_call('<tool_call>{"name": "testsrv_slow", "arguments": '
                                '{"text": "hi"}}</tool_call>')
        first, again = [await runner.call(good.name, good.args) for _ in range(2)]
        assert (first.text, first.cached, again.cached) == ("HI", False, True)
        # the runner's timeout holds; the server lives on
        late = await runner.call("testsrv_slow", '{"text": "x", "seconds": 30}')
        assert late.error == "timeout" and not late.ok
        assert (await runner.call("testsrv_slow", '{"seconds": 0, "text": "up"}')).text == "UP"
        failed = [await runner.call("testsrv_fails", "error") for _ in range(2)]
        assert [r.error for r in failed] == ["mcp_error"] * 2  # never cached
        assert "asked to fail (error)" in failed[0].text
        assert (await runner.call("testsrv_fails", "[1")).error == "mcp_error"
        # the server dies: the call that killed it, and one during the backoff, get errors
        pids = [p.pid for p in _servers()]
        died = await runner.call("testsrv_fails", "exit")
        assert died.error == "mcp_down" and not died.ok
        down = await runner.call("testsrv_slow", '{"text": "x"}')
        assert down.error == "mcp_down" and "is not running" in down.text
        assert _wait(lambda: slow.stats()["mcp_restarts"] == 1), slow.stats()
        assert (await runner.call("testsrv_slow", '{"text": "back"}')).text == "BACK"
        stats = runner.stats()
        assert stats["testsrv_slow.mcp_deaths"] == 1 and stats["testsrv_slow.mcp_up"] == 1
        assert stats["testsrv_fails.calls"] == 4 and stats["cache_hits"] == 1
        assert [p.pid for p in _servers()] != pids  # a new process
    finally:
        await runner.close()
    assert _servers() == []


def _free_port() -> int:
    return free_port()


def _listening(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
        return True
    except OSError:
        return False


async def test_http_server_and_bad_entries(tmp_path):
    port = _free_port()
    proc = subprocess.Popen([sys.executable, SERVER, "--http", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        assert _wait(lambda: _listening(port) or proc.poll() is not None)
        cfg = ToolsConfig(mcp=[{"name": "web", "url": f"http://127.0.0.1:{port}/mcp"}],
                          mcp_restart_backoff_s=30.0)
        runner = build_tools(cfg, tmp_path / "http")
        try:
            assert (await runner.call("web_slow", '{"text": "over http"}')).text == "OVER HTTP"
            proc.kill()
            proc.wait()
            gone = await runner.call("web_slow", '{"text": "again"}')
            assert gone.error == "mcp_down" and not gone.ok
            assert runner.stats()["web_slow.mcp_deaths"] == 1
        finally:
            await runner.close()
    finally:
        proc.kill()
        proc.wait()
    with pytest.raises(ConfigError, match=r"tools.mcp\[0\] \(nope\): cannot start"):
        build_tools(ToolsConfig(mcp=[{"name": "nope", "command": "/nonexistent/server"}]),
                    tmp_path / "bad")
    assert _servers() == []
