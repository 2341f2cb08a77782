"""The actor loop: many prompt groups in flight on one engine, admission by ticket,
weights applied in place at a safe point, exact accounting of what was sent.

Each of ``actors.concurrent_groups`` slots repeats: ask the learner for a ticket (the
learner's admission control bounds staleness), generate a group with the rollout, send
it (blocking while the learner is behind: backpressure, never a drop). A background task
polls for newer weights and loads them without restarting the engine; tokens sampled
after that carry the new version.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
from pathlib import Path

from actors.engine import GenerationEngine
from actors.rollout import Rollout
from arpo_async import protocol as P
from arpo_async.metrics import append_jsonl, probe_sequence
from arpo_async.tasks import PromptSource
from arpo_async.transport import ControlClient, TrajectorySender

log = logging.getLogger("actor")


class Actor:
    def __init__(self, cfg, actor_id: int, engine: GenerationEngine, rollout: Rollout,
                 source: PromptSource, sender: TrajectorySender, control: ControlClient,
                 vocab_size: int, tools=None):
        self.cfg, self.actor_id, self.engine, self.rollout = cfg, actor_id, engine, rollout
        self.source, self.sender, self.control, self.tools = source, sender, control, tools
        self.vocab_size = vocab_size
        self.stop = False
        self.groups_sent = 0
        self.model_tokens = 0
        self.tool_calls = 0
        self.updates = 0
        self.pause_s = 0.0
        self.idle_s = 0.0
        self.started = time.time()
        self._weights_lock = asyncio.Lock()
        self._probe_path = Path(cfg.run.dir) / f"actor{actor_id}_probe.jsonl"

    # ------------------------------------------------------------------ weights
    async def sync_weights(self) -> None:
        async with self._weights_lock:
            update = await self.control.fetch_weights(self.engine.version, self.actor_id)
            if update is None or update.version <= self.engine.version:
                return
            paused = await self.engine.update_weights(update.tensors, update.version)
            self.updates += 1
            self.pause_s += paused
            log.info("actor %d: weights v%d loaded (paused %.3f s)", self.actor_id,
                     update.version, paused)
            if self.cfg.run.probe_logprobs:
                prompt, tokens = probe_sequence(self.vocab_size)
                lp = await self.engine.sequence_logprobs(prompt, tokens)
                append_jsonl(self._probe_path, {"version": update.version, "logprobs": lp})

    async def _weights_loop(self) -> None:
        while not self.stop:
            try:
                ack = await self.control.request(
                    P.Heartbeat(self.actor_id, self.engine.version, self.stats()))
                if ack.learner_version > self.engine.version:
                    await self.sync_weights()
            except Exception as exc:  # keep polling: the learner may be restarting
                log.warning("actor %d: heartbeat failed: %s", self.actor_id, exc)
            await asyncio.sleep(self.cfg.actors.weight_poll_s)

    # ------------------------------------------------------------------ slots
    async def _slot(self) -> None:
        while not self.stop:
            t0 = time.perf_counter()
            grant = await self.control.request(
                P.TicketRequest(self.actor_id, self.engine.version, 1))
            if grant.stop:
                self.stop = True
                break
            if not grant.granted:
                if grant.reason.startswith("stale"):
                    await self.sync_weights()
                else:  # at capacity: the learner frees tickets as it trains
                    await asyncio.sleep(0.02 if grant.reason == "capacity" else 0.2)
                self.idle_s += time.perf_counter() - t0
                continue
            self.idle_s += time.perf_counter() - t0
            group = await self.rollout.run(self.source.next(), self.actor_id)
            group.stats = {"gen_s": time.time() - group.created_at}
            group.sent_at = time.time()
            await self.sender.send(group)
            self.groups_sent += 1
            self.model_tokens += sum(int(leaf.loss_mask.sum()) for leaf in group.leaves)
            self.tool_calls += group.tool_calls_executed

    def stats(self) -> dict[str, float]:
        elapsed = max(time.time() - self.started, 1e-9)
        out = {"groups_sent": self.groups_sent, "model_tokens": self.model_tokens,
               "tokens_per_s": self.model_tokens / elapsed, "weight_updates": self.updates,
               "pause_s": self.pause_s, "idle_s": self.idle_s, "tool_calls": self.tool_calls,
               "version": self.engine.version}
        if self.tools is not None:
            out |= {f"tools/{k}": v for k, v in self.tools.stats().items()}
        return out

    async def _connect(self) -> None:
        """Handshake, retried while the learner starts (DeepSpeed start-up takes a while)."""
        deadline = time.monotonic() + self.cfg.transport.connect_timeout_s
        hello = P.Hello(self.actor_id, os.getpid(), socket.gethostname(), self.engine.version)
        while True:
            try:
                await self.control.hello(hello)
                return
            except TimeoutError:
                if time.monotonic() > deadline:
                    raise
                log.info("actor %d: waiting for the learner at %s", self.actor_id,
                         self.control.endpoint)

    async def run(self) -> None:
        await self._connect()
        await self.sync_weights()
        poller = asyncio.create_task(self._weights_loop())
        try:
            await asyncio.gather(*[self._slot() for _ in range(self.cfg.actors.concurrent_groups)])
        finally:
            self.stop = True
            poller.cancel()
            await asyncio.gather(poller, return_exceptions=True)
        await self.control.request(P.Bye(self.actor_id, self.groups_sent, self.stats()))
        log.info("actor %d done: %d groups sent", self.actor_id, self.groups_sent)
