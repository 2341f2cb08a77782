"""The Python interpreter tool: runs a model's code in the sandbox and reports what it printed.

Like the reference ARPO tool, a bare expression as the last statement is shown the way
the REPL shows it (its repr, unless None), so ``6*7`` gives ``42``. Output (stdout and
stderr interleaved) is capped at ``max_output`` characters; past the cap the run is
stopped. Errors carry the last lines of the traceback (frames of the sandbox's own
runner are dropped, and the offending source line is shown).

The interpreter is this process's own (``sys.executable``), so the sandbox offers the
same packages (numpy, sympy, ...); its installation and virtual environment are bound
back read-only inside the hidden folders, and nothing else of the project is visible.
``hide`` adds folders to hide (``build_tools`` passes the run and cache folders).

With ``pool`` > 0 (``tools.python.pool``) a call takes a warm sandbox from
``toolenv.pool.WarmPool``: started ahead of the call, the ``preload`` modules
(``tools.python.preload``) imported, used for that call only and then thrown away, under
the same limits and isolation (toolenv/pool.py gives the design and its threat model).
With ``pool=0`` every call starts a cold sandbox, as before.

With ``state="session"`` (``tools.python.state``) the tool is *stateful*: a trajectory's
calls (``call_in``) run in one live interpreter of its own, which a fork of the trajectory
copies (toolenv/session.py: sessions, forks, replays; toolenv/session_child.py: what runs
inside). The pool then holds session sandboxes; a call without a session runs cold.

At construction the tool probes which isolation works here (``sandbox`` describes the
modes) and logs a warning for anything missing: no bwrap is an error unless
``allow_unsandboxed``, in which case every start-up logs an ``UNSANDBOXED`` warning.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import sys
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

from toolenv.base import ToolResult
from toolenv.fork_server import ForkServer
from toolenv.pool import READY, PoolEmpty, PoolError, WarmPool, WarmSandbox
from toolenv.sandbox import Limits, Sandbox, SandboxRun, default_hidden
from toolenv.session import PySession, SessionManager, canonical_code
from toolenv.session_sandbox import Reply, SessionSandbox

log = logging.getLogger(__name__)

_FILE_BYTES = 16 << 20  # largest file a snippet may write in its scratch folder
_RESULT_VERSION = "1"  # bump when the text of results would change
_SESSION_VERSION = "1"  # bump when session results would change (session_child.py)
# One program from two files: the checkpoint functions, then the rest and main()
_SESSION_CHILD = "\n\n".join(Path(__file__).with_name(name).read_text()
                               for name in ("session_checkpoint.py", "session_child.py"))
# Besides the call's own processes, a session runs its keeper and its holder.
_SESSION_PROCS = 2
_STATES = ("stateless", "session")
_WINDOW = 10_000  # latencies kept for the percentiles

# Runs inside the sandbox (python -c); the snippet arrives on stdin.
_RUNNER_DEF = r"""
import ast, linecache, sys, traceback
def _arpo_run():
    src = sys.stdin.buffer.read().decode("utf-8", "replace")
    linecache.cache["<code>"] = (len(src), None, src.splitlines(True), "<code>")
    scope = {"__name__": "__main__", "__builtins__": __builtins__}
    try:
        tree = ast.parse(src, "<code>")
        last = tree.body.pop() if tree.body and isinstance(tree.body[-1], ast.Expr) else None
        exec(compile(tree, "<code>", "exec"), scope)
        if last is not None:  # REPL-style display of a final bare expression
            exec(compile(ast.Interactive(body=[last]), "<code>", "single"), scope)
    except SystemExit:
        raise
    except BaseException as exc:
        tb = exc.__traceback__
        while tb is not None and tb.tb_frame.f_code.co_filename != "<code>":
            tb = tb.tb_next
        sys.stdout.flush()
        sys.stderr.write("".join(traceback.format_exception(type(exc), exc, tb, limit=-8)))
        sys.stderr.flush()
        raise SystemExit(1)
"""
_RUNNER = _RUNNER_DEF + "_arpo_run()\n"

# A warm sandbox (toolenv/pool.py): import the preloads (argv), then fork. The child, whose
# CPU time starts at zero, says READY and waits for its code; it ends with os._exit after
# joining threads and running exit handlers (the interpreter's teardown is the slow part of
# an exit, at low priority on a busy machine; skipping it changes one thing: objects still
# alive at exit, e.g. in reference cycles, are not finalized, so a __del__ that prints
# prints nothing). The parent, the sandbox's init, only waits and exits as the child did
# (with its exit code, or 128 + the signal that killed it), so the sandbox ends when the
# child does.
_EXIT_DEF = r"""
import atexit, os, select, signal
def _arpo_exit(code):
    if code is None:
        code = 0
    elif not isinstance(code, int):  # as the interpreter treats SystemExit("message")
        print(code, file=sys.stderr)
        code = 1
    if "threading" in sys.modules:
        sys.modules["threading"]._shutdown()  # joins non-daemon threads, as an exit does
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
    os._exit(code & 255)
"""
_WARM_RUNNER = _RUNNER_DEF + _EXIT_DEF + r"""
for _name in sys.argv[1:]:
    try:
        __import__(_name)
    except Exception:
        pass  # not installed here: the snippet's own import will say so
sys.argv[1:] = []
# The sandbox's init (bwrap --as-pid-1) must not be killable by the snippet (init gets no
# signal it has no handler for; Python's SIGINT handler and the others are set to ignore).
# They are ignored before the fork, so no snippet ever runs while its parent still has the
# defaults (under load the parent could be descheduled right after forking); the child
# takes back what it had before it says it is ready.
_saved = {}
for _sig in signal.valid_signals():
    if _sig not in (signal.SIGKILL, signal.SIGSTOP, signal.SIGCHLD):
        try:
            _saved[_sig] = signal.signal(_sig, signal.SIG_IGN)
        except (OSError, ValueError):
            pass
_pid = os.fork()
if _pid == 0:
    for _sig, _old in _saved.items():
        signal.signal(_sig, signal.SIG_DFL if _old is None else _old)
    os.write(1, __READY__)
    try:
        _arpo_run()
    except SystemExit as _exc:
        _arpo_exit(_exc.code)
    _arpo_exit(0)
else:
    # The waiting parent: the call always ends with the snippet's own status.
    # The host's output pipe, kept: its reader gone means the host is gone (died, or
    # dropped the sandbox), and then the call ends now, as it would with bwrap as init.
    _host = os.dup(1)
    _null = os.open(os.devnull, os.O_RDWR)
    for _fd in (0, 1, 2):  # only the child holds the pipes: EOF comes when it is done
        os.dup2(_null, _fd)
    _pidfd = os.pidfd_open(_pid)
    _poll = select.poll()
    _poll.register(_host, 0)  # a pipe's write end reports POLLERR once no reader is left
    _poll.register(_pidfd, select.POLLIN)
    while _pidfd not in {_fd for _fd, _ in _poll.poll()}:
        os.kill(_pid, signal.SIGKILL)  # the host is gone
        _poll.unregister(_host)
    _status = os.waitpid(_pid, 0)[1]
    if os.WIFSIGNALED(_status):  # as a shell says it: init cannot send itself the signal
        os._exit(128 + os.WTERMSIG(_status))
    os._exit(os.waitstatus_to_exitcode(_status) & 255)
""".replace("__READY__", repr(READY))

# Start-up probe: what the sandbox actually isolates, as JSON.
_PROBE = r"""
import json, os, socket, sys
hidden, exposed = json.loads(sys.argv[1]), json.loads(sys.argv[2])
def visible(path):
    keep = {e[len(path) + 1:].split("/")[0] for e in exposed if e.startswith(path + "/")}
    try:
        return [n for n in os.listdir(path) if n not in keep]
    except OSError:
        return []
net = True
try:
    socket.create_connection(("1.1.1.1", 80), timeout=1).close()
except OSError:
    net = False
print(json.dumps({"uid": os.getuid(), "network": net,
                  "visible": {p: visible(p)[:5] for p in hidden if visible(p)}}))
"""


def _interpreter_roots(python: str) -> list[str]:
    """Folders the interpreter needs: its installation and its virtual environment."""
    if python == sys.executable:
        roots = {sys.prefix, sys.base_prefix}
    else:
        roots = {str(Path(python).parent.parent), str(Path(python).resolve().parent.parent)}
    return sorted({os.path.realpath(r) for r in roots})


class PythonTool:
    """``<python>code</python>``: run code in a fresh sandbox, return what it printed."""

    name = "python"
    description = "Run Python code in a sandbox and return what it printed (use print)."
    parameters = {"type": "object", "required": ["code"], "properties": {
        "code": {"type": "string", "description": "the program to run"}}}
    canonical = staticmethod(canonical_code)  # the cache key's form of the code

    @classmethod
    def from_config(cls, cfg, run_dir: str | Path, cache_dir: str | Path) -> PythonTool:
        """The tool of a ``tools`` section (its ``python`` section). Its own wall-clock limit
        is set a little under ``tools.timeout_s`` so that it, not the runner's backstop,
        reports the timeout (with the output printed so far)."""
        py = cfg.python  # tools.python: its state's keys (arpo_async/core/config/tools.py)
        session = ({"max_sessions": py.max_sessions, "session_idle_s": py.session_idle_s,
                    "checkpoint_mb": py.checkpoint_mb} if py.state == "session" else {})
        return cls(cpu_s=py.cpu_s, memory_mb=py.memory_mb, max_procs=py.max_procs,
                   max_output=py.max_output,
                   wall_timeout_s=max(cfg.timeout_s - 0.25, 0.9 * cfg.timeout_s),
                   allow_unsandboxed=py.allow_unsandboxed,
                   hide=[run_dir, cache_dir],  # checkpoints, logs and cached results
                   pool=py.pool, preload=py.preload, state=py.state,
                   holder=py.state == "stateless" and py.holder, **session)

    def __init__(self, cpu_s: int = 5, memory_mb: int = 512, max_procs: int = 32,
                 max_output: int = 4096, wall_timeout_s: float = 10.0,
                 allow_unsandboxed: bool = False, *, python: str | None = None,
                 isolation: str = "auto", hide: Sequence[str | Path] = (), pool: int = 0,
                 preload: Sequence[str] = ("math",), state: str = "stateless",
                 max_sessions: int = 32, session_idle_s: float = 120.0,
                 checkpoint_mb: int = 64, holder: bool = False):
        for key, value in (("cpu_s", cpu_s), ("memory_mb", memory_mb),
                           ("max_procs", max_procs), ("max_output", max_output),
                           ("wall_timeout_s", wall_timeout_s)):
            if value <= 0:
                raise ValueError(f"PythonTool {key} must be > 0, got {value}")
        if pool < 0:
            raise ValueError(f"PythonTool pool must be >= 0, got {pool}")
        if state not in _STATES:
            raise ValueError(f"PythonTool state must be one of {_STATES}, got {state!r}")
        self.preload = _check_modules(preload)
        self.python = python or sys.executable
        self.hide = default_hidden(hide)
        self.cpu_s, self.max_output, self.wall_timeout_s = cpu_s, max_output, wall_timeout_s
        py_version = f"{sys.version_info[0]}.{sys.version_info[1]}"
        self.version = f"{_RESULT_VERSION}:py{py_version}:out{max_output}"
        self.stateful = state == "session"
        if self.stateful:  # session results never mix with stateless ones in the cache
            self.version += f":session{_SESSION_VERSION}"
        limits = Limits(cpu_s=cpu_s, memory_bytes=memory_mb << 20, max_procs=max_procs,
                        file_bytes=_FILE_BYTES)
        self.sandbox, self.warnings = self._choose(limits, isolation, allow_unsandboxed)
        for warning in self.warnings:
            log.warning("python tool: %s", warning)
        if pool > 0 and not hasattr(os, "pidfd_open"):  # Linux >= 5.3, Python >= 3.9
            self.warnings.append("warm sandboxes need pidfd_open (Linux 5.3): tools.python.pool "
                                 "ignored, every call starts a cold sandbox")
            log.warning("python tool: %s", self.warnings[-1])
            pool = 0
        self.sessions: SessionManager | None = None
        if self.stateful:
            self.sessions = SessionManager(
                self._spawn_session, pool=pool, max_live=max_sessions, idle_s=session_idle_s,
                checkpoint_bytes=checkpoint_mb << 20, wall_timeout_s=wall_timeout_s,
                cap=4 * max_output)
            pool = 0  # the pool holds session sandboxes; a call without a session runs cold
        self.forks = ForkServer.of(self.sandbox, self.python, _RUNNER_DEF + _EXIT_DEF,
                                   self.preload) if holder and not self.stateful else None
        pool = 0 if self.forks is not None else pool  # a holder's fallback call runs cold
        self.pool = WarmPool(self._spawn_warm, pool) if pool > 0 else None
        self._latencies: deque[float] = deque(maxlen=_WINDOW)
        self._cold_fallbacks = self._cold_overflow = 0

    # ------------------------------------------------------------------ start-up probe

    def _make(self, mode: str, limits: Limits) -> Sandbox:
        env = {"PATH": f"{Path(self.python).parent}:/usr/local/bin:/usr/bin:/bin",
               "PYTHONHASHSEED": "0",  # same snippet, same output: results are cached
               "PYTHONDONTWRITEBYTECODE": "1", "PYTHONUNBUFFERED": "1",
               "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
               "MPLBACKEND": "Agg", "MPLCONFIGDIR": "/tmp"}
        return Sandbox(mode, limits, expose=_interpreter_roots(self.python), hide=self.hide,
                       env=env)

    def _choose(self, limits: Limits, isolation: str,
                allow_unsandboxed: bool) -> tuple[Sandbox, list[str]]:
        if isolation not in ("auto", "setuid", "userns"):
            raise ValueError(f"isolation must be auto, setuid or userns, got {isolation!r}")
        failures: list[str] = []
        if shutil.which("bwrap") is None:
            failures.append("bubblewrap (bwrap) is not installed")
        else:
            modes = [isolation] if isolation != "auto" else (
                ["setuid", "userns"] if os.geteuid() == 0 else ["userns"])
            for mode in modes:
                sandbox = self._make(mode, limits)
                missing, error = self._probe(sandbox)
                if not error:
                    return sandbox, missing
                failures.append(f"{mode} mode failed: {error}")
        reason = "; ".join(failures)
        if not allow_unsandboxed:
            hint = ("install bubblewrap (apt-get install bubblewrap)" if "not installed" in reason
                    else "see toolenv/sandbox.py for what each mode needs")
            raise RuntimeError(f"python tool cannot sandbox code: {reason}. Fix: {hint}, or set "
                               "tools.python.allow_unsandboxed=true to run code without one "
                               "(unsafe)")
        warning = (f"UNSANDBOXED: model-written code runs with only rlimits, with access to "
                   f"this machine's files and network ({reason})")
        return self._make("none", limits), [warning]

    def _probe(self, sandbox: Sandbox) -> tuple[list[str], str]:
        """(missing isolation, error that makes the mode unusable)."""
        args = [json.dumps(list(sandbox.hide)), json.dumps(list(sandbox.expose))]
        run = sandbox.run_sync([self.python, "-s", "-c", _PROBE, *args], timeout_s=30)
        text = run.output.decode("utf-8", "replace").strip()
        if run.returncode != 0:
            return [], f"exit {run.returncode}: {text[-500:]}"
        try:
            facts = json.loads(text.splitlines()[-1])
        except (ValueError, IndexError):
            return [], f"unreadable probe output: {text[-500:]!r}"
        missing = []
        if facts["uid"] == 0:
            missing.append("code runs as root inside the sandbox")
        if facts["network"]:
            missing.append("the network is reachable from the sandbox")
        for path, names in facts["visible"].items():
            missing.append(f"hidden folder {path} is visible (e.g. {names})")
        return missing, ""

    # ------------------------------------------------------------------ calls

    def _spawn_warm(self) -> WarmSandbox:
        # One more process for the warm runner's waiting parent, so the snippet keeps the
        # same process allowance as on the cold path.
        limits = replace(self.sandbox.limits, max_procs=self.sandbox.limits.max_procs + 1)
        return WarmSandbox(*replace(self.sandbox, limits=limits, as_pid_1=True).spawn(
            [self.python, "-s", "-u", "-c", _WARM_RUNNER, *self.preload]))

    def _spawn_session(self) -> SessionSandbox:
        limits = replace(self.sandbox.limits,
                         max_procs=self.sandbox.limits.max_procs + _SESSION_PROCS)
        # folders of /tmp that hold binds of the host's (an interpreter in a clone under
        # /tmp): not the session's files, never carried by a checkpoint
        skip = sorted({Path(p).relative_to("/tmp").parts[0] for p in self.sandbox.expose
                       if p.startswith("/tmp/")})
        settings = json.dumps({"ready": READY.decode("latin-1"), "skip": skip,
                               "preload": [*self.preload, "cloudpickle", "tarfile"]})
        return SessionSandbox(*replace(self.sandbox, limits=limits, as_pid_1=True).spawn(
            [self.python, "-s", "-u", "-c", _SESSION_CHILD, settings]))

    def open_session(self) -> PySession:
        """A new trajectory's interpreter (no sandbox until its first call)."""
        if self.sessions is None:
            raise RuntimeError("PythonTool: sessions need state='session'")
        return self.sessions.open()

    def restore_session(self, history: list[str]) -> PySession:
        """A trajectory's interpreter at the end of ``history`` (rebuilt at its next call)."""
        if self.sessions is None:
            raise RuntimeError("PythonTool: sessions need state='session'")
        return self.sessions.restore(history)

    async def call_in(self, session: PySession, args: str) -> ToolResult:
        """One call in ``session``: what it printed, as ``call`` reports it."""
        start = time.perf_counter()
        result = self._session_result(await self.sessions.call(session, args))
        result.latency_s = time.perf_counter() - start
        self._latencies.append(result.latency_s)
        return result

    async def call(self, args: str) -> ToolResult:
        start = time.perf_counter()
        code, cap = args.encode("utf-8"), 4 * self.max_output
        run = None
        if self.forks is not None:  # None back: no holder, or its setup failed: cold
            run = await self.forks.run(code, self.wall_timeout_s, max_bytes=cap)
        warm = None
        if run is None and self.pool is not None:
            try:
                warm = await self.pool.take()
            except PoolEmpty:  # a burst past the pool: this call starts cold
                self._cold_overflow += 1
            except PoolError:  # logged by the pool; this call starts cold instead
                self._cold_fallbacks += 1
        if warm is not None:
            try:
                run = await warm.run(code, self.wall_timeout_s, max_bytes=cap)
            finally:
                self.pool.finished()
        elif run is None:
            run = await self.sandbox.run([self.python, "-s", "-u", "-c", _RUNNER], code,
                                         self.wall_timeout_s, max_bytes=cap)
        result = self._result(run)
        result.latency_s = time.perf_counter() - start  # the wait for a sandbox included
        self._latencies.append(result.latency_s)
        return result

    def stats(self) -> dict[str, float]:
        """latency_p50_s/p99_s: seconds per executed call (the last 10,000), waiting for a
        sandbox included; cold_fallbacks: calls that started cold because a warm sandbox
        could not be prepared; cold_overflow: calls that started cold because none was
        free (a burst bigger than the pool); pool_*: ``WarmPool.stats`` (without a pool,
        absent); holder_*: ``ForkServer.stats`` (``tools.python.holder``; else absent)."""
        ordered = sorted(self._latencies)

        def pct(q: float) -> float:
            return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else 0.0

        out = {"latency_p50_s": pct(0.5), "latency_p99_s": pct(0.99),
               "cold_fallbacks": self._cold_fallbacks, "cold_overflow": self._cold_overflow}
        if self.sessions is not None:
            out |= self.sessions.stats()
        out |= self.forks.stats() if self.forks is not None else {}
        return out | (self.pool.stats() if self.pool is not None else {})

    def _session_result(self, reply: Reply) -> ToolResult:
        """A session reply as a result; errors say what became of the session's state."""
        text = reply.output.decode("utf-8", "replace")
        kind, status = reply.kind, reply.status
        if kind == "ok":
            return ToolResult(self._clip(text if reply.truncated else text.rstrip(),
                                         keep_tail=False), ok=True, latency_s=reply.wall_s)
        if kind == "exit" and status.get("kept") and status.get("code") == 0:
            return ToolResult(self._clip(text.rstrip(), keep_tail=False), ok=True,
                              latency_s=reply.wall_s)
        text = self._clip(text.rstrip(), keep_tail=True)
        kept = "" if status.get("kept") else (
            " (the session keeps its state from before this call)")
        rebuilt = " Its state from before this call is rebuilt at the next call."
        note, error = {
            "exception": ("", "exception"),
            "exit": (f"exit code {status.get('code')}{kept}", "exit_code"),
            "killed": (f"{self._signal_text(int(status.get('signal', 9)))}{kept}", "killed"),
            "timeout": (f"TimeoutError: execution exceeded the {self.wall_timeout_s:g} s time "
                        f"limit; the session was stopped.{rebuilt}", "timeout"),
            "flood": (f"Output flood: the session was stopped.{rebuilt}", "killed"),
            "dead": (f"The session's interpreter died during the call.{rebuilt}", "session"),
            "protocol": (f"The session's reply broke its protocol ({status.get('message')}): "
                         f"the session was stopped.{rebuilt}", "session"),
        }.get(kind, (f"Session error: {status.get('message', kind)}", "session"))
        full = f"{text}\n{note}" if text and note else text or note
        return ToolResult(full, ok=False, latency_s=reply.wall_s, error=error)

    def _result(self, run: SandboxRun) -> ToolResult:
        text = run.output.decode("utf-8", "replace")
        if run.truncated:  # stopped for the size of its output, not for an error
            return ToolResult(self._clip(text, keep_tail=False), ok=True, latency_s=run.wall_s)
        text, code = text.rstrip(), run.returncode
        if code == 0:
            return ToolResult(self._clip(text, keep_tail=False), ok=True, latency_s=run.wall_s)
        # Errors keep the end of the output, where the traceback is.
        text = self._clip(text, keep_tail=True)
        if run.timed_out:
            note = f"TimeoutError: execution exceeded the {self.wall_timeout_s:g} s time limit"
            return self._error(text, note, "timeout", run)
        if text.startswith(("bwrap:", "prlimit:", "setpriv:")):
            return self._error(text, "", "sandbox", run)
        if code == 1:
            return self._error(text, "", "exception", run)
        signum = -code if code < 0 else code - 128 if code > 128 else 0
        if signum:
            return self._error(text, self._signal_text(signum), "killed", run)
        return self._error(text, f"exit code {code}", "exit_code", run)

    def _clip(self, text: str, keep_tail: bool) -> str:
        if len(text) <= self.max_output:
            return text
        marker = f"[output truncated at {self.max_output} characters]"
        if keep_tail:
            return f"... {marker}\n{text[-self.max_output:]}"
        return f"{text[: self.max_output]}\n... {marker}"

    @staticmethod
    def _error(text: str, note: str, kind: str, run: SandboxRun) -> ToolResult:
        full = f"{text}\n{note}" if text and note else text or note
        return ToolResult(full, ok=False, latency_s=run.wall_s, error=kind)

    def _signal_text(self, signum: int) -> str:
        if signum == signal.SIGXCPU:
            return f"Killed: CPU time limit of {self.cpu_s} s exceeded"
        try:
            name = signal.Signals(signum).name
        except ValueError:
            name = f"signal {signum}"
        if signum == signal.SIGKILL:
            return f"Killed ({name}: CPU hard limit, memory or a process limit)"
        return f"Killed ({name})"

    async def close(self) -> None:
        """Kill the unused warm sandboxes, the holder and every live session's sandbox."""
        self.forks is not None and self.forks.close()
        if self.pool is not None:
            await self.pool.close()
        if self.sessions is not None:
            await self.sessions.close_all()


def _check_modules(names: Sequence[str]) -> list[str]:
    """Preload names reach the sandbox's argv: only dotted identifiers pass."""
    for name in names:
        if not all(part.isidentifier() for part in name.split(".")):
            raise ValueError(f"python preload: {name!r} is not a module name")
    return list(names)
