"""Reaping a vLLM engine's processes at close: vLLM 0.32 SIGKILLs an engine core that
outlives its shutdown grace but never waits on it, so without this the
``VLLM::EngineCore`` child stays a zombie in any process that starts several engines (the
pipeline, the benches, a test run). ``mp_children`` before and after an engine starts
says which processes are its; ``reap`` ends and collects them. The engine core's own
children (its workers) are reaped too: if vLLM has to SIGKILL the core, its workers are
orphaned, and an init that does not reap (a container's) would keep them as zombies for
good, so this process adopts them while the engine shuts down (``adopting``)."""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import multiprocessing
import multiprocessing.connection
import os
import time
from collections.abc import Iterator

import psutil  # vLLM's own dependency

logger = logging.getLogger(__name__)

# After vLLM's own shutdown (which SIGTERMs, waits its 5 s, then SIGKILLs), how long an
# engine process may take to exit before close() SIGKILLs it; then as long again to reap.
REAP_GRACE_S = 10.0
# vLLM's own shutdown grace (its default is 5 s): an engine core that stops in time stops
# and reaps its workers itself; one SIGKILLed leaves them to ``adopting``.
SHUTDOWN_GRACE_S = 30.0
_PR_SET_CHILD_SUBREAPER, _PR_GET_CHILD_SUBREAPER = 36, 37

Procs = list[multiprocessing.process.BaseProcess]


def mp_children(before: Procs = ()) -> Procs:
    """This process's live multiprocessing children, less those in ``before``: what an
    engine start adds is its engine-core process(es). (Not a psutil diff: that would also
    catch multiprocessing's resource tracker, which the first spawn starts for the whole
    process, and any child another thread starts meanwhile.)"""
    known = {id(p) for p in before}
    return [p for p in multiprocessing.active_children() if id(p) not in known]


def _exited(proc: multiprocessing.process.BaseProcess) -> bool:
    """The process has ended, whoever reaped it: its sentinel pipe closes at exit."""
    try:
        return bool(multiprocessing.connection.wait([proc.sentinel], timeout=0))
    except ValueError:  # Process.close() was called: it had been joined already
        return True


async def reap(procs: Procs) -> None:
    """Wait for the engine's processes to end and reap them, SIGKILLing any still running
    ``REAP_GRACE_S`` after vLLM's shutdown. vLLM 0.32 SIGKILLs an engine core that
    outlives its shutdown grace but never waits on it, so the ``VLLM::EngineCore`` child
    stayed a zombie in any process that starts several engines. Reaping goes through the
    Process object: a bare ``os.waitpid`` would leave its ``is_alive()`` true and
    multiprocessing would signal the (maybe reused) pid again at exit. A process that
    vLLM, or anyone, has already reaped costs nothing."""
    if not procs:
        return
    if not await _all_exited(procs, REAP_GRACE_S):
        for p in procs:
            if not _exited(p):
                logger.warning("vLLM engine process %s (pid %s) still running %.0f s after "
                               "shutdown: killing it", p.name, p.pid, REAP_GRACE_S)
                p.kill()
        if not await _all_exited(procs, REAP_GRACE_S):
            logger.error("vLLM engine processes %s survived SIGKILL",
                         [p.pid for p in procs if not _exited(p)])
    for p in procs:
        if _exited(p):
            # Not join(0): the sentinel closes a moment before the child becomes
            # reapable; with a timeout, join's waitpid blocks through that moment.
            with contextlib.suppress(ValueError):  # closed: joined already
                p.join(1.0)


@contextlib.contextmanager
def adopting(procs: Procs) -> Iterator[list[int]]:
    """Around vLLM's shutdown: this process is a child subreaper (Linux), so the workers
    of an engine core that dies before reaping them become its children; yields the pids
    of the engine's descendants as they were before the shutdown, for ``reap_adopted``.
    The flag is restored afterwards."""
    tree = []
    for proc in procs:
        with contextlib.suppress(psutil.Error, ValueError):
            tree += [p.pid for p in psutil.Process(proc.pid).children(recursive=True)]
    libc = ctypes.CDLL(None, use_errno=True)
    was = ctypes.c_int(0)
    known = libc.prctl(_PR_GET_CHILD_SUBREAPER, ctypes.byref(was), 0, 0, 0) == 0
    if known and not was.value:
        libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    try:
        yield tree
    finally:
        if known and not was.value:
            libc.prctl(_PR_SET_CHILD_SUBREAPER, 0, 0, 0, 0)


async def reap_adopted(pids: list[int], timeout_s: float = REAP_GRACE_S) -> None:
    """Reap the engine's former descendants that became this process's children; a pid
    that is not (or no longer) a child of this process is someone else's to reap."""
    deadline = time.monotonic() + timeout_s
    waiting = list(pids)
    while waiting:
        for pid in list(waiting):
            try:
                done, _ = os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                done = pid
            if done:
                waiting.remove(pid)
        if not waiting or time.monotonic() >= deadline:
            break
        await asyncio.sleep(0.05)
    if waiting:
        logger.warning("vLLM engine processes %s not reaped %.0f s after shutdown",
                       waiting, timeout_s)


async def _all_exited(procs: Procs, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while not all(_exited(p) for p in procs):
        if time.monotonic() >= deadline:
            return False
        await asyncio.sleep(0.05)
    return True

