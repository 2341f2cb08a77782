"""Reaping a vLLM engine's processes at close: vLLM 0.32 SIGKILLs an engine core that
outlives its shutdown grace but never waits on it, so without this the
``VLLM::EngineCore`` child stays a zombie in any process that starts several engines (the
pipeline, the benches, a test run). ``mp_children`` before and after an engine starts
says which processes are its; ``reap`` ends and collects them."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing
import multiprocessing.connection
import time

logger = logging.getLogger(__name__)

# After vLLM's own shutdown (which SIGTERMs, waits its 5 s, then SIGKILLs), how long an
# engine process may take to exit before close() SIGKILLs it; then as long again to reap.
REAP_GRACE_S = 10.0

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


async def _all_exited(procs: Procs, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while not all(_exited(p) for p in procs):
        if time.monotonic() >= deadline:
            return False
        await asyncio.sleep(0.05)
    return True

