"""Python sessions benchmark: ``python bench/python_session.py`` prints and writes
bench/results/python_session.json.

A session (``tools.python.state=session``, the real bubblewrap sandbox) runs ``h`` calls,
h in ``--histories`` (1, 4, 16); each call defines a variable holding a list of 100 ints.
Then, ``--repeats`` times, its state is copied to a new session in each of the two ways
``toolenv/session.py`` has, and the copy is brought to the point where its next call can
run (``SessionManager.prepare``):

- fork: the parent writes a checkpoint (``fork``) and a fresh sandbox from the warm pool
  loads it;
- replay: no checkpoint (``checkpoint_bytes = 0``), so a fresh sandbox re-executes the h
  calls of the history.

Latency is wall time from asking for the copy to the copy being ready, p50/p99 over the
repeats; the pool is refilled between repeats (``--pool`` sandboxes, a trajectory's next
round would give it that time), so a fork's sandbox is ready when asked for, as in a
rollout whose pool keeps up. The load average is recorded with each row: a busy machine
stretches the tails. The last line is ``RESULT python_session fork_p50_ms=<the largest
fork p50 over the history lengths> replay_p50_ms_at_16=<y> target=fork_p50_ms<=30
met|missed``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results" / "python_session.json"
TARGET_FORK_P50_MS = 30.0


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def _refilled(tool) -> None:
    pool = tool.sessions.pool
    while pool is not None and len(pool._ready) < pool.size:
        await asyncio.sleep(0.01)


async def _copy_ms(tool, parent, replay: bool) -> float:
    manager = tool.sessions
    manager.checkpoint_bytes = 0 if replay else 64 << 20
    start = time.perf_counter()
    child = await parent.fork()
    problem = await manager.prepare(child)
    elapsed = time.perf_counter() - start
    assert problem is None, problem
    check = await tool.call_in(child, "print(len(v0))")
    assert check.ok and check.text == "100", check.text
    child.close()
    return 1e3 * elapsed


async def bench_history(h: int, repeats: int, pool: int) -> dict:
    from toolenv.python_tool import PythonTool

    tool = await asyncio.to_thread(PythonTool, pool=pool, state="session",
                                   max_sessions=pool + 4)
    try:
        parent = tool.open_session()
        for i in range(h):
            result = await tool.call_in(parent, f"v{i} = list(range(100))")
            assert result.ok, result.text
        rows = {"fork": [], "replay": []}
        for _ in range(repeats):
            for kind in ("fork", "replay"):
                await _refilled(tool)
                rows[kind].append(await _copy_ms(tool, parent, kind == "replay"))
        stats = tool.stats()
        assert stats["session_fork_fallbacks"] == repeats, stats  # the replays, no others
    finally:
        await tool.close()
    return {"history": h, "load_1min": os.getloadavg()[0],
            **{f"{kind}_{name}_ms": fn(values) for kind, values in rows.items()
               for name, fn in (("p50", lambda v: percentile(v, 0.5)),
                                ("p99", lambda v: percentile(v, 0.99)),
                                ("mean", statistics.fmean))},
            "fork_ms": rows["fork"], "replay_ms": rows["replay"]}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--histories", type=int, nargs="+", default=[1, 4, 16],
                   help="calls in the parent's history")
    p.add_argument("--repeats", type=int, default=30, help="forks and replays per history")
    p.add_argument("--pool", type=int, default=2, help="warm session sandboxes")
    p.add_argument("--out", default=str(RESULTS), help="JSON results file")
    a = p.parse_args(argv)
    out = {"host": {"cpus": os.cpu_count(), "python": sys.version.split()[0],
                    "platform": platform.platform()},
           "time": time.strftime("%Y-%m-%dT%H:%M:%S"), "repeats": a.repeats, "rows": []}
    for h in a.histories:
        row = asyncio.run(bench_history(h, a.repeats, a.pool))
        out["rows"].append(row)
        print(f"history {h:3d}: fork p50 {row['fork_p50_ms']:.1f} ms p99 "
              f"{row['fork_p99_ms']:.1f} ms | replay p50 {row['replay_p50_ms']:.1f} ms p99 "
              f"{row['replay_p99_ms']:.1f} ms  (load {row['load_1min']:.1f})", flush=True)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {a.out}")
    fork_p50 = max(r["fork_p50_ms"] for r in out["rows"])
    at16 = next((r["replay_p50_ms"] for r in out["rows"] if r["history"] == 16), float("nan"))
    met = "met" if fork_p50 <= TARGET_FORK_P50_MS else "missed"
    print(f"RESULT python_session fork_p50_ms={fork_p50:.1f} replay_p50_ms_at_16={at16:.1f} "
          f"target=fork_p50_ms<={TARGET_FORK_P50_MS:g} {met}")
    return out


if __name__ == "__main__":
    main()
