"""vLLM engines started and closed one after another in one long-lived process (the
pipeline's actors, the benches, a test run) leave no child process behind.

vLLM 0.32's shutdown SIGKILLs an engine-core process that has not exited within its
grace period ("Process manager: force killing remaining process EngineCore") and never
waits on it, so the ``VLLM::EngineCore`` child stayed a zombie until something else
happened to reap it; ``VLLMEngine.close`` now reaps its engine's processes itself."""

from __future__ import annotations

import multiprocessing.resource_tracker
import subprocess
import sys
import time

import psutil
import pytest

from actors.engines.vllm_engine import VLLMEngine

pytestmark = [pytest.mark.integration, pytest.mark.asyncio(loop_scope="module")]

# Each close is checked before the next start: starting a multiprocessing child reaps
# the finished ones by the way, which would hide a zombie the close left.
ENGINES = 2


def children() -> dict[int, str]:
    """pid -> status of every descendant of this process (zombies included)."""
    out = {}
    for proc in psutil.Process().children(recursive=True):
        try:
            out[proc.pid] = f"{proc.name()} ({proc.status()})"
        except psutil.NoSuchProcess:  # exited and reaped meanwhile
            pass
    return out


async def test_engines_closed_in_one_process_leave_no_children(tiny_model_dir):
    pytest.importorskip("vllm")
    # multiprocessing's resource tracker is one helper per process, started by the first
    # spawn and kept until exit: not an engine's, so it is running before the snapshot.
    multiprocessing.resource_tracker.ensure_running()
    # A child that is not an engine's: closing engines must neither reap nor kill it.
    bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        before = children()
        for i in range(ENGINES):
            t0 = time.perf_counter()
            engine = await VLLMEngine.create(tiny_model_dir, kv_cache_gib=0.25,
                                             max_model_len=256, cpu_bind="0")
            started = time.perf_counter() - t0
            running = set(children()) - set(before)
            assert running, "the engine core should be a child of this process"
            t0 = time.perf_counter()
            await engine.close()
            closed = time.perf_counter() - t0
            left = {pid: what for pid, what in children().items() if pid not in before}
            assert not left, f"engine {i} left children behind: {left}"
            print(f"\nengine {i}: start-up {started:.1f} s, close {closed:.1f} s, "
                  f"processes {sorted(running)}")
        assert bystander.poll() is None  # still running, and still ours to wait on
    finally:
        bystander.kill()
        assert bystander.wait(10) == -9
