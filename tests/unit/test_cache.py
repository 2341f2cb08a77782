"""ToolCache: key canonicalisation, ttl, counters, refusal of errors, CLI helpers."""

from __future__ import annotations

import time

import pytest

from toolenv.base import ToolResult
from toolenv.base import canonical
from toolenv.builtin import BUILTIN_TOOLS
from toolenv.cache import ToolCache, cache_clear, cache_stats
from toolenv.runner import ToolRunner


@pytest.fixture
def cache(tmp_path):
    with ToolCache(tmp_path / "cache") as c:
        yield c


@pytest.mark.parametrize(
    ("tool", "a", "b"),
    [
        ("python", "print(1)\r\n", "print(1)"),
        ("python", "x=1\r\nprint(x)   \n\n", "x=1\nprint(x)"),
        ("python", "a=1\rb=2", "a=1\nb=2"),
        ("search", "  Capital   of\tFrance\n", "capital of france"),
        ("search", "EIFFEL Tower", "eiffel tower"),
    ],
)
def test_same_key(tool, a, b):
    """Each built-in tool's canonical form (what the runner hands the cache)."""
    cls = BUILTIN_TOOLS[tool]
    assert canonical(cls, a) == canonical(cls, b)
    key = ToolCache.key
    assert key(tool, "1", canonical(cls, a)) == key(tool, "1", canonical(cls, b))


@pytest.mark.parametrize(
    ("tool", "a", "b"),
    [
        # inside code, whitespace and case matter: they change what the code prints
        ("python", "print('a  b')", "print('a b')"),
        ("python", "print('A')", "print('a')"),
        ("python", "if 1:\n  print(1)", "if 1:\n    print(1)"),
        ("search", "paris france", "paris, france"),
        ("other", "X ", "x"),  # unknown tools: arguments used as given
    ],
)
def test_different_key(tool, a, b):
    cls = BUILTIN_TOOLS.get(tool, object)  # a tool without canonical(): arguments as given
    key = ToolCache.key
    assert key(tool, "1", canonical(cls, a)) != key(tool, "1", canonical(cls, b))


def test_key_includes_tool_and_version():
    keys = {ToolCache.key("python", "1", "x"), ToolCache.key("python", "2", "x"),
            ToolCache.key("search", "1", "x")}
    assert len(keys) == 3
    assert len(ToolCache.key("python", "1", "x")) == 64  # sha256 hex


def test_get_set_and_counters(cache):
    assert cache.get("python", "1", "print(1)") is None
    cache.set("python", "1", "print(1)", "1")
    assert cache.get("python", "1", "print(1)") == "1"
    assert cache.get("python", "1", "print(1)\n") is None  # canonical forms: the runner's
    assert cache.get("python", "2", "print(1)") is None  # other version
    assert cache.get("search", "1", "print(1)") is None  # other tool
    stats = cache.stats()
    assert (stats["hits"], stats["misses"], stats["sets"]) == (1, 4, 1)
    assert stats["hit_rate"] == pytest.approx(0.2)
    assert stats["get_latency_mean_s"] > 0 and stats["set_latency_mean_s"] > 0
    disk = cache.disk_stats()
    assert (disk["entries"], disk["hits_total"], disk["misses_total"], disk["sets_total"]) == \
        (1, 1, 4, 1)
    assert disk["size_bytes"] > 0


def test_persistent_counters_add_up_across_instances(tmp_path):
    with ToolCache(tmp_path / "c") as first:
        first.set("search", "1", "q", "a")
        first.get("search", "1", "q")
    with ToolCache(tmp_path / "c") as second:
        second.get("search", "1", "q")
        second.get("search", "1", "other")
        assert second.stats()["hits"] == 1  # this instance only
        disk = second.disk_stats()
    assert (disk["hits_total"], disk["misses_total"], disk["sets_total"]) == (2, 1, 1)


def test_ttl_expiry(tmp_path):
    # 2 s, not less: on a loaded machine set + get once took over 0.3 s
    with ToolCache(tmp_path / "c", ttl_s=2.0) as cache:
        cache.set("search", "1", "q", "answer")
        assert cache.get("search", "1", "q") == "answer"
        time.sleep(2.2)
        assert cache.get("search", "1", "q") is None
    with ToolCache(tmp_path / "d", ttl_s=0) as forever:
        forever.set("search", "1", "q", "answer")
        time.sleep(0.1)
        assert forever.get("search", "1", "q") == "answer"
    with pytest.raises(ValueError, match="ttl_s"):
        ToolCache(tmp_path / "e", ttl_s=-1)


def test_set_refuses_errors(cache):
    with pytest.raises(ValueError, match="errors are never cached"):
        cache.set("python", "1", "1/0", "ZeroDivisionError", ok=False)
    with pytest.raises(TypeError):
        cache.set("python", "1", "x", b"bytes")
    assert cache.disk_stats()["entries"] == 0


class _Scripted:
    name, version = "python", "1"

    def __init__(self, results):
        self.results = list(results)

    async def call(self, args):
        return self.results.pop(0)

    async def close(self):
        pass


async def test_errors_never_cached_via_runner(cache):
    results = [ToolResult("Traceback: ZeroDivisionError", ok=False, error="exception"),
               ToolResult("killed", ok=False, error="timeout"),
               ToolResult("503", ok=False, error="http_503", transient=True),
               ToolResult("42", ok=True)]
    runner = ToolRunner({"python": _Scripted(results)}, cache, rate_per_s=0, concurrency=1,
                        timeout_s=5, retries=0)
    for _ in range(3):
        assert not (await runner.call("python", "code")).ok
        assert cache.get("python", "1", "code") is None
    assert (await runner.call("python", "code")).ok
    assert cache.get("python", "1", "code") == "42"
    assert cache.disk_stats()["sets_total"] == 1


def test_cli_helpers(tmp_path):
    with pytest.raises(FileNotFoundError, match="no tool cache"):
        cache_stats(tmp_path / "missing")
    with pytest.raises(FileNotFoundError):
        cache_clear(tmp_path / "missing")
    assert not (tmp_path / "missing").exists()  # looking did not create it
    with ToolCache(tmp_path / "c") as cache:
        for i in range(5):
            cache.set("search", "1", f"q{i}", f"a{i}")
        cache.get("search", "1", "q0")
    stats = cache_stats(tmp_path / "c")
    assert (stats["entries"], stats["sets_total"], stats["hits_total"]) == (5, 5, 1)
    assert cache_clear(tmp_path / "c") == 5
    stats = cache_stats(tmp_path / "c")
    assert (stats["entries"], stats["sets_total"], stats["hits_total"]) == (0, 0, 0)
