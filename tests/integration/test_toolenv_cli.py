"""``python -m toolenv``: help without heavy imports, tool calls, cache stats/clear, and the
retriever server's start-up errors, each as a real subprocess."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

from toolenv.cache import ToolCache
from toolenv.retriever_server import RetrieverProcess

pytestmark = pytest.mark.integration


def toolenv(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "toolenv", *args], capture_output=True,
                          text=True, timeout=timeout, check=False)


def test_help_imports_nothing_heavy():
    code = ("import sys, toolenv.__main__ as m\n"
            "try:\n    m.main(['serve-retriever', '--help'])\nexcept SystemExit:\n    pass\n"
            "print(sorted(k for k in ('aiohttp', 'bm25s', 'math_verify', 'pyarrow') "
            "if k in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, check=False)
    assert out.returncode == 0, out.stderr
    assert "--delay-ms" in out.stdout
    assert out.stdout.strip().endswith("[]")
    assert toolenv("--help").returncode == 0


@pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap not installed")
def test_call_python():
    out = toolenv("call", "python", "print(6*7)")
    assert (out.returncode, out.stdout) == (0, "42\n"), out.stderr
    failed = toolenv("call", "python", "raise SystemExit(3)")
    assert failed.returncode == 1 and failed.stdout == ""


@pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap not installed")
def test_call_python_in_a_session_that_forks():
    out = toolenv("call", "python", "--session", "x = 41", "x += 1; x", "x * 2",
                  "--fork-after", "2", "--child", "x -= 2; x", "x * 2")
    assert out.returncode == 0, out.stderr
    # the state persists from call to call; the fork starts from 42 and goes its own way
    assert out.stdout.splitlines() == [
        "[root 1]", "[root 2]", "42", "-- forked after call 2", "[root 3]", "84",
        "[child 3]", "40", "[child 4]", "80",
        "-- forks=1 replays=0 fork_fallbacks=0 replayed_calls=0"], out.stdout
    replayed = toolenv("call", "python", "--session", "y = 1", "--fork-after", "1",
                       "--child", "y + 1", "--replay")
    assert replayed.stdout.splitlines()[-3:] == [
        "[child 2]", "2", "-- forks=0 replays=1 fork_fallbacks=1 replayed_calls=1"]
    wrong = toolenv("call", "python", "a", "b")
    assert wrong.returncode == 2 and "need --session" in wrong.stderr


def test_call_search(tmp_path):
    corpus = tmp_path / "c.jsonl"
    corpus.write_text(json.dumps({"id": "a", "contents": "Danube\nThe Danube flows to the "
                                  "Black Sea."}) + "\n" +
                      json.dumps({"id": "b", "contents": "Rhine\nThe Rhine flows to the "
                                  "North Sea."}) + "\n")
    with RetrieverProcess(corpus) as server:
        out = toolenv("call", "search", "Rhine river", "--retriever", server.url, "--topk", "1")
    assert out.returncode == 0, out.stderr
    assert out.stdout == "Doc 1(Title: Rhine) The Rhine flows to the North Sea.\n"
    missing = toolenv("call", "search", "Rhine")
    assert missing.returncode != 0 and "--retriever" in missing.stderr


def test_cache_stats_and_clear(tmp_path):
    folder = tmp_path / "tool_cache"
    with ToolCache(folder) as cache:
        cache.set("search", "v1", "rhine", "Doc 1(Title: Rhine) ...")
        cache.set("python", "v1", "print(1)", "1")
        assert cache.get("search", "v1", "rhine") is not None
    stats = toolenv("cache", "stats", str(folder))
    assert stats.returncode == 0, stats.stderr
    got = json.loads(stats.stdout)
    assert got["entries"] == 2 and got["hits_total"] == 1 and got["sets_total"] == 2
    cleared = toolenv("cache", "clear", str(folder))
    assert cleared.returncode == 0 and cleared.stdout.startswith("removed 2 entries")
    assert json.loads(toolenv("cache", "stats", str(folder)).stdout)["entries"] == 0
    nowhere = toolenv("cache", "stats", str(tmp_path / "none"))
    assert nowhere.returncode == 2 and "no tool cache" in nowhere.stderr


def test_serve_retriever_rejects_bad_corpus(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": 1, "contents": "ok\\ntext"}\n{"id": 2, "contents": ""}\n')
    out = toolenv("serve-retriever", "--corpus", str(bad), "--port", "0")
    assert out.returncode == 2
    assert f"{bad}: row 2: no text" in out.stderr
