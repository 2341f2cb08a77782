"""The uids of setuid-mode sandboxes (toolenv/sandbox.py): a pool of unused uids, each
held by one sandbox at a time through a flock'd lock file, and the reaper that kills what
still runs as a pool uid, before the uid is handed out and when a sandbox is killed, so
nothing of one sandbox survives into the next that gets its uid."""

from __future__ import annotations

import fcntl
import logging
import os
import signal
import tempfile
import time
from pathlib import Path

log = logging.getLogger(__name__)

# Above systemd's container uid ranges (up to 1879048191): no real account uses these.
UID_POOL_BASE = 2_000_000_000
UID_POOL_SIZE = 4096
_REAP_TIMEOUT_S = 5.0
_ZOMBIE_WAIT_S = 0.5  # a zombie of a pool uid whose parent has not reaped it by then never will


class UidPool:
    """Hands out uids that no other sandbox on this host holds, with flock'd lock files.

    A lock is released when its file descriptor closes, also when the holder dies. The
    lowest free uid is taken, so the lock folder holds as many files as the peak number
    of sandboxes at once; reusing a uid at once is safe because nothing outlives a run.
    """

    def __init__(self, base: int = UID_POOL_BASE, size: int = UID_POOL_SIZE,
                 lock_dir: str | Path | None = None):
        self.base, self.size = base, size
        self.lock_dir = Path(lock_dir or Path(tempfile.gettempdir()) / "arpo_sandbox_uids")
        self.lock_dir.mkdir(mode=0o700, parents=True, exist_ok=True)

    def acquire(self) -> tuple[int, int]:
        """(uid, lock fd); pass the fd to ``release`` once every process of the uid is gone.
        A process left running as the uid (a sandbox that escaped its end) is killed
        first; a uid whose processes cannot be killed is skipped, and stays locked."""
        for index in range(self.size):
            fd = os.open(self.lock_dir / f"{index}.lock", os.O_CREAT | os.O_RDWR, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                continue
            if kill_uid(self.base + index):
                return self.base + index, fd
            # kept locked (the fd stays open): its processes count against its limit
            log.warning("sandbox uid %d: processes (or unreaped zombies) outlive SIGKILL; "
                        "not used again by this process", self.base + index)
        raise RuntimeError(f"sandbox uid pool exhausted: {self.size} uids in use ({self.lock_dir})")

    @staticmethod
    def release(fd: int) -> None:
        os.close(fd)


def uid_processes(uid: int) -> list[int]:
    """Pids whose /proc entry belongs to ``uid`` (zombies included): one stat per process,
    about 1 ms for 300 processes where reading each status file took 15. The entry's owner
    is the process's effective uid, except for a process that is not dumpable, which shows
    root: a session's keeper, which exits by itself once the rest of its sandbox is gone."""
    found = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            if entry.stat(follow_symlinks=False).st_uid == uid:
                found.append(int(entry.name))
        except (FileNotFoundError, ProcessLookupError):
            continue  # gone between the listing and the stat
    return found


def kill_uid(uid: int, timeout_s: float = _REAP_TIMEOUT_S) -> bool:
    """SIGKILL every process running as ``uid`` until none is left, zombies included
    (True), or ``timeout_s`` passed (False). A zombie still counts against the uid's
    process limit (RLIMIT_NPROC): its parent reaps it at once (bwrap, for a sandbox's
    init), or, orphaned to an init that never reaps, it stays, and the uid with it.
    Only for uids that belong to sandboxes."""
    deadline = time.monotonic() + timeout_s
    zombie_deadline = None
    while True:
        pids = uid_processes(uid)
        alive = [pid for pid in pids if not _zombie(pid)]
        if not pids:
            return True
        for pid in alive:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        if not alive:  # only zombies: give their parents a moment to reap them
            zombie_deadline = zombie_deadline or time.monotonic() + _ZOMBIE_WAIT_S
            if time.monotonic() > zombie_deadline:
                return False
        if time.monotonic() > deadline:
            return False
        time.sleep(0.005)


def _zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            return stat.read().rsplit(b")", 1)[1].split()[0] in (b"Z", b"X")
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return True
