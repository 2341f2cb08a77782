"""The actor loop: many prompt groups in flight on one engine, admission by ticket,
weights applied in place, exact accounting of what was sent.

Trajectory-level scheduling (``actors.max_inflight_trajectories`` = T > 0): whenever fewer
than T trajectories are generating (``Occupancy``: leaves that ended, or wait for a tool,
do not count), the actor asks the learner for a ticket (the learner's admission control
bounds staleness) and starts the next group, without waiting for any group's stragglers.
Each group runs as its own task and is sent whole when its last leaf ends, in whatever
order groups finish (blocking while the learner is behind: backpressure, never a drop).
With T = 0, ``actors.concurrent_groups`` slots each generate one group and wait for its
slowest leaf before the next (the synchronous systems' organisation, kept for comparison).
A background task polls for newer weights and loads them without restarting the engine
(``actors.update_mode``: keeping the requests in flight on their KV cache, interrupting
them to resume under the new weights, or draining them); tokens sampled after that carry
the new version. Weights
come over ZeroMQ, or, with ``learner.weight_sync.channel=nccl``, by NCCL broadcast into a vLLM
GPU actor on the learner's machine (arpo_async/core/weights/ picks the channel and falls back to
ZeroMQ).

Surviving a learner restart: every request goes through one ``ResilientControl``
(actors/control.py: retry, Hello again, the learner's version); a learner whose published
version is behind this actor's weights (it resumed from an older checkpoint) makes the
actor load that version before it generates more. Data position: the stream continues at
``saved_position`` (RUN_DIR/state.json), and the actor reports the earliest prompt it has
not yet delivered as ``data_pos``.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time
from pathlib import Path

import numpy as np

from actors.control import ResilientControl
from actors.difficulty import DifficultyBudget
from actors.journal import TreeJournal, TreeRecord, journal_path, why_regenerate
from actors.engines.base import GenerationEngine
from actors.rollout import Occupancy, Rollout
from arpo_async.core import protocol as P
from arpo_async.core.faults import (
    FAULT_HOLD_FIRST_GROUP,
    FAULT_STOP_AFTER_GRANT,
    actor_fault_floats,
    actor_fault_int,
)
from arpo_async.core.metrics import append_jsonl, probe_sequence
from arpo_async.core.rundir import saved_position
from arpo_async.core.transport.control import ControlClient, TransportTimeout
from arpo_async.core.transport.trajectory import TrajectorySender
from arpo_async.core.weights import WeightReceiver, build_weight_receiver
from arpo_async.core.weights.zeromq import ZmqWeightReceiver
from toolenv.tasks.prompts import PromptSource

log = logging.getLogger("actor")


def redo_positions(below: int, above, upto: int, pending) -> list[int]:
    """The stream positions under ``upto`` that a learner holding every position below
    ``below`` and those in ``above`` lacks, less ``pending`` (in flight or queued);
    [] when ``below`` is -1 (the learner does not know)."""
    if below < 0:
        return []
    have = set(above) | set(pending)
    return [p for p in range(below, upto) if p not in have]


class Actor:
    def __init__(self, cfg, actor_id: int, engine: GenerationEngine, rollout: Rollout,
                 source: PromptSource, sender: TrajectorySender, control: ControlClient,
                 vocab_size: int, tools=None):
        self.cfg, self.actor_id, self.engine, self.rollout = cfg, actor_id, engine, rollout
        self.source, self.sender, self.tools = source, sender, tools
        self.control = ResilientControl(control, actor_id, lambda: self.engine.version,
                                        cfg.transport.connect_timeout_s)
        self.vocab_size = vocab_size
        self.stop = False
        self.groups_sent = 0
        self.model_tokens = 0
        self.tool_calls = 0
        self.updates = 0
        self.pause_s = 0.0
        self.idle_s = 0.0
        self.groups_started = 0
        self.max_groups_in_flight = 0
        self.started = time.time()
        self._weights_lock = asyncio.Lock()
        self._in_flight: set[int] = set()  # stream positions of prompts not yet delivered
        # positions of prompts this actor delivered that the learner does not have (it
        # resumed from a checkpoint, or they were lost on the way): drawn again first
        self._redo: list[int] = []
        self.redone = 0
        # the trees an earlier incarnation left in flight (actors/journal.py), by position:
        # drawn first, and finished instead of generated again
        a = cfg.actors
        self.journal = (TreeJournal(journal_path(cfg.run.dir, actor_id), a.journal_fsync_s,
                                    a.journal_max_mb) if a.journal else None)
        self._resume: dict[int, TreeRecord] = {}
        self.control.on_hello = self._plan_redo
        self._probe_path = Path(cfg.run.dir) / f"actor{actor_id}_probe.jsonl"
        # task.difficulty: pass over prompts whose groups would teach nothing
        d = cfg.task.difficulty
        self.difficulty = (DifficultyBudget(d, np.random.default_rng([cfg.run.seed, actor_id, 55]))
                           if d.enabled else None)
        # the fault points (arpo_async/core/faults.py); None in every real run
        self._stop_at = actor_fault_int(FAULT_STOP_AFTER_GRANT, actor_id)
        self._hold = actor_fault_floats(FAULT_HOLD_FIRST_GROUP, actor_id)
        # ZeroMQ until run() has met the learner and picked the configured channel
        self.weights: WeightReceiver = ZmqWeightReceiver(self.control, actor_id)

    # ------------------------------------------------------------------ weights
    async def sync_weights(self) -> None:
        """Load newer weights over the configured channel; or, when the learner is behind
        us (it resumed from an older checkpoint), load the version it publishes now."""
        async with self._weights_lock:
            behind = 0 <= self.control.learner_version < self.engine.version
            before = self.engine.version
            got = await self.weights.sync(self.engine, -1 if behind else before)
            if got is None:
                return
            if got.version < before:
                log.warning("actor %d: the learner restarted at v%d, behind our v%d: loaded "
                            "its weights", self.actor_id, got.version, before)
            self.updates += 1
            self.pause_s += got.paused_s
            log.info("actor %d: weights v%d loaded over %s (paused %.3f s)", self.actor_id,
                     got.version, got.channel, got.paused_s)
            if self.cfg.run.probe_logprobs:
                prompt, tokens = probe_sequence(self.vocab_size)
                lp = await self.engine.sequence_logprobs(prompt, tokens)
                append_jsonl(self._probe_path, {"version": got.version, "logprobs": lp})

    async def _sync_or_wait(self) -> None:
        """The weights a refusal asked for. A load that fails (the weight file cannot be
        written: a full disk or /dev/shm) is retried after a pause, as the weights loop
        does, so the actor lives on; a learner gone for good (TransportTimeout) ends it."""
        try:
            await self.sync_weights()
        except TransportTimeout:
            raise
        except Exception as exc:
            log.warning("actor %d: weight sync failed: %s; retrying", self.actor_id, exc)
            await asyncio.sleep(self.cfg.actors.refusal_retry_s)

    async def _weights_loop(self) -> None:
        while not self.stop:
            try:
                learner = self.control.learner_version
                if learner != self.engine.version and learner >= 0:
                    await self.sync_weights()
            except Exception as exc:  # keep polling: the learner may be restarting
                log.warning("actor %d: weight sync failed: %s", self.actor_id, exc)
            await asyncio.sleep(self.cfg.actors.weight_poll_s)

    async def _heartbeat_loop(self) -> None:
        """Heartbeats on their own, so that a slow weight fetch never looks like a dead
        actor to the learner (which releases a silent actor's tickets)."""
        while not self.stop:
            try:
                await self.control.request(P.Heartbeat(self.actor_id, self.engine.version,
                                                self.stats()))
            except Exception as exc:  # keep beating: the learner may be restarting
                log.warning("actor %d: heartbeat failed: %s", self.actor_id, exc)
            await asyncio.sleep(self.cfg.actors.heartbeat_s)

    # ------------------------------------------------------------------ admission
    async def _ticket(self) -> tuple[int, int] | None:
        """Ask until a ticket is granted: (the weights version it was asked on, the grant's
        epoch), which the group reports so that the learner knows which ticket it used;
        or None when the learner says stop."""
        while not self.stop:
            t0 = time.perf_counter()
            asked_on = self.engine.version
            grant = await self.control.request(P.TicketRequest(self.actor_id, asked_on, 1))
            if grant.stop:
                self.stop = True
                break
            if not grant.granted:
                reason = P.GrantReason.of(grant.reason)
                if reason is P.GrantReason.HELLO_REQUIRED:
                    pass  # the control client said hello; ask again
                elif reason is not None and reason.needs_weights:
                    await self._sync_or_wait()
                else:  # tickets free up as the learner trains
                    await asyncio.sleep(self.cfg.actors.capacity_retry_s
                                        if reason is not None and reason.busy
                                        else self.cfg.actors.refusal_retry_s)
                self.idle_s += time.perf_counter() - t0
                continue
            self.idle_s += time.perf_counter() - t0
            if 0 <= self.control.learner_version < self.engine.version:
                await self.sync_weights()  # never generate with weights the learner lost
            return asked_on, grant.epoch
        return None

    def _plan_redo(self, ack: P.Ack) -> None:
        """The learner's reply to a Hello says which of this actor's prompts it has;
        those delivered (below the stream position, not in flight) that it lacks are
        drawn again, first. A group it has after all comes twice and is dropped there
        as a duplicate: drawing too much costs generation, never a second training."""
        redo = redo_positions(ack.prompts_below, ack.prompts_above, self.source.position,
                              self._in_flight | set(self._redo) | set(self._resume))
        redo = [p for p in redo if self.source.prompt_at(p) is not None]
        if redo:
            self._redo = sorted(set(self._redo) | set(redo))
            log.warning("actor %d: the learner lacks %d of the prompts this actor delivered "
                        "(positions %d..%d): drawing them again", self.actor_id, len(redo),
                        redo[0], redo[-1])

    def _draw(self) -> tuple[int, int, object]:
        """(position, end, prompt) of the next group: a tree left in flight by an earlier
        incarnation first, then a prompt to draw again, else the stream's next (past
        prompts too long for the model: [position, end))."""
        while self._resume:
            pos = min(self._resume)
            tree = self._resume.pop(pos)
            prompt = self.source.prompt_at(pos)
            if prompt is None:
                log.warning("actor %d: the journal's tree at position %d no longer fits the "
                            "model: skipped", self.actor_id, pos)
                self.journal.sent(pos)
                continue
            version = self.control.learner_version
            why = why_regenerate(tree, version, self.cfg.learner.max_staleness)
            if why:  # the prompt starts again: its tokens could never be trained
                log.warning("actor %d: the journal's tree at position %d holds tokens of "
                            "v%d-v%d, %s at learner v%d: generated again", self.actor_id,
                            pos, *tree.versions(), why.replace("_", " "), version)
                self.journal.sent(pos)
                self.journal.counts[f"trees_{why}"] += 1
            return pos, tree.end, prompt
        if self._redo:  # each fits the model (_plan_redo keeps only those)
            pos = self._redo.pop(0)
            self.redone += 1
            return pos, pos + 1, self.source.prompt_at(pos)
        pos = self.source.position
        if self.difficulty is None:
            prompt = self.source.next()
        else:  # prompts passed over are inside [pos, end), as those too long are
            prompt, _ = self.difficulty.draw(self.source.next)
        return pos, self.source.position, prompt

    async def _group(self, ticket: tuple[int, int]) -> None:
        """Generate the next prompt's group and send it. Its first trajectories count
        as generating before this coroutine first waits (``Rollout.run``)."""
        pos, end, prompt = self._draw()
        self._in_flight.add(pos)
        log.debug("actor %d: group at stream position %d started on v%d", self.actor_id, pos,
                  self.engine.version)
        if self._stop_at is not None and self.engine.version >= self._stop_at:
            self._stop_at = None
            log.warning("actor %d: %s: stopping with a ticket held, on v%d", self.actor_id,
                        FAULT_STOP_AFTER_GRANT, self.engine.version)
            os.killpg(os.getpgrp(), signal.SIGSTOP)  # a test sends SIGCONT
        journal = (self.journal.group(pos, end, self.source.position)
                   if self.journal is not None else None)
        group = await self.rollout.run(prompt, self.actor_id, journal)
        if self.difficulty is not None:
            self.difficulty.observe(prompt, [leaf.reward for leaf in group.leaves])
        if self._hold is not None:
            await self._fault_hold(pos)
        # the actor's own figures next to the rollout's (branch/*), never instead of them
        group.stats = {**group.stats, "gen_s": time.time() - group.created_at}
        group.pid, group.data_pos, group.data_end = os.getpid(), pos, end
        group.ticket_version, group.ticket_epoch = ticket
        await self.sender.send(group)  # stamps sent_at
        if self.journal is not None:
            self.journal.sent(pos)
        self._in_flight.discard(pos)
        self.groups_sent += 1
        self.model_tokens += sum(int(leaf.loss_mask.sum()) for leaf in group.leaves)
        self.tool_calls += group.tool_calls_executed

    async def _fault_hold(self, pos: int) -> None:
        """FAULT_HOLD_FIRST_GROUP: hold the group at ``pos`` before it is sent (its own
        function, so that its deadline shares no name with the group's provenance: a
        deadline once went out as the group's data_end)."""
        (hold_s, *until), self._hold = self._hold, None
        log.warning("actor %d: %s: holding group at position %d for %.0f s",
                    self.actor_id, FAULT_HOLD_FIRST_GROUP, pos, hold_s)
        deadline = time.monotonic() + hold_s
        while time.monotonic() < deadline and not (
                until and self.control.learner_version >= until[0]):
            await asyncio.sleep(0.1)

    async def _slot(self) -> None:
        """Group slots (``max_inflight_trajectories=0``): one group at a time, whole."""
        while (ticket := await self._ticket()) is not None:
            await self._group(ticket)

    async def _scheduler(self, target: int) -> None:
        """Trajectory-level scheduling: a new group whenever fewer than ``target``
        trajectories generate; the groups' tasks finish in any order."""
        occupancy = getattr(self.rollout, "occupancy", None) or Occupancy()
        groups: set[asyncio.Task] = set()
        resumed: set[asyncio.Task] = set()
        try:
            while not self.stop:
                await occupancy.below(target)
                for task in [t for t in groups if t.done()]:
                    groups.discard(task)
                    task.result()  # a failed group ends the actor
                if resumed and not self._resume:
                    # the trees resumed from the journal reach the learner before any new
                    # group: their tokens are the oldest in the run (the staleness bound)
                    await asyncio.wait(resumed)
                    resumed = set()
                ticket = await self._ticket()
                if ticket is None:
                    break
                was_resume = bool(self._resume)
                task = asyncio.create_task(self._group(ticket))
                groups.add(task)
                if was_resume:
                    resumed.add(task)
                self.groups_started += 1
                self.max_groups_in_flight = max(self.max_groups_in_flight,
                                                sum(not t.done() for t in groups))
                await asyncio.sleep(0)  # the group's task counts its first trajectories
            if groups:  # the learner said stop: the groups in flight still finish and send
                await asyncio.gather(*groups)
        finally:
            for task in groups:
                task.cancel()

    def stats(self) -> dict[str, float]:
        elapsed = max(time.time() - self.started, 1e-9)
        out = {"groups_sent": self.groups_sent, "model_tokens": self.model_tokens,
               "tokens_per_s": self.model_tokens / elapsed, "weight_updates": self.updates,
               "pause_s": self.pause_s, "idle_s": self.idle_s, "tool_calls": self.tool_calls,
               "version": self.engine.version,
               # for idle fractions (arpo_async/jobs/experiments.py): slot-seconds = elapsed * slots
               "elapsed_s": elapsed, "send_blocked_s": getattr(self.sender, "blocked_s", 0.0),
               # restart bookkeeping (learner/service.py): incarnation and data position
               "pid": float(os.getpid()), "data_pos": float(self.data_position()),
               "prompts_redone": float(self.redone),
               "prompts_skipped_too_long": self.source.skipped_long}
        if self.difficulty is not None:
            out |= self.difficulty.stats()
        occupancy = getattr(self.rollout, "occupancy", None)
        if occupancy is not None:
            out |= {"generating": float(occupancy.count), "generating_mean": occupancy.mean(),
                    "generating_target": float(self.cfg.actors.max_inflight_trajectories),
                    "max_groups_in_flight": float(self.max_groups_in_flight)}
        if hasattr(self.weights, "stats"):  # a channel's own counters (delta: steps, fulls)
            out |= {f"weights/{k}": v for k, v in self.weights.stats().items()}
        if hasattr(self.engine, "stats"):
            out |= {f"engine/{k}": v for k, v in self.engine.stats().items()}
        if self.tools is not None:
            out |= {f"tools/{k}": v for k, v in self.tools.stats().items()}
        if self.journal is not None:
            out |= {f"journal/{k}": v for k, v in self.journal.stats().items()}
        return out

    def data_position(self) -> int:
        """The earliest stream position not yet delivered (in flight, or to draw again):
        where a restart continues."""
        return min([*self._in_flight, *self._resume, *self._redo[:1], self.source.position])

    async def run(self) -> None:
        start = saved_position(self.cfg.run.dir, self.actor_id)
        if self.journal is not None:
            self._resume = self.journal.load()
            start = max(start, self.journal.next)
            if self._resume or self.journal.counts["torn"]:
                log.warning("actor %d: resuming %d trees left in flight (positions %s, %d "
                            "model tokens) from the journal%s", self.actor_id,
                            len(self._resume), sorted(self._resume),
                            self.journal.counts["tokens_resumed"],
                            "; a torn last record was dropped" if self.journal.counts["torn"]
                            else "")
        if start:
            self.source.seek(start)
            log.info("actor %d: continuing the prompt stream at position %d", self.actor_id,
                     start)
        await self.control.connect()
        # learner.weight_sync.channel=nccl: join the learner's NCCL group when this actor can
        self.weights = await build_weight_receiver(self.cfg, self.control, self.engine,
                                                   self.actor_id)
        await self.sync_weights()
        pollers = [asyncio.create_task(self._weights_loop()),
                   asyncio.create_task(self._heartbeat_loop())]
        target = self.cfg.actors.max_inflight_trajectories
        try:
            if target > 0:
                await self._scheduler(target)
            else:
                await asyncio.gather(*[self._slot()
                                       for _ in range(self.cfg.actors.concurrent_groups)])
        finally:
            self.stop = True
            for task in pollers:
                task.cancel()
            await asyncio.gather(*pollers, return_exceptions=True)
        await self.control.request(P.Bye(self.actor_id, self.groups_sent, self.stats()))
        log.info("actor %d done: %d groups sent", self.actor_id, self.groups_sent)
