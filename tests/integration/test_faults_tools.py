"""Hostile code through the actor's tool path (issue 7): 50 snippets (fork bombs, memory
and CPU hogs, sleepers, log floods, disk fillers, killers of their parent or of every
process, environment and network snoops, segfaults, deep recursion, thread floods, writes
to /etc/passwd) run in the python sandbox at once while 8 ordinary rollouts generate and
call the tool: each snippet is contained within its limits, leaks no secret, leaves no
process behind, and the rollouts are not slowed past their own limits."""

from __future__ import annotations

import asyncio
import subprocess
import time
import uuid
from pathlib import Path

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.slow]

HOSTILE = [
    "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass",
    "x = []\nwhile True:\n    x.append(bytearray(10**7))",
    "while True:\n    pass",
    "import time\ntime.sleep(60)",
    "while True:\n    print('x' * 1000)",
    "f = open('big', 'wb')\nwhile True:\n    f.write(b'x' * 10**6)",
    "import os\nos.kill(os.getppid(), 9)",
    "import os\nos.kill(-1, 9)",
    "import os\nprint(dict(os.environ))",
    "import socket\nsocket.create_connection(('1.1.1.1', 80), timeout=2)",
    "import ctypes\nctypes.string_at(0)",
    "def f(n):\n    return f(n + 1)\nf(0)",
    "import threading, time\nfor _ in range(10000):\n"
    "    threading.Thread(target=time.sleep, args=(60,)).start()",
    "open('/etc/passwd', 'a').write('pwned')",
]


async def test_fifty_hostile_snippets_do_not_break_other_rollouts(tiny_model_dir, tmp_path,
                                                                 monkeypatch):
    import shutil

    if shutil.which("bwrap") is None:
        pytest.skip("bubblewrap (bwrap) is not installed")
    from actors.engines.base import GenRequest
    from actors.engines.hf_engine import HFEngine
    from arpo_async.core.config import ToolsConfig
    from toolenv.runner import build_tools

    secret = f"sk-{uuid.uuid4().hex}"
    monkeypatch.setenv("SERPER_API_KEY", secret)  # what a web tool would hold
    limit = 3.0
    cfg = ToolsConfig(enabled=["python"], timeout_s=limit, concurrency=64, rate_per_s=1000,
                      python={"cpu_s": 2, "memory_mb": 256, "max_procs": 16})
    runner = build_tools(cfg, tmp_path / "run")
    engine = await HFEngine.create(tiny_model_dir, max_model_len=256)
    marker = uuid.uuid4().hex
    passwd = Path("/etc/passwd").read_bytes()

    async def call(code: str):
        t0 = time.monotonic()
        return await runner.call("python", code), time.monotonic() - t0

    async def rollout(k: int):
        """Another rollout: a generation round, a tool call, another round."""
        t0 = time.monotonic()
        first = await engine.generate(GenRequest(list(range(1, 9)), 24, seed=k))
        result = await runner.call("python", f"print({k} * 7)")
        second = await engine.generate(GenRequest(list(range(1, 9)) + first.tokens, 24, seed=k))
        return first, result, second, time.monotonic() - t0

    try:
        t0 = time.monotonic()
        hostile = [call(HOSTILE[i % len(HOSTILE)] + f"\n# {marker} {i}") for i in range(50)]
        honest = [rollout(k) for k in range(8)]
        results = await asyncio.gather(*hostile, *honest)
        total_s = time.monotonic() - t0
        stats = runner.stats()
    finally:
        await runner.close()
        await engine.close()
    bad, good = results[:50], results[50:]
    slack = 3.0  # sandbox start-up and kill on a busy 2-core machine (50 sandboxes at once)
    assert all(elapsed < limit + slack for _, elapsed in bad), [round(e, 2) for _, e in bad]
    assert sum(not r.ok for r, _ in bad) >= 30  # killed, timed out or failed: contained
    for k, (first, result, second, elapsed) in enumerate(good):
        assert len(first.tokens) >= 1 and len(second.tokens) >= 1
        assert result.ok and result.text.strip() == str(k * 7), result
        assert elapsed < 2 * limit + slack, elapsed  # its own limits, not the others'
    assert all(secret not in r.text for r, _ in bad)
    assert Path("/etc/passwd").read_bytes() == passwd
    assert stats["calls"] == 58 and stats["cache_hits"] == 0
    leftovers = subprocess.run(["pgrep", "-f", marker], capture_output=True, text=True).stdout
    assert leftovers.strip() == ""
    assert not any(secret.encode() in p.read_bytes() for p in (tmp_path / "run").rglob("*")
                   if p.is_file())
    print(f"\nhostile: 50 snippets + 8 rollouts in {total_s:.1f} s; slowest hostile "
          f"{max(e for _, e in bad):.2f} s, slowest rollout {max(g[3] for g in good):.2f} s; "
          f"tool errors {stats['errors']}, timeouts {stats['timeouts']}")
