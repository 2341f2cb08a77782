"""Attacks on Python sessions and warm sandboxes, each followed by a victim call that must
get its own right answer (issue: sessions and MCP tools hardened). Each test forces its
attack directly: the keeper traced or signalled, the reply protocol forged with the nonce
read from the call's own stack, a checkpoint beside a bind of the host's under /tmp, a
replay of random draws, a __reduce__ that writes files, every process slot taken, a
waiting parent killed, and a process left running as a pool uid."""

from __future__ import annotations

import asyncio
import os
import resource
import shutil
import subprocess
import threading
import time
from dataclasses import replace

import pytest

from toolenv import sandbox as sandbox_mod
from toolenv import uids
from toolenv.python_tool import PythonTool

pytestmark = pytest.mark.integration

# Walks up the call's stack to the frame that holds the request's nonce (the holder's),
# as an attacker would, and builds the real end marker from it.
_FIND_NONCE = """
import os, sys
_f = sys._getframe()
while _f is not None and "nonce" not in _f.f_locals:
    _f = _f.f_back
MARK = b"\\x00arpo-end-" + _f.f_locals["nonce"].encode() + b"\\x00"
"""


@pytest.fixture()
def make_tool():
    if shutil.which("bwrap") is None:
        pytest.skip("bubblewrap (bwrap) is not installed")
    made: list[PythonTool] = []

    def make(**kwargs) -> PythonTool:
        made.append(PythonTool(**{"cpu_s": 2, "memory_mb": 256, "max_procs": 16,
                                  "wall_timeout_s": 60, "pool": 0, "state": "session",
                                  **kwargs}))
        return made[-1]

    yield make
    for tool in made:
        asyncio.run(tool.close())


async def _text(tool, session, code: str) -> str:
    result = await tool.call_in(session, code)
    assert result.ok, result.text
    return result.text


async def test_no_call_can_trace_or_signal_the_keeper(make_tool):
    tool = make_tool()
    session = tool.open_session()
    await _text(tool, session, "x = 5")
    # PTRACE_SEIZE of the keeper (pid 1), and of the holder, and reading their memory
    traced = await _text(tool, session, (
        "import ctypes, os\nlibc = ctypes.CDLL(None, use_errno=True)\n"
        "out = []\nfor pid in (1, os.getppid()):\n"
        "    out.append((libc.ptrace(0x4206, pid, 0, 0), ctypes.get_errno()))\n"
        "try:\n    open('/proc/1/mem', 'rb').read(1)\n    out.append('mem read')\n"
        "except OSError as exc:\n    out.append(exc.errno)\nprint(out)"))
    assert traced == "[(-1, 1), (-1, 1), 13]" or traced == "[(-1, 1), (-1, 1), 1]", traced
    # SIGINT (Python's own handler) and every other catchable signal: the keeper stays
    sent = await _text(tool, session, (
        "import os, signal\nn = 0\nfor s in signal.valid_signals():\n"
        "    if s not in (signal.SIGKILL, signal.SIGSTOP):\n"
        "        try:\n            os.kill(1, s)\n            n += 1\n"
        "        except OSError:\n            pass\nprint(n > 30)"))
    assert sent == "True"
    await asyncio.sleep(0.2)
    assert await _text(tool, session, "print(x)") == "5"
    stats = tool.stats()
    assert stats["session_lost"] == 0 and stats["session_replays"] == 0, stats


def test_a_process_left_running_as_a_pool_uid_is_killed_before_the_uid_is_reused(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("setuid mode: needs root")
    pool = sandbox_mod.UidPool(base=2_100_000_000, size=4, lock_dir=tmp_path)
    uid = pool.base  # the uid the pool hands out first
    stray = subprocess.Popen(["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups",
                              "sleep", "300"])
    try:
        deadline = time.monotonic() + 10
        while not sandbox_mod.uid_processes(uid) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert sandbox_mod.uid_processes(uid) == [stray.pid]
        # its parent (this test) reaps it as soon as it dies, as bwrap reaps a sandbox's
        # init: a zombie left unreaped would keep the uid out of use
        waiter = threading.Thread(target=stray.wait, daemon=True)
        waiter.start()
        got, fd = pool.acquire()
        assert got == uid
        waiter.join(5)
        assert stray.returncode == -9  # killed before the uid was handed out
        assert sandbox_mod.kill_uid(uid)
        pool.release(fd)
    finally:
        stray.kill()
        stray.wait()


async def _loop_lag(until: asyncio.Future) -> float:
    """The longest the event loop went without running this task, until ``until``."""
    worst, last = 0.0, time.monotonic()
    while not until.done():
        await asyncio.sleep(0.01)
        now = time.monotonic()
        worst, last = max(worst, now - last), now
    return worst


async def _attack(tool, session, code: str):
    call = asyncio.ensure_future(tool.call_in(session, code))
    lag = await _loop_lag(call)
    return await call, lag


async def test_a_forged_status_costs_only_the_forging_session(make_tool):
    tool = make_tool(wall_timeout_s=6)
    session = tool.open_session()
    await _text(tool, session, "x = 41")
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    # a status line that never ends: the host stops reading it, the loop keeps running
    start = time.monotonic()
    result, lag = await _attack(tool, session, _FIND_NONCE + (
        "os.write(1, MARK)\nwhile True:\n    os.write(1, b'x' * 65536)"))
    assert not result.ok and "protocol" in result.text, result.text
    assert time.monotonic() - start < 6 and lag < 1.0, (time.monotonic() - start, lag)
    # a payload of 1e11 bytes declared: refused, nothing buffered
    result, lag = await _attack(tool, session, _FIND_NONCE + (
        "os.write(1, MARK + b'{\"kind\": \"ok\", \"n\": 100000000000}\\n')\n"
        "while True:\n    os.write(1, b'y' * 65536)"))
    assert not result.ok and "payload" in result.text, result.text
    assert lag < 1.0
    # a status that is not an object
    result, _ = await _attack(tool, session, _FIND_NONCE + "os.write(1, MARK + b'[1, 2]\\n')")
    assert not result.ok and "protocol" in result.text, result.text
    grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss
    assert grown < 200_000, f"the host grew by {grown} KiB"
    # each broken reply stopped the sandbox; the state came back from the history
    assert await _text(tool, session, "print(x + 1)") == "42"
    # a forged "ok" that ends the reply early: what the call printed after it never
    # reaches the next reply of the session
    forged = await tool.call_in(session, _FIND_NONCE + (
        "os.write(1, MARK + b'{\"kind\": \"ok\", \"n\": 0}\\n')\nprint('LEFTOVER' * 100)"))
    assert forged.ok and "LEFTOVER" not in forged.text
    assert await _text(tool, session, "print(1 + 1)") == "2"


async def test_a_checkpoint_beside_a_bind_under_tmp_holds_only_the_sessions_files(make_tool,
                                                                                 tmp_path):
    # an interpreter tree bound read-only under /tmp, as a clone under /tmp has: 4 MB here
    bound = tmp_path / "venv"
    bound.mkdir()
    (bound / "big.bin").write_bytes(os.urandom(4 << 20))
    assert str(bound).startswith("/tmp/")
    tool = make_tool(checkpoint_mb=1)
    tool.sandbox = replace(tool.sandbox, expose=[*tool.sandbox.expose, str(bound)])
    parent = tool.open_session()
    assert await _text(tool, parent, (
        f"import os\nprint(os.path.getsize({str(bound / 'big.bin')!r}))")) == str(4 << 20)
    await _text(tool, parent, "open('mine.txt', 'w').write('kept')\ny = 3")
    child = await parent.fork()
    assert await _text(tool, child, "print(open('mine.txt').read(), y)") == "kept 3"
    stats = tool.stats()
    assert (stats["session_forks"], stats["session_fork_fallbacks"]) == (1, 0), stats


async def test_replays_draw_what_the_context_shows_and_a_checkpoint_changes_nothing(make_tool):
    tool = make_tool()
    parent = tool.open_session()
    drawn = await _text(tool, parent, "import random\nr = random.random()\nprint(r)")
    tool.sessions.checkpoint_bytes = 16  # no checkpoint fits: the fork replays
    child = await parent.fork()
    tool.sessions.checkpoint_bytes = 64 << 20
    assert await _text(tool, child, "print(r, random.random() == r)") == f"{drawn} False"
    parent.sandbox.kill()  # stopped (as when idle): rebuilt by replay
    assert await _text(tool, parent, "print(r)") == drawn
    assert tool.stats()["session_fork_fallback_too_large"] == 1
    # a __reduce__ that writes to the session's files while the checkpoint is taken
    await _text(tool, parent, (
        "class Sneaky:\n    def __reduce__(self):\n"
        "        open('/tmp/touched', 'w').write('x')\n        return (int, (0,))\n"
        "s = Sneaky()"))
    forked = await parent.fork()
    assert await _text(tool, parent, "import os\nprint(os.path.exists('/tmp/touched'))") == "False"
    assert await _text(tool, forked, "import os\nprint(os.path.exists('/tmp/touched'), r)") == (
        f"False {drawn}")
    stats = tool.stats()
    assert stats["session_fork_fallback_files_changed"] == 1, stats


async def test_a_call_with_no_process_slot_left_gets_an_error_at_once(make_tool):
    tool = make_tool(max_procs=8, wall_timeout_s=60)
    session = tool.open_session()
    await _text(tool, session, "x = 9")
    # a fork bomb in the background takes every slot of the session's process limit, and
    # every slot that frees again
    await tool.call_in(session, (
        "import os, time\nif os.fork() == 0:\n    while True:\n        try:\n"
        "            os.fork()\n        except OSError:\n            time.sleep(0.005)"))
    await asyncio.sleep(1.0)
    start = time.monotonic()
    result = await tool.call_in(session, "print(x)")
    assert time.monotonic() - start < 20, "waited for the wall timeout"
    assert not result.ok and "process" in result.text, result.text


async def test_a_warm_call_cannot_kill_its_waiting_parent():
    if shutil.which("bwrap") is None:
        pytest.skip("bubblewrap (bwrap) is not installed")
    tool = PythonTool(cpu_s=2, memory_mb=256, max_procs=16, wall_timeout_s=30, pool=1)
    try:
        result = await tool.call(
            "import os, signal\nfor s in (signal.SIGINT, signal.SIGTERM, signal.SIGKILL):\n"
            "    os.kill(os.getppid(), s)\nprint('after')")
        assert result.ok and result.text == "after", result
        killed = await tool.call("import os, signal\nos.kill(os.getpid(), signal.SIGKILL)")
        assert not killed.ok and "SIGKILL" in killed.text
    finally:
        await tool.close()


async def test_a_warm_call_ends_when_its_host_is_gone():
    """The waiting parent is the sandbox's init, which bwrap's death does not reach (setuid
    mode): when the host's end of the output pipe closes (the actor died), it ends the
    call itself instead of letting a snippet run on unwatched."""
    if shutil.which("bwrap") is None or os.geteuid() != 0:
        pytest.skip("setuid mode: needs bubblewrap and root")
    tool = PythonTool(cpu_s=2, memory_mb=256, max_procs=16, wall_timeout_s=30, pool=1)
    try:
        assert tool.sandbox.mode == "setuid"
        warm = tool._spawn_warm()
        await warm.ready(30)
        uid = warm._lease.uid
        warm.proc.stdin.write(b"import time\ntime.sleep(300)\n")
        warm.proc.stdin.close()
        await asyncio.sleep(1.0)  # the snippet sleeps; its parent waits for it
        assert len(_alive(uid)) == 2, _alive(uid)
        warm.proc.stdout.close()  # the host is gone: nobody reads the call's output
        deadline = time.monotonic() + 10
        while _alive(uid) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert not _alive(uid), "the snippet outlived its host"
        warm.proc.wait(10)
    finally:
        await tool.close()


def _alive(uid: int) -> list[int]:
    return [pid for pid in sandbox_mod.uid_processes(uid) if not uids._zombie(pid)]
