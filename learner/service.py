"""The learner's side of the wire (rank 0 only): admission, collection, accounting.

Actors ask for tickets before starting a group (admission control keeps the number of
groups in flight within the staleness bound), send finished groups on the trajectory
channel, and fetch weights over the control channel. This class owns both sockets, the
admission controller and the staleness filter, and keeps an exact per-actor ledger
(learner/ledger.py): every group an actor says it sent is trained on, dropped with a
reason, or counted lost. The control handler runs on the transport's server thread,
hence the lock.

Faults it survives:
- hostile input: a group that decodes but is not trainable (token ids outside the
  vocabulary, non-finite numbers, a broken tree...) is rejected by ``check_group`` and
  counted under ``rejected/group/<reason>``; the trainer only ever sees checked groups.
- a restarted actor (a Hello with a new pid): the old incarnation's tickets are released;
  its groups still in the pipe are counted but never release capacity twice.
- a silent actor (stopped, or dead and not yet restarted) for ``learner.actor_silent_s``:
  its tickets are released ("actor_silent") so the others keep the learner busy; its late
  groups are dropped as stale and counted, without releasing capacity again.
- a straggler (a long trajectory, a slow tool): groups finish out of order, so before a
  step that would make a group still generating too old to train (its ticket granted on
  weights ``max_staleness`` versions behind), ``collect`` waits for it, up to
  ``learner.straggler_wait_s``, and trains the oldest groups first; admission bounds such
  groups to one batch. Groups beyond the batch wait for the next step, never trained
  older than the bound.
- a lost connection: an actor whose requests timed out says Hello again once it hears
  from us; its outstanding tickets are released then, since a retried ticket request
  may have been granted twice (the grant for the timed-out one is never used).
- a learner restart: ``restore`` reloads the ledger from the checkpoint and the run state;
  actors that kept running are asked to say Hello again ("hello_required"), and groups
  granted by the dead learner are accepted without a ticket (counted "untracked"): they
  can only loosen admission by the groups then in flight, and the staleness filter still
  drops anything older than eta.
"""

from __future__ import annotations

import logging
import math
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass

import numpy as np
import zmq

from arpo_async.core import protocol as P
from arpo_async.core.config import Config, total_actors
from arpo_async.core.staleness import Admission, StalenessFilter
from arpo_async.core.transport.control import ControlServer
from arpo_async.core.transport.trajectory import TrajectoryReceiver
from arpo_async.core.weights import build_weight_senders
from learner.advantages import check_tree
from learner.config_server import ConfigServer
from learner.ledger import Ledger
from learner.tokens import TokenLedger, prefill_figures

log = logging.getLogger("learner.service")

_SHUTDOWN_QUIET_S = 3.0  # after every Bye, this long without a group means none is coming
_SHUTDOWN_MAX_S = 300.0  # the longest a learner waits for live actors' Bye at the end
_LEAVES_PER_GROUP_SIZE = 4  # a group may hold at most this many times rollout.group_size leaves


def check_group(group: P.TrajectoryGroup, vocab_size: int | None, max_tokens: int | None,
                max_leaves: int = 4096) -> str:
    """"" when ``group`` is safe to train on, else the reason it is not."""
    if group.actor_id < 0 or group.actor_id >= 2**31:
        return "actor_id"
    if not group.leaves or len(group.leaves) > max_leaves:
        return "leaves"
    if group.prompt_tokens.size == 0:
        return "empty_prompt"
    for arr in [group.prompt_tokens] + [leaf.tokens for leaf in group.leaves]:
        if arr.size and (arr.min() < 0 or (vocab_size is not None and arr.max() >= vocab_size)):
            return "token_id"
    for leaf in group.leaves:
        if max_tokens is not None and group.prompt_tokens.size + len(leaf) > max_tokens:
            return "too_long"
        if leaf.loss_mask.size and leaf.loss_mask.max() > 1:
            return "loss_mask"
        model = leaf.loss_mask > 0
        lp = leaf.logprobs[model]
        # every log-prob finite, tool tokens' too: a NaN there still poisons the loss sums
        if not np.all(np.isfinite(leaf.logprobs)) or (lp.size and lp.max() > 1e-3):
            return "logprobs"
        if leaf.versions[model].size and leaf.versions[model].min() < 0:
            return "versions"
        if not (math.isfinite(leaf.reward) and math.isfinite(leaf.score)):
            return "reward"
    try:  # a tree (parents, branch points), whichever attribution the learner uses
        check_tree([leaf.parent for leaf in group.leaves],
                   [leaf.branch_point for leaf in group.leaves],
                   [len(leaf) for leaf in group.leaves])
    except (ValueError, IndexError) as exc:
        log.debug("group %s: bad tree: %s", group.group_id[:40], exc)
        return "tree"
    return ""


def may_stop(now: float, last_group: float, byes_at: float | None, byes: bool,
             done: bool) -> bool:
    """Whether the learner's shutdown may stop reading: every actor said Bye and every
    group they announced arrived (``done``); or every Bye is in and no group came for
    ``_SHUTDOWN_QUIET_S`` since the last group *and* since the last Bye. A group sent just
    before its actor's Bye travels on the trajectory socket, the Bye on the control one,
    so the group can arrive after it: timed from the last group alone, a Bye that came
    after a quiet spell ended the shutdown at once and that group was counted lost."""
    if done:
        return True
    return byes and byes_at is not None and \
        now - max(last_group, byes_at) > _SHUTDOWN_QUIET_S


@dataclass
class _Held:
    """An arrived group not yet trained; ``ticketed``: it holds admission capacity (a
    ticket, or a slot it was adopted into), released if it is dropped."""

    group: P.TrajectoryGroup
    ticketed: bool


class LearnerService:
    def __init__(self, cfg: Config, keys=None, vocab_size: int | None = None,
                 max_tokens: int | None = None, resume: dict | None = None):
        """``vocab_size``/``max_tokens`` bound what ``check_group`` accepts; ``resume``
        ({"version", "ledger", "newer"}) restores a checkpoint's state before the control
        channel opens, so no ticket is granted against the wrong counters."""
        t = cfg.transport
        max_bytes = int(t.max_message_mb * 2**20)
        self.cfg = cfg
        self.vocab_size, self.max_tokens = vocab_size, max_tokens
        self.max_leaves = _LEAVES_PER_GROUP_SIZE * cfg.rollout.group_size
        self.receiver = TrajectoryReceiver(f"tcp://{t.host}:{t.trajectory_port}", hwm=t.recv_hwm,
                                           max_bytes=max_bytes, curve=keys)
        self.control = ControlServer(f"tcp://{t.host}:{t.control_port}", self._handle,
                                     max_bytes=max_bytes, curve=keys)
        self.admission = Admission(cfg.learner.batch_groups, cfg.learner.max_staleness)
        self.filter = StalenessFilter(cfg.learner.max_staleness)
        self.lock = threading.Lock()
        self.version = 0  # learner version: optimizer steps taken
        self.published = -1  # newest version actors can fetch
        self.stopping = False
        self.closing = False  # the run's end is reached: no new groups (close_admission)
        self.closed_at = 0.0
        self.ledger = Ledger()
        self.invalid: Counter = Counter()  # groups that decoded but cannot be trained on
        self.events: Counter = Counter()  # untracked groups, expired tickets, restarts...
        self.wait_s = 0.0  # time spent waiting for trajectories
        self.straggler_wait_s = 0.0  # of that, with a batch ready, waiting for stragglers
        self.held: list[_Held] = []  # arrived, admissible, not trained yet
        self.tokens = TokenLedger()
        self.not_back: list[dict] = []  # after shutdown: actors that never said Bye
        # No tickets until every actor said hello (or the wait ran out), so that one
        # fast-starting actor does not generate a short run's whole first batches.
        self.expected_actors = total_actors(cfg)  # local and remote (cluster.remote_actors)
        self.gate_deadline = time.monotonic() + cfg.actors.start_wait_s
        self.gate_open = self.expected_actors <= 1
        # actors on other machines ask here for the config (arpo_async/launcher/remote.py)
        self.config_server = ConfigServer(cfg)
        self.weights = build_weight_senders(cfg)  # arpo_async/core/weights/: ZeroMQ, NCCL
        if resume is not None:
            self.restore(resume["version"], resume["ledger"], resume.get("newer"))
        self.control.start()

    # ---------------------------------------------------------------- control thread
    def _handle(self, msg, _peer: bytes):
        assign = isinstance(msg, P.ConfigRequest) and msg.actor_id == -1  # "give me an id"
        if (getattr(msg, "actor_id", 0) < 0 and not assign) or getattr(msg, "n", 0) < 0:
            with self.lock:
                self.events["bad_request"] += 1  # counted and refused, never a traceback
            return P.Ack(ok=False, reason=P.AckReason.BAD_REQUEST,
                         learner_version=self.published)
        for sender in self.weights:  # outside the lock: no weight reply waits for the ledger
            if isinstance(msg, sender.requests):
                return sender.handle(msg)
        if getattr(msg, "CHANNEL", ""):  # a request of a weight channel this run has not
            return P.Ack(ok=False, reason=P.AckReason.NO_FAST_WEIGHTS)
        with self.lock:
            if isinstance(msg, P.TicketRequest):
                return self._ticket(msg)
            if isinstance(msg, P.ConfigRequest):  # before the ledger: not an actor yet
                return self.config_server.handle(
                    msg, {i: a.last_seen for i, a in self.ledger.actors.items()})
            if hasattr(msg, "actor_id"):
                self.ledger.actor(msg.actor_id).last_seen = time.time()
            if isinstance(msg, P.Hello):
                return self._hello(msg)
            if isinstance(msg, P.Heartbeat):
                if not self.ledger.heartbeat(msg.actor_id, msg.version, msg.stats):
                    return P.Ack(ok=False, reason=P.AckReason.HELLO_REQUIRED,
                                 learner_version=self.published)
            elif isinstance(msg, P.Bye):
                self.ledger.bye(msg.actor_id, msg.groups_sent, msg.stats)
                log.info("actor %d said bye after %d groups", msg.actor_id, msg.groups_sent)
            return P.Ack(ok=True, learner_version=self.published)

    def _hello(self, msg: P.Hello) -> P.Ack:
        # A restarted actor's tickets are void. The same process saying Hello again lost
        # us for a while: ticket requests it retried may have been granted twice, and only
        # it knows; what is outstanding is released and its groups in flight arrive as
        # orphans (counted, never released twice).
        kind, voided = self.ledger.hello(msg.actor_id, msg.pid, msg.version, msg.host)
        if kind != "new":
            if voided > 0:
                self.admission.release(voided, f"actor_{kind}")
            self.events[f"actor_{kind}s"] += 1
        log.info("actor %d connected (pid %d, version %d)", msg.actor_id, msg.pid, msg.version)
        below, above = self.ledger.prompts_held(msg.actor_id)
        return P.Ack(ok=True, learner_version=self.published, prompts_below=below,
                     prompts_above=above)

    def _ticket(self, msg: P.TicketRequest) -> P.TicketGrant:
        led = self.ledger.actor(msg.actor_id)
        led.last_seen, led.version = time.time(), msg.version
        if self.stopping or self.closing:
            return P.TicketGrant(0, self.published, stop=True, reason=P.GrantReason.STOPPING)
        if not led.hello:
            return P.TicketGrant(0, self.published, reason=P.GrantReason.HELLO_REQUIRED)
        if msg.version > self.published >= 0:  # the learner restarted behind this actor
            return P.TicketGrant(0, self.published, reason=P.GrantReason.STALE_AHEAD)
        if not self.gate_open:
            connected = self.ledger.connected()
            if connected < self.expected_actors and time.monotonic() < self.gate_deadline:
                return P.TicketGrant(0, self.published,
                                     reason=P.GrantReason.WAITING_FOR_ACTORS)
            self.gate_open = True
        # Fair share: no actor holds more than its part of a staleness window's groups, so
        # a fast actor that always asks first cannot starve the others in short runs.
        # Shared among the actors heard from lately: a stopped one does not shrink it.
        window = self.admission.limit(0)  # groups that may start on one version's weights
        alive = self.ledger.alive(time.time(), self.cfg.learner.actor_silent_s)
        share = max(1, -(-window // max(alive, 1)))
        want = max(0, min(msg.n, share - led.outstanding()))
        if want == 0:
            return P.TicketGrant(0, self.published, reason=P.GrantReason.FAIR_SHARE)
        # no group past the last step's: it would only be generated to be dropped at the
        # end ("shutdown"); a released ticket (dropped, lost) opens its place again
        left = self.cfg.learner.max_steps * self.cfg.learner.batch_groups - self.admission.started
        if left <= 0:
            return P.TicketGrant(0, self.published, reason=P.GrantReason.RUN_FULL)
        want = min(want, left)
        granted, reason = self.admission.grant(want, self.version, msg.version)
        led.grant(granted, min(msg.version, self.version))
        return P.TicketGrant(granted, self.published, reason=reason, epoch=led.epoch)

    # ---------------------------------------------------------------- main thread
    def _accept(self, group: P.TrajectoryGroup) -> None:
        """A group that arrived: checked, counted, and held for training or dropped."""
        reason = check_group(group, self.vocab_size, self.max_tokens, self.max_leaves)
        with self.lock:
            if (arrived := self._count_arrival(group, reason)) is None:
                return
            ticketed, why = arrived
            if why:  # this prompt came before, or no draw spans what the group claims
                self._drop(_Held(group, ticketed), why)
                return
            if not ticketed and not self.filter.reason(self.version, group.min_version()):
                self.events["untracked"] += 1  # trained without a counted ticket: it takes
                self.admission.adopt(1)  # a slot (released like a ticket if dropped)
                ticketed = True
            self.held.append(_Held(group, ticketed))
            self._drop_too_old()

    def _count_arrival(self, group: P.TrajectoryGroup, reason: str) -> tuple[bool, str] | None:
        """Count an arrived group that ``check_group`` judged (``reason``; lock held): None
        when it cannot be trained (counted under ``rejected/group/<reason>``), else whether
        it holds a ticket and why its prompt does not count ("" when it does)."""
        if reason:
            self.invalid[reason] += 1
            return None
        ticketed = self.ledger.receive(group.actor_id, group.pid, group.ticket_version,
                                       group.ticket_epoch)
        self.tokens.receive(group)
        return ticketed, self.ledger.claim_prompt(
            group.actor_id, group.data_pos, group.data_end if group.data_end >= 0 else None)

    def _drop_too_old(self) -> None:
        """Drop the held groups that can no longer be trained at this version (lock held)."""
        keep = []
        for h in self.held:
            if self.filter.reason(self.version, h.group.min_version()):
                _, why = self.filter.check(self.version, h.group.min_version())  # counts it
                self._drop(h, why)
            else:
                keep.append(h)
        self.held = keep

    def _drop(self, h: _Held, why: str) -> None:
        self.ledger.drop(h.group.actor_id, why)
        self.tokens.drop(h.group, why)
        if h.ticketed:
            self.admission.release(1, why)

    def expire_silent(self, now: float | None = None) -> int:
        """Release the tickets of actors silent for ``learner.actor_silent_s``."""
        now = time.time() if now is None else now
        released = 0
        with self.lock:
            for actor_id, n, silent in self.ledger.expire_silent(
                    now, self.cfg.learner.actor_silent_s):
                if n > 0:
                    self.admission.release(n, "actor_silent")
                released += n
                log.warning("actor %d silent for %.0f s: released its %d tickets", actor_id,
                            silent, n)
        return released

    def _recv(self, timeout_s: float) -> P.TrajectoryGroup | None:
        try:
            return self.receiver.recv(timeout_s=timeout_s)
        except zmq.Again:
            # A poll that woke without a message: seen once, after a peer without CurveZMQ
            # keys tried a CURVE socket. It must not end the learner.
            self.events["recv_again"] += 1
            return None

    def collect(self, n: int, timeout_s: float,
                should_stop=lambda: False) -> list[P.TrajectoryGroup]:
        """The next ``n`` groups to train, oldest first.

        Waits until ``n`` admissible groups are held, and then, for at most
        ``learner.straggler_wait_s``, until no group whose ticket was granted on weights
        ``max_staleness`` versions behind is still out: this step would make it too old to
        train. Groups too old are dropped and counted; those not taken wait for the next
        step. Raises TimeoutError when no group arrives for ``timeout_s`` while fewer than
        ``n`` are held.

        ``should_stop`` (the time limit, the tool-call budget) closes admission: no group
        starts after it, and the groups already out are still collected and trained, up
        to ``n`` a step, until none is left (then []), waiting for them at most
        ``learner.straggler_wait_s``: what was generated is not thrown away at the end."""
        eta = self.cfg.learner.max_staleness
        limit = self.cfg.learner.straggler_wait_s
        t0 = time.perf_counter()
        last = time.monotonic()
        ready_at = None
        with self.lock:
            self._drop_too_old()  # the version moved on since the last step
        while True:
            if not self.closing and should_stop():
                self.close_admission()
            with self.lock:
                held, closing = len(self.held), self.closing
                out = self.ledger.at_risk(sys.maxsize)  # every ticket whose group is out
                risk = self.ledger.at_risk(self.version - eta)
            ready = held >= n or (closing and out == 0)
            if ready:
                ready_at = time.monotonic() if ready_at is None else ready_at
                if risk == 0:
                    break
                if time.monotonic() - ready_at >= limit:
                    if limit > 0:  # 0: never waits, nothing expired
                        self.events["straggler_wait_expired"] += 1
                    break
            elif closing and time.monotonic() - self.closed_at >= limit:
                self.events["closing_wait_expired"] += 1  # train what is held, drop the rest
                break
            group = self._recv(0.5)
            if group is None:
                self.expire_silent()
                if not ready and not closing and time.monotonic() - last > timeout_s:
                    raise TimeoutError(f"no trajectory for {timeout_s:.0f} s "
                                       f"(actors alive: {self.actors_alive()})")
                continue
            last = time.monotonic()
            self._accept(group)
        if ready_at is not None:
            self.straggler_wait_s += time.monotonic() - ready_at
        with self.lock:
            self.held.sort(key=lambda h: h.group.min_version())  # stable: arrival order next
            take, self.held = self.held[:n], self.held[n:]
            for h in take:  # the last check, at the version they train on: always passes
                self.filter.check(self.version, h.group.min_version())
        self.wait_s += time.perf_counter() - t0
        return [h.group for h in take]

    def close_admission(self) -> None:
        """No group starts from now on (ticket requests are answered ``stop``); the groups
        out still arrive and are trained (``collect``)."""
        with self.lock:
            self.closing, self.closed_at = True, time.monotonic()
            held, out = len(self.held), self.ledger.at_risk(sys.maxsize)
        log.info("the run's end: no new groups; training the %d groups held and the %d "
                 "still out", held, out)

    def mark_trained(self, groups: list[P.TrajectoryGroup]) -> None:
        with self.lock:
            self.ledger.mark_trained(g.actor_id for g in groups)
            self.tokens.train(groups)
            self.version += 1

    def publish(self, version: int, tensors) -> None:
        """Every channel serves ``version`` from now on; the trainer hands over fresh
        copies, which the channels keep as they are."""
        for sender in self.weights:
            sender.publish(version, tensors)
        with self.lock:
            self.published = version

    # ---------------------------------------------------------------- restart
    def ledger_state(self) -> dict:
        """The per-actor ledger as JSON (checkpoints and RUN_DIR/state.json)."""
        with self.lock:
            return self.ledger.state()

    def restore(self, version: int, ledger: dict, newer: dict | None = None) -> None:
        """Continue from a checkpoint at ``version`` with its ``ledger``. ``newer`` is the
        ledger of the run state written after the checkpoint by the learner that died:
        groups it received are kept as received, and those it trained after the
        checkpoint are counted as dropped "rolled_back" (that training was undone)."""
        with self.lock:
            self.version = version
            self.gate_open = True  # a restart: the actors are running already
            self.ledger = Ledger.from_state(ledger, newer)
            # admission resumes with the trained groups counted as started
            self.admission.grant(version * self.cfg.learner.batch_groups, version, version)

    def data_positions(self) -> dict[str, int]:
        with self.lock:
            return self.ledger.data_positions()

    # ---------------------------------------------------------------- reporting
    def actors_alive(self, within_s: float | None = None) -> int:
        within_s = self.cfg.learner.actor_silent_s if within_s is None else within_s
        with self.lock:
            return self.ledger.alive(time.time(), within_s)

    def snapshot(self) -> dict:
        """Counters for metrics.jsonl."""
        with self.lock:
            dropped, stats = self.ledger.metrics(time.time())
            return {"dropped_stale": dropped.get("stale", 0), "dropped": dropped,
                    "rejected": dict(self.receiver.rejected) | {
                        f"control/{k}": v for k, v in self.control.rejected.items()} | {
                        f"group/{k}": v for k, v in self.invalid.items()},
                    "events": dict(self.events),
                    "control": {k: v for k, v in self.control.stats().items()
                                if k in ("requests", "dropped_replies")},
                    "weights": {s.channel: s.stats() for s in self.weights},
                    "admission": self.admission.counters(), "staleness": self.filter.stats(),
                    "tokens": self.tokens.figures() | {"prefill": prefill_figures(
                        led.stats for led in self.ledger.actors.values())},
                    "held": len(self.held),
                    "straggler_wait_s": self.straggler_wait_s,
                    "incarnations": self.ledger.incarnations(), **stats}

    def _byes_pending_from_live_actors(self) -> bool:
        with self.lock:
            return self.ledger.alive(time.time(), self.cfg.learner.actor_silent_s) > 0

    def shutdown(self, wait_s: float) -> dict:
        """Tell actors to stop, wait for their Bye, drain what they sent, close the ledger.
        Groups an actor said it sent that never arrived are reported as ``lost``.

        Waits ``wait_s``, and longer (up to ``_SHUTDOWN_MAX_S``) for actors still heard
        from: one finishing a long group says Bye late but says it."""
        with self.lock:
            self.stopping = True
            for h in self.held:  # arrived, never trained: the run ended first
                self._drop(h, "shutdown")
            self.held = []
        t0 = time.monotonic()
        quiet_since, byes_at = t0, None
        while time.monotonic() - t0 < _SHUTDOWN_MAX_S:
            if time.monotonic() - t0 > wait_s and not self._byes_pending_from_live_actors():
                break
            group = self._recv(0.2)
            if group is not None:
                quiet_since = time.monotonic()
                reason = check_group(group, self.vocab_size, self.max_tokens, self.max_leaves)
                with self.lock:
                    if self._count_arrival(group, reason) is not None:
                        # counted, never trained (stopping: no capacity to release)
                        self.ledger.drop(group.actor_id, "shutdown")
                        self.tokens.drop(group, "shutdown")
                continue
            with self.lock:
                byes, done = self.ledger.drained()
            if byes and byes_at is None:
                byes_at = time.monotonic()
            if may_stop(time.monotonic(), quiet_since, byes_at, byes, done):
                break
        with self.lock:
            ledger = self.ledger.summary()
            self.not_back = self.ledger.not_back(time.time())
        for gone in self.not_back:
            log.warning("actor %d (%s) never came back: silent for %.0f s", gone["actor"],
                        gone["host"] or "host unknown", gone["silent_s"])
        self.control.stop()
        for sender in self.weights:
            sender.close()
        self.receiver.close()
        return ledger
