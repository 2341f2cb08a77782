"""The Python tool in the real bubblewrap sandbox: correct answers for honest code, and
hostile snippets contained within their time bound with the host left unchanged; every
test runs four times: with a cold sandbox per call (pool 0), with warm sandboxes (pool 2),
forked from a holder sandbox (tools.python.holder, toolenv/fork_server.py) and in session
mode (tools.python.state=session: each snippet in a session of its own, on session
sandboxes from a pool of 2). No call sees another's files, variables, processes or
environment, earlier or at once; in session mode neither does a fork of a session see its
sibling's later state."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from toolenv.python_tool import PythonTool

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
WALL_S = 2.5
SLACK_S = 2.0  # process start-up and kill on a busy 2-core machine



class SessionPerCall:
    """A session-mode tool that runs each call in a new session of its own, closed after
    it: the hostile snippets meet session sandboxes (their keeper, holder and forked
    executor) exactly as they meet one-shot sandboxes."""

    def __init__(self, tool: PythonTool):
        self.tool, self.sandbox, self.warnings, self.pool = (tool, tool.sandbox,
                                                             tool.warnings, None)

    async def call(self, code: str):
        session = self.tool.open_session()
        try:
            return await self.tool.call_in(session, code)
        finally:
            session.close()
            await self.tool.sessions.stopped()

    async def close(self) -> None:
        await self.tool.close()


def make(mode: str, **kwargs) -> PythonTool | SessionPerCall:
    """The tool of a mode: cold (pool 0), pool (2 warm sandboxes), holder (calls forked
from a holder sandbox) or session."""
    if mode == "session":
        return SessionPerCall(PythonTool(pool=2, state="session", **kwargs))
    return PythonTool(pool=2 if mode == "pool" else 0, holder=mode == "holder", **kwargs)


@pytest.fixture(scope="module", params=["cold", "pool", "holder", "session"])
def pool(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def tool(pool) -> Iterator[PythonTool]:
    if shutil.which("bwrap") is None:
        pytest.skip("bubblewrap (bwrap) is not installed")
    made = make(pool, cpu_s=2, memory_mb=256, max_procs=16, max_output=2000,
                wall_timeout_s=WALL_S)
    yield made
    if made.pool is not None:
        made.pool.discard()
    if isinstance(made, SessionPerCall) or getattr(made, "forks", None) is not None:
        asyncio.run(made.close())


async def _run_all(tool: PythonTool, snippets: list[str]):
    """Run snippets concurrently; each result with the wall time of its own call."""

    async def one(code):
        start = time.monotonic()
        result = await tool.call(code)
        return result, time.monotonic() - start

    return await asyncio.gather(*(one(code) for code in snippets))


def _procs_with(marker: str) -> list[int]:
    found = []
    for proc in psutil.process_iter(["pid", "cmdline"]):
        try:
            if any(marker in part for part in proc.info["cmdline"] or []):
                found.append(proc.info["pid"])
        except psutil.Error:
            pass
    return found


def test_probe_found_full_isolation(tool):
    assert tool.sandbox.mode in ("setuid", "userns")
    assert tool.warnings == []


async def test_honest_code(pool):
    # Its own wall limit, far from the one the hostile tests need: importing sympy beside
    # eight other calls must not race a 2.5 s limit on a busy machine.
    if shutil.which("bwrap") is None:
        pytest.skip("bubblewrap (bwrap) is not installed")
    tool = make(pool, cpu_s=10, memory_mb=256, max_procs=16, max_output=2000,
                wall_timeout_s=60)
    snippets = ["print(6*7)", "6*7", "x = 'abc'\nx", "None", "import math\nmath.factorial(20)",
                "def f(n):\n    return 1 / n\nf(0)",
                "print('partial')\nraise ValueError('bad input')",
                "print(", "import sympy\nsympy.simplify('(x**2 - 1)/(x - 1)')"]
    results = [r for r, _ in await _run_all(tool, snippets)]
    texts = [r.text for r in results]
    assert [r.ok for r in results] == [True, True, True, True, True, False, False, False, True]
    assert texts[:5] == ["42", "42", "'abc'", "", "2432902008176640000"]
    assert "ZeroDivisionError: division by zero" in texts[5] and "return 1 / n" in texts[5]
    assert texts[6].startswith("partial") and texts[6].endswith("ValueError: bad input")
    assert "_arpo_run" not in texts[6]  # the runner's own frames are hidden
    assert "SyntaxError" in texts[7]
    assert texts[8] == "x + 1"
    assert [r.error for r in results[5:8]] == ["exception"] * 3
    await tool.close()


async def test_deterministic_hashing(tool):
    code = "print(sorted({'a', 'b', 'c', 'd'}, key=hash))"
    first, second = [r.text for r, _ in await _run_all(tool, [code, code])]
    assert first == second  # PYTHONHASHSEED is fixed, so cached results are reproducible


async def test_filesystem_is_contained(tool):
    marker = uuid.uuid4().hex
    secret_dir = Path(tempfile.mkdtemp(dir=Path.home()))
    secret = secret_dir / "secret.txt"
    secret.write_text(f"SECRET-{marker}")
    targets = [REPO / f"PWNED_{marker}", Path.home() / f"PWNED_{marker}",
               Path(f"/etc/PWNED_{marker}"), Path(f"/tmp/PWNED_{marker}"),
               secret_dir / f"PWNED_{marker}", Path(f"/usr/lib/PWNED_{marker}")]
    readable = [REPO / "pyproject.toml", secret, Path.home() / ".bashrc", Path("/etc/shadow"),
                REPO.parent / "shared" / "DESIGN.md"]
    readable = [p for p in readable if p.exists()]
    writes = "\n".join(
        f"try:\n    open({str(p)!r}, 'w').write('x')\n    print('WROTE', {str(p)!r})\n"
        f"except OSError as e:\n    print('denied', type(e).__name__)" for p in targets)
    reads = "\n".join(
        f"try:\n    print('READ', open({str(p)!r}).read()[:50])\n"
        f"except OSError as e:\n    print('denied', type(e).__name__)" for p in readable)
    folders = [str(Path.home()), str(REPO), str(REPO.parent), "/home"]
    listing = f"import json, os\nprint(json.dumps({{d: sorted(os.listdir(d)) if " \
              f"os.path.isdir(d) else [] for d in {folders!r}}}))"
    try:
        (w, w_s), (r, r_s), (ls, _) = await _run_all(tool, [writes, reads, listing])
        host_tmp_write = Path(f"/tmp/PWNED_{marker}")
        # writing to the private /tmp works inside, but nowhere on the host
        assert w.text.count("WROTE") == 1 and str(host_tmp_write) in w.text, w.text
        assert not any(p.exists() for p in targets)
        assert "READ" not in r.text and marker not in r.text, r.text
        assert r.text.count("denied") == len(readable)
        seen = json.loads(ls.text)
        assert secret_dir.name not in seen[str(Path.home())]
        # only the interpreter's own environment is bound back inside the hidden folders
        exposed = {Path(p).relative_to(REPO).parts[0] for p in tool.sandbox.expose
                   if Path(p).is_relative_to(REPO)}
        assert set(seen[str(REPO)]) == exposed, seen
        assert max(w_s, r_s) < WALL_S + SLACK_S
    finally:
        shutil.rmtree(secret_dir, ignore_errors=True)


async def test_network_is_unreachable(tool):
    connections = []

    async def on_connect(reader, writer):
        connections.append(writer.get_extra_info("peername"))
        writer.close()

    server = await asyncio.start_server(on_connect, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    code = ("import socket\n"
            f"for addr in [('127.0.0.1', {port}), ('1.1.1.1', 80), ('localhost', {port})]:\n"
            "    try:\n"
            "        socket.create_connection(addr, timeout=1).close()\n"
            "        print('CONNECTED', addr)\n"
            "    except OSError as e:\n"
            "        print('failed', addr, type(e).__name__)")
    async with server:
        (result, elapsed), = await _run_all(tool, [code])
        await asyncio.sleep(0.2)
    assert "CONNECTED" not in result.text and result.text.count("failed") == 3, result.text
    assert connections == []
    assert elapsed < WALL_S + SLACK_S


async def test_resource_bombs_are_contained(tool):
    marker = uuid.uuid4().hex
    fork_bomb = (f"# {marker}\nimport os\nwhile True:\n    try:\n        os.fork()\n"
                 "    except OSError:\n        pass")
    bombs = {
        "fork": fork_bomb,
        "memory": "x = []\nwhile True:\n    x.append(bytearray(10**7))",
        "big_alloc": "s = 'a' * (10**10)",
        "cpu": "while True:\n    pass",
        "sleep": "import time\ntime.sleep(30)",
        "output": "while True:\n    print('x' * 1000)",
        "disk": "f = open('big', 'wb')\nwhile True:\n    f.write(b'x' * 10**6)",
    }
    # Forks sleeping children until the process limit stops it. Two run at once: each call
    # must get its own full allowance (the limit counts one call's processes, not all).
    counted = ("import os, time\nn = 0\ntry:\n    while n < 1000:\n"
               "        if os.fork() == 0:\n            time.sleep(5)\n            os._exit(0)\n"
               "        n += 1\nexcept OSError as e:\n    print('limit', n, type(e).__name__)")
    bombs["nproc_a"] = bombs["nproc_b"] = counted
    # The memory bombs run on their own: beside the fork bomb's spinning children and the
    # CPU bomb on 2 cores they could be starved past the wall limit before reaching the
    # memory limit (a timeout, not the MemoryError this checks; seen once under load).
    memory = ("memory", "big_alloc")
    results = dict(zip([b for b in bombs if b not in memory],
                       await _run_all(tool, [c for b, c in bombs.items() if b not in memory])))
    results |= dict(zip(memory, await _run_all(tool, [bombs[b] for b in memory])))
    for name, (_, elapsed) in results.items():
        assert elapsed < WALL_S + SLACK_S, (name, elapsed)
    fork, _ = results["fork"]
    assert not fork.ok and fork.error in ("timeout", "killed")
    assert results["memory"][0].error == "exception" and "MemoryError" in results["memory"][0].text
    assert "MemoryError" in results["big_alloc"][0].text
    cpu, _ = results["cpu"]
    assert not cpu.ok and cpu.error in ("killed", "timeout")
    sleep, sleep_s = results["sleep"]
    assert sleep.error == "timeout" and sleep_s >= WALL_S
    out, out_s = results["output"]
    assert out.ok and out.text.endswith("[output truncated at 2000 characters]")
    assert len(out.text) <= 2000 + 60 and out_s < WALL_S  # stopped early, not timed out
    disk = results["disk"][0]
    assert not disk.ok and ("File too large" in disk.text or "No space" in disk.text), disk.text
    limits = {results[k][0].text for k in ("nproc_a", "nproc_b")}
    assert len(limits) == 1, limits
    count = int(limits.pop().split()[1])
    assert 10 <= count < 16  # max_procs=16 minus the snippet itself (and bwrap's init)
    # the host is fine: it can still start processes, and nothing of the bomb survived
    spawned = await asyncio.create_subprocess_exec("true")
    assert await asyncio.wait_for(spawned.wait(), 10) == 0
    assert _procs_with(marker) == []


async def test_killing_the_parent_is_contained(tool):
    bystander = await asyncio.create_subprocess_exec("sleep", "60")
    try:
        snippets = ["import os\nos.kill(os.getppid(), 9)\nprint('after')",
                    "import os\nos.kill(-1, 9)\nprint('after')",
                    "import os, signal\nos.killpg(0, signal.SIGKILL)"]
        results = await _run_all(tool, snippets)
        for _, elapsed in results:
            assert elapsed < WALL_S + SLACK_S
        await asyncio.sleep(0.1)
        assert bystander.returncode is None, "a sandboxed snippet killed a host process"
        assert psutil.pid_exists(os.getpid())
    finally:
        bystander.kill()
        await bystander.wait()


async def test_background_processes_do_not_outlive_the_call(tool):
    marker = uuid.uuid4().hex
    code = (
        "import os, subprocess\n"
        f"subprocess.Popen(['/bin/sh', '-c', 'sleep 30; : {marker}'], start_new_session=True)\n"
        "if os.fork() == 0:\n"
        "    os.setsid()\n"
        "    if os.fork() == 0:\n"
        f"        os.execv('/bin/sh', ['/bin/sh', '-c', 'sleep 31; : {marker}'])\n"
        "    os._exit(0)\n"
        "print('spawned')")
    (result, _), = await _run_all(tool, [code])
    assert result.ok and result.text == "spawned", result.text
    assert _procs_with(marker) == []


async def test_cancelled_call_kills_the_sandbox(tool):
    marker = uuid.uuid4().hex
    code = f"import subprocess\nsubprocess.run(['/bin/sh', '-c', 'sleep 30; : {marker}'])"
    task = asyncio.ensure_future(tool.call(code))
    deadline = time.monotonic() + 5
    while not _procs_with(marker) and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    assert _procs_with(marker), "the snippet never started"
    with pytest.raises(asyncio.TimeoutError):
        await asyncio.wait_for(task, 0.1)  # how the runner's backstop timeout cancels
    await asyncio.sleep(0.1)
    assert _procs_with(marker) == []


async def test_unprivileged_user_namespace_mode(pool):
    """The mode a non-root host uses (here: bwrap launched as uid 65534)."""
    python = "/usr/bin/python3"
    if not os.path.exists(python):
        pytest.skip("needs a system python readable by any user")
    try:
        tool = make(pool, cpu_s=2, memory_mb=256, max_procs=8, wall_timeout_s=WALL_S,
                    python=python, isolation="userns")
    except RuntimeError as err:
        pytest.skip(f"unprivileged user namespaces unavailable here: {err}")
    assert tool.sandbox.mode == "userns" and tool.warnings == []
    marker = uuid.uuid4().hex
    fork_bomb = (f"# {marker}\nimport os\nwhile True:\n    try:\n        os.fork()\n"
                 "    except OSError:\n        pass")
    snippets = ["6*7", f"open('{REPO}/PWNED_{marker}', 'w')", fork_bomb]
    (ok, _), (write, _), (fork, fork_s) = await _run_all(tool, snippets)
    assert ok.text == "42"
    assert not write.ok and not (REPO / f"PWNED_{marker}").exists()
    assert not fork.ok and fork_s < WALL_S + SLACK_S
    assert _procs_with(marker) == []
    await tool.close()


async def test_runner_with_the_real_tool(tmp_path, pool):
    if shutil.which("bwrap") is None:
        pytest.skip("bubblewrap (bwrap) is not installed")
    from arpo_async.core.config import ToolsConfig
    from toolenv.runner import build_tools

    if pool == "session":
        pytest.skip("the runner in session mode: tests/integration/test_python_session.py")
    cfg = ToolsConfig(enabled=["python"], timeout_s=2.0,
                      python={"max_output": 100, "pool": 2 if pool == "pool" else 0,
                              "holder": pool == "holder"})
    runner = build_tools(cfg, tmp_path)
    first, again = [await runner.call("python", "print(6*7)\n") for _ in range(2)]
    slow = await runner.call("python", "import time\ntime.sleep(30)")
    assert (first.text, first.cached, again.text, again.cached) == ("42", False, "42", True)
    # the tool's own limit fires first, so the result keeps what the snippet printed
    assert slow.error == "timeout" and "time limit" in slow.text and slow.latency_s < 3.0
    assert runner.cache.get("python", runner.tools["python"].version,
                            "import time\ntime.sleep(30)") is None
    stats = runner.stats()
    assert (stats["calls"], stats["cache_hits"], stats["timeouts"]) == (3, 1, 1)
    assert stats["python.latency_p99_s"] >= stats["python.latency_p50_s"] > 0
    assert ("python.pool_taken" in stats) == (pool == "pool")
    if pool == "pool":  # two calls ran the tool, each in its own warm sandbox
        assert stats["python.pool_taken"] == 2 and stats["python.pool_failed"] == 0
    assert ("python.holder_calls" in stats) == (pool == "holder")
    if pool == "holder":  # two calls ran the tool, each forked from the holder
        assert (stats["python.holder_calls"], stats["python.holder_fallbacks"]) == (2, 0)
    await runner.close()


async def test_without_bwrap(monkeypatch, caplog, pool):
    """No bubblewrap: refuse, unless explicitly allowed, then warn loudly and still limit."""
    monkeypatch.setattr("toolenv.python_tool.shutil.which", lambda name: None)
    with pytest.raises(RuntimeError, match="bubblewrap .bwrap. is not installed"):
        make(pool)
    with caplog.at_level("WARNING"):
        tool = make(pool, wall_timeout_s=WALL_S, cpu_s=2, allow_unsandboxed=True)
    assert tool.sandbox.mode == "none"
    assert any("UNSANDBOXED" in r.getMessage() for r in caplog.records)
    (ok, _), (slow, slow_s), (mem, _) = await _run_all(
        tool, ["6*7", "import time\ntime.sleep(30)", "s = 'a' * (10**10)"])
    assert ok.text == "42"
    assert slow.error == "timeout" and slow_s < WALL_S + SLACK_S
    assert "MemoryError" in mem.text
    await tool.close()


# Leaves a trace everywhere a later or concurrent call might look, then (optionally) stays.
_LEAK = """import builtins, math, os, socket, subprocess, sys, time
M = {marker!r}
os.environ["LEAK"] = M
math.LEAK = builtins.LEAK = sys.LEAK = sys.modules["__main__"].LEAK = LEAK_VAR = M
for folder in ("/tmp", "/dev/shm"):
    open(f"{{folder}}/leak_{{M}}", "w").write(M)
tcp = socket.socket()
tcp.bind(("127.0.0.1", {port}))
tcp.listen()
unix = socket.socket(socket.AF_UNIX)
unix.bind("\\0leak_" + M)
unix.listen()
subprocess.Popen(["/bin/sh", "-c", "sleep 60; : " + M], env={{"LEAK": M}})
print("leaked", flush=True)
time.sleep({stay})
"""

# Looks for every trace _LEAK leaves; prints what it found as JSON.
_LOOK = """import builtins, glob, json, math, os, socket, sys
M = {marker!r}
found = [k for k, v in (("env", os.environ.get("LEAK")), ("math", getattr(math, "LEAK", 0)),
         ("builtins", getattr(builtins, "LEAK", 0)), ("sys", getattr(sys, "LEAK", 0)),
         ("__main__", getattr(sys.modules["__main__"], "LEAK", 0)),
         ("variable", globals().get("LEAK_VAR"))) if v == M]
found += [p for p in glob.glob("/tmp/*") + glob.glob("/dev/shm/*") if M in p]
for family, addr in ((socket.AF_INET, ("127.0.0.1", {port})), (socket.AF_UNIX, "\\0leak_" + M)):
    try:
        socket.socket(family).connect(addr)
        found.append(f"connected {{addr!r}}")
    except OSError:
        pass
pids = [p for p in os.listdir("/proc") if p.isdigit()]
for pid in pids:
    for part in ("cmdline", "environ"):
        try:
            if M.encode() in open(f"/proc/{{pid}}/{{part}}", "rb").read():
                found.append(f"process {{pid}} {{part}}")
        except OSError:
            pass
print(json.dumps({{"found": found, "pids": len(pids)}}))
"""


async def test_calls_cannot_see_each_other(pool):
    """A call that left traces everywhere, finished (earlier) or still running (at once),
    is invisible to the next call: files, variables, modules, environment, processes,
    sockets. With the pool, the looking call's sandbox was prepared while the first ran."""
    if shutil.which("bwrap") is None:
        pytest.skip("bubblewrap (bwrap) is not installed")
    # A long wall limit: the running call must outlive the looking call, whatever the load.
    tool = make(pool, cpu_s=2, memory_mb=256, max_procs=16, wall_timeout_s=120)
    try:
        for stay in (0, 100):  # earlier, then at once
            marker, port = uuid.uuid4().hex, 20000 + uuid.uuid4().int % 20000
            leak = asyncio.ensure_future(tool.call(_LEAK.format(marker=marker, port=port,
                                                                stay=stay)))
            if stay:  # wait until the leaking call is demonstrably alive
                while not _procs_with(marker):
                    assert not leak.done(), leak.result().text
                    await asyncio.sleep(0.05)
            else:
                assert (await leak).text == "leaked", leak.result().text
            look = await tool.call(_LOOK.format(marker=marker, port=port))
            assert look.ok, look.text
            seen = json.loads(look.text)
            # only its own processes: init, the snippet and (warm) its waiting parent, or
            # (session) the keeper, the holder and the snippet's executor
            assert seen["found"] == [] and seen["pids"] <= (4 if pool == "session" else 3), seen
            if stay:
                assert not leak.done() and _procs_with(marker), "the leaking call ended early"
                leak.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await leak
            assert _procs_with(marker) == []
    finally:
        await tool.close()


async def test_forked_sessions_cannot_see_each_other():
    """Session mode: a session and its fork share what was there at the fork, and nothing
    either does after it. One branch leaves traces everywhere and stays alive while the
    other looks (and the other way round, after the first finished); neither finds any,
    and a third, unrelated session finds none either."""
    if shutil.which("bwrap") is None:
        pytest.skip("bubblewrap (bwrap) is not installed")
    tool = PythonTool(cpu_s=2, memory_mb=256, max_procs=16, wall_timeout_s=120, pool=2,
                      state="session")
    parent = tool.open_session()
    try:
        assert (await tool.call_in(parent, "shared = 'before the fork'")).ok
        child = await parent.fork()
        other = tool.open_session()
        for leaker, looker in ((parent, child), (child, parent), (child, other)):
            marker, port = uuid.uuid4().hex, 20000 + uuid.uuid4().int % 20000
            stay = 100 if looker is child else 0
            leak = asyncio.ensure_future(tool.call_in(leaker, _LEAK.format(
                marker=marker, port=port, stay=stay)))
            if stay:
                while not _procs_with(marker):
                    assert not leak.done(), leak.result().text
                    await asyncio.sleep(0.05)
            else:
                assert (await leak).text == "leaked", leak.result().text
            look = await tool.call_in(looker, _LOOK.format(marker=marker, port=port))
            assert look.ok, look.text
            assert json.loads(look.text)["found"] == [], look.text
            if stay:
                assert not leak.done() and _procs_with(marker)
                leak.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await leak
                assert _procs_with(marker) == []  # the cancelled call took its sandbox down
        seen = await tool.call_in(child, "print(shared)")
        assert seen.text == "before the fork"  # the child's copy, from the checkpoint
        stats = tool.stats()
        # the parent's sandbox died with its cancelled call, and was rebuilt by replay
        assert stats["session_forks"] == 1 and stats["session_lost"] == 1, stats
        assert stats["session_replays"] == 1, stats
    finally:
        await tool.close()
