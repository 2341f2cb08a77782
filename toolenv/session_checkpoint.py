"""The checkpoint half of the program inside a Python session's sandbox: seeding the
random streams, and writing (``dump``) and loading (``load``) a session's checkpoint.
toolenv/python_tool.py runs this text followed by toolenv/session_child.py's as one
``python -c`` program (what they share, ``_SETTINGS``, ``_SEED``, ``_SCRATCH`` ..., is
defined there; these functions read it when called). The rules (what a checkpoint
carries, how replays stay reproducible) are in session_child.py's docstring.
"""
# ruff: noqa: F821 (names defined in session_child.py: the two run as one program)

import builtins
import io
import os
import pickle
import random
import stat
import sys
import tarfile
import types

class _SeedNumpy:
    """A finder that seeds numpy's global generator as ``numpy.random`` is first imported
    (numpy seeds it from the OS at import), then steps aside."""

    def find_spec(self, name, path, target=None):
        if name != "numpy.random":
            return None
        sys.meta_path.remove(self)
        for finder in sys.meta_path:
            spec = getattr(finder, "find_spec", lambda *a: None)(name, path, target)
            if spec is not None and spec.loader is not None:
                spec.loader.exec_module = _seeding(spec.loader.exec_module)
                return spec
        return None


def _seeding(run):
    def exec_module(module):
        run(module)
        module.seed(_SEED)

    return exec_module


def _seed():

    random.seed(_SEED)
    sys.meta_path.insert(0, _SeedNumpy())


def _main_scope():
    return {"__name__": "__main__", "__builtins__": builtins}


def _own_files():
    """(path, relative name, lstat) of the session's own files in its scratch folder: not
    the host's read-only binds (``skip``), nor anything on another file system."""
    device = os.stat(_SCRATCH).st_dev
    found = []
    for root, dirs, files in os.walk(_SCRATCH):
        if root == _SCRATCH:
            dirs[:] = [d for d in dirs if d not in _SKIP_TMP]
            files = [f for f in files if f not in _SKIP_TMP]
        descend = []
        for name in sorted(dirs) + sorted(files):
            path = os.path.join(root, name)
            try:
                st = os.lstat(path)
            except OSError:
                continue  # removed while we walk
            if st.st_dev != device:
                continue
            found.append((path, os.path.relpath(path, _SCRATCH), st))
            if stat.S_ISDIR(st.st_mode):
                descend.append(name)
        dirs[:] = descend
    return found


def _fingerprint():
    return [(rel, st.st_mode, st.st_size, st.st_mtime_ns, st.st_ino)
            for _, rel, st in _own_files()]


def _tmp_tar():
    """The session's files as an uncompressed tar (b"" when there are none)."""
    files = _own_files()
    if not files:
        return b""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for path, rel, _ in files:
            info = tar.gettarinfo(path, arcname=rel)
            if info.isreg():
                with open(path, "rb") as f:
                    tar.addfile(info, f)
            elif info.isdir() or info.issym():
                tar.addfile(info)
    return buf.getvalue()


def _checkpoint(state):
    # cloudpickle: only a checkpoint (a forked process) needs it; at the top it would load
    # into every session, where the code it runs can see it
    import cloudpickle

    scope = state["scope"]
    extra = {}
    if "random" in sys.modules:
        extra["random"] = sys.modules["random"].getstate()
    if "numpy" in sys.modules:
        extra["numpy"] = sys.modules["numpy"].random.get_state()
    ns = {k: v for k, v in scope.items() if k not in _SKIP}
    cwd = os.path.relpath(os.getcwd(), _SCRATCH)
    return cloudpickle.dumps({"ns": ns, "env": dict(os.environ), "cwd": cwd,
                              "cells": state["cells"], "sources": state["sources"],
                              "extra": extra, "tmp": _tmp_tar()})


def _dump(state, nonce, limit):
    """Write a checkpoint in a forked process of its own group (killed with everything it
    started once it is done); the session's files are compared before and after."""
    before = _fingerprint()
    forked = _fork_with_pipe(nonce)
    if forked is None:
        return
    r, w, pid = forked
    if pid == 0:
        os.close(r)
        os.setpgid(0, 0)
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
    try:
        os.killpg(pid, signal.SIGKILL)  # what the pickling started in the background
    except OSError:
        pass
    code = os.WEXITSTATUS(wstatus) if os.WIFEXITED(wstatus) else None
    if _fingerprint() != before:
        _reply(nonce, {"kind": "error", "reason": "files_changed", "message":
                       "taking the checkpoint changed the session's files (a __reduce__ "
                       "with side effects)"})
    elif code == 0:
        _reply(nonce, {"kind": "ok"}, bytes(data))
    elif code in (3, 4):
        _reply(nonce, {"kind": "error", "reason": "unpicklable" if code == 3 else "too_large",
                       "message": data.decode("utf-8", "replace")[-500:]})
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
    if ckpt["tmp"]:  # "r:", not "r": probing for compressions costs milliseconds
        with tarfile.open(fileobj=io.BytesIO(ckpt["tmp"]), mode="r:") as tar:
            tar.extractall(_SCRATCH, filter="data")
    cwd = os.path.normpath(os.path.join(_SCRATCH, ckpt["cwd"]))
    if cwd.startswith(_SCRATCH) and os.path.isdir(cwd):
        os.chdir(cwd)
    extra = ckpt["extra"]
    if "random" in extra:
        __import__("random").setstate(extra["random"])
    if "numpy" in extra:
        __import__("numpy").random.set_state(extra["numpy"])
    for cell, source in ckpt["sources"].items():
        linecache.cache[cell] = (len(source), None, source.splitlines(True), cell)
    state.update(scope=scope, cells=ckpt["cells"], sources=dict(ckpt["sources"]))


def _exec_work(code, cap, quiet):
    return lambda state: (_execute(state, code, cap, quiet), True)


def _load_work(payload):
    def load(state):
        try:
            _restore(state, payload)
        except BaseException as exc:  # a checkpoint that does not load: the host replays
            return {"kind": "error", "message": f"{type(exc).__name__}: {exc}"[:500]}, False
        return {"kind": "ok"}, True

    return load
