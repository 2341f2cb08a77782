"""The program inside a Python session's sandbox (``tools.python.state=session``): it keeps
one interpreter's state across calls, runs each call in a fork of it, and writes or loads
checkpoints. The host side is toolenv/session_sandbox.py (the wire format) and
toolenv/session.py (histories, forks, replays).

Runs as ``python -s -u -c <text> <settings JSON>``, the text being
toolenv/session_checkpoint.py's (seeding, dump and load) followed by this file's, so it
imports only the standard library and cloudpickle: the project is hidden inside the
sandbox.

Processes. The first one (the *keeper*) is the pid namespace's init (bwrap --as-pid-1, so
no call can kill it: init ignores signals it has no handler for); it imports the
preloads, forks the *holder*, then only reaps; the sandbox lives as long as it does
(without a sandbox, mode none, it is a child subreaper instead). The holder
keeps the state (``state["scope"]``, the namespace the code runs in) and reads requests:

- ``exec``: fork an *executor* that runs the code (its CPU clock starts at zero, so the
  per-call CPU limit holds per call). When the code ends or raises, its changes are kept:
  the executor forks the next holder (again with a fresh CPU clock) and the old holder and
  the executor exit. When it is killed (CPU limit, a signal, ``os._exit``), the old holder
  stays, with the state from before the call. Output goes to the pipe as it is written;
  Python-level output past ``cap`` bytes stops the call there (``truncated``, an ok call
  that keeps what it did, as a stateless call is stopped at the cap); a replay (``quiet``)
  counts the same bytes without writing them, so it stops at the same point.
- ``dump``: a forked process writes the checkpoint (cloudpickle of the namespace, functions
  and classes of the session by value, modules by name; the files of its scratch folder
  (/tmp) as a tar; the environment, cwd, cell sources and the random and numpy.random
  states) into a pipe; the holder sends it on. Forked, so that a ``__reduce__`` of the
  session's own cannot change the state it is copying.
- ``load``: like exec, with a checkpoint instead of code: the namespace is restored into a
  fresh holder of this (new, empty) sandbox.

What a checkpoint does not carry: other modules' state (a module attribute set by a call),
threads, open files and sockets (an object holding one does not pickle: the fork replays),
processes started in the background, /dev/shm, and the folders of /tmp that the sandbox
binds read-only from the host (an interpreter under /tmp: ``skip`` in the settings).
Taking it must not change the session: a ``__reduce__`` that writes to the session's files
makes the dump fail (``files_changed``) and the host rebuilds the parent from its history.

Replays reproduce the state the model saw: ``random`` is seeded with a constant before the
first call and ``numpy.random`` when it is first imported, so a history run again gives the
same values (as ``PYTHONHASHSEED`` does for ``hash``). Time, ``os.urandom`` and ``secrets``
are not reproduced.

Trust. Only the keeper never runs the model's code; the holder is a fork of the last call
that kept its changes, so a call can change how its own session's later replies are
written. Each reply starts with ``BEGIN + nonce`` and ends with ``END + nonce``, and the host
(toolenv/session_sandbox.py) reads both with bounds: a forged or broken reply costs that
session, never the host. No process here can ptrace another (toolenv/seccomp.py), and the
keeper is not dumpable and ignores every signal it can.
"""
# ruff: noqa: F821 (names defined in session_checkpoint.py: the two run as one program)

import ast
import ctypes
import io
import json
import linecache
import os
import select
import signal
import struct
import sys
import traceback

_SETTINGS = json.loads(sys.argv[1])
_READY = _SETTINGS["ready"].encode("latin-1")
_BEGIN = b"\x00arpo-begin-"
_END = b"\x00arpo-end-"
_SEED = 0  # every session's random streams start here: a replay draws what the call drew
_PR_SET_DUMPABLE = 4
_PR_SET_CHILD_SUBREAPER = 36
_CELL = "<cell {}>"
_SKIP = {"__builtins__"}
# The session's scratch folder, its cwd at start: /tmp in a sandbox, a temporary folder
# of its own without one (mode none), never the host's /tmp.
_SCRATCH = os.getcwd()
# Top-level folders of /tmp that the sandbox binds from the host (read-only): not the
# session's files, never in a checkpoint.
_SKIP_TMP = set(_SETTINGS.get("skip", []))
_HANDOVER_WAIT_S = 1.0  # longest wait for the old holder to exit at a hand-over


def _read_exact(n):
    out = bytearray()
    while len(out) < n:
        chunk = os.read(0, n - len(out))
        if not chunk:
            os._exit(0)  # the host closed the session
        out += chunk
    return bytes(out)


def _write_all(fd, data):
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def _reply(nonce, status, payload=b""):
    status = dict(status, n=len(payload))
    _write_all(1, _END + nonce.encode() + b"\x00" + json.dumps(status).encode() + b"\n" + payload)


class _OutputCut(BaseException):
    """Raised inside a call's print once its output passes the cap: the call stops there,
    as a stateless call is stopped at the cap, and keeps what it did so far."""


class _Capped(io.RawIOBase):
    """fd 1 behind a call's sys.stdout and sys.stderr: counts its output against the cap and
    stops the call past it. ``quiet`` (a replay) counts the same but writes nothing, so a
    replayed call stops where it stopped the first time."""

    def __init__(self, budget, quiet):
        self.budget, self.quiet = budget, quiet
        self.cut = False

    def writable(self):
        return True

    def write(self, data):
        keep = min(len(data), max(self.budget, 0))
        if keep and not self.quiet:
            _write_all(1, bytes(data[:keep]))
        self.budget -= keep
        if keep < len(data):
            self.cut = True
            raise _OutputCut()
        return len(data)

    def say(self, text):
        """Our own last words for the call (a traceback): within the cap, never raising."""
        try:
            self.write(text.encode("utf-8", "backslashreplace"))
        except _OutputCut:
            pass


def _streams(cap, quiet):
    raw = _Capped(cap, quiet)
    for name in ("stdout", "stderr"):
        setattr(sys, name, io.TextIOWrapper(raw, encoding="utf-8", errors="backslashreplace",
                                            write_through=True))
    return raw


def _exit_code(code, raw):
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 255
    raw.say(f"{code}\n")  # as the interpreter treats SystemExit("message")
    return 1


def _execute(state, code, cap, quiet):
    cell = _CELL.format(state["cells"])
    state["cells"] += 1
    linecache.cache[cell] = (len(code), None, code.splitlines(True), cell)
    state["sources"][cell] = code
    raw = _streams(cap, quiet)
    scope = state["scope"]
    status = {"kind": "ok"}
    try:
        tree = ast.parse(code, cell)
        last = tree.body.pop() if tree.body and isinstance(tree.body[-1], ast.Expr) else None
        exec(compile(tree, cell, "exec"), scope)
        if last is not None:
            exec(compile(ast.Interactive(body=[last]), cell, "single"), scope)
    except _OutputCut:
        pass  # stopped at the cap: an ok call whose output was cut
    except SystemExit as exc:
        status = {"kind": "exit", "code": _exit_code(exc.code, raw)}
    except BaseException as exc:
        if not raw.cut:  # else the cut, caught and re-raised as another error by the code
            tb = exc.__traceback__
            while tb is not None and not tb.tb_frame.f_code.co_filename.startswith("<cell "):
                tb = tb.tb_next
            raw.say("".join(traceback.format_exception(type(exc), exc, tb, limit=-8)))
            status = {"kind": "exception"}
    if raw.cut:
        status["truncated"] = True
    return status


def _fork():
    """os.fork for the session's own processes: the random module reseeds itself in a
    forked child (os.register_at_fork), which would make every call a new random stream;
    a session's calls continue one stream, as in a single interpreter."""
    rnd = sys.modules.get("random")
    saved = rnd.getstate() if rnd is not None else None
    pid = os.fork()
    if pid == 0 and saved is not None:
        rnd.setstate(saved)
    return pid


def _wait_child(pid, r):
    """(message from the child's pipe, exit status) once it wrote one byte or exited."""
    pidfd = os.pidfd_open(pid)
    try:
        while True:
            ready, _, _ = select.select([r, pidfd], [], [])
            if r in ready:
                first = os.read(r, 1)
                if first == b"H":
                    return first, None
                if first:  # a status follows, up to EOF
                    rest = bytearray(first)
                    while chunk := os.read(r, 65536):
                        rest += chunk
                    os.waitpid(pid, 0)
                    return bytes(rest), None
            if pidfd in ready:
                os.set_blocking(r, False)
                try:
                    first = os.read(r, 1)
                except BlockingIOError:
                    first = b""
                if first == b"H":
                    return first, None
                return b"", os.waitpid(pid, 0)[1]
    finally:
        os.close(pidfd)


def _dead_status(wstatus):
    if os.WIFSIGNALED(wstatus):
        return {"kind": "killed", "signal": os.WTERMSIG(wstatus)}
    return {"kind": "exit", "code": os.waitstatus_to_exitcode(wstatus) & 255, "lost": True}


def _in_fork(state, nonce, work):
    """Run ``work(state)`` in a fork of this holder. ``work`` returns (status, hand_over): on
    hand_over the fork becomes the holder (through a fresh fork of its own, whose CPU clock
    starts at zero) and this process exits; else this one stays, as it was."""
    forked = _fork_with_pipe(nonce)
    if forked is None:
        return False
    r, w, pid = forked
    if pid == 0:
        os.close(r)
        me, old_holder = os.getpid(), os.pidfd_open(os.getppid())
        status, hand_over = work(state)
        if os.getpid() != me:  # a process the call forked fell through: not ours to run
            os._exit(0)
        try:  # the old holder may be gone (the call killed it): this one goes on regardless
            _write_all(w, b"H" if hand_over else b"F" + json.dumps(status).encode())
        except OSError:
            pass
        if not hand_over:
            os._exit(0)
        os.close(w)
        try:
            holder = _fork() == 0
        except OSError:
            # No process slot: the call used every other one of the session's limit. The
            # old holder's frees as it exits (a bounded wait: a call could have stopped it).
            select.select([old_holder], [], [], _HANDOVER_WAIT_S)
            try:
                holder = _fork() == 0
            except OSError:  # still none: this process holds the state, CPU clock and all
                holder = True
        os.close(old_holder)
        if holder:
            _reply(nonce, dict(status, kept=True))
            return True
        os._exit(0)
    os.close(w)
    message, wstatus = _wait_child(pid, r)
    os.close(r)
    if message == b"H":
        os._exit(0)
    _reply(nonce, json.loads(message[1:]) if message else _dead_status(wstatus))
    return False


def _fork_with_pipe(nonce):
    """(read end, write end, pid) of a fork with a pipe to it; None, the request answered
    with ``no_process``, when no process slot is left."""
    r, w = os.pipe()
    try:
        return r, w, _fork()
    except OSError as exc:
        os.close(r)
        os.close(w)
        _reply(nonce, _no_process(exc))
        return None


def _no_process(exc):
    return {"kind": "error", "reason": "no_process",
            "message": f"the call could not start: no process is left in the session's "
                       f"process limit ({exc.strerror}); its background processes hold them"}


def _serve(state):
    """The holder's loop: one request at a time, each answered before the next is read."""
    while True:
        (size,) = struct.unpack(">I", _read_exact(4))
        head = json.loads(_read_exact(size))
        payload = _read_exact(head["n"])
        nonce, op = head["end"], head["op"]
        _write_all(1, _BEGIN + nonce.encode() + b"\x00")
        if op == "exec":
            code = payload.decode("utf-8", "replace")
            _in_fork(state, nonce, _exec_work(code, head["cap"], head.get("quiet", False)))
        elif op == "load":
            _in_fork(state, nonce, _load_work(payload))
        elif op == "dump":
            _dump(state, nonce, head["max"])
        else:
            _reply(nonce, {"kind": "error", "message": f"unknown op {op!r}"})


def _keep(host):
    """The keeper's loop: reap every child; end the sandbox (as init, taking everything in
    it along) when the host's end of the request pipe closes (the host stopped the session,
    or died), or when no process is left."""
    # Not dumpable: no process of the sandbox (all of one uid) may read or write its
    # memory through /proc or attach to it (the seccomp filter also denies ptrace).
    ctypes.CDLL(None).prctl(_PR_SET_DUMPABLE, 0, 0, 0, 0)
    # As init it ignores signals it has no handler for; Python's own SIGINT handler and
    # any other default a call could use were set to ignore before the fork (main).
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    poller = select.poll()
    poller.register(host, 0)  # a pipe's read end reports POLLHUP once no writer is left
    poller.register(wake_r, select.POLLIN)
    while True:
        for fd, _ in poller.poll():
            if fd == host:
                os._exit(0)
            os.read(wake_r, 4096)
        try:
            while os.waitpid(-1, os.WNOHANG)[0]:
                pass
        except ChildProcessError:
            os._exit(0)


def main():
    ctypes.CDLL(None).prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)  # for mode none
    for name in _SETTINGS.get("preload", []):
        try:
            __import__(name)
        except Exception:
            pass
    host = os.dup(0)
    # The keeper (init) ignores every signal a call could send it, from before the fork:
    # no call ever runs while it still has Python's defaults; the server takes back what
    # it had.
    saved = {}
    for sig in signal.valid_signals():
        if sig not in (signal.SIGKILL, signal.SIGSTOP, signal.SIGCHLD):
            try:
                saved[sig] = signal.signal(sig, signal.SIG_IGN)
            except (OSError, ValueError):
                pass
    pid = os.fork()
    if pid == 0:
        for sig, old in saved.items():
            signal.signal(sig, signal.SIG_DFL if old is None else old)
        os.close(host)
        _seed()
        os.write(1, _READY)
        state = {"scope": _main_scope(), "cells": 1, "sources": {}}
        _serve(state)
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(null, fd)
    _keep(host)


if __name__ == "__main__":
    main()
