"""The program inside a Python session's sandbox (``tools.python_state=session``): it keeps
one interpreter's state across calls, runs each call in a fork of it, and writes or loads
checkpoints. The host side is toolenv/session_sandbox.py (the wire format) and
toolenv/session.py (histories, forks, replays).

Runs as ``python -s -u -c <this file's text> <settings JSON>``, so it imports only the
standard library and cloudpickle: the project is hidden inside the sandbox.

Processes. The first one (the *keeper*) imports the preloads, becomes the child subreaper
and forks the *holder*, then only reaps; the sandbox lives as long as it does. The holder
keeps the state (``state["scope"]``, the namespace the code runs in) and reads requests:

- ``exec``: fork an *executor* that runs the code (its CPU clock starts at zero, so the
  per-call CPU limit holds per call). When the code ends or raises, its changes are kept:
  the executor forks the next holder (again with a fresh CPU clock) and the old holder and
  the executor exit. When it is killed (CPU limit, a signal, ``os._exit``), the old holder
  stays, with the state from before the call. Output goes to the pipe as it is written;
  Python-level output past ``cap`` bytes is dropped here (``truncated``).
- ``dump``: a forked process writes the checkpoint (cloudpickle of the namespace, functions
  and classes of the session by value, modules by name; the files under /tmp as a tar; the
  environment, cwd, cell sources and the random and numpy.random states) into a pipe; the
  holder sends it on. Forked, so that a ``__reduce__`` of the session's own cannot change
  the state it is copying.
- ``load``: like exec, with a checkpoint instead of code: the namespace is restored into a
  fresh holder of this (new, empty) sandbox.

What a checkpoint does not carry: other modules' state (a module attribute set by a call),
threads, open files and sockets (an object holding one does not pickle: the fork replays),
processes started in the background, and /dev/shm.
"""

import ast
import builtins
import ctypes
import io
import json
import linecache
import os
import pickle
import select
import signal
import struct
import sys
import tarfile
import traceback
import types

_SETTINGS = json.loads(sys.argv[1])
_READY = _SETTINGS["ready"].encode("latin-1")
_END = b"\x00arpo-end-"
_PR_SET_CHILD_SUBREAPER = 36
_CELL = "<cell {}>"
_SKIP = {"__builtins__"}


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


class _Capped(io.RawIOBase):
    """fd 1 for sys.stdout and sys.stderr of a call: drops what passes the cap in-process."""

    def __init__(self, budget):
        self.budget = [budget]
        self.dropped = False

    def writable(self):
        return True

    def write(self, data):
        keep = min(len(data), max(self.budget[0], 0))
        if keep:
            _write_all(1, bytes(data[:keep]))
        self.budget[0] -= keep
        if keep < len(data):
            self.dropped = True
        return len(data)


def _streams(cap):
    raw = _Capped(cap)
    for name in ("stdout", "stderr"):
        setattr(sys, name, io.TextIOWrapper(raw, encoding="utf-8", errors="backslashreplace",
                                            write_through=True))
    return raw


def _exit_code(code):
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 255
    print(code, file=sys.stderr)
    return 1


def _execute(state, code, cap):
    cell = _CELL.format(state["cells"])
    state["cells"] += 1
    linecache.cache[cell] = (len(code), None, code.splitlines(True), cell)
    state["sources"][cell] = code
    raw = _streams(cap)
    scope = state["scope"]
    status = {"kind": "ok"}
    try:
        tree = ast.parse(code, cell)
        last = tree.body.pop() if tree.body and isinstance(tree.body[-1], ast.Expr) else None
        exec(compile(tree, cell, "exec"), scope)
        if last is not None:
            exec(compile(ast.Interactive(body=[last]), cell, "single"), scope)
    except SystemExit as exc:
        status = {"kind": "exit", "code": _exit_code(exc.code)}
    except BaseException as exc:
        tb = exc.__traceback__
        while tb is not None and not tb.tb_frame.f_code.co_filename.startswith("<cell "):
            tb = tb.tb_next
        sys.stderr.write("".join(traceback.format_exception(type(exc), exc, tb, limit=-8)))
        status = {"kind": "exception"}
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
    if raw.dropped:
        status["truncated"] = True
    return status


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
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        me = os.getpid()
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
        if os.fork() == 0:
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


def _main_scope():
    return {"__name__": "__main__", "__builtins__": builtins}


def _tmp_tar():
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name in sorted(os.listdir("/tmp")):
            tar.add(os.path.join("/tmp", name), arcname=name,
                    filter=lambda t: t if (t.isreg() or t.isdir() or t.issym()) else None)
    return buf.getvalue()


def _checkpoint(state):
    import cloudpickle

    scope = state["scope"]
    extra = {}
    if "random" in sys.modules:
        extra["random"] = sys.modules["random"].getstate()
    if "numpy" in sys.modules:
        extra["numpy"] = sys.modules["numpy"].random.get_state()
    ns = {k: v for k, v in scope.items() if k not in _SKIP}
    return cloudpickle.dumps({"ns": ns, "env": dict(os.environ), "cwd": os.getcwd(),
                              "cells": state["cells"], "sources": state["sources"],
                              "extra": extra, "tmp": _tmp_tar()})


def _dump(state, nonce, limit):
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        try:
            data = _checkpoint(state)
            code = 0 if len(data) <= limit else 4
            if code:
                data = f"checkpoint of {len(data)} bytes passes the limit of {limit}".encode()
        except BaseException as exc:
            data, code = f"{type(exc).__name__}: {exc}".encode(), 3
        _write_all(w, data)
        os._exit(code)
    os.close(w)
    data = bytearray()
    while chunk := os.read(r, 1 << 20):
        data += chunk
        if len(data) > limit + 4096:
            os.kill(pid, signal.SIGKILL)
            break
    os.close(r)
    wstatus = os.waitpid(pid, 0)[1]
    if os.WIFEXITED(wstatus) and os.WEXITSTATUS(wstatus) == 0:
        _reply(nonce, {"kind": "ok"}, bytes(data))
    elif os.WIFEXITED(wstatus) and os.WEXITSTATUS(wstatus) in (3, 4):
        _reply(nonce, {"kind": "error", "message": data.decode("utf-8", "replace")[-500:]})
    else:
        _reply(nonce, _dead_status(wstatus))


def _find_globals(values, depth=3):
    """The globals dict that cloudpickle gave the restored session functions (one, shared)."""
    for value in values:
        if (isinstance(value, types.FunctionType)
                and value.__globals__.get("__name__") == "__main__"):
            return value.__globals__
        if depth and isinstance(value, type):
            found = _find_globals(list(vars(value).values()), depth - 1)
        elif depth and isinstance(value, (list, tuple, set, frozenset)):
            found = _find_globals(list(value)[:1000], depth - 1)
        elif depth and isinstance(value, dict):
            found = _find_globals(list(value.values())[:1000], depth - 1)
        else:
            found = None
        if found is not None:
            return found
    return None


def _restore(state, payload):
    ckpt = pickle.loads(payload)
    ns = ckpt["ns"]
    scope = _find_globals(list(ns.values()))
    if scope is None:
        scope = {}
    scope.update(ns)
    scope.update(_main_scope())
    os.environ.clear()
    os.environ.update(ckpt["env"])
    with tarfile.open(fileobj=io.BytesIO(ckpt["tmp"]), mode="r") as tar:
        tar.extractall("/tmp", filter="data")
    if os.path.isdir(ckpt["cwd"]):
        os.chdir(ckpt["cwd"])
    extra = ckpt["extra"]
    if "random" in extra:
        __import__("random").setstate(extra["random"])
    if "numpy" in extra:
        __import__("numpy").random.set_state(extra["numpy"])
    for cell, source in ckpt["sources"].items():
        linecache.cache[cell] = (len(source), None, source.splitlines(True), cell)
    state.update(scope=scope, cells=ckpt["cells"], sources=dict(ckpt["sources"]))


def _exec_work(code, cap):
    return lambda state: (_execute(state, code, cap), True)


def _load_work(payload):
    def load(state):
        try:
            _restore(state, payload)
        except BaseException as exc:  # a checkpoint that does not load: the host replays
            return {"kind": "error", "message": f"{type(exc).__name__}: {exc}"[:500]}, False
        return {"kind": "ok"}, True

    return load


def _serve(state):
    """The holder's loop: one request at a time, each answered before the next is read."""
    while True:
        (size,) = struct.unpack(">I", _read_exact(4))
        head = json.loads(_read_exact(size))
        payload = _read_exact(head["n"])
        nonce, op = head["end"], head["op"]
        if op == "exec":
            _in_fork(state, nonce, _exec_work(payload.decode("utf-8", "replace"), head["cap"]))
        elif op == "load":
            _in_fork(state, nonce, _load_work(payload))
        elif op == "dump":
            _dump(state, nonce, head["max"])
        else:
            _reply(nonce, {"kind": "error", "message": f"unknown op {op!r}"})


def main():
    ctypes.CDLL(None).prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    for name in _SETTINGS.get("preload", []):
        try:
            __import__(name)
        except Exception:
            pass
    pid = os.fork()
    if pid == 0:
        os.write(1, _READY)
        state = {"scope": _main_scope(), "cells": 1, "sources": {}}
        _serve(state)
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(null, fd)
    while True:
        try:
            os.wait()
        except ChildProcessError:
            os._exit(0)


if __name__ == "__main__":
    main()
