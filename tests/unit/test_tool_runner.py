"""ToolRunner with fake tools: rate limit, concurrency, timeouts, retries, cache, stats."""

from __future__ import annotations

import asyncio
import time

import pytest

from toolenv.base import ToolResult
from toolenv.cache import ToolCache
from toolenv.search import SearchTool
from toolenv.runner import ToolRunner, build_tools


class FakeTool:
    """A scripted tool: each call pops the next behaviour (default: echo the args)."""

    def __init__(self, name="python", delay_s=0.0, script=None):
        self.name, self.version = name, "v1"
        self.delay_s = delay_s
        self.script = list(script or [])
        self.calls: list[tuple[str, float]] = []
        self.in_flight = self.max_in_flight = 0
        self.closed = False

    async def call(self, args: str) -> ToolResult:
        self.calls.append((args, time.monotonic()))
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            await asyncio.sleep(self.delay_s)
            step = self.script.pop(0) if self.script else "ok"
            if isinstance(step, BaseException):
                raise step
            if step == "transient":
                return ToolResult("HTTP 503", ok=False, error="http_503", transient=True)
            if step == "fail":
                return ToolResult("Traceback: boom", ok=False, error="exception")
            return ToolResult(f"out:{args}", ok=True)
        finally:
            self.in_flight -= 1

    async def close(self) -> None:
        self.closed = True


def _runner(tools, cache=None, rate=0.0, concurrency=16, timeout=5.0, retries=2, backoff=0.01):
    tools = tools if isinstance(tools, dict) else {t.name: t for t in tools}
    return ToolRunner(tools, cache, rate_per_s=rate, concurrency=concurrency,
                      timeout_s=timeout, retries=retries, backoff_s=backoff)


async def test_rate_limit_spreads_calls():
    tool = FakeTool()
    runner = _runner([tool], rate=20.0)
    start = time.monotonic()
    results = await asyncio.gather(*(runner.call("python", str(i)) for i in range(50)))
    elapsed = time.monotonic() - start
    assert all(r.ok for r in results)
    starts = sorted(t for _, t in tool.calls)
    # 20 per second: the first 20 at once, then 20 more a second later, then the last 10
    assert elapsed >= 1.9  # no upper bound: a loaded machine only makes it slower
    for i in range(len(starts) - 20):
        assert starts[i + 20] - starts[i] >= 0.99, "more than 20 calls started within 1 s"


async def test_rate_below_one_per_second():
    tool = FakeTool()
    runner = _runner([tool], rate=0.8)  # one call every 1.25 s
    await asyncio.gather(*(runner.call("python", str(i)) for i in range(2)))
    assert tool.calls[1][1] - tool.calls[0][1] >= 1.24


async def test_concurrency_limit_never_exceeded():
    tool = FakeTool(delay_s=0.02)
    runner = _runner([tool], concurrency=3)
    await asyncio.gather(*(runner.call("python", str(i)) for i in range(30)))
    assert tool.max_in_flight == 3
    assert len(tool.calls) == 30


async def test_timeout_fires_and_is_not_cached_or_retried(tmp_path):
    tool = FakeTool(delay_s=30.0)
    cache = ToolCache(tmp_path / "c")
    runner = _runner([tool], cache=cache, timeout=0.2, retries=3)
    start = time.monotonic()
    result = await runner.call("python", "while True: pass")
    assert time.monotonic() - start < 1.0
    assert (result.ok, result.error, result.transient) == (False, "timeout", False)
    assert len(tool.calls) == 1
    assert cache.get("python", "v1", "while True: pass") is None
    stats = runner.stats()
    assert (stats["timeouts"], stats["errors"], stats["retries"]) == (1, 1, 0)
    assert cache.disk_stats()["entries"] == 0


async def test_transient_errors_retried_with_backoff():
    tool = FakeTool(script=["transient", "transient", "ok"])
    runner = _runner([tool], retries=2, backoff=0.05)
    start = time.monotonic()
    result = await runner.call("python", "x")
    assert result.ok and result.text == "out:x"
    assert len(tool.calls) == 3
    gaps = [b - a for (_, a), (_, b) in zip(tool.calls, tool.calls[1:])]
    assert gaps[0] >= 0.05 and gaps[1] >= 0.10  # exponential: 0.05, then 0.1
    assert time.monotonic() - start >= 0.15
    assert runner.stats()["retries"] == 2


async def test_transient_errors_reported_after_retries():
    tool = FakeTool(script=["transient"] * 10)
    runner = _runner([tool], retries=2)
    result = await runner.call("python", "x")
    assert (result.ok, result.error, result.transient) == (False, "http_503", True)
    assert len(tool.calls) == 3
    stats = runner.stats()
    assert (stats["retries"], stats["errors"], stats["executed"]) == (2, 1, 1)


async def test_non_transient_errors_not_retried(tmp_path):
    tool = FakeTool(script=["fail"])
    cache = ToolCache(tmp_path / "c")
    runner = _runner([tool], cache=cache, retries=5)
    result = await runner.call("python", "1/0")
    assert (result.ok, result.error) == (False, "exception")
    assert len(tool.calls) == 1
    assert cache.get("python", "v1", "1/0") is None  # errors are never cached


async def test_raised_exceptions_become_results():
    tool = FakeTool(script=[ConnectionResetError("reset"), ValueError("bug"), "ok"])
    runner = _runner([tool], retries=3)
    first = await runner.call("python", "a")  # reset -> retried -> ValueError, not transient
    assert (first.ok, first.error) == (False, "raised:ValueError")
    assert len(tool.calls) == 2
    assert (await runner.call("python", "b")).ok


async def test_cache_hits_skip_the_tool(tmp_path):
    """The runner keys the cache on the tool's canonical form of its arguments."""
    tool = FakeTool(name="search")
    tool.canonical = SearchTool.canonical
    cache = ToolCache(tmp_path / "c")
    runner = _runner([tool], cache=cache)
    first = await runner.call("search", "Capital of  France")
    second = await runner.call("search", "capital of france ")  # same canonical query
    assert first.ok and not first.cached
    assert second.ok and second.cached and second.text == first.text
    assert len(tool.calls) == 1
    stats = runner.stats()
    assert (stats["cache_hits"], stats["cache_misses"], stats["executed"]) == (1, 1, 1)


async def test_unknown_tool():
    runner = _runner([FakeTool()])
    result = await runner.call("browser", "x")
    assert (result.ok, result.error) == (False, "unknown_tool")
    assert "python" in result.text


async def test_stats_exact(tmp_path):
    py, search = FakeTool(script=["ok", "fail", "transient", "ok"]), FakeTool(name="search")
    cache = ToolCache(tmp_path / "c")
    runner = _runner([py, search], cache=cache, retries=1, backoff=0.0)
    await runner.call("python", "a")  # executed ok, stored
    await runner.call("python", "a")  # cache hit
    await runner.call("python", "b")  # fail
    await runner.call("python", "c")  # transient, retried once, ok
    await runner.call("search", "q")  # ok
    await runner.call("nope", "q")  # unknown tool
    stats = runner.stats()
    expected = {"calls": 6, "executed": 4, "cache_hits": 1, "cache_misses": 4, "errors": 2,
                "timeouts": 0, "retries": 1, "cache_store_errors": 0,
                "python.calls": 4, "python.cache_hits": 1, "python.errors": 1,
                "search.calls": 1, "search.errors": 0, "nope.calls": 1, "nope.errors": 1}
    for key, value in expected.items():
        assert stats[key] == value, key
    assert stats["latency_p50_s"] <= stats["latency_p99_s"]
    assert stats["latency_mean_s"] > 0 and stats["python.latency_mean_s"] > 0
    assert cache.stats()["sets"] == 3
    await runner.close()
    assert py.closed and search.closed


class BrokenCache:
    """A cache whose disk fails: lookups and stores raise."""

    def get(self, *args):
        raise OSError("database is locked")

    def set(self, *args):
        raise OSError("disk full")

    def close(self):
        pass


async def test_cache_failures_cost_only_the_cache():
    tool = FakeTool()
    runner = _runner([tool], cache=BrokenCache())
    result = await runner.call("python", "x")
    assert result.ok and result.text == "out:x" and not result.cached
    stats = runner.stats()
    assert (stats["cache_lookup_errors"], stats["cache_store_errors"], stats["errors"]) == (1, 1, 0)


def test_bad_limits_rejected():
    with pytest.raises(ValueError, match="concurrency"):
        _runner([FakeTool()], concurrency=0)


def test_build_tools(tmp_path):
    from arpo_async.core.config import ToolsConfig

    runner = build_tools(ToolsConfig(enabled=[]), tmp_path)
    assert runner.tools == {} and (tmp_path / "tool_cache" / "cache.db").is_file()
    with pytest.raises(ValueError, match="tools.enabled: unknown tool 'browser'"):
        build_tools(ToolsConfig(enabled=["browser"]), tmp_path)
    custom = tmp_path / "shared_cache"
    runner = build_tools(ToolsConfig(enabled=[], cache_dir=str(custom), cache_ttl_s=5), tmp_path)
    assert runner.cache.directory == custom and runner.cache.ttl_s == 5
