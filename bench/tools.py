"""Tool-path benchmark: ``python bench/tools.py`` prints and writes bench/results/tools.json.

1. Cache hit: latency of a repeated identical call through ``ToolRunner`` with the disk
   cache (the first call fills it), p50/p99 as the caller sees it.
2. Python sandbox: latency of ``print(1)`` through the real bubblewrap sandbox, p50/p99.
3. Search throughput: requests/s through ``ToolRunner`` at concurrency 32 against the real
   retriever server with ``--delay-ms 100`` added per request (ideal: 32 / 0.1 s = 320/s).

The corpus is synthetic and seeded (words drawn from a fixed vocabulary), so runs compare.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

from toolenv.cache import ToolCache
from toolenv.retriever_server import RetrieverProcess
from toolenv.runner import ToolRunner
from toolenv.search import SearchTool

RESULTS = Path(__file__).resolve().parent / "results" / "tools.json"


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def summary_ms(values: list[float]) -> dict[str, float]:
    return {"n": len(values), "p50_ms": 1e3 * percentile(values, 0.5),
            "p99_ms": 1e3 * percentile(values, 0.99), "mean_ms": 1e3 * statistics.fmean(values)}


def write_corpus(path: Path, docs: int, seed: int) -> None:
    rng = random.Random(seed)
    vocab = [f"w{i}" for i in range(5000)]
    with path.open("w") as fh:
        for i in range(docs):
            words = " ".join(rng.choices(vocab, k=60))
            fh.write(json.dumps({"id": str(i), "contents": f"Doc{i}\n{words}"}) + "\n")


async def bench_cache_hit(url: str, calls: int, cache_dir: Path) -> dict:
    runner = ToolRunner({"search": SearchTool(url)}, ToolCache(cache_dir), rate_per_s=0,
                        concurrency=8, timeout_s=30, retries=0)
    first = await runner.call("search", "w1 w2 w3")
    assert first.ok and not first.cached, first.text
    lat = []
    for _ in range(calls):
        res = await runner.call("search", "w1 w2 w3")
        assert res.cached, "repeated call missed the cache"
        lat.append(res.latency_s)
    await runner.close()
    return {**summary_ms(lat), "miss_ms": 1e3 * first.latency_s}


async def bench_python(calls: int) -> dict:
    from toolenv.python_tool import PythonTool

    tool = await asyncio.to_thread(PythonTool)  # its sandbox probe runs its own loop
    for _ in range(3):  # warm the page cache for the interpreter inside the sandbox
        await tool.call("print(1)")
    lat = []
    for _ in range(calls):
        start = time.perf_counter()
        res = await tool.call("print(1)")
        lat.append(time.perf_counter() - start)
        assert res.ok and res.text.strip() == "1", res.text
    await tool.close()
    return summary_ms(lat)


async def bench_search(url: str, requests: int, concurrency: int, delay_ms: float) -> dict:
    """``concurrency`` workers each issue calls back to back, so a call's latency is its
    own round trip (no time spent queued behind the runner's semaphore)."""
    runner = ToolRunner({"search": SearchTool(url)}, None, rate_per_s=0,
                        concurrency=concurrency, timeout_s=30, retries=0)
    rng = random.Random(1)
    queries = [f"w{rng.randrange(5000)} w{rng.randrange(5000)} q{i}" for i in range(requests)]
    results = []

    async def worker(mine: list[str]) -> None:
        for q in mine:
            results.append(await runner.call("search", q))

    start = time.perf_counter()
    await asyncio.gather(*(worker(queries[w::concurrency]) for w in range(concurrency)))
    elapsed = time.perf_counter() - start
    await runner.close()
    return {"requests": requests, "concurrency": concurrency, "delay_ms": delay_ms,
            "seconds": elapsed, "req_per_s": requests / elapsed,
            "errors": sum(not r.ok for r in results),
            "ideal_req_per_s": concurrency / (delay_ms / 1000) if delay_ms else None,
            **summary_ms([r.latency_s for r in results])}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--cache-calls", type=int, default=1000, help="repeated cached calls")
    p.add_argument("--python-calls", type=int, default=50, help="sandboxed print(1) calls")
    p.add_argument("--search-requests", type=int, default=960, help="search requests")
    p.add_argument("--concurrency", type=int, default=32, help="search calls in flight")
    p.add_argument("--delay-ms", type=float, default=100.0, help="retriever added latency")
    p.add_argument("--docs", type=int, default=5000, help="synthetic corpus size")
    p.add_argument("--out", default=str(RESULTS), help="JSON results file")
    a = p.parse_args(argv)

    out: dict = {"host": {"cpus": os.cpu_count(), "python": sys.version.split()[0],
                          "platform": platform.platform()},
                 "time": time.strftime("%Y-%m-%dT%H:%M:%S")}
    with tempfile.TemporaryDirectory(prefix="bench-tools-") as tmp:
        corpus = Path(tmp) / "corpus.jsonl"
        write_corpus(corpus, a.docs, seed=0)
        with RetrieverProcess(corpus) as fast:
            out["cache_hit"] = asyncio.run(bench_cache_hit(fast.url, a.cache_calls,
                                                           Path(tmp) / "cache"))
        out["python_sandbox"] = asyncio.run(bench_python(a.python_calls))
        with RetrieverProcess(corpus, delay_ms=a.delay_ms) as slow:
            out["search"] = asyncio.run(bench_search(slow.url, a.search_requests,
                                                     a.concurrency, a.delay_ms))
            out["search"]["server_max_inflight"] = slow.stats()["max_inflight"]
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(out, indent=2) + "\n")
    c, py, s = out["cache_hit"], out["python_sandbox"], out["search"]
    print(f"cache hit        p50 {c['p50_ms']:.3f} ms  p99 {c['p99_ms']:.3f} ms "
          f"(miss {c['miss_ms']:.1f} ms, n={c['n']})")
    print(f"python print(1)  p50 {py['p50_ms']:.1f} ms  p99 {py['p99_ms']:.1f} ms (n={py['n']})")
    print(f"search           {s['req_per_s']:.0f} req/s at concurrency {s['concurrency']}, "
          f"{s['delay_ms']:g} ms server delay (ideal {s['ideal_req_per_s']:.0f}), "
          f"p50 {s['p50_ms']:.0f} ms, errors {s['errors']}")
    print(f"wrote {a.out}")
    return out


if __name__ == "__main__":
    main()
