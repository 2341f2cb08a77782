"""ToolCache shared by real processes: exact counts, no lost entries, and a writer killed
with SIGKILL mid-write leaves the cache readable and consistent."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import diskcache
import pytest

from toolenv.cache import ToolCache

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
PROCS, OPS, KEYS = 4, 5000, 1500

# Each worker waits for the go file so that all four hammer the cache at the same time.
WORKER = r"""
import json, os, random, sys, time
from toolenv.cache import ToolCache
directory, index, ops, keys, procs = sys.argv[1], *map(int, sys.argv[2:6])
go = os.path.join(directory, "..", "go")
while not os.path.exists(go):
    time.sleep(0.005)
rng = random.Random(1000 + index)
counts = {"hits": 0, "misses": 0, "sets": 0, "bad": 0}
written = set()
cache = ToolCache(directory)
for _ in range(ops):
    if rng.random() < 0.5:
        j = rng.randrange(keys)
        cache.set("search", "1", f"query {index} {j}", f"value {index} {j}")
        counts["sets"] += 1
        written.add(j)
    else:
        p, j = rng.randrange(procs), rng.randrange(keys)
        value = cache.get("search", "1", f"query {p} {j}")
        if value is None:
            counts["misses"] += 1
        else:
            counts["hits"] += 1
            counts["bad"] += value != f"value {p} {j}"
assert all(cache.stats()[k] == counts[k] for k in ("hits", "misses", "sets"))
cache.close()
print(json.dumps({**counts, "written": sorted(written)}))
"""

WRITER = r"""
import sys
from toolenv.cache import ToolCache
cache = ToolCache(sys.argv[1])
n = 0
while True:
    # mostly small values (stored in SQLite), every 7th large enough to go to its own file
    size = 40_000 if n % 7 == 0 else 10 + n % 3000
    cache.set("python", "1", f"print({n})", str(n % 10) * size)
    n += 1
    if n == 1:
        print("started", flush=True)
"""


def _env() -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=str(REPO))


def test_four_processes_exact_counts(tmp_path):
    directory = tmp_path / "cache"
    ToolCache(directory).close()  # create the schema once, before the race
    workers = [subprocess.Popen([sys.executable, "-c", WORKER, str(directory), str(i), str(OPS),
                                 str(KEYS), str(PROCS)], stdout=subprocess.PIPE, text=True,
                                env=_env(), cwd=REPO) for i in range(PROCS)]
    time.sleep(0.5)
    (tmp_path / "go").touch()
    reports = []
    for proc in workers:
        out, _ = proc.communicate(timeout=240)
        assert proc.returncode == 0, out
        reports.append(json.loads(out.strip().splitlines()[-1]))
    assert sum(r["bad"] for r in reports) == 0, "a get returned another key's value"
    assert sum(r["hits"] for r in reports) > 0 and sum(r["misses"] for r in reports) > 0
    assert all(r["hits"] + r["misses"] + r["sets"] == OPS for r in reports)
    with ToolCache(directory) as cache:
        disk = cache.disk_stats()
        assert disk["hits_total"] == sum(r["hits"] for r in reports)
        assert disk["misses_total"] == sum(r["misses"] for r in reports)
        assert disk["sets_total"] == sum(r["sets"] for r in reports)
        assert disk["entries"] == sum(len(r["written"]) for r in reports)
        for index, report in enumerate(reports):
            for j in report["written"]:
                assert cache.get("search", "1", f"query {index} {j}") == f"value {index} {j}"
        assert cache.check() == []


def test_writer_killed_mid_write_leaves_cache_sound(tmp_path):
    directory = tmp_path / "cache"
    writer = subprocess.Popen([sys.executable, "-c", WRITER, str(directory)],
                              stdout=subprocess.PIPE, text=True, env=_env(), cwd=REPO)
    try:
        assert writer.stdout.readline().strip() == "started"
        time.sleep(0.5)
    finally:
        writer.send_signal(signal.SIGKILL)
        writer.wait(timeout=10)
    assert writer.returncode == -signal.SIGKILL
    with diskcache.Cache(str(directory)) as raw:  # every stored entry reads back whole
        keys = list(raw.iterkeys())
        assert len(keys) > 10
        for key in keys:
            value = raw[key]
            assert value == value[0] * len(value)
    with ToolCache(directory) as cache:
        # A writer killed between creating a value file and committing its row leaves an
        # orphan file or empty folder: wasted space, not damage. Anything else is damage.
        orphans = (diskcache.UnknownFileWarning, diskcache.EmptyDirWarning)
        warnings = cache.check()
        damage = [str(w.message) for w in warnings if not issubclass(w.category, orphans)]
        assert damage == [], "diskcache check found damage"
        if warnings:
            # Removing an orphan file can empty its folder (and that one its parent), which
            # a later pass removes: value files sit two folders deep, so three passes at most
            for _ in range(3):
                left = cache.check(fix=True)
                assert all(issubclass(w.category, orphans) for w in left), left
            assert cache.check() == []
        assert cache.get("python", "1", "print(0)") == "0" * 40_000
        cache.set("python", "1", "after", "still works")
        assert cache.get("python", "1", "after") == "still works"
        assert cache.disk_stats()["entries"] == len(keys) + 1
