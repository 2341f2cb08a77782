"""Stateless calls forked from a holder sandbox (tools.python.holder, toolenv/fork_server.py)
in forced situations: two calls in flight at once cannot see each other's files or
processes (the first is demonstrably alive, its file demonstrably there, while the second
looks), a background child dies with its call, a call that exhausts memory or loops is
killed and the next works in the same holder, each call runs as its own pool uid without
capabilities under the seccomp filter, a failed setup falls back to a cold sandbox, and a
holder that dies (between calls or during one) is reported and replaced. The hostile
snippets of test_sandbox.py also run on this path (its ``holder`` mode)."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import time
import uuid
from pathlib import Path

import psutil
import pytest

from tests.integration.test_sandbox import _procs_with
from toolenv.python_tool import PythonTool
from toolenv.uids import UID_POOL_BASE, UID_POOL_SIZE, uid_processes

pytestmark = pytest.mark.integration


@pytest.fixture()
def make_tool():
    if shutil.which("bwrap") is None:
        pytest.skip("bubblewrap (bwrap) is not installed")
    if os.geteuid() != 0:
        pytest.skip("the holder needs setuid mode (root)")
    made: list[PythonTool] = []

    def make(**kwargs) -> PythonTool:
        args = {"cpu_s": 2, "memory_mb": 256, "max_procs": 16, "wall_timeout_s": 30,
                "holder": True} | kwargs
        made.append(PythonTool(**args))
        assert made[-1].forks is not None and made[-1].pool is None
        return made[-1]

    yield make
    for tool in made:
        asyncio.run(tool.close())


async def _wait_for(marker: str, task: asyncio.Future) -> list[int]:
    deadline = time.monotonic() + 30
    while not (pids := _procs_with(marker)):
        assert not task.done(), task.result().text
        assert time.monotonic() < deadline, "the first call never started"
        await asyncio.sleep(0.05)
    return pids


async def test_two_calls_in_flight_cannot_see_each_other(make_tool):
    tool = make_tool()
    marker = uuid.uuid4().hex
    first = asyncio.ensure_future(tool.call(
        f"import subprocess, time\nopen('/tmp/mine_{marker}', 'w').write('x')\n"
        f"open('/dev/shm/mine_{marker}', 'w').write('x')\n"
        f"subprocess.Popen(['/bin/sh', '-c', 'sleep 60; : {marker}'])\ntime.sleep(60)"))
    pids = await _wait_for(marker, first)
    # the file is there, in the first call's own /tmp (seen through its mount namespace)
    assert Path(f"/proc/{pids[0]}/root/tmp/mine_{marker}").exists()
    look = await tool.call(
        "import glob, json, os\n"
        "pids = sorted(int(p) for p in os.listdir('/proc') if p.isdigit())\n"
        "cmds = [open(f'/proc/{p}/cmdline', 'rb').read().decode() for p in pids]\n"
        f"seen = [c[-100:] for c in cmds if '{marker}' in c]\n"
        "print(json.dumps({'files': glob.glob('/tmp/*') + glob.glob('/dev/shm/*'),"
        " 'pids': pids, 'seen': seen, 'uid': os.getuid()}))")
    assert look.ok, look.text
    seen = json.loads(look.text)
    assert seen["files"] == [] and seen["pids"] == [1, 2], seen  # its init and itself
    assert seen["seen"] == []
    assert not first.done() and _procs_with(marker), "the first call ended early"
    first_uid = psutil.Process(pids[0]).uids().real
    assert seen["uid"] != first_uid and UID_POOL_BASE <= seen["uid"] < UID_POOL_BASE + \
        UID_POOL_SIZE
    first.cancel()
    with pytest.raises(asyncio.CancelledError):
        await first
    assert _procs_with(marker) == [] and uid_processes(first_uid) == []


async def test_a_background_child_does_not_outlive_its_call(make_tool):
    tool = make_tool()
    marker = uuid.uuid4().hex
    code = ("import os, subprocess\n"
            f"subprocess.Popen(['/bin/sh', '-c', 'sleep 30; : {marker}'], "
            "start_new_session=True)\n"
            "if os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n"
            f"        os.execv('/bin/sh', ['/bin/sh', '-c', 'sleep 31; : {marker}'])\n"
            "    os._exit(0)\nprint(os.getuid())")
    result = await tool.call(code)
    assert result.ok, result.text
    # gone when the call returns, not some time later
    assert _procs_with(marker) == [] and uid_processes(int(result.text)) == []


async def test_memory_and_loops_are_killed_and_the_next_call_works(make_tool):
    tool = make_tool(cpu_s=1, wall_timeout_s=3)
    await tool.call("1")
    holder = tool.forks.holder_pid
    memory = await tool.call("x = []\nwhile True:\n    x.append(bytearray(10**7))")
    assert memory.error == "exception" and "MemoryError" in memory.text
    loop = await tool.call("while True:\n    pass")
    assert not loop.ok and loop.error in ("killed", "timeout"), loop.text
    sleeper = await tool.call("import time\ntime.sleep(30)")
    assert sleeper.error == "timeout"
    suicide = await tool.call("import os\nos.kill(os.getpid(), 9)")
    assert suicide.error == "killed"
    after = await tool.call("print(6*7)")
    assert after.ok and after.text == "42"
    stats = tool.stats()
    assert tool.forks.holder_pid == holder
    assert (stats["holder_deaths"], stats["holder_fallbacks"], stats["holder_starts"]) == (
        0, 0, 1)


async def test_a_call_has_no_privilege(make_tool):
    tool = make_tool()
    result = await tool.call(
        "import ctypes, json, os\n"
        "st = dict(l.split(':\\t', 1) for l in open('/proc/self/status').read().splitlines())\n"
        "libc = ctypes.CDLL(None, use_errno=True)\n"
        "traced = libc.ptrace(16, 1, 0, 0)  # PTRACE_ATTACH to its init\n"
        "try:\n    os.setuid(0)\n    root = True\nexcept PermissionError:\n    root = False\n"
        "print(json.dumps({k: st[k].strip() for k in ('CapEff', 'CapPrm', 'NoNewPrivs', "
        "'Seccomp')} | {'uid': os.getuid(), 'ptrace': traced, 'root': root, "
        "'cwd': os.getcwd()}))")
    facts = json.loads(result.text)
    assert facts["CapEff"] == facts["CapPrm"] == "0000000000000000", facts
    assert (facts["NoNewPrivs"], facts["Seccomp"], facts["ptrace"], facts["root"]) == (
        "1", "2", -1, False)
    assert facts["uid"] >= UID_POOL_BASE and facts["cwd"] == "/tmp"


async def test_a_failed_setup_falls_back_to_a_cold_sandbox(make_tool, caplog):
    tool = make_tool()
    settings = json.loads(tool.forks._command[-1])
    tool.forks._command[-1] = json.dumps(settings | {"binds": ["/tmp/no_such_folder_here"]})
    with caplog.at_level("WARNING"):
        result = await tool.call("print(6*7)")
    assert result.ok and result.text == "42"
    stats = tool.stats()
    assert (stats["holder_setup_failures"], stats["holder_fallbacks"]) == (1, 1)
    assert any("setup in the holder failed" in r.getMessage() for r in caplog.records)


async def test_a_dead_holder_is_reported_and_replaced(make_tool, caplog):
    tool = make_tool(wall_timeout_s=20)
    assert (await tool.call("6*7")).text == "42"
    # between calls
    first = tool.forks.holder_pid
    os.kill(first, signal.SIGKILL)
    await asyncio.sleep(0.2)
    with caplog.at_level("WARNING"):
        after = await tool.call("6*7")
    assert after.ok and after.text == "42"
    second = tool.forks.holder_pid
    assert second not in (None, first)
    assert any("holder sandbox died" in r.getMessage() for r in caplog.records)
    # during a call: the call is killed at once (not at its time limit), the next works
    marker = uuid.uuid4().hex
    running = asyncio.ensure_future(tool.call(
        f"import subprocess\nsubprocess.run(['/bin/sh', '-c', 'sleep 60; : {marker}'])"))
    await _wait_for(marker, running)
    start = time.monotonic()
    os.kill(second, signal.SIGKILL)
    killed = await running
    assert not killed.ok and killed.error == "killed" and time.monotonic() - start < 10
    assert _procs_with(marker) == []
    again = await tool.call("6*7")
    assert again.ok and again.text == "42"
    stats = tool.stats()
    assert (stats["holder_deaths"], stats["holder_starts"]) == (2, 3), json.dumps(stats)
    assert stats["holder_fallbacks"] == 0


async def test_close_ends_the_holder_and_its_calls(make_tool):
    tool = make_tool()
    marker = uuid.uuid4().hex
    running = asyncio.ensure_future(tool.call(
        f"import subprocess\nsubprocess.run(['/bin/sh', '-c', 'sleep 60; : {marker}'])"))
    await _wait_for(marker, running)
    holder = tool.forks.holder_pid
    await tool.close()
    result = await asyncio.wait_for(running, 10)
    assert not result.ok
    assert _procs_with(marker) == []
    deadline = time.monotonic() + 5
    while psutil.pid_exists(holder) and time.monotonic() < deadline:
        try:  # bwrap does not reap its init: this machine's init does
            if psutil.Process(holder).status() == psutil.STATUS_ZOMBIE:
                break
        except psutil.NoSuchProcess:
            break
        await asyncio.sleep(0.05)
    else:
        assert not psutil.pid_exists(holder)
