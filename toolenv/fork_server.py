"""Stateless Python calls forked from one prepared holder sandbox (``tools.python.holder``,
the default; the program inside is toolenv/fork_child.py).

Why. A sandbox per call costs about 40 ms of CPU (bwrap's namespaces and mounts, prlimit,
setpriv, a new interpreter); the warm pool (toolenv/pool.py) takes that off the call's
path but not off the machine, so under a job's load it ran dry on 43% of calls, which
then waited for a cold sandbox. Here one sandbox per tool holds an interpreter with the
preloads imported and forks each call a process tree of its own, in new namespaces, as
a session's holder forks its executors (toolenv/session_child.py).

What a call gets is what a sandbox per call gives: its own pool uid (``UidPool``, held by
the host for the call, reaped with ``kill_uid`` when the call is killed and before the
uid is handed out again), its own mount, pid, network, IPC and UTS namespaces, a fresh
64 MiB /tmp and /dev/shm, the hidden folders and the read-only root of the holder's
sandbox, the same rlimits (CPU time from zero, address space, processes + 1 for its
init, file size, no core) set after the switch to its uid, nice 10, and the seccomp
filter (inherited from the holder, loaded by bwrap). The code runs in a fork of an
interpreter that never ran a call's code nor saw a call's data, so no call sees
another's memory. A call ends as a warm one does: its init exits with the runner's
status and the pid namespace takes everything else along.

Threat model. As for the other paths, the code is hostile; the host, the holder and the
setup code are trusted. New is a long-lived process with CAP_SYS_ADMIN in a sandbox: it
reads only the host's small JSON headers and file descriptors, never code or output, and
the calls cannot reach it (it is root and in an ancestor pid namespace, they run as pool
uids with no capability and cannot ptrace). Setuid mode only (the host runs as root);
elsewhere ``PythonTool`` keeps the sandbox per call and says so.

The holder is started at the first call and replaced when it dies (``holder_deaths``,
logged): a call that finds it dead, or whose setup fails, runs in a cold sandbox
(``holder_fallbacks``); a call it was running when it died gets a "killed" result.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import select
import signal
import socket
import subprocess
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path

from toolenv.pool import READY, read_some, ready_fd, write_all
from toolenv.sandbox import CappedOutput, Lease, Sandbox, SandboxRun

log = logging.getLogger(__name__)

_PROGRAM = Path(__file__).with_name("fork_child.py").read_text()
_READY_CAP = 1 << 16
_REAP_TIMEOUT_S = 5.0
_STATUS_CAP = 4096
_SEND_TIMEOUT_S = 1.0  # a holder that takes no message for this long is not serving
_SETTLE_S = 1.0  # longest wait for a dying holder's exit once its calls are gone
_MAX_FAILURES = 3  # holder starts or call setups failing in a row: the path is given up
_WINDOW = 10_000


@dataclass
class _Holder:
    proc: subprocess.Popen  # bwrap
    ctrl: socket.socket
    pidfd: int | None = None  # the holder's own: readable once it has exited. bwrap, which
    # holds the other end of ``ctrl`` as its stdin, exits a little after it.


class ForkServer:
    """Runs stateless calls as forks of one holder sandbox (see the module docstring)."""

    def __init__(self, sandbox: Sandbox, python: str, runner_text: str,
                 preload: list[str], ready_timeout_s: float = 30.0):
        if sandbox.mode != "setuid":
            raise ValueError("a holder sandbox needs setuid mode (the host runs as root)")
        self.sandbox, self.ready_timeout_s = sandbox, ready_timeout_s
        binds = [p for p in sandbox.expose if p.startswith("/tmp/")]
        settings = json.dumps({"ready": READY.decode("latin-1"), "preload": list(preload),
                               "scratch_bytes": sandbox.scratch_bytes, "binds": binds})
        self._command = [python, "-s", "-u", "-c", runner_text + _PROGRAM, settings]
        lim = sandbox.limits
        self._limits = {"cpu_s": lim.cpu_s, "memory_bytes": lim.memory_bytes,
                        "max_procs": lim.max_procs, "file_bytes": lim.file_bytes}
        self._holder: _Holder | None = None
        self._starting: asyncio.Future | None = None
        self._failures = 0
        self.disabled = ""  # why the path was given up (every call then runs cold)
        self.counts = dict.fromkeys(("calls", "fallbacks", "starts", "deaths",
                                     "start_failures", "setup_failures"), 0)
        self._start_s: deque[float] = deque(maxlen=_WINDOW)

    @classmethod
    def of(cls, sandbox: Sandbox, python: str, runner_text: str,
           preload: list[str]) -> ForkServer | None:
        """The tool's fork server, or None (logged) where the holder cannot run."""
        if sandbox.mode == "setuid":
            return cls(sandbox, python, runner_text, preload)
        # a slower path, not a missing isolation: a warning, not one of the tool's
        log.warning("python tool: tools.python.holder needs setuid mode (the host runs as "
                    "root); in %s mode each call starts a sandbox of its own", sandbox.mode)
        return None

    # ------------------------------------------------------------------ the holder
    @property
    def holder_pid(self) -> int | None:
        """The holder's pid on this host (bwrap's child), or None."""
        return None if self._holder is None else _child_of(self._holder.proc.pid)

    def _alive(self) -> _Holder | None:
        """The holder, or None once it is found dead (counted, logged, dropped). Dead: its
        end of the socket is closed (at once when it dies; bwrap exits a little later)."""
        holder = self._holder
        if holder is not None and (holder.proc.poll() is not None or _exited(holder.pidfd)):
            self.counts["deaths"] += 1
            log.warning("python tool: the holder sandbox died (exit %s); starting a new one",
                        holder.proc.poll())
            self._drop()
            holder = None
        return holder

    async def _get(self) -> _Holder | None:
        """The live holder, started (or replaced) if needed; None when none could be."""
        holder = self._alive()
        if holder is not None or self.disabled:
            return holder
        if self._starting is None or self._starting.done():
            self._starting = asyncio.ensure_future(self._start())
        return await asyncio.shield(self._starting)

    async def _start(self) -> _Holder | None:
        start = time.monotonic()
        host, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            proc = self.sandbox.spawn_holder(self._command, child.fileno())
        except OSError as exc:
            host.close()
            return self._failed(f"starting the holder sandbox failed: {exc}")
        finally:
            child.close()
        out = proc.stdout.fileno()
        os.set_blocking(out, False)
        buf = b""
        try:
            async with asyncio.timeout(self.ready_timeout_s):
                while READY not in buf and len(buf) < _READY_CAP:
                    chunk = await read_some(out)
                    if not chunk:
                        break
                    buf += chunk
        except TimeoutError:
            pass
        proc.stdout.close()
        if READY not in buf:
            _kill(proc)
            host.close()
            return self._failed(f"the holder sandbox was not ready: {buf[-500:]!r}")
        host.setblocking(False)
        pid = _child_of(proc.pid)
        self._holder = _Holder(proc, host, None if pid is None else os.pidfd_open(pid))
        self.counts["starts"] += 1
        self._start_s.append(time.monotonic() - start)
        return self._holder

    def _failed(self, why: str, kind: str = "start_failures") -> None:
        self.counts[kind] += 1
        self._failures += 1
        log.warning("python tool: %s", why)
        if self._failures >= _MAX_FAILURES:
            self.disabled = why
            log.warning("python tool: %d holder failures in a row; every stateless call "
                        "now starts a sandbox of its own", self._failures)
        return None

    def _drop(self) -> None:
        holder, self._holder = self._holder, None
        if holder is not None:
            holder.ctrl.close()  # the holder exits on EOF, taking every call along
            if holder.pidfd is not None:  # at once, and so does everything in its sandbox
                try:
                    signal.pidfd_send_signal(holder.pidfd, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                os.close(holder.pidfd)
            _kill(holder.proc)

    # ------------------------------------------------------------------ calls
    async def run(self, code: bytes, timeout_s: float, max_bytes: int) -> SandboxRun | None:
        """Run ``code`` in a fork of the holder, as ``WarmSandbox.run`` does; None when the
        call could not be started there (the caller runs it in a sandbox of its own)."""
        start = time.monotonic()
        for _ in range(2):  # a holder found dead as the call is sent: once more, a new one
            holder = await self._get()
            if holder is None:
                self.counts["fallbacks"] += 1
                return None
            lease = Lease(*self.sandbox.uid_pool.acquire())
            pipes = [os.pipe() for _ in range(3)]  # the call's stdin, output and status
            (in_r, in_w), (out_r, out_w), (st_r, st_w) = pipes
            try:
                header = json.dumps({"uid": lease.uid, **self._limits}).encode()
                sent = _send(holder.ctrl, header, [in_r, out_w, st_w])
            finally:
                for fd in (in_r, out_w, st_w):
                    os.close(fd)
            if sent:
                break
            for fd in (in_w, out_r, st_r):
                os.close(fd)
            lease.release()
            if self._alive() is not None:  # alive, but not taking messages
                self.counts["fallbacks"] += 1
                return None
        else:
            self.counts["fallbacks"] += 1
            return None
        for fd in (in_w, out_r, st_r):
            os.set_blocking(fd, False)
        try:
            return await self._call(code, timeout_s, max_bytes, lease, in_w, out_r, st_r,
                                    start)
        finally:
            for fd in (out_r, st_r):
                os.close(fd)
            lease.release()

    async def _call(self, code: bytes, timeout_s: float, max_bytes: int, lease: Lease,
                    in_w: int, out_r: int, st_r: int, start: float) -> SandboxRun | None:
        out = CappedOutput(max_bytes, lease.kill)
        status = bytearray()

        async def pump() -> None:
            try:
                await write_all(in_w, code)
            except (BrokenPipeError, ConnectionResetError):
                pass  # ended before reading its code: its output says why
            finally:
                os.close(in_w)
            await out.read_all(lambda: read_some(out_r))
            while len(status) < _STATUS_CAP and (chunk := await read_some(st_r)):
                status.extend(chunk)

        timed_out, done = False, False
        try:
            await asyncio.wait_for(pump(), timeout_s)
            done = True
        except asyncio.TimeoutError:
            timed_out = True
        finally:
            if not done:  # timed out, or the caller was cancelled
                lease.kill()
                await asyncio.shield(self._drain(out_r, st_r, status))
        if status.startswith(b"E") or (not status and not timed_out and not out.truncated):
            # never started: a failed setup, or the holder died before it forked the call
            why = bytes(status[1:]).decode("utf-8", "replace") or "the holder did not run it"
            if not status:
                await self._settle()
            if self._alive() is not None or status:
                self._failed(f"a call's setup in the holder failed: {why}", "setup_failures")
            self.counts["fallbacks"] += 1
            return None
        self._failures = 0
        self.counts["calls"] += 1
        returncode = None
        if status.startswith(b"S") and status[1:2] == b"X":
            returncode = int(status[2:])
        elif not timed_out:  # started, never finished: killed (the cap, or its holder died)
            if not out.truncated:
                await self._settle()
            self._alive()
            returncode = -signal.SIGKILL
        return out.result(None if timed_out else returncode, timed_out,
                          time.monotonic() - start)

    async def _settle(self) -> None:
        """A call's init died though nobody killed it: the holder may be dying (its calls
        die first, as its pid namespace ends, then it): wait a moment to know."""
        holder = self._holder
        if holder is not None and holder.pidfd is not None:
            try:
                await asyncio.wait_for(ready_fd(holder.pidfd), _SETTLE_S)
            except asyncio.TimeoutError:
                pass

    async def _drain(self, out_r: int, st_r: int, status: bytearray) -> None:
        """After a kill: both pipes to their end (everything of the call is gone)."""

        async def both() -> None:
            while await read_some(out_r):
                pass
            while chunk := await read_some(st_r):
                status.extend(chunk[:_STATUS_CAP])

        try:
            await asyncio.wait_for(both(), _REAP_TIMEOUT_S)
        except asyncio.TimeoutError:
            log.warning("python tool: a forked call's pipes still open %.0f s after SIGKILL",
                        _REAP_TIMEOUT_S)

    # ------------------------------------------------------------------ figures, end
    def stats(self) -> dict[str, float]:
        """holder_calls: calls run as forks; holder_fallbacks: calls that ran in a cold
        sandbox instead (no holder, a failed setup); holder_starts / holder_deaths /
        holder_start_failures / holder_setup_failures; holder_start_p50_s: spawn to READY."""
        ordered = sorted(self._start_s)
        return {f"holder_{k}": v for k, v in self.counts.items()} | {
            "holder_start_p50_s": ordered[len(ordered) // 2] if ordered else 0.0}

    def close(self) -> None:
        """Stop the holder and every call in it (no event loop needed)."""
        self._drop()


def _send(ctrl: socket.socket, header: bytes, fds: list[int]) -> bool:
    """One call's message; False when the holder is gone."""
    try:
        ctrl.settimeout(_SEND_TIMEOUT_S)  # a few hundred bytes: the buffer takes them
        socket.send_fds(ctrl, [header], fds)
        return True
    except OSError:
        return False
    finally:
        ctrl.setblocking(False)


def _child_of(pid: int) -> int | None:
    try:
        children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    except OSError:
        return None
    return int(children[0]) if children else None


def _exited(pidfd: int | None) -> bool:
    if pidfd is None:
        return False
    poller = select.poll()
    poller.register(pidfd, select.POLLIN)
    return bool(poller.poll(0))


def _kill(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        proc.wait(_REAP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        log.warning("python tool: the holder sandbox %d not reaped after SIGKILL", proc.pid)
