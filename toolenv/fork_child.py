"""The program inside the stateless Python tool's *holder* sandbox (``tools.python.holder``;
the host side is toolenv/fork_server.py): an interpreter with the preloads imported that
forks one fresh, isolated process tree per call, so a call pays a fork instead of a
sandbox.

Runs as ``python -s -u -c <runner text + this text> <settings JSON>`` (the runner text,
``_arpo_run``, is python_tool's), in a bubblewrap sandbox of setuid mode whose command
stays host root with CAP_SYS_ADMIN, CAP_NET_ADMIN, CAP_SETUID and CAP_SETGID (no prlimit,
no setpriv) and is the sandbox's init. Its stdin is a SOCK_SEQPACKET socket to the host;
each message is one call: a JSON header (``uid``, limits) and three file descriptors (the
call's stdin read end, its output write end and a status pipe's write end). The holder
never reads a call's code nor its output: it only forks.

Per call (the host holds the call's pool uid; toolenv/uids.py):

- *setup* (a fork of the holder, still root): closes every descriptor but the call's
  three; new mount, pid, network, IPC and UTS namespaces; every mount made private; fresh
  size-capped tmpfs on /tmp (its cwd) and /dev/shm, the host binds under /tmp put back
  read-only (an interpreter in a clone under /tmp); a new devpts instance; loopback up,
  as bwrap brings it up. Then it forks the call's init and exits. A failure writes
  ``E`` + the reason to the status pipe (the host runs that call in a cold sandbox).
- *init* (pid 1 of the new pid namespace): mounts its /proc, drops to the call's uid
  (groups cleared; the change of uid clears every capability; no_new_privs is bwrap's,
  inherited), sets the call's rlimits (CPU, address space, processes + 1 for itself, file
  size, no core), makes itself not dumpable (the call cannot read or write its memory
  through /proc), ignores every signal it can, writes ``S`` and forks the *runner*; then
  waits for the runner, kills and reaps whatever the call left running, and writes
  ``X<exit code>`` (128 + the signal that killed it, as a shell says it).
- *runner*: signals as they were, dumpable again (so the uid reaper sees it), its
  stdin/stdout/stderr the call's pipes, nothing else open; runs the code as the warm
  sandbox's child does (``_arpo_run``, then ``_arpo_exit`` without the teardown).

The seccomp filter (toolenv/seccomp.py) is the holder's, loaded by bwrap and inherited by
every process here. A call's processes are all of its uid, in its own namespaces: it sees
no other call's files, processes, sockets or memory, and the holder (root, in an ancestor
pid namespace) is out of its sight. The holder exits when the host's end of the socket
closes (the host died or dropped it), which as the sandbox's init ends every call in it.
"""
# ruff: noqa: F821 (_arpo_run and _arpo_exit come from python_tool's runner text)

import ctypes
import json
import os
import resource
import select
import signal
import socket
import struct
import sys

_SETTINGS = json.loads(sys.argv[1])
_LIBC = ctypes.CDLL(None, use_errno=True)
_NEW_NAMESPACES = 0x00020000 | 0x04000000 | 0x08000000 | 0x20000000 | 0x40000000  # ns uts
# ipc pid net
_MS_NOSUID, _MS_NODEV, _MS_NOEXEC, _MS_RDONLY = 2, 4, 8, 1
_MS_REMOUNT, _MS_BIND, _MS_REC, _MS_PRIVATE = 32, 4096, 16384, 1 << 18
_PR_SET_DUMPABLE = 4
_SIOCGIFFLAGS, _SIOCSIFFLAGS, _IFF_UP = 0x8913, 0x8914, 0x1


def _sys(ret, what):
    if ret != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _mount(source, target, fstype, flags, data=None):
    enc = lambda s: None if s is None else s.encode()  # noqa: E731
    _sys(_LIBC.mount(enc(source), enc(target), enc(fstype), ctypes.c_ulong(flags),
                     enc(data)), f"mount {target}")


def _loopback_up():
    import fcntl

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        req = struct.pack("16sh", b"lo", 0)
        flags = struct.unpack("16sh", fcntl.ioctl(s, _SIOCGIFFLAGS, req))[1]
        fcntl.ioctl(s, _SIOCSIFFLAGS, struct.pack("16sh", b"lo", flags | _IFF_UP))


def _isolate():
    """New namespaces and a fresh /tmp, /dev/shm and devpts for one call (still root)."""
    binds = [(path, os.open(path, os.O_PATH)) for path in _SETTINGS["binds"]]
    _sys(_LIBC.unshare(_NEW_NAMESPACES), "unshare")
    _mount(None, "/", None, _MS_REC | _MS_PRIVATE)
    scratch = f"size={_SETTINGS['scratch_bytes']},mode=1777"
    for target in ("/tmp", "/dev/shm"):
        _mount("tmpfs", target, "tmpfs", _MS_NOSUID | _MS_NODEV, scratch)
    for path, fd in binds:  # bwrap's binds under /tmp, which the new tmpfs covers
        os.makedirs(path, mode=0o755, exist_ok=True)
        _mount(f"/proc/self/fd/{fd}", path, None, _MS_BIND | _MS_REC)
        _mount(None, path, None, _MS_REMOUNT | _MS_BIND | _MS_RDONLY | _MS_NOSUID | _MS_NODEV)
        os.close(fd)
    _mount("devpts", "/dev/pts", "devpts", _MS_NOSUID | _MS_NOEXEC,
           "newinstance,ptmxmode=0666,mode=620")
    _loopback_up()
    os.chdir("/tmp")


def _limits(req):
    cpu = req["cpu_s"]
    for which, value in ((resource.RLIMIT_CPU, (cpu, cpu + 1)),
                         (resource.RLIMIT_AS, (req["memory_bytes"],) * 2),
                         (resource.RLIMIT_NPROC, (req["max_procs"] + 1,) * 2),
                         (resource.RLIMIT_FSIZE, (req["file_bytes"],) * 2),
                         (resource.RLIMIT_CORE, (0, 0))):
        resource.setrlimit(which, value)


def _init(req, stdin_fd, out_fd, status_fd):
    """The call's pid 1: drop to the call's uid, fork the runner, report its status."""
    _mount("proc", "/proc", "proc", _MS_NOSUID | _MS_NODEV | _MS_NOEXEC)
    uid = req["uid"]
    os.setgroups([])
    os.setresgid(uid, uid, uid)
    os.setresuid(uid, uid, uid)  # from root to a non-zero uid: every capability goes
    _limits(req)
    _LIBC.prctl(_PR_SET_DUMPABLE, 0, 0, 0, 0)
    saved = {}
    for sig in signal.valid_signals():
        if sig not in (signal.SIGKILL, signal.SIGSTOP, signal.SIGCHLD):
            try:
                saved[sig] = signal.signal(sig, signal.SIG_IGN)
            except (OSError, ValueError):
                pass
    os.write(status_fd, b"S")
    pid = os.fork()
    if pid == 0:
        for sig, old in saved.items():
            signal.signal(sig, signal.SIG_DFL if old is None else old)
        _LIBC.prctl(_PR_SET_DUMPABLE, 1, 0, 0, 0)
        os.dup2(stdin_fd, 0)
        os.dup2(out_fd, 1)
        os.dup2(out_fd, 2)
        os.closerange(3, _max_fd())
        try:
            _arpo_run()
        except SystemExit as exc:
            _arpo_exit(exc.code)
        _arpo_exit(0)
    for fd in (stdin_fd, out_fd):  # only the call holds its pipes: EOF when it is done
        os.close(fd)
    status = os.waitpid(pid, 0)[1]
    code = (128 + os.WTERMSIG(status) if os.WIFSIGNALED(status)
            else os.waitstatus_to_exitcode(status) & 255)
    # What the call left running dies and is reaped before the status goes out, so that
    # the host, once it has read it, hands the uid on with nothing of the call left.
    while True:
        try:
            os.kill(-1, signal.SIGKILL)  # as init: every other process of its namespace
        except ProcessLookupError:
            pass
        try:
            os.wait()
        except ChildProcessError:
            break
    os.write(status_fd, b"X%d" % code)
    os._exit(0)


def _max_fd():
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def _start_call(req, fds):
    """In a fork of the holder: isolate, fork the call's init, exit."""
    stdin_fd, out_fd, status_fd = fds
    try:
        null = os.open(os.devnull, os.O_RDWR)
        for fd in (0, 1, 2):  # the holder's socket and pipes are not the call's
            os.dup2(null, fd)
        keep = sorted({null, *fds})
        low = 3
        for fd in keep:
            os.closerange(low, fd)
            low = fd + 1
        os.closerange(low, _max_fd())
        os.close(null)
        _isolate()
        if os.fork() == 0:
            try:
                _init(req, stdin_fd, out_fd, status_fd)
            except BaseException as exc:  # before the code runs: the host goes cold
                os.write(status_fd, f"E{type(exc).__name__}: {exc}".encode()[:2000])
                os._exit(1)
    except BaseException as exc:
        try:
            os.write(status_fd, f"E{type(exc).__name__}: {exc}".encode()[:2000])
        except OSError:
            pass
    os._exit(0)


def _serve(ctrl):
    """The holder's loop: fork one call per message; reap; end with the host's socket."""
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    poller = select.poll()
    poller.register(ctrl.fileno(), select.POLLIN)
    poller.register(wake_r, select.POLLIN)
    while True:
        for fd, _ in poller.poll():
            if fd == wake_r:
                os.read(wake_r, 4096)
                continue
            msg, fds, _, _ = socket.recv_fds(ctrl, 4096, 3)
            if not msg:
                os._exit(0)  # the host is gone
            if len(fds) == 3:
                if os.fork() == 0:
                    signal.set_wakeup_fd(-1)
                    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                    _start_call(json.loads(msg), fds)
            for fd in fds:
                os.close(fd)
        try:
            while os.waitpid(-1, os.WNOHANG)[0]:
                pass
        except ChildProcessError:
            pass


def _main():
    for name in _SETTINGS["preload"]:
        try:
            __import__(name)
        except Exception:
            pass  # not installed here: the snippet's own import will say so
    sys.argv[1:] = []
    ctrl = socket.socket(fileno=os.dup(0))
    os.write(1, _SETTINGS["ready"].encode("latin-1"))
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):  # nothing reads the holder's own output after READY
        os.dup2(null, fd)
    os.close(null)
    _serve(ctrl)


_main()
