"""Run a command in a bubblewrap sandbox with rlimits, a wall-clock timeout and capped output.

What the sandboxed command sees: the host's root file system read-only; fresh, size-capped
tmpfs at /tmp (its writable scratch folder and cwd) and /dev/shm; private /proc and /dev;
the project, the folder that holds it, home and other hidden folders replaced by empty
read-only tmpfs, with only the paths in ``expose`` (the interpreter and its packages)
bound back read-only; no
network (its own network namespace has only a loopback); its own pid namespace, so when
the command's main process exits or bwrap is killed, every process it started dies too.

Isolation modes, picked by the caller after probing (see ``python_tool``):

- ``setuid`` (host runs as root): bwrap keeps real root to set up mounts, drops every
  capability except setuid/setgid, and the command starts through ``setpriv`` as an
  unused uid from ``UidPool``. Why not bwrap's ``--uid``: as root it maps the sandbox
  user onto host uid 0, which keeps owner access to root's files and is exempt from
  RLIMIT_NPROC, so a fork bomb would not be contained. Each call holds its own uid, so
  RLIMIT_NPROC counts exactly that call's processes.
- ``userns`` (any user): unprivileged bwrap in a new user namespace (launched as uid
  65534 when the host is root). RLIMIT_NPROC is counted per user namespace.
- ``none``: no bwrap (``allow_unsandboxed``): only rlimits, its own session and a temp cwd.

Limits are set inside the sandbox by ``prlimit`` (CPU seconds, address space, processes,
file size, no core dumps). The wall-clock timeout always fires: bwrap starts in its own
session and the whole group gets SIGKILL; ``--die-with-parent`` and the pid namespace take
everything inside down with it. A seccomp filter (``toolenv/seccomp.py``) denies every
process inside ``ptrace`` and reading or writing another process's memory, so no process of
a sandbox can hold another (a session's keeper) alive or change it.

In setuid mode the pool's uids belong to sandboxes only: before a uid is handed out, and
when a sandbox did not end as it should, every process still running as that uid is
killed (``kill_uid``), so nothing of one sandbox can survive into the next that gets its uid.
"""

from __future__ import annotations

import asyncio
import logging
import os
import resource
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path

from toolenv import seccomp
from toolenv.uids import UID_POOL_BASE, UID_POOL_SIZE, UidPool, kill_uid, uid_processes

__all__ = ["UID_POOL_BASE", "UID_POOL_SIZE", "CappedOutput", "Limits", "Sandbox", "SandboxRun",
           "UidPool", "default_hidden", "kill_uid", "run_capped", "uid_processes"]

log = logging.getLogger(__name__)

MODES = ("setuid", "userns", "none")
NOBODY = 65534
_READ_CHUNK = 65536
_REAP_TIMEOUT_S = 5.0
# Model-written code runs below the priority of the actors and learner that call it.
_NICE = 10
_HIDDEN_TMPFS_BYTES = 1 << 20
_BASE_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


@dataclass(frozen=True)
class Limits:
    cpu_s: int
    memory_bytes: int
    max_procs: int
    file_bytes: int  # largest file the command may write (RLIMIT_FSIZE)


@dataclass
class SandboxRun:
    output: bytes  # stdout and stderr interleaved, at most max_bytes + one read chunk
    returncode: int | None  # None after a timeout; negative signal number when killed
    timed_out: bool
    truncated: bool  # output passed the cap, so the command was killed early
    wall_s: float


class CappedOutput:
    """A command's output, kept up to ``max_bytes`` (plus at most one read chunk): past the
    cap ``kill`` is called once and the rest is read to its end and thrown away, so the
    pipe can close. Its state outlives ``read_all``, which a timeout cancels."""

    def __init__(self, max_bytes: int, kill: Callable[[], None], head: bytes = b""):
        self.max_bytes, self._kill = max_bytes, kill
        self.chunks, self.size, self.truncated = [head], len(head), False

    async def read_all(self, read: Callable[[], Awaitable[bytes]]) -> None:
        """Read with ``read`` (b"" at the end) until the end."""
        while chunk := await read():
            if self.truncated:
                continue  # killed: read on to EOF, discarding, so the pipe can close
            self.chunks.append(chunk)
            self.size += len(chunk)
            if self.size > self.max_bytes:
                self.truncated = True
                self._kill()

    def result(self, returncode: int | None, timed_out: bool, wall_s: float) -> SandboxRun:
        return SandboxRun(b"".join(self.chunks), returncode, timed_out, self.truncated, wall_s)


_SYSTEM_DIRS = {"/", "/usr", "/usr/lib", "/usr/local", "/usr/local/lib", "/lib", "/lib64",
                "/bin", "/sbin", "/etc", "/var", "/opt", "/tmp"}


def default_hidden(extra: Sequence[str | Path] = ()) -> list[str]:
    """Folders a sandbox must not see: homes, the project, run-time sockets, mounts, and
    ``extra`` (e.g. the run folder). Missing folders and "/" are skipped."""
    repo = Path(__file__).resolve().parents[1]
    # The project's parent folder too: checkouts sit beside their workspace (shared data,
    # notes, other clones); a system folder or "/" as that parent hides only the project.
    workspace = repo.parent if str(repo.parent) not in _SYSTEM_DIRS else repo
    candidates = ["/root", "/home", "/work", "/run", "/srv", "/mnt", "/media",
                  str(Path.home()), str(repo), str(workspace), *map(str, extra)]
    found: list[str] = []
    for path in candidates:
        real = os.path.realpath(path)
        if os.path.isdir(real) and real != "/" and real not in found:
            found.append(real)
    # A folder inside another hidden one is already hidden.
    return [p for p in found if not any(p.startswith(q + "/") for q in found if q != p)]


@dataclass
class Sandbox:
    mode: str
    limits: Limits
    expose: Sequence[str] = ()  # read-only paths bound back inside hidden folders
    hide: Sequence[str] = field(default_factory=default_hidden)
    scratch_bytes: int = 64 << 20  # size of the /tmp scratch tmpfs (and /dev/shm's)
    env: dict[str, str] = field(default_factory=dict)
    uid_pool: UidPool | None = None
    # The command is the pid namespace's init (bwrap --as-pid-1): nothing inside can kill
    # it (init ignores signals it has no handler for), and the sandbox ends when it does.
    # A Python session's keeper runs so (toolenv/session_child.py).
    as_pid_1: bool = False

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"sandbox mode must be one of {MODES}, got {self.mode!r}")
        if self.mode == "setuid" and self.uid_pool is None:
            self.uid_pool = UidPool()

    # ------------------------------------------------------------------ command lines

    def argv(self, command: Sequence[str], uid: int | None,
             filter_fd: int | None = None, holder: bool = False) -> list[str]:
        """The full command line for one run (``uid``: the pool uid in setuid mode;
        ``filter_fd``: the seccomp program's pipe, passed to bwrap). ``holder`` (setuid
        mode): the command stays root, without rlimits, and keeps the capabilities to
        make namespaces and mounts; it must drop them itself before running any code
        (toolenv/fork_child.py, which sets each call's uid and limits)."""
        if self.mode == "none":
            return list(command)  # limits and priority come from preexec_fn
        inner = [] if holder else self._prlimit()
        inner += ["nice", "-n", str(_NICE)]
        if self.mode == "setuid":
            if not holder:
                inner += ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups",
                          "--no-new-privs", "--"]
            head = ["--unshare-ipc", "--unshare-pid", "--unshare-net", "--unshare-uts",
                    "--unshare-cgroup-try", "--cap-drop", "ALL",
                    "--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID"]
            if holder:
                head += ["--cap-add", "CAP_SYS_ADMIN", "--cap-add", "CAP_NET_ADMIN"]
        elif holder:
            raise ValueError("a holder sandbox needs setuid mode")
        else:
            head = ["--unshare-all", "--unshare-user", "--disable-userns",
                    "--uid", str(NOBODY), "--gid", str(NOBODY)]
        if self.as_pid_1:
            head.append("--as-pid-1")
        if filter_fd is not None:
            head += ["--seccomp", str(filter_fd)]
        inner += list(command)
        return ["bwrap", "--die-with-parent", "--new-session", *head, *self._mounts(),
                "--clearenv", *self._setenv(), "--", *inner]

    def _prlimit(self) -> list[str]:
        lim = self.limits
        return ["prlimit", f"--cpu={lim.cpu_s}:{lim.cpu_s + 1}", f"--as={lim.memory_bytes}",
                f"--nproc={lim.max_procs}", f"--fsize={lim.file_bytes}", "--core=0", "--"]

    def _mounts(self) -> list[str]:
        args = ["--ro-bind", "/", "/", "--proc", "/proc", "--dev", "/dev",
                "--size", str(self.scratch_bytes), "--perms", "1777", "--tmpfs", "/dev/shm"]
        for path in self.hide:
            args += ["--size", str(_HIDDEN_TMPFS_BYTES), "--perms", "0755", "--tmpfs", path]
        for path in self.expose:
            outer = next((h for h in self.hide if path.startswith(h + "/")), None)
            if outer is None:
                continue  # visible anyway through the read-only root
            # bwrap creates missing parents 0700; the dropped uid must be able to pass.
            parts = Path(path).relative_to(outer).parts[:-1]
            for i in range(len(parts)):
                args += ["--perms", "0755", "--dir", str(Path(outer, *parts[: i + 1]))]
            args += ["--ro-bind", path, path]
        for path in self.hide:
            args += ["--remount-ro", path]
        args += ["--size", str(self.scratch_bytes), "--perms", "1777", "--tmpfs", "/tmp"]
        for path in self.expose:  # an interpreter under /tmp (a CI clone) stays reachable
            if not path.startswith("/tmp/"):
                continue
            parts = Path(path).relative_to("/tmp").parts[:-1]
            for i in range(len(parts)):
                args += ["--perms", "0755", "--dir", str(Path("/tmp", *parts[: i + 1]))]
            args += ["--ro-bind", path, path]
        return args + ["--chdir", "/tmp"]

    def _setenv(self) -> list[str]:
        env = {"PATH": _BASE_PATH, "HOME": "/tmp", "TMPDIR": "/tmp", "LANG": "C.UTF-8",
               **self.env}
        return [arg for key, value in env.items() for arg in ("--setenv", key, value)]

    def _host_env(self) -> dict[str, str]:
        if self.mode != "none":  # bwrap --clearenv sets the inside's environment
            return {"PATH": os.environ.get("PATH", _BASE_PATH)}
        return {"PATH": _BASE_PATH, "HOME": "/tmp", "LANG": "C.UTF-8", **self.env}

    def _spawn_kwargs(self) -> dict:
        if self.mode == "userns" and os.geteuid() == 0:
            return {"user": NOBODY, "group": NOBODY, "extra_groups": []}
        if self.mode == "none":
            return {"preexec_fn": self._set_rlimits}
        return {}

    def _set_rlimits(self) -> None:
        lim = self.limits
        for which, value in ((resource.RLIMIT_CPU, (lim.cpu_s, lim.cpu_s + 1)),
                             (resource.RLIMIT_AS, (lim.memory_bytes,) * 2),
                             (resource.RLIMIT_NPROC, (lim.max_procs,) * 2),
                             (resource.RLIMIT_FSIZE, (lim.file_bytes,) * 2),
                             (resource.RLIMIT_CORE, (0, 0))):
            resource.setrlimit(which, value)
        os.nice(_NICE)

    # ------------------------------------------------------------------ running

    def _acquire(self) -> Lease:
        """A pool uid (setuid mode) or a scratch folder (no sandbox), and the seccomp
        filter's pipe (bwrap modes) for one run."""
        lease = Lease(*(self.uid_pool.acquire() if self.mode == "setuid" else (None, None)))
        if self.mode == "none":
            lease.workdir = tempfile.mkdtemp(prefix="arpo_py_")
        else:
            lease.filter_fd = _filter_fd()
        return lease

    def _start(self, command: Sequence[str], lease: Lease) -> dict:
        """argv and the keyword arguments every way of starting a run shares."""
        fds = () if lease.filter_fd is None else (lease.filter_fd,)
        return {"args": self.argv(command, lease.uid, lease.filter_fd), "pass_fds": fds,
                "start_new_session": True, "env": self._host_env(), "cwd": lease.workdir,
                **self._spawn_kwargs()}

    @contextmanager
    def _lease(self) -> Iterator[Lease]:
        lease = self._acquire()
        try:
            yield lease
        finally:
            lease.release()

    def spawn(self, command: Sequence[str]) -> tuple[subprocess.Popen, Lease]:
        """Start ``command`` now and hand its pipes to the caller (a warm sandbox that
        ``toolenv.pool`` feeds later): (process, lease). The process has stdin and
        stdout (stderr joined) pipes and its own session; ``lease.kill()`` kills what
        runs as its uid, and ``lease.release()`` once it has been reaped gives back its
        uid or scratch folder."""
        lease = self._acquire()
        try:
            kwargs = self._start(command, lease)
            proc = subprocess.Popen(kwargs.pop("args"), stdin=subprocess.PIPE,
                                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT, **kwargs)
        except BaseException:
            lease.release()
            raise
        lease.started()
        return proc, lease

    def spawn_holder(self, command: Sequence[str], control: int) -> subprocess.Popen:
        """Start the stateless tool's holder (toolenv/fork_server.py): setuid mode, the
        command as the sandbox's init, root with the capabilities to isolate each call it
        forks, no uid of the pool (each call takes its own), ``control`` (a socket) as its
        stdin, stdout (stderr joined) a pipe. Killing bwrap's group ends it: no setpriv
        clears the parent-death signal that ``--die-with-parent`` gives it."""
        if self.mode != "setuid":
            raise ValueError("a holder sandbox needs setuid mode")
        lease = Lease(filter_fd=_filter_fd())
        try:
            fds = () if lease.filter_fd is None else (lease.filter_fd,)
            return subprocess.Popen(
                replace(self, as_pid_1=True).argv(command, None, lease.filter_fd,
                                                  holder=True),
                stdin=control, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                pass_fds=fds, start_new_session=True, env=self._host_env())
        finally:
            lease.release()

    async def run(self, command: Sequence[str], stdin: bytes, timeout_s: float,
                  max_bytes: int) -> SandboxRun:
        """Run once; never raises for what the command does (only for failing to start)."""
        with self._lease() as lease:
            kwargs = self._start(command, lease)
            return await run_capped(kwargs.pop("args"), stdin, timeout_s, max_bytes,
                                    started=lease.started, **kwargs)

    def run_sync(self, command: Sequence[str], stdin: bytes = b"",
                 timeout_s: float = 30.0) -> SandboxRun:
        """A blocking run for start-up probes; works with or without a running event loop."""
        start = time.monotonic()
        with self._lease() as lease:
            kwargs = self._start(command, lease)
            try:
                done = subprocess.run(kwargs.pop("args"), check=False, input=stdin,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      timeout=timeout_s, **kwargs)
            except subprocess.TimeoutExpired as exc:  # bwrap was killed: so is its namespace
                return SandboxRun(exc.output or b"", None, True, False, time.monotonic() - start)
        return SandboxRun(done.stdout, done.returncode, False, False, time.monotonic() - start)


@dataclass
class Lease:
    """What one run holds: its pool uid and the uid's lock (setuid mode), its scratch folder
    (mode none), the read end of the seccomp filter's pipe until bwrap has started."""

    uid: int | None = None
    lock_fd: int | None = None
    workdir: str | None = None
    filter_fd: int | None = None

    def kill(self) -> bool:
        """SIGKILL what runs as the run's uid now (setuid mode; False in the other modes,
        where killing bwrap's group is the way): its init among them, whose end takes the
        pid namespace along, and bwrap, its parent, reaps it and exits by itself. Killing
        bwrap does not reach the init: the uid change by setpriv clears the parent-death
        signal that ``--die-with-parent`` sets. Nor should bwrap die first: the init,
        orphaned to this machine's init, could stay a zombie that counts against the
        uid's process limit for good."""
        if self.lock_fd is None:
            return False
        kill_uid(self.uid)
        return True

    def started(self) -> None:
        """bwrap has its own copy of the filter's pipe: ours can go."""
        if self.filter_fd is not None:
            os.close(self.filter_fd)
            self.filter_fd = None

    def release(self) -> None:
        """Give everything back. The uid is unlocked without a look at its processes: a
        sandbox that ended as it should has none left, one that was killed had them killed
        (``kill``), and ``UidPool.acquire`` kills any left before it hands the uid out."""
        self.started()
        if self.lock_fd is not None:
            UidPool.release(self.lock_fd)
            self.lock_fd = None
        if self.workdir is not None:
            shutil.rmtree(self.workdir, ignore_errors=True)
            self.workdir = None


_FILTER = seccomp.program()


def _filter_fd() -> int | None:
    """A pipe's read end holding the seccomp program, for bwrap ``--seccomp``."""
    if _FILTER is None:
        return None
    r, w = os.pipe()
    try:
        os.write(w, _FILTER)  # 100 bytes: far below a pipe's capacity, never blocks
    finally:
        os.close(w)
    return r


def _kill_group(proc: asyncio.subprocess.Process) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    if proc.returncode is None:
        try:
            proc.kill()
        except ProcessLookupError:
            pass


async def run_capped(argv: Sequence[str], stdin: bytes, timeout_s: float, max_bytes: int,
                     started: Callable[[], None] | None = None, **spawn) -> SandboxRun:
    """Start ``argv`` in a new session, feed ``stdin``, keep at most ``max_bytes`` of output.

    Killed with its whole process group on timeout, on passing the cap, and when the
    awaiting task is cancelled (``asyncio.wait_for`` around this always cleans up).
    """
    start = time.monotonic()
    proc = await asyncio.create_subprocess_exec(
        *argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        **{"start_new_session": True, **spawn})
    if started is not None:
        started()
    out = CappedOutput(max_bytes, lambda: _kill_group(proc))
    done = False

    async def pump() -> int:
        nonlocal done
        try:
            proc.stdin.write(stdin)
            await proc.stdin.drain()
        except (BrokenPipeError, ConnectionResetError):
            pass  # exited before reading its input: its output says why
        finally:
            proc.stdin.close()
        await out.read_all(lambda: proc.stdout.read(_READ_CHUNK))
        returncode = await proc.wait()
        done = True
        return returncode

    timed_out, returncode = False, None
    try:
        returncode = await asyncio.wait_for(pump(), timeout_s)
    except asyncio.TimeoutError:
        timed_out = True
    finally:
        if not done:  # timed out, or the caller was cancelled
            _kill_group(proc)
            await asyncio.shield(_reap(proc))
    return out.result(returncode, timed_out, time.monotonic() - start)


async def _reap(proc: asyncio.subprocess.Process) -> None:
    """After a kill: read the output pipe to EOF, then collect the exit status.

    asyncio's ``wait()`` returns only once the pipes are closed; in a sandbox every other
    holder of the pipe died with the pid namespace, so EOF comes at once.
    """

    async def drain_and_wait() -> None:
        while await proc.stdout.read(_READ_CHUNK):
            pass
        await proc.wait()

    try:
        await asyncio.wait_for(drain_and_wait(), _REAP_TIMEOUT_S)
    except asyncio.TimeoutError:
        # Only without a sandbox can an escaped process keep the pipe open this long.
        log.warning("process %d: output pipe still open %.0f s after SIGKILL; abandoning it",
                    proc.pid, _REAP_TIMEOUT_S)
        proc._transport.close()  # no public API closes a subprocess's pipes
