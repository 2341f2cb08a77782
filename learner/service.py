"""The learner's side of the wire (rank 0 only): admission, collection, accounting.

Actors ask for tickets before starting a group (admission control keeps the number of
groups in flight within the staleness bound), send finished groups on the trajectory
channel, and fetch weights over the control channel. This class owns both sockets, the
admission controller and the staleness filter, and keeps an exact per-actor ledger:
every group an actor says it sent is either trained on or dropped with a reason.
The control handler runs on the transport's server thread, hence the lock.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from dataclasses import dataclass, field

from arpo_async import protocol as P
from arpo_async.config import Config
from arpo_async.staleness import Admission, StalenessFilter
from arpo_async.transport import ControlServer, TrajectoryReceiver

log = logging.getLogger("learner.service")


@dataclass
class ActorLedger:
    pid: int = 0
    granted: int = 0  # tickets granted to the current incarnation
    received: int = 0  # groups received from the current incarnation
    sent_total: int = -1  # from Bye; -1 until the actor said goodbye
    received_total: int = 0
    trained: int = 0
    dropped: Counter = field(default_factory=Counter)
    version: int = -1
    last_seen: float = 0.0
    stats: dict = field(default_factory=dict)


class LearnerService:
    def __init__(self, cfg: Config, keys=None):
        t = cfg.transport
        max_bytes = int(t.max_message_mb * 2**20)
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
        self.actors: dict[int, ActorLedger] = {}
        self.wait_s = 0.0  # time spent waiting for trajectories
        # No tickets until every actor said hello (or the wait ran out), so that one
        # fast-starting actor does not generate a short run's whole first batches.
        self.expected_actors = cfg.actors.num
        self.gate_deadline = time.monotonic() + cfg.actors.start_wait_s
        self.gate_open = cfg.actors.num <= 1
        self.control.start()

    # ---------------------------------------------------------------- control thread
    def _ledger(self, actor_id: int) -> ActorLedger:
        return self.actors.setdefault(actor_id, ActorLedger())

    def _handle(self, msg, _peer: bytes):
        with self.lock:
            if isinstance(msg, P.TicketRequest):
                return self._ticket(msg)
            led = self._ledger(msg.actor_id) if hasattr(msg, "actor_id") else None
            if led is not None:
                led.last_seen = time.time()
            if isinstance(msg, P.Hello):
                if led.pid and led.pid != msg.pid:  # a restarted actor: its tickets are void
                    self._release(led, "actor_restart")
                led.pid, led.version = msg.pid, msg.version
                log.info("actor %d connected (pid %d, version %d)", msg.actor_id, msg.pid,
                         msg.version)
            elif isinstance(msg, P.Heartbeat):
                led.version, led.stats = msg.version, dict(msg.stats)
            elif isinstance(msg, P.Bye):
                led.sent_total, led.stats = msg.groups_sent, dict(msg.stats)
                log.info("actor %d said bye after %d groups", msg.actor_id, msg.groups_sent)
            return P.Ack(ok=True, learner_version=self.published)

    def _ticket(self, msg: P.TicketRequest) -> P.TicketGrant:
        led = self._ledger(msg.actor_id)
        led.last_seen, led.version = time.time(), msg.version
        if self.stopping:
            return P.TicketGrant(0, self.published, stop=True, reason="stopping")
        if not self.gate_open:
            connected = sum(1 for a in self.actors.values() if a.pid)
            if connected < self.expected_actors and time.monotonic() < self.gate_deadline:
                return P.TicketGrant(0, self.published, reason="waiting_for_actors")
            self.gate_open = True
        granted, reason = self.admission.grant(msg.n, self.version, msg.version)
        led.granted += granted
        return P.TicketGrant(granted, self.published, reason=reason)

    def _release(self, led: ActorLedger, reason: str) -> None:
        outstanding = led.granted - led.received
        if outstanding > 0:
            self.admission.release(outstanding, reason)
        led.granted = led.received = 0

    # ---------------------------------------------------------------- main thread
    def _accept(self, group: P.TrajectoryGroup) -> bool:
        with self.lock:
            led = self._ledger(group.actor_id)
            led.received += 1
            led.received_total += 1
            keep, reason = self.filter.check(self.version, group.min_version())
            if not keep:
                led.dropped[reason] += 1
                self.admission.release(1, reason)
            return keep

    def collect(self, n: int, timeout_s: float, should_stop=lambda: False) -> list[P.TrajectoryGroup]:
        """Block until ``n`` admissible groups arrived; stale ones are dropped and counted."""
        groups: list[P.TrajectoryGroup] = []
        t0 = time.perf_counter()
        last = time.monotonic()
        while len(groups) < n:
            group = self.receiver.recv(timeout_s=0.5)
            if group is None:
                if should_stop():
                    break
                if time.monotonic() - last > timeout_s:
                    raise TimeoutError(f"no trajectory for {timeout_s:.0f} s "
                                       f"(actors alive: {self.actors_alive()})")
                continue
            last = time.monotonic()
            if self._accept(group):
                groups.append(group)
        self.wait_s += time.perf_counter() - t0
        return groups

    def mark_trained(self, groups: list[P.TrajectoryGroup]) -> None:
        with self.lock:
            for g in groups:
                self._ledger(g.actor_id).trained += 1
            self.version += 1

    def publish(self, version: int, tensors, bf16_names=()) -> None:
        # the trainer hands over fresh copies, so the transport need not copy again
        self.control.publish_weights(version, tensors, bf16_names=bf16_names, copy=False)
        with self.lock:
            self.published = version

    def actors_alive(self, within_s: float = 30.0) -> int:
        now = time.time()
        with self.lock:
            return sum(1 for a in self.actors.values()
                       if a.sent_total < 0 and now - a.last_seen < within_s)

    def snapshot(self) -> dict:
        """Counters for metrics.jsonl."""
        with self.lock:
            dropped = Counter()
            for a in self.actors.values():
                dropped.update(a.dropped)
            stats = {f"actor{i}/{k}": v for i, a in self.actors.items() for k, v in a.stats.items()}
            return {"dropped_stale": dropped.get("stale", 0), "dropped": dict(dropped),
                    "rejected": dict(self.receiver.rejected) | {
                        f"control/{k}": v for k, v in self.control.rejected.items()},
                    "admission": self.admission.counters(), "staleness": self.filter.stats(),
                    **stats}

    def shutdown(self, wait_s: float) -> dict:
        """Tell actors to stop, wait for their Bye, drain what they sent, close the ledger."""
        with self.lock:
            self.stopping = True
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            group = self.receiver.recv(timeout_s=0.2)
            if group is not None:
                with self.lock:
                    led = self._ledger(group.actor_id)
                    led.received_total += 1
                    led.dropped["shutdown"] += 1
                continue
            with self.lock:
                done = all(a.sent_total >= 0 and a.received_total >= a.sent_total
                           for a in self.actors.values())
            if done:
                break
        with self.lock:
            ledger = {i: {"sent": a.sent_total, "received": a.received_total,
                          "trained": a.trained, "dropped": dict(a.dropped)}
                      for i, a in self.actors.items()}
        self.control.stop()
        self.receiver.close()
        return ledger
