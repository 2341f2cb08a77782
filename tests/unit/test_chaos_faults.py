"""The chaos soak's fault injectors (arpo_async/jobs/chaos_faults.py) do what they say
on real processes: the full-cache fault makes a writer's inserts fail until it is
lifted, the delaying proxy slows requests on kept-alive connections."""

from __future__ import annotations

import json
import subprocess
import sys
import time

from arpo_async.jobs import chaos_faults as F
from tests.conftest import REPO, python_env

_WRITER = r"""
import sys, time
from toolenv.cache import ToolCache
cache = ToolCache(sys.argv[1])
for i in range(50):
    cache.set("python", "1", f"print({i})", "x" * 2000)
print("warm", flush=True)
for line in sys.stdin:  # one insert per line; reports ok or the error
    try:
        cache.set("python", "1", f"print('{line.strip()}')", "y" * 4000)
        print("ok", flush=True)
    except Exception as exc:
        print(type(exc).__name__, flush=True)
"""


def test_the_full_cache_fault_makes_inserts_fail_until_lifted(tmp_path):
    proc = subprocess.Popen([sys.executable, "-c", _WRITER, str(tmp_path / "c")], cwd=REPO,
                            env=python_env(), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True)
    try:
        assert proc.stdout.readline().strip() == "warm"

        def insert(n: int) -> list[str]:
            out = []
            for i in range(n):
                proc.stdin.write(f"{time.time()}-{i}\n")
                proc.stdin.flush()
                out.append(proc.stdout.readline().strip())
            return out

        assert set(insert(3)) == {"ok"}
        before = F.limit_file_size(proc.pid, F.cache_bytes(tmp_path / "c"))
        full = insert(50)
        F.restore_file_size_tree(proc.pid, before)
        after = insert(3)
    finally:
        proc.kill()
        proc.wait()
    assert "ok" not in full[-10:], full  # the log passed the limit: inserts fail
    assert set(full) - {"ok"} and set(after) == {"ok"}, (full, after)
    from toolenv.cache import ToolCache

    with ToolCache(tmp_path / "c") as cache:
        assert cache.check() == []
    print(json.dumps({"failed": sum(x != "ok" for x in full)}))
