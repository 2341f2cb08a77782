"""Regressions the chaos soak found (issue 17, arpo_async/jobs/chaos.py), each forced
directly: no waiting for a fault to land at the right moment."""

from __future__ import annotations

import errno
from pathlib import Path

import numpy as np
import pytest

from actors.actor import Actor
from arpo_async.core import protocol as P
from arpo_async.core.config import config_from_dict
from arpo_async.core.weights.zeromq import WeightsRequest, WeightsUpdate


class _FullDiskEngine:
    """An engine whose first weight load fails as on a full /dev/shm (EFBIG)."""

    def __init__(self):
        self.version, self.loaded, self.failures = 0, [], 0
        self.nccl_workers = 1

    async def update_weights(self, tensors, version):
        if not self.failures:
            self.failures += 1
            raise OSError(errno.EFBIG, "File too large")
        self.loaded.append(version)
        self.version = version
        return 0.0


class _Control:
    """Refuses the first two ticket requests for stale weights, then says stop."""

    def __init__(self):
        self.tickets, self.endpoint = 0, "fake"

    async def request(self, msg):
        if isinstance(msg, WeightsRequest):
            return WeightsUpdate(version=3, tensors={"w": np.ones(2, np.float32)})
        if isinstance(msg, P.TicketRequest):
            self.tickets += 1
            if self.tickets <= 2:
                return P.TicketGrant(0, 3, reason=P.GrantReason.STALE_WEIGHTS.value)
            return P.TicketGrant(0, 3, stop=True)
        return P.Ack(ok=True, learner_version=3)


class _Source:
    position = 0
    skipped_long = 0


async def test_a_weight_load_that_cannot_be_written_does_not_end_the_actor(tmp_path):
    """Soak finding: with the disk full (RLIMIT_FSIZE) the weight file could not be
    written; the slot that had been refused for stale weights raised and the actor
    exited (code 1), restarting vLLM for half a minute. Now the slot retries."""
    cfg = config_from_dict({"run": {"dir": str(tmp_path), "probe_logprobs": False},
                            "actors": {"concurrent_groups": 1, "refusal_retry_s": 0.01}})
    engine = _FullDiskEngine()
    actor = Actor(cfg, 0, engine, rollout=None, source=_Source(), sender=None,
                  control=_Control(), vocab_size=100)
    await actor._slot()  # returns at the stop, does not raise
    assert engine.failures == 1 and engine.loaded == [3] and actor.stop


async def test_a_weight_file_that_fails_to_write_leaves_nothing_in_shm(tmp_path, monkeypatch):
    """Soak finding: a save that failed half-way left the partial v<N>.safetensors in
    /dev/shm (only a failed reload removed it), filling it further."""
    pytest.importorskip("vllm")
    import safetensors.torch

    from actors.engines.vllm_engine import VLLMEngine

    def half_write(state, path):
        Path(path).write_bytes(b"x" * 100)
        raise OSError(errno.EFBIG, "File too large")

    monkeypatch.setattr(safetensors.torch, "save_file", half_write)
    engine = object.__new__(VLLMEngine)
    engine._shm, engine._dtype, engine._expected = tmp_path, "float32", None
    with pytest.raises(OSError):
        await engine.update_weights({"w": np.ones(2, np.float32)}, 4)
    assert list(tmp_path.iterdir()) == []


def test_a_tool_cache_locked_by_a_stopped_process_does_not_freeze_the_caller(tmp_path):
    """Soak finding (the stalled-actor fault): an actor stopped while it held the shared
    cache's write lock froze every other actor's event loop, whose cache store waited
    for ever (diskcache's 60 s busy timeout, retried). The lock is held here by another
    connection; the store now gives up within LOCK_WAIT_S and the runner goes on."""
    import asyncio
    import sqlite3
    import time

    from toolenv import cache as C
    from toolenv.base import ToolResult
    from toolenv.runner import ToolRunner

    class Echo:
        name, version = "python", "1"

        async def call(self, args):
            return ToolResult(args, True)

    cache = C.ToolCache(tmp_path / "cache")
    runner = ToolRunner({"python": Echo()}, cache, rate_per_s=0, concurrency=4, timeout_s=30,
                        retries=0)
    holders = []
    for db in (tmp_path / "cache" / "cache.db", tmp_path / "cache" / "counters" / "cache.db"):
        con = sqlite3.connect(db, isolation_level=None)
        con.execute("BEGIN IMMEDIATE")  # the write lock, as a stopped writer holds it
        holders.append(con)
    import threading

    out = {}
    # in a thread: the blocked store is synchronous, no event-loop timeout can end it
    worker = threading.Thread(target=lambda: out.setdefault(
        "result", asyncio.run(runner.call("python", "x = 1"))), daemon=True)
    t0 = time.monotonic()
    worker.start()
    worker.join(12)
    took = time.monotonic() - t0
    for con in holders:
        con.rollback()
    worker.join(10)
    assert took < 10, f"the call waited {took:.1f} s on the lock (LOCK_WAIT_S per operation)"
    result, stats = out["result"], runner.stats()
    assert result.ok and result.text == "x = 1"
    assert stats["cache_store_errors"] == 1 and cache.counter_skips >= 1
    cache.close()


async def test_a_request_to_a_learner_that_died_fails_at_once_not_after_the_timeout():
    """Soak finding: after each learner kill, every actor request in flight to the dead
    process waited transport.request_timeout_s (30 s) for a reply that could not come ("no answer
    to ticket_request for 30 s" while the restarted learner was up), so every slot idled
    that long. A dropped connection now fails the pending requests at once (the caller
    retries, reaches the new learner and says Hello)."""
    import asyncio
    import time

    import zmq
    import zmq.asyncio

    from arpo_async.core.transport.control import ControlClient, TransportTimeout

    ctx = zmq.asyncio.Context()
    server = ctx.socket(zmq.ROUTER)
    port = server.bind_to_random_port("tcp://127.0.0.1")
    client = ControlClient(f"tcp://127.0.0.1:{port}", timeout_s=20)
    try:
        task = asyncio.ensure_future(client.request(P.Heartbeat(0, 0, {})))
        await asyncio.wait_for(server.recv_multipart(), 10)  # arrived; never answered
        server.close(linger=0)  # the learner process dies: its connections close
        t0 = time.monotonic()
        with pytest.raises(TransportTimeout):
            await asyncio.wait_for(task, 15)
        assert time.monotonic() - t0 < 5, "waited for the request timeout"
        assert client.disconnects >= 1
    finally:
        client.close()
        ctx.term()
