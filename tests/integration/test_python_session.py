"""Python sessions (tools.python.state=session) in the real bubblewrap sandbox: state that
persists from call to call, forks by checkpoint and by replay that both continue from the
parent's state at the fork and from nothing later, limits per call and per session, a
killed session that answers with an error (not a hang) and is rebuilt, the cache keyed by
the history, the cap on live sessions and the idle stop. The hostile snippets run in
session mode in test_sandbox.py (and a fork against its sibling there)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import time
import uuid

import psutil
import pytest

from toolenv.python_tool import PythonTool

pytestmark = pytest.mark.integration


@pytest.fixture()
def make_tool():
    if shutil.which("bwrap") is None:
        pytest.skip("bubblewrap (bwrap) is not installed")
    made: list[PythonTool] = []

    def make(**kwargs) -> PythonTool:
        made.append(PythonTool(**{"cpu_s": 2, "memory_mb": 256, "max_procs": 16,
                                  "wall_timeout_s": 60, "pool": 2, "state": "session",
                                  **kwargs}))
        return made[-1]

    yield make
    for tool in made:
        asyncio.run(tool.close())


async def _texts(tool, session, *codes) -> list[str]:
    out = []
    for code in codes:
        result = await tool.call_in(session, code)
        assert result.ok, result.text
        out.append(result.text)
    return out


def _procs_with(marker: str) -> list[int]:
    return [p.pid for p in psutil.process_iter(["cmdline"])
            if any(marker in part for part in p.info["cmdline"] or [])]


def _roots_with(marker: str) -> list[int]:
    """The marked processes whose parent is not marked: a shell's child between its fork
    and its exec still shows the shell's command line."""
    marked = set(_procs_with(marker))
    out = []
    for pid in marked:
        with contextlib.suppress(psutil.NoSuchProcess):
            if psutil.Process(pid).ppid() not in marked:
                out.append(pid)
    return out


async def test_state_persists_and_both_kinds_of_fork_continue_from_the_fork(make_tool):
    tool = make_tool()
    parent = tool.open_session()
    setup = ["x = 41", "x += 1\nx", "def f(n):\n    return n * x\nf(2)",
             "open('notes.txt', 'w').write('kept')", "import random\nrandom.seed(3)"]
    assert await _texts(tool, parent, *setup) == ["", "42", "84", "4", ""]
    by_checkpoint = await parent.fork()
    tool.sessions.checkpoint_bytes = 16  # no checkpoint fits: this fork replays
    by_replay = await parent.fork()
    tool.sessions.checkpoint_bytes = 64 << 20
    look = "print(x, f(3), open('notes.txt').read(), random.random())"
    expected = (await _texts(tool, parent, look))[0]
    for child in (by_checkpoint, by_replay):  # set before the fork: seen by both branches
        assert await _texts(tool, child, look) == [expected]
    # changed after the fork: seen by one branch only
    await _texts(tool, by_checkpoint, "x = 0\nopen('notes.txt', 'w').write('child')")
    assert await _texts(tool, parent, "print(x, open('notes.txt').read())") == ["42 kept"]
    assert await _texts(tool, by_replay, "print(x, open('notes.txt').read())") == ["42 kept"]
    assert await _texts(tool, by_checkpoint, "print(x, f(1))") == ["0 0"]
    stats = tool.stats()
    assert (stats["session_forks"], stats["session_fork_fallbacks"],
            stats["session_replays"]) == (1, 1, 1), stats
    assert stats["session_replayed_calls"] == len(setup)
    # state that does not pickle (a generator) is copied by replay, and it continues too
    await _texts(tool, parent, "gen = (i for i in range(10))\nnext(gen)")
    child = await parent.fork()
    assert await _texts(tool, child, "next(gen)") == ["1"]
    assert tool.stats()["session_fork_fallbacks"] == 2
    for session in (parent, by_checkpoint, by_replay, child):
        session.close()
    assert tool.stats()["session_closed_finished"] == 4
    assert tool.stats()["session_live"] == 0


async def test_limits_hold_per_call_and_per_session(make_tool):
    tool = make_tool(cpu_s=1)
    session = tool.open_session()
    burn = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.6:\n" \
           "    pass\nruns = globals().get('runs', 0) + 1\nruns"
    # each call has its own CPU clock: two calls of 0.6 s under a limit of 1 s
    assert await _texts(tool, session, burn, burn) == ["1", "2"]
    killed = await tool.call_in(session, "runs = 100\nwhile True:\n    pass")
    assert not killed.ok and killed.error == "killed" and "CPU time limit" in killed.text
    assert "keeps its state from before this call" in killed.text
    assert await _texts(tool, session, "runs") == ["2"]  # the killed call left no trace
    # processes: the session's background processes count against its own allowance
    count = ("import os, time\nn = 0\ntry:\n    while n < 100:\n        if os.fork() == 0:\n"
             "            time.sleep(3)\n            os._exit(0)\n        n += 1\n"
             "except OSError:\n    pass\nn")
    fresh = int((await _texts(tool, tool.open_session(), count))[0])
    marker = uuid.uuid4().hex
    await _texts(tool, session, "import subprocess\nkeep = [subprocess.Popen(['/bin/sh', "
                 f"'-c', 'sleep 60; : {marker}']) for _ in range(5)]")
    assert len(_roots_with(marker)) == 5  # alive between calls, as in a notebook
    # each holds two slots (the shell and its sleep); the last hand-over's two processes
    # (the executor and the old holder, exiting as the call starts) may not be reaped yet
    assert fresh - 12 <= int((await _texts(tool, session, count))[0]) <= fresh - 10
    session.close("dropped")
    await tool.sessions.stopped()
    assert _procs_with(marker) == [] and tool.stats()["session_closed_dropped"] == 1


async def test_a_killed_session_answers_with_an_error_and_is_rebuilt(make_tool):
    tool = make_tool()
    session = tool.open_session()
    await _texts(tool, session, "x = 7")
    marker = uuid.uuid4().hex
    call = asyncio.ensure_future(tool.call_in(
        session, f"import subprocess\nsubprocess.run(['/bin/sh', '-c', 'sleep 50; : {marker}'])"))
    while not _procs_with(marker):
        assert not call.done(), call.result().text
        await asyncio.sleep(0.05)
    start = time.monotonic()
    # the sandbox's init (the session's keeper, bwrap's child) dies mid-call: the kernel
    # takes every process of the sandbox with it
    keeper = psutil.Process(session.sandbox.proc.pid).children()[0]
    os.kill(keeper.pid, signal.SIGKILL)
    result = await call
    assert not result.ok and result.error == "session" and "died" in result.text
    assert time.monotonic() - start < 30  # answered on the death, not at the 60 s limit
    assert await _texts(tool, session, "x") == ["7"]  # rebuilt by replay
    # from inside, a call cannot kill its session: kill(-1) spares the keeper (init) and
    # the caller, which carries the state on
    assert (await tool.call_in(session, "import os\nos.kill(-1, 9)")).ok
    assert await _texts(tool, session, "x + 1") == ["8"]
    stats = tool.stats()
    assert stats["session_lost"] == 1 and stats["session_replays"] == 1, stats


async def test_a_rebuild_outlives_the_call_that_timed_out_waiting_for_it(make_tool):
    tool = make_tool()
    session = tool.open_session()
    await _texts(tool, session, "import time\nn = 0", *["time.sleep(0.4)\nn += 1"] * 3)
    session.sandbox.kill()  # its state must be replayed: 1.2 s of sleeps
    with pytest.raises(asyncio.TimeoutError):  # as the runner's timeout cancels a call
        await asyncio.wait_for(tool.call_in(session, "n"), 0.3)
    assert await _texts(tool, session, "n") == ["3"]
    stats = tool.stats()  # the second call waited for the first one's replay
    assert stats["session_replays"] == 1 and stats["session_replayed_calls"] == 4, stats


async def test_the_cache_serves_a_result_only_to_the_same_history(tmp_path):
    if shutil.which("bwrap") is None:
        pytest.skip("bubblewrap (bwrap) is not installed")
    from arpo_async.core.config import ToolsConfig
    from toolenv.runner import build_tools

    runner = build_tools(ToolsConfig(enabled=["python"],
                                     python={"state": "session", "pool": 2}), tmp_path)
    try:
        one, two, again = runner.open_state(), runner.open_state(), runner.open_state()

        async def call(state, code):
            return await runner.call("python", code, state=state)

        assert (await call(one, "x = 1")).cached is False
        assert (await call(one, "print(x)")).text == "1"
        await call(two, "x = 2")
        second = await call(two, "print(x)")  # same code, another history: not served
        assert (second.text, second.cached) == ("2", False)
        assert (await call(again, "x = 1")).cached is True  # same history and code
        hit = await call(again, "print(x)")
        assert (hit.text, hit.cached) == ("1", True)
        # the session caught up with what the cache stood for before running anew
        fresh = await call(again, "print(x + 1)")
        assert (fresh.text, fresh.cached) == ("2", False)
        stats = runner.stats()
        assert stats["cache_hits"] == 2 and stats["python.session_replayed_calls"] == 2
        for state in (one, two, again):
            state.close()
    finally:
        await runner.close()


async def test_the_cap_on_live_sessions_and_the_idle_stop(make_tool):
    tool = make_tool(max_sessions=2, session_idle_s=0.5)
    sessions = [tool.open_session() for _ in range(3)]
    for i, session in enumerate(sessions):
        await _texts(tool, session, f"v = {i}")
    stats = tool.stats()  # the third stopped the least recently used: the first
    assert stats["session_evictions"] == 1 and stats["session_live"] == 2, stats
    assert sessions[0].sandbox is None and sessions[2].sandbox is not None
    assert await _texts(tool, sessions[0], "v") == ["0"]  # replayed in a new sandbox
    deadline = time.monotonic() + 30
    while tool.stats()["session_live"] and time.monotonic() < deadline:
        await asyncio.sleep(0.1)  # untouched for idle_s: every sandbox is stopped
    stats = tool.stats()
    assert stats["session_live"] == 0 and stats["session_idle_stops"] == 2, stats
    assert await _texts(tool, sessions[2], "v") == ["2"]
