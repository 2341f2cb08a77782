"""Warm sandboxes for the Python tool: started ahead of the call, each used for one call.

Design. A ``WarmSandbox`` is an ordinary one-shot sandbox (``Sandbox.spawn``: bubblewrap
namespaces, its own uid in setuid mode, prlimit, nice, setpriv) whose interpreter has
already started, imported the ``preload`` modules and forked: the forked child writes
``READY`` on stdout and blocks reading its code from stdin, its parent only waits for it
and exits with its status. ``WarmPool`` keeps ``size`` of them ready or in preparation.
A call takes a ready one (or waits for one in preparation that no other call is waiting
for; past that, in a burst bigger than the pool, it runs cold as today), feeds it the code,
reads its output under the same wall timeout and output cap as the cold path, and the
sandbox ends with the call: it is never handed out twice. When the call ends, a
replacement is prepared in the background (not before: it would compete for the CPU with
the call it replaces), so ready + preparing + in use stays at ``size``.

Threat model. The code is hostile; the host process, the pool and the code that prepares
a sandbox (the runner in ``python_tool``) are trusted. A sandbox receives untrusted bytes
only after it was taken for a call, and it is thrown away when that call ends, so
everything a call can change - files in its tmpfs /tmp and /dev/shm, variables, imported
modules, environment, processes, sockets in its network namespace - dies with it. Two
calls never share a sandbox: each has its own mount, pid, network, IPC and UTS namespaces
and (setuid mode) its own uid from ``UidPool`` held until it is reaped, so a running call
cannot see, signal or connect to another call, nor to a ready sandbox waiting in the pool.
Limits are those of the cold path, per call: the snippet runs in the forked child, whose
CPU time starts at zero; the address-space limit covers the preloaded modules as if the
snippet had imported them; the process limit is raised by one for the waiting parent.
The waiting parent runs as the snippet's uid but is the sandbox's init (bwrap
--as-pid-1, every signal it can ignore ignored) and no process of a sandbox may ptrace
(toolenv/seccomp.py), so the snippet can neither kill it nor change the status it
reports. New against the cold path is only that a sandbox exists before its code is
known; nothing in it depends on the code, and it runs at the same low priority. Without
bubblewrap (mode ``none``) a warm sandbox is, like a cold one, only a process with rlimits
in its own session and folder.
What a waiting sandbox costs: one interpreter's memory (with its preloads) and one uid.

Event loops. Sandboxes are plain ``subprocess.Popen`` processes whose pipes are driven
with the running loop's readers and writers only during a call, so the pool works under
any loop; it serves one loop at a time: a call from a new loop (each test has its own)
kills the sandboxes prepared under the old one and starts afresh.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import subprocess
import time
from collections import deque
from collections.abc import Callable

from toolenv.sandbox import CappedOutput, Lease, SandboxRun

log = logging.getLogger(__name__)

READY = b"\x00arpo-ready\n"
_READ_CHUNK = 65536
_READY_CAP = 1 << 16  # what preparation may print before READY (warnings of an import)
_REAP_TIMEOUT_S = 5.0
_WINDOW = 10_000  # waits kept for the percentiles


class PoolError(RuntimeError):
    """A sandbox could not be prepared; the caller may fall back to a cold start."""


class PoolEmpty(PoolError):
    """None ready, and every sandbox in preparation already has a call waiting for it."""


async def ready_fd(fd: int, writable: bool = False) -> None:
    """Wait until ``fd`` can be read (or written) without blocking."""
    loop = asyncio.get_running_loop()
    fut = loop.create_future()
    add, remove = ((loop.add_writer, loop.remove_writer) if writable
                   else (loop.add_reader, loop.remove_reader))
    add(fd, lambda: fut.done() or fut.set_result(None))
    try:
        await fut
    finally:
        remove(fd)


async def read_some(fd: int) -> bytes:
    """What the non-blocking ``fd`` has to read (b"" at its end), waiting in the loop."""
    while True:
        try:
            return os.read(fd, _READ_CHUNK)
        except BlockingIOError:
            await ready_fd(fd)


async def write_all(fd: int, data: bytes) -> None:
    """Write all of ``data`` to the non-blocking ``fd``, waiting in the loop;
    ``BrokenPipeError`` when the reader is gone."""
    view = memoryview(data)
    while view:
        try:
            view = view[os.write(fd, view):]
        except BlockingIOError:
            await ready_fd(fd, writable=True)


class WarmSandbox:
    """One started sandbox: ``ready`` once, then ``run`` once (or ``kill``)."""

    def __init__(self, proc: subprocess.Popen, lease: Lease):
        self.proc, self._lease = proc, lease
        self._pidfd = os.pidfd_open(proc.pid)
        self._out, self._in = proc.stdout.fileno(), proc.stdin.fileno()
        os.set_blocking(self._out, False)
        os.set_blocking(self._in, False)
        self._early = b""  # output that came with READY (none, unless preparation printed)
        self._closed = False

    async def _read(self) -> bytes:
        return await read_some(self._out)

    async def ready(self, timeout_s: float) -> None:
        """Wait for READY; raise ``PoolError`` when the sandbox exits or stalls first."""
        buf = b""

        async def until_ready() -> None:
            nonlocal buf
            while READY not in buf:
                chunk = await self._read()
                if not chunk or len(buf) > _READY_CAP:
                    raise PoolError(f"sandbox exited before it was ready: {buf[-500:]!r}")
                buf += chunk

        try:
            await asyncio.wait_for(until_ready(), timeout_s)
        except asyncio.TimeoutError:
            raise PoolError(f"sandbox not ready after {timeout_s:g} s") from None
        self._early = buf.split(READY, 1)[1]

    async def _write_all(self, data: bytes) -> None:
        try:
            await write_all(self._in, data)
        except (BrokenPipeError, ConnectionResetError):
            pass  # exited before reading its input: its output says why
        finally:
            self.proc.stdin.close()

    async def run(self, stdin: bytes, timeout_s: float, max_bytes: int) -> SandboxRun:
        """Feed the code, keep at most ``max_bytes`` of output; as ``run_capped``: killed on
        timeout, on passing the cap and on cancellation. Never raises for what it does."""
        start = time.monotonic()
        out = CappedOutput(max_bytes, self._kill_group, head=self._early)

        async def pump() -> int:
            await self._write_all(stdin)
            await out.read_all(self._read)
            return await self._exited()

        timed_out, returncode = False, None
        try:
            returncode = await asyncio.wait_for(pump(), timeout_s)
        except asyncio.TimeoutError:
            timed_out = True
        finally:
            if self.proc.returncode is None:  # timed out, or the caller was cancelled
                self._kill_group()
                await asyncio.shield(self._reap())
            self._close()
        return out.result(returncode, timed_out, time.monotonic() - start)

    async def _exited(self) -> int:
        await ready_fd(self._pidfd)  # a pidfd reads ready when the process has exited
        return self.proc.wait()

    async def _reap(self) -> None:
        async def drain_and_wait() -> None:
            while await self._read():
                pass
            await self._exited()

        try:
            await asyncio.wait_for(drain_and_wait(), _REAP_TIMEOUT_S)
        except asyncio.TimeoutError:
            log.warning("sandbox %d: still open %.0f s after SIGKILL", self.proc.pid,
                        _REAP_TIMEOUT_S)
            self._kill_bwrap()

    def _kill_group(self) -> None:
        """Kill the sandbox: through its uid in setuid mode (bwrap then exits by itself,
        having reaped the sandbox's init: ``Lease.kill``), else through bwrap's group."""
        if not self._lease.kill():
            self._kill_bwrap()

    def _kill_bwrap(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass

    def kill(self) -> None:
        """Kill and reap at once (no event loop needed); bwrap dies in milliseconds."""
        if self._closed:
            return
        self._kill_group()
        try:
            self.proc.wait(_REAP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            log.warning("sandbox %d: not reaped %.0f s after SIGKILL", self.proc.pid,
                        _REAP_TIMEOUT_S)
            self._kill_bwrap()
            try:
                self.proc.wait(_REAP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                pass
        self._close()

    def _close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for stream in (self.proc.stdin, self.proc.stdout):
            stream.close()
        os.close(self._pidfd)
        self._lease.release()


class WarmPool:
    """Keeps ``size`` warm sandboxes ready or in preparation; see the module docstring."""

    def __init__(self, spawn: Callable[[], WarmSandbox], size: int,
                 ready_timeout_s: float = 30.0):
        if size < 1:
            raise ValueError(f"WarmPool size must be >= 1, got {size}")
        self._spawn, self.size, self.ready_timeout_s = spawn, size, ready_timeout_s
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ready: deque[WarmSandbox] = deque()
        self._live: set[WarmSandbox] = set()  # spawned, not yet handed out
        self._waiters: deque[asyncio.Future] = deque()
        self._tasks: set[asyncio.Task] = set()
        self._preparing = self._in_use = 0  # in use: taken by a call not yet finished
        self._closed = False
        self._started = time.monotonic()
        self._waits: deque[float] = deque(maxlen=_WINDOW)
        self._counts = dict.fromkeys(("taken", "waited", "overflow", "prepared", "failed"), 0)
        self._wait_sum = self._prep_sum = 0.0

    async def take(self) -> WarmSandbox:
        """A ready sandbox for one call; ``PoolError`` when preparing one failed."""
        if self._closed:
            raise PoolError("the sandbox pool is closed")
        self._bind_loop()
        self._fill()
        start = time.monotonic()
        waited = not self._ready
        if waited and len(self._waiters) >= self._preparing:
            # A burst past the pool: waiting behind another call's preparation would be
            # slower than the cold path, which the caller takes instead.
            self._counts["overflow"] += 1
            raise PoolEmpty("no warm sandbox free")
        while not self._ready:
            fut = asyncio.get_running_loop().create_future()
            self._waiters.append(fut)
            try:
                await fut  # a PoolError set by a failed preparation propagates
            finally:
                if fut in self._waiters:
                    self._waiters.remove(fut)
        sandbox = self._ready.popleft()
        self._live.discard(sandbox)
        self._in_use += 1
        wait = time.monotonic() - start
        self._counts["taken"] += 1
        self._counts["waited"] += waited
        self._wait_sum += wait
        self._waits.append(wait)
        return sandbox

    def finished(self) -> None:
        """The call that took a sandbox is over: prepare its replacement now, so that the
        preparation does not compete for the CPU with the call it replaces."""
        self._in_use = max(0, self._in_use - 1)  # discard() may have reset it meanwhile
        if not self._closed and self._loop is asyncio.get_running_loop():
            self._fill()

    def _bind_loop(self) -> None:
        loop = asyncio.get_running_loop()
        if self._loop is not loop:
            if self._loop is not None:  # its tasks will never run again: drop their work
                self.discard()
            self._loop = loop

    def _fill(self) -> None:
        while len(self._ready) + self._preparing + self._in_use < self.size:
            self._preparing += 1
            task = self._loop.create_task(self._prepare())
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _prepare(self) -> None:
        start = time.monotonic()
        sandbox = None
        try:
            sandbox = self._spawn()
            self._live.add(sandbox)
            await sandbox.ready(self.ready_timeout_s)
        except Exception as exc:  # no retry here: the next take() tries again
            if sandbox is not None:
                self._live.discard(sandbox)
                sandbox.kill()
            self._counts["failed"] += 1
            log.warning("python tool: preparing a warm sandbox failed: %s", exc)
            self._wake(PoolError(str(exc)))
            return
        except BaseException:  # cancelled (pool closed, loop shut down)
            if sandbox is not None:
                self._live.discard(sandbox)
                sandbox.kill()
            raise
        finally:
            self._preparing -= 1
        self._counts["prepared"] += 1
        self._prep_sum += time.monotonic() - start
        self._ready.append(sandbox)
        self._wake(None)

    def _wake(self, error: Exception | None) -> None:
        while self._waiters:
            fut = self._waiters.popleft()
            if not fut.done():
                fut.set_exception(error) if error else fut.set_result(None)
                return

    def discard(self) -> None:
        """Kill every sandbox not yet handed out, now (no event loop needed)."""
        for sandbox in list(self._live):
            sandbox.kill()
        self._live.clear()
        self._ready.clear()
        self._waiters.clear()
        self._tasks.clear()
        self._preparing = self._in_use = 0

    async def close(self) -> None:
        """Kill every sandbox not yet handed out; calls in progress finish on their own."""
        self._closed = True
        tasks = [t for t in self._tasks if self._loop is asyncio.get_running_loop()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self.discard()

    def stats(self) -> dict[str, float]:
        """taken: sandboxes handed to calls; waited: takes that found none ready and waited
        for one in preparation; overflow: takes that found none free (the call ran cold);
        wait_*:
        seconds from asking to getting one (p50/p99 over the last 10,000); prepared /
        failed: preparations; refill_per_s: prepared per second since the pool started;
        prep_mean_s: spawn to READY."""
        ordered = sorted(self._waits)

        def pct(q: float) -> float:
            return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else 0.0

        taken, prepared = self._counts["taken"], self._counts["prepared"]
        return {f"pool_{k}": v for k, v in self._counts.items()} | {
            "pool_size": self.size, "pool_ready": len(self._ready),
            "pool_wait_mean_s": self._wait_sum / taken if taken else 0.0,
            "pool_wait_p50_s": pct(0.5), "pool_wait_p99_s": pct(0.99),
            "pool_refill_per_s": prepared / max(time.monotonic() - self._started, 1e-9),
            "pool_prep_mean_s": self._prep_sum / prepared if prepared else 0.0}
