"""The warm-sandbox pool (toolenv/pool.py) in forced situations: a sandbox serves one call
and is never reused, waits and refills are counted, a failed preparation falls back to a
cold start, a new event loop discards the old loop's sandboxes, and close kills the rest.
No timing is asserted; the isolation tests run with the pool in test_sandbox.py."""

from __future__ import annotations

import asyncio
import shutil

import pytest

from toolenv.pool import WarmSandbox
from toolenv.python_tool import PythonTool

pytestmark = pytest.mark.integration


@pytest.fixture()
def make_tool():
    if shutil.which("bwrap") is None:
        pytest.skip("bubblewrap (bwrap) is not installed")
    made: list[PythonTool] = []

    def make(**kwargs) -> PythonTool:
        made.append(PythonTool(cpu_s=2, memory_mb=256, max_procs=16, wall_timeout_s=30,
                               **kwargs))
        return made[-1]

    yield make
    for tool in made:
        if tool.pool is not None:
            tool.pool.discard()


async def test_one_sandbox_per_call_and_counts(make_tool):
    tool = make_tool(pool=1, preload=["math", "not_a_module_here"])
    # Three at once into a fresh pool of one: the first waits for the one in preparation,
    # the other two find none free and start cold.
    code = "import sys\npre = 'math' in sys.modules\nimport math\n" \
           "print(getattr(math, 'seen', 'fresh'), pre)\nmath.seen = 'reused'"
    results = await asyncio.gather(*(tool.call(code) for _ in range(3)))
    results.append(await tool.call(code))
    # Never reused; the warm ones had math preloaded (a missing preload is skipped).
    assert [r.text for r in results] == ["fresh True", "fresh False", "fresh False",
                                         "fresh True"]
    stats = tool.stats()
    assert (stats["pool_taken"], stats["pool_overflow"], stats["cold_overflow"]) == (2, 2, 2)
    assert stats["pool_waited"] >= 1 and stats["pool_prepared"] >= 2
    assert stats["pool_failed"] == stats["cold_fallbacks"] == 0 and stats["pool_ready"] <= 1
    assert stats["pool_refill_per_s"] > 0 and stats["pool_prep_mean_s"] > 0
    assert stats["pool_wait_p99_s"] >= stats["pool_wait_p50_s"] >= 0
    await tool.close()


async def test_the_replacement_is_prepared_when_the_call_ends(make_tool):
    tool = make_tool(pool=1)
    sandbox = await tool.pool.take()
    assert (tool.pool._preparing, len(tool.pool._ready)) == (0, 0)  # not during the call
    run = await sandbox.run(b"print(6*7)", 30, 1000)
    assert run.output == b"42\n" and run.returncode == 0
    tool.pool.finished()
    assert tool.pool._preparing + len(tool.pool._ready) == 1
    await tool.close()


async def test_failed_preparation_falls_back_to_a_cold_start(make_tool, caplog):
    tool = make_tool(pool=1)

    def broken_spawn() -> WarmSandbox:
        raise OSError("no more processes")

    def exits_early() -> WarmSandbox:  # a sandbox that ends before it says READY
        return WarmSandbox(*tool.sandbox.spawn([tool.python, "-c", "print('boom')"]))

    for spawn, expected in ((broken_spawn, "no more processes"), (exits_early, "boom")):
        tool.pool._spawn = spawn
        with caplog.at_level("WARNING"):
            result = await tool.call("6*7")
        assert result.ok and result.text == "42"
        assert any(expected in r.getMessage() for r in caplog.records)
    stats = tool.stats()
    assert (stats["cold_fallbacks"], stats["pool_failed"], stats["pool_taken"]) == (2, 2, 0)
    await tool.close()


def test_a_new_event_loop_discards_the_old_loops_sandboxes(make_tool):
    tool = make_tool(pool=2)

    async def call_and_refill() -> str:
        text = (await tool.call("6*7")).text
        while len(tool.pool._ready) < 2:  # let both replacements finish
            await asyncio.sleep(0.05)
        return text

    assert asyncio.run(call_and_refill()) == "42"
    old = list(tool.pool._live)  # prepared under the first loop, never to be used there
    assert old and all(s.proc.returncode is None for s in old)
    assert asyncio.run(tool.call("6*7")).text == "42"
    assert all(s.proc.returncode is not None for s in old)
    assert not set(old) & tool.pool._live


async def test_close_kills_the_waiting_sandboxes(make_tool):
    tool = make_tool(pool=2)
    await tool.call("1")
    while len(tool.pool._ready) < 2:  # let both preparations finish
        await asyncio.sleep(0.05)
    waiting = list(tool.pool._ready)
    await tool.close()
    assert all(s.proc.returncode is not None for s in waiting)
    result = await tool.call("6*7")  # a closed pool: the call still runs, cold
    assert result.text == "42" and tool.stats()["cold_fallbacks"] == 1


def test_preload_names_are_checked():
    with pytest.raises(ValueError, match="not a module name"):
        PythonTool(isolation="auto", allow_unsandboxed=True, preload=["math; import os"])
