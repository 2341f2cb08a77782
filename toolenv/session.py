"""Python sessions (``tools.python.state = "session"``): one live interpreter per
trajectory, forked with the ARPO tree.

A ``PySession`` is a trajectory's interpreter: the *history* (the code of every call whose
changes the interpreter kept, in order; its running sha256 is ``digest``, the state part of
the tool cache key) and, while it is live, the ``SessionSandbox`` that holds that state.
The history is the truth; the sandbox is a materialisation of a prefix of it, ``live_len``
calls long, and can be rebuilt at any time:

- **fork** (``PySession.fork``): the parent's sandbox writes a checkpoint (cloudpickle of its
  namespace, the files of its /tmp, its environment and random states;
  toolenv/session_child.py) and the child session keeps those bytes; at the child's next
  call a fresh sandbox of its own (from the warm pool: its own uid, namespaces and /tmp)
  loads them. The host carries the bytes and never unpickles them.
- **replay**: a fresh sandbox re-executes the history (outputs dropped). Used when no
  checkpoint could be taken (state that does not pickle: an open file, a generator; a
  checkpoint past ``tools.python.checkpoint_mb``), when a restore fails, and when a live
  sandbox was stopped (idle past ``tools.python.session_idle_s``, evicted for the cap
  ``tools.python.max_sessions``, killed by a timeout, or dead).
- **catch-up**: a cached result served to a session (``advance``) appends its code to the
  history without running it; the next call that runs first re-executes those calls in the
  live sandbox, so a cached result never stands for a state the session does not reach.

A call's changes are kept when it ran to its end or raised (as in a notebook); a call that
was killed (its CPU limit, a signal, ``os._exit``) leaves the state as it was before it,
since each call runs in a fork of the interpreter (session_child.py). Counted in
``stats``: forks (states restored from a checkpoint), replays (states rebuilt by
re-execution) and fork_fallbacks (forks that had to replay; by reason in
fork_fallback_<reason>: unpicklable, too_large, files_changed, no_process, lost,
restore_failed), plus sessions opened, closed (finished / dropped), evicted, stopped idle
and lost. Every count is reported from the start, at zero.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections import Counter, deque
from collections.abc import Callable
from typing import Any

from toolenv.pool import PoolError, WarmPool
from toolenv.session_sandbox import LOST, Reply, SessionSandbox

log = logging.getLogger(__name__)

_WINDOW = 10_000  # latencies kept for the percentiles
_LOST = LOST  # replies after which the sandbox is gone
# Every count ``stats`` reports, there from the start at zero (a run whose forks all
# replay says so: session_forks 0 next to session_fork_fallbacks).
COUNTS = ("opened", "restored", "closed_finished", "closed_dropped", "forks", "replays", "catchups",
          "replayed_calls", "replay_failures", "fork_fallbacks", "lost", "evictions",
          "idle_stops", "cold_starts")
# Why a fork replayed instead of restoring a checkpoint: session_fork_fallback_<reason>.
FALLBACK_REASONS = ("unpicklable", "too_large", "files_changed", "no_process", "lost",
                    "restore_failed")


def canonical_code(code: str) -> str:
    """The python tool's canonical form of code (``PythonTool.canonical``, the cache key
    and the history digest): line endings normalised to ``\\n``, trailing whitespace at
    the end removed; nothing else (whitespace inside code can change what it prints)."""
    return code.replace("\r\n", "\n").replace("\r", "\n").rstrip()


def next_digest(digest: str, code: str) -> str:
    """The history digest after one more kept call (over the canonical form of code)."""
    return hashlib.sha256(f"{digest}\n{canonical_code(code)}".encode()).hexdigest()


def _rebuilding(session: PySession) -> bool:
    return session._rebuild is not None and not session._rebuild.done()


class PySession:
    """One trajectory's interpreter (see the module docstring); made by ``SessionManager``."""

    def __init__(self, manager: SessionManager, history: list[str] | None = None,
                 digest: str = "", checkpoint: tuple[bytes, int] | None = None):
        self.manager = manager
        self.history = list(history or [])
        self.digest = digest
        self.checkpoint = checkpoint  # (bytes, history length it holds), until restored
        self.sandbox: SessionSandbox | None = None
        self.live_len = 0
        self.busy = False
        self.closed = False
        self.last_used = time.monotonic()
        self._lock = asyncio.Lock()
        self._rebuild: asyncio.Task | None = None  # a materialisation in progress

    def advance(self, code: str) -> None:
        """A cached result stood for this call: the state moves on as if it had run."""
        self.history.append(code)
        self.digest = next_digest(self.digest, code)

    async def fork(self) -> PySession:
        return await self.manager.fork(self)

    def close(self, reason: str = "finished") -> None:
        self.manager.close(self, reason)


class SessionManager:
    """The sessions of one ``PythonTool``: a warm pool of session sandboxes, the cap on
    live ones (least recently used idle one stopped first), the idle timeout, and counts."""

    def __init__(self, spawn: Callable[[], SessionSandbox], *, pool: int, max_live: int,
                 idle_s: float, checkpoint_bytes: int, wall_timeout_s: float, cap: int,
                 ready_timeout_s: float = 30.0):
        if max_live < 1 or idle_s <= 0 or checkpoint_bytes < 1:
            raise ValueError(f"python sessions need max_sessions >= 1, idle_s > 0 and "
                             f"checkpoint bytes >= 1; got {max_live}, {idle_s}, "
                             f"{checkpoint_bytes}")
        self._spawn, self.max_live, self.idle_s = spawn, max_live, idle_s
        self.checkpoint_bytes, self.wall_timeout_s, self.cap = (checkpoint_bytes,
                                                                wall_timeout_s, cap)
        self.ready_timeout_s = ready_timeout_s
        self.pool = WarmPool(spawn, pool, ready_timeout_s) if pool > 0 else None
        self._live: dict[int, PySession] = {}  # sessions holding a sandbox, by id
        self._freed: asyncio.Event | None = None
        self._stopping: set[asyncio.Future] = set()  # kills in progress
        self.counts: Counter[str] = Counter(
            {k: 0 for k in (*COUNTS, *(f"fork_fallback_{r}" for r in FALLBACK_REASONS))})
        self._lat: dict[str, deque[float]] = {k: deque(maxlen=_WINDOW)
                                              for k in ("fork", "restore", "replay")}

    # ------------------------------------------------------------------ lifecycle
    def open(self) -> PySession:
        self.counts["opened"] += 1
        return PySession(self)

    def restore(self, history: list[str]) -> PySession:
        """A session whose state is ``history`` (an actor's journal kept it across a
        restart): no sandbox until its next call, which replays the history first."""
        self.counts["restored"] += 1
        digest = ""
        for code in history:
            digest = next_digest(digest, code)
        return PySession(self, history, digest)

    async def fork(self, parent: PySession) -> PySession:
        """The child's copy of ``parent``'s state now (checkpoint bytes, or its history to
        replay); the parent's next call waits until the checkpoint is written."""
        start = time.perf_counter()
        child = PySession(self, parent.history, parent.digest, parent.checkpoint)
        self.counts["opened"] += 1
        async with parent._lock:
            if parent._rebuild is not None and not parent._rebuild.done():
                await asyncio.shield(parent._rebuild)
            sandbox = parent.sandbox
            if sandbox is not None and sandbox.alive and parent.live_len > 0:
                reply = await sandbox.request("dump", timeout_s=self.wall_timeout_s,
                                              max_bytes=self.cap, max=self.checkpoint_bytes,
                                              max_payload=self.checkpoint_bytes)
                if reply.kind == "ok":
                    child.checkpoint = (reply.payload, parent.live_len)
                else:  # the child replays instead
                    reason = "lost" if reply.kind in _LOST else reply.status.get("reason")
                    self._fallback(reason if reason in FALLBACK_REASONS else "unpicklable")
                    child.checkpoint = None
                    log.info("python session: no checkpoint (%s: %s); the fork replays",
                             reply.kind, reply.status.get("message", "")[:200])
                    if reply.kind in _LOST:
                        self._drop(parent, "lost")
                    elif reason == "files_changed":  # the parent's files are not its own
                        self._drop(parent, None)  # history's: rebuilt from it
                self._lat["fork"].append(time.perf_counter() - start)  # checkpoints only
        return child

    def _fallback(self, reason: str) -> None:
        self.counts["fork_fallbacks"] += 1
        self.counts[f"fork_fallback_{reason}"] += 1

    def close(self, session: PySession, reason: str) -> None:
        """The trajectory ended (``finished``) or was cancelled or failed (``dropped``)."""
        if session.closed:
            return
        session.closed = True
        session.checkpoint = None
        self._drop(session, None)
        self.counts[f"closed_{reason}"] += 1

    def _drop(self, session: PySession, why: str | None) -> None:
        """Stop the session's sandbox (its history stays: it can be replayed)."""
        sandbox, session.sandbox = session.sandbox, None
        self._live.pop(id(session), None)
        if sandbox is not None:
            self._stop(sandbox)
            if why:
                self.counts[why] += 1
        self._wake_waiters()

    def _stop(self, sandbox: SessionSandbox) -> None:
        """Kill a sandbox off the event loop: waiting for everything in it to be gone
        takes tens of milliseconds, which a trajectory's end must not cost the loop."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # no loop (a tool closed from synchronous code)
            sandbox.kill()
            return
        future = loop.run_in_executor(None, sandbox.kill)
        self._stopping.add(future)
        future.add_done_callback(self._stopping.discard)

    async def stopped(self) -> None:
        """Wait until every sandbox stopped so far is gone (its processes and its uid)."""
        while self._stopping:
            await asyncio.gather(*list(self._stopping), return_exceptions=True)

    def _wake_waiters(self) -> None:
        """Calls waiting for a live slot (``_make_room``) look again."""
        if self._freed is not None:
            try:
                self._freed.set()
            except RuntimeError:  # its loop is closed (a tool serves one loop at a time)
                self._freed = None

    async def close_all(self) -> None:
        for session in list(self._live.values()):
            self._drop(session, None)
        await self.stopped()
        if self.pool is not None:
            await self.pool.close()

    # ------------------------------------------------------------------ calls
    async def prepare(self, session: PySession) -> Reply | None:
        """Bring the session's sandbox to the end of its history now (restore a fork's
        checkpoint, replay, catch up), as its next call would; the reply that says why
        not, or None (bench/python_session.py times forks and replays with it)."""
        async with session._lock:
            session.busy = True
            try:
                return await self._ready(session)
            finally:
                session.busy = False
                self._touch(session)

    async def call(self, session: PySession, code: str) -> Reply:
        """Run ``code`` in the session (rebuilding its state first if needed)."""
        if session.closed:
            return Reply(b"session closed", {"kind": "error", "message": "session closed"})
        async with session._lock:
            session.busy = True
            try:
                problem = await self._ready(session)
                if problem is not None:
                    return problem
                reply = await session.sandbox.request(
                    "exec", code.encode("utf-8", "replace"), timeout_s=self.wall_timeout_s,
                    max_bytes=self.cap, cap=self.cap)
                if reply.status.get("kept"):
                    session.advance(code)
                    session.live_len = len(session.history)
                elif reply.kind in _LOST:
                    self._drop(session, "lost")
                return reply
            finally:
                session.busy = False
                self._touch(session)

    async def _ready(self, session: PySession) -> Reply | None:
        """``_materialise`` in a task of its own, shielded: a call cancelled (its timeout)
        while the state is being rebuilt leaves the rebuild running, and the next call
        waits for it instead of starting over (a long history could otherwise never be
        rebuilt within one call's time). Called with the session's lock held."""
        if session._rebuild is None or session._rebuild.done():
            session._rebuild = asyncio.ensure_future(self._materialise(session))
        return await asyncio.shield(session._rebuild)

    async def _materialise(self, session: PySession) -> Reply | None:
        """A live sandbox at the end of the history, or the reply that says why not."""
        if session.sandbox is None or not session.sandbox.alive:
            if session.sandbox is not None:
                self._drop(session, "lost")
            session.sandbox = await self._take(session)
            if session.sandbox is None:
                return Reply(b"", {"kind": "error", "message": "no session sandbox could "
                                   "be started (see the actor log)"})
            session.live_len = 0
            if session.checkpoint is not None:
                problem = await self._restore(session)
                if problem is not None:
                    return problem
        behind = session.history[session.live_len:]
        if not behind:
            return None
        start = time.perf_counter()
        rebuilt = session.live_len == 0
        for i, code in enumerate(behind, start=session.live_len):
            reply = await session.sandbox.request(
                "exec", code.encode("utf-8", "replace"), timeout_s=self.wall_timeout_s,
                max_bytes=0, cap=self.cap, quiet=True)
            if not reply.status.get("kept"):
                if reply.kind in _LOST:
                    self._drop(session, "lost")
                self.counts["replay_failures"] += 1
                return Reply(b"", {"kind": "error", "message": (
                    f"the session's state could not be rebuilt: call {i + 1} of its history "
                    f"ended with {reply.kind} when run again")})
            session.live_len = i + 1
        self.counts["replays" if rebuilt else "catchups"] += 1
        self.counts["replayed_calls"] += len(behind)
        if rebuilt:
            self._lat["replay"].append(time.perf_counter() - start)
        return None

    async def _restore(self, session: PySession) -> Reply | None:
        data, length = session.checkpoint
        start = time.perf_counter()
        reply = await session.sandbox.request("load", data, timeout_s=self.wall_timeout_s,
                                              max_bytes=self.cap)
        session.checkpoint = None  # restored or not, the bytes are not needed again
        if reply.status.get("kept"):
            session.live_len = length
            self.counts["forks"] += 1
            self._lat["restore"].append(time.perf_counter() - start)
            return None
        self._fallback("restore_failed")
        log.info("python session: restoring a checkpoint failed (%s: %s); replaying",
                 reply.kind, reply.status.get("message", "")[:200])
        if reply.kind in _LOST:  # the sandbox is gone: start over with a new one
            self._drop(session, "lost")
            session.sandbox = await self._take(session)
            if session.sandbox is None:
                return Reply(b"", {"kind": "error", "message": "no session sandbox"})
        return None

    # ------------------------------------------------------------------ sandboxes
    async def _take(self, session: PySession) -> SessionSandbox | None:
        await self._make_room()
        sandbox = None
        if self.pool is not None:
            try:
                sandbox = await self.pool.take()
                self.pool.finished()  # held for the session's life: prepare the next now
            except PoolError:  # none free or preparing failed: start one for this call
                self.counts["cold_starts"] += 1
        if sandbox is None:
            try:
                sandbox = self._spawn()
                await sandbox.ready(self.ready_timeout_s)
            except (PoolError, OSError) as exc:
                log.warning("python session: starting a sandbox failed: %s", exc)
                if sandbox is not None:
                    sandbox.kill()
                return None
        self._live[id(session)] = session
        return sandbox

    async def _make_room(self) -> None:
        """Past the cap, stop the least recently used idle session (it replays later);
        when every live one is in a call, wait until one is not."""
        while len(self._live) >= self.max_live:
            idle = [s for s in self._live.values() if not s.busy and not _rebuilding(s)]
            if idle:
                self._drop(min(idle, key=lambda s: s.last_used), "evictions")
                return
            self._freed = asyncio.Event()  # of this loop (a tool may serve several in turn)
            await self._freed.wait()

    def _touch(self, session: PySession) -> None:
        session.last_used = stamp = time.monotonic()
        self._wake_waiters()
        if session.sandbox is not None:
            asyncio.get_running_loop().call_later(self.idle_s, self._idle, session, stamp)

    def _idle(self, session: PySession, stamp: float) -> None:
        if (session.last_used == stamp and not session.busy and not _rebuilding(session)
                and session.sandbox is not None):
            self._drop(session, "idle_stops")

    # ------------------------------------------------------------------ figures
    def stats(self) -> dict[str, Any]:
        """session_*: counts (see the module docstring) and fork/restore/replay seconds
        (p50 over the last 10,000); session_live: sandboxes held now."""
        out: dict[str, Any] = {f"session_{k}": v for k, v in self.counts.items()}
        out["session_live"] = len(self._live)
        for name, values in self._lat.items():
            ordered = sorted(values)
            if ordered:
                out[f"session_{name}_p50_s"] = ordered[len(ordered) // 2]
        return out | (self.pool.stats() if self.pool is not None else {})
