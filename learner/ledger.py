"""The learner's per-actor ledger of trajectory groups (pure): what each actor says it
sent, what arrived, and what became of it.

Every group an actor sends ends up in exactly one column: trained, dropped with a
reason ("stale", "rolled_back", "shutdown", ...), or lost (sent but never received).
Actors report ``groups_sent`` per process (incarnation, keyed by pid) in heartbeats and
in their Bye; the ledger keeps one count per incarnation so that a restarted actor's
counter starting again at 0 does not hide what its predecessor sent. For a dead
incarnation whose last heartbeat predates its last groups, what arrived is the better
lower bound, hence ``max(said, received)`` per pid.

The ledger also tracks the tickets (admission grants) of each actor's current
incarnation, because whether an arriving group still holds capacity depends on the
actor's history: a group of an earlier incarnation, or one whose ticket was released
while the actor was silent ("orphaned"), must not release capacity a second time. The
caller (learner/service.py) owns the admission controller and the lock; the methods
here only count (and log a peer's impossible claim once), and return what the caller has
to release or drop.

State for checkpoints and ``RUN_DIR/state.json`` is JSON: ``{actor_id: {"pid",
"received_total", "trained", "dropped", "sent_by_pid", "received_by_pid",
"data_pos", "prompts"}}`` with string keys (checkpoints of every version read alike). Tickets are
not saved: they belong to the learner process that granted them.
"""

from __future__ import annotations

import logging
import math
from collections import Counter
from dataclasses import dataclass, field

log = logging.getLogger("learner.ledger")

# why a group's prompt is not taken (the caller drops the group under this reason)
DUPLICATE = "duplicate"  # its stream positions were taken already
BAD_ORIGIN = "bad_origin"  # it claims stream positions no draw spans (``span_end``)


def peer_count(value, default: int) -> int:
    """A non-negative integer from a peer's stats (floats on the wire), else ``default``:
    a NaN or absurd number from a peer must not raise in the learner."""
    if isinstance(value, (int, float)) and not isinstance(value, bool) \
            and math.isfinite(value) and 0 <= value < 2**62:
        return int(value)
    return default


# Most stream positions one group may claim: its draw passes over the prompts too long for
# the model (PromptSource.next: at most one pass of the task's, a count the learner does not
# know); 4096 in a row of a shuffled order is no run's data (at 99% too long, 1e-18).
MAX_SPAN = 4096


def span_end(pos: int, end_stat) -> int:
    """The end of the stream positions [pos, end) a group at ``pos`` claims (``end_stat``:
    its origin's ``data_end``; ``pos + 1`` when it does not say), or -1 when no draw spans
    them: an end that is not a whole number (positions are counts; a clock's deadline once
    went out as one), not past ``pos`` (a draw takes its own prompt's position), or more
    than ``MAX_SPAN`` past it."""
    if end_stat is None:
        return pos + 1
    end = peer_count(end_stat, -1)
    return end if end == end_stat and pos < end <= pos + MAX_SPAN else -1


@dataclass
class PromptRecord:
    """The stream positions (``data_pos`` of a group's origin: the prompt's index in the
    actor's seeded prompt stream) of the groups the learner took from one actor, trained
    or dropped with a reason: every position below ``below``, and those in ``above``.
    A group whose position was taken already is a duplicate: a restarted actor draws
    again from the earliest prompt it had not delivered, so the prompts it delivered
    after that one come twice; the learner drops the second ("duplicate") instead of
    training a prompt twice. Positions below the actor's own stream position that were
    never taken were skipped: lost in transit, or trained and then rolled back with a
    learner checkpoint (not generated again)."""

    below: int = 0
    above: set = field(default_factory=set)
    duplicates: int = 0
    known: bool = True  # False: restored from a checkpoint that predates the record

    def take(self, pos: int, end: int | None = None) -> bool:
        """Record positions ``[pos, end)`` (``end``: ``pos + 1`` when None; more when the
        actor passed over prompts too long for the model, which it counted); False (and
        counted) when one of them was taken already."""
        span = range(pos, end if end is not None and end > pos else pos + 1)
        if any(p < self.below or p in self.above for p in span):
            self.duplicates += 1
            return False
        self.above.update(span)
        while self.below in self.above:
            self.above.remove(self.below)
            self.below += 1
        return True

    def taken(self) -> int:
        return self.below + len(self.above)

    def skipped(self, upto: int) -> int:
        """Positions below ``upto`` never taken (-1: not known)."""
        if not self.known:
            return -1
        return max(upto - self.below, 0) - sum(1 for p in self.above if p < upto)

    def to_state(self) -> dict:
        out = {"below": self.below, "above": sorted(self.above),
               "duplicates": self.duplicates}
        return out if self.known else out | {"known": False}

    @classmethod
    def from_state(cls, d: dict | None) -> PromptRecord:
        if d is None:  # a checkpoint written before the record existed
            return cls(known=False)
        out = cls(below=int(d.get("below", 0)), duplicates=int(d.get("duplicates", 0)),
                  known=bool(d.get("known", True)))
        out.above = {int(p) for p in d.get("above", []) if int(p) >= out.below}
        return out


@dataclass
class ActorLedger:
    pid: int = 0  # current incarnation (from Hello)
    hello: bool = False  # said Hello to this learner process
    granted: int = 0  # tickets granted to the current incarnation by this learner
    # its outstanding tickets by the weights version they were granted on: those granted
    # on old weights are the groups the learner waits for before a step would make them
    # stale (learner/service.py collect)
    ticket_versions: Counter = field(default_factory=Counter)
    # bumped whenever its outstanding tickets are voided; each grant carries it and each
    # group reports it back, so a group of a voided ticket is an orphan exactly
    epoch: int = 0
    used: int = 0  # of those, groups received
    orphaned: int = 0  # groups in flight whose tickets were released while it was silent
    bye: bool = False
    received_total: int = 0
    trained: int = 0
    dropped: Counter = field(default_factory=Counter)
    sent_by_pid: dict = field(default_factory=dict)  # incarnation -> groups it said it sent
    received_by_pid: dict = field(default_factory=dict)
    version: int = -1
    last_seen: float = 0.0
    host: str = ""  # the machine its Hello named
    stats: dict = field(default_factory=dict)
    prompts: PromptRecord = field(default_factory=PromptRecord)
    told_bad_origin: bool = False  # its first impossible claim was logged (this process)

    def sent(self) -> int:
        """Groups sent over all incarnations; a dead one counts at least what arrived."""
        pids = set(self.sent_by_pid) | set(self.received_by_pid)
        return sum(max(self.sent_by_pid.get(p, 0), self.received_by_pid.get(p, 0))
                   for p in pids)

    def lost(self) -> int:
        return self.sent() - self.received_total

    def outstanding(self) -> int:
        """Tickets of the current incarnation whose groups have not arrived."""
        return max(self.granted - self.used, 0)

    def grant(self, n: int, version: int) -> None:
        """``n`` tickets granted on weights ``version``."""
        self.granted += n
        if n > 0:
            self.ticket_versions[version] += n

    def void_tickets(self) -> int:
        """Forget the current incarnation's outstanding tickets; how many there were
        (the caller releases them from admission)."""
        outstanding = self.outstanding()
        self.granted = self.used = 0
        self.ticket_versions.clear()
        self.epoch += 1
        return outstanding

    def take_ticket(self, pid: int, ticket_version: int | None = None,
                    ticket_epoch: int = -1) -> bool:
        """Whether a group just received from incarnation ``pid`` used a ticket still
        counted by admission (see the module docstring). ``ticket_version``: the weights
        version the actor asked for that ticket on (its group's stats), which says which
        outstanding ticket it was; the oldest when unknown. ``ticket_epoch``: the epoch
        its grant carried; an earlier one is a voided ticket's group (an orphan). Without
        it (-1) orphans are counted off ``orphaned``, which a voided grant nobody used
        (a retried request's duplicate) keeps above zero, swallowing later groups."""
        if pid != self.pid:  # an earlier incarnation: released at its successor's Hello
            return False
        if ticket_epoch >= 0:
            if ticket_epoch != self.epoch:
                self.orphaned = max(self.orphaned - 1, 0)
                return False
        elif self.orphaned > 0:
            self.orphaned -= 1
            return False
        if self.used < self.granted:
            self.used += 1
            held = self.ticket_versions
            if held:
                key = ticket_version if held.get(ticket_version, 0) > 0 else min(held)
                held[key] -= 1
                if held[key] <= 0:
                    del held[key]
            return True
        return False

    def at_risk(self, bound: int) -> int:
        """Outstanding tickets granted on weights ``bound`` or older."""
        return sum(n for v, n in self.ticket_versions.items() if v <= bound)

    def to_state(self) -> dict:
        return {"pid": self.pid, "received_total": self.received_total,
                "trained": self.trained, "dropped": dict(self.dropped),
                "sent_by_pid": {str(k): v for k, v in self.sent_by_pid.items()},
                "received_by_pid": {str(k): v for k, v in self.received_by_pid.items()},
                "data_pos": self.stats.get("data_pos"), "prompts": self.prompts.to_state()}

    @classmethod
    def from_state(cls, d: dict) -> ActorLedger:
        if not isinstance(d, dict):
            raise ValueError(f"expected an object, got {type(d).__name__}")
        led = cls(pid=int(d.get("pid", 0)), received_total=int(d.get("received_total", 0)),
                  trained=int(d.get("trained", 0)),
                  dropped=Counter({str(k): int(v) for k, v in d.get("dropped", {}).items()}))
        led.sent_by_pid = {int(k): int(v) for k, v in d.get("sent_by_pid", {}).items()}
        led.received_by_pid = {int(k): int(v) for k, v in d.get("received_by_pid", {}).items()}
        if d.get("data_pos") is not None:
            led.stats["data_pos"] = d["data_pos"]
        led.prompts = PromptRecord.from_state(d.get("prompts"))
        return led


class Ledger:
    """Every actor's ``ActorLedger``, and the events that change them. Not thread-safe:
    the learner service calls it under its lock."""

    def __init__(self, actors: dict[int, ActorLedger] | None = None):
        self.actors: dict[int, ActorLedger] = dict(actors or {})

    def actor(self, actor_id: int) -> ActorLedger:
        return self.actors.setdefault(actor_id, ActorLedger())

    # ------------------------------------------------------------- messages from actors
    def hello(self, actor_id: int, pid: int, version: int, host: str = "") -> tuple[str, int]:
        """An actor said Hello: ("restart", n) for a new pid, ("reconnect", n) for the same
        process saying it again, ("new", 0) otherwise; ``n`` outstanding tickets are void
        and must be released. A reconnecting process may still deliver groups for those
        tickets (a retried request may have been granted twice): they arrive as orphans."""
        led = self.actor(actor_id)
        kind, voided = "new", 0
        if led.pid and led.pid != pid:
            kind, voided = "restart", led.void_tickets()
            # orphans belong to the dead incarnation; its groups are told apart by pid,
            # so the new one's first groups must not be taken for them
            led.orphaned = 0
        elif led.hello:
            kind, voided = "reconnect", led.void_tickets()
            led.orphaned += voided
        led.pid, led.version, led.hello, led.bye = pid, version, True, False
        led.host = host or led.host
        led.sent_by_pid.setdefault(pid, 0)
        return kind, voided

    def heartbeat(self, actor_id: int, version: int, stats: dict) -> bool:
        """Record a heartbeat's stats; whether the actor said Hello to this learner."""
        led = self.actor(actor_id)
        led.version, led.stats = version, dict(stats)
        pid = peer_count(stats.get("pid"), led.pid)
        if pid and "groups_sent" in stats:
            led.sent_by_pid[pid] = peer_count(stats["groups_sent"], 0)
        return led.hello

    def bye(self, actor_id: int, groups_sent: int, stats: dict) -> None:
        led = self.actor(actor_id)
        led.bye, led.stats = True, dict(stats)
        # bounded like a heartbeat's count: a peer's absurd total is not a real loss
        led.sent_by_pid[peer_count(stats.get("pid"), led.pid)] = peer_count(groups_sent, 0)

    # ------------------------------------------------------------- groups
    def receive(self, actor_id: int, pid, ticket_version=None, ticket_epoch=None) -> bool:
        """A checked group arrived (its origin's ``pid``, ``ticket_version`` and
        ``ticket_epoch``, protocol ``TrajectoryGroup``; -1 or None: not said); whether it
        used a ticket still counted by admission. The caller then records it as trained
        (after the step) or dropped."""
        led = self.actor(actor_id)
        led.received_total += 1
        pid = peer_count(pid, led.pid)
        led.received_by_pid[pid] = led.received_by_pid.get(pid, 0) + 1
        return led.take_ticket(pid, peer_count(ticket_version, -1),
                               peer_count(ticket_epoch, -1))

    def claim_prompt(self, actor_id: int, data_pos, data_end=None) -> str:
        """A group that arrived claims the stream positions its draw consumed, [data_pos,
        data_end) (its origin's; ``data_end`` None: pos + 1): "" when they are taken now,
        else why the caller drops the group: DUPLICATE (one was taken already) or
        BAD_ORIGIN (no draw spans them, ``span_end``: nothing is taken, and an actor's
        first is logged). A group without a position (-1) is not tracked ("")."""
        pos = peer_count(data_pos, -1)
        if pos < 0:
            return ""
        led, end = self.actor(actor_id), span_end(pos, data_end)
        if end < 0:
            if not led.told_bad_origin:
                led.told_bad_origin = True
                log.warning("actor %d: a group claims stream positions [%d, %r), which no "
                            "draw spans: refused, %s (its first; the others only counted)",
                            actor_id, pos, data_end, BAD_ORIGIN)
            return BAD_ORIGIN
        return "" if led.prompts.take(pos, end) else DUPLICATE

    def prompts_held(self, actor_id: int) -> tuple[int, list[int]]:
        """For the reply to an actor's Hello: the positions of its prompts taken, as
        (every one below, those above), or (-1, []) when not known."""
        rec = self.actor(actor_id).prompts
        return (rec.below, sorted(rec.above)) if rec.known else (-1, [])

    def at_risk(self, bound: int) -> int:
        """Outstanding tickets, over every actor, granted on weights ``bound`` or older:
        groups that a step past ``bound + eta`` would make stale before they arrive."""
        return sum(led.at_risk(bound) for led in self.actors.values())

    def drop(self, actor_id: int, reason: str) -> None:
        if not reason:
            raise ValueError(f"drop: actor {actor_id}: a reason is required")
        self.actor(actor_id).dropped[reason] += 1

    def mark_trained(self, actor_ids) -> None:
        for actor_id in actor_ids:
            self.actor(actor_id).trained += 1

    def expire_silent(self, now: float, silent_s: float) -> list[tuple[int, int, float]]:
        """Void the tickets of actors silent for more than ``silent_s``: (actor, tickets,
        seconds silent) for each; the caller releases them. Their groups in flight then
        arrive as orphans."""
        out = []
        for actor_id, led in self.actors.items():
            if led.outstanding() and now - led.last_seen > silent_s:
                n = led.void_tickets()
                led.orphaned += n
                out.append((actor_id, n, now - led.last_seen))
        return out

    # ------------------------------------------------------------- checkpoints
    def state(self) -> dict:
        """JSON for checkpoints and RUN_DIR/state.json (layout in the module docstring)."""
        return {str(i): a.to_state() for i, a in self.actors.items()}

    @classmethod
    def from_state(cls, ledger: dict, newer: dict | None = None) -> Ledger:
        """The ledger of a checkpoint. ``newer`` is the ledger of a run state written after
        it by the learner that died: groups it received stay received, those it trained
        after the checkpoint count as dropped "rolled_back" (that training was undone by
        resuming from the checkpoint), and those it held, received but neither trained
        nor dropped yet (waiting for a step, learner/service.py), died with it: dropped
        "learner_died"."""
        out = cls(_parse(ledger, "checkpoint ledger"))
        for i, led in _parse(newer or {}, "run state ledger").items():
            old = out.actors.get(i, ActorLedger())
            held = led.received_total - led.trained - sum(led.dropped.values())
            if held > 0:
                led.dropped["learner_died"] += held
            rolled_back = led.trained - old.trained
            led.trained = old.trained
            if rolled_back > 0:
                led.dropped["rolled_back"] += rolled_back
            # the prompts taken after the checkpoint are not taken any more: their training
            # was undone (a group for one of them is trained, not a duplicate)
            led.prompts = PromptRecord(old.prompts.below, set(old.prompts.above),
                                       led.prompts.duplicates, old.prompts.known)
            out.actors[i] = led
        return out

    def data_positions(self) -> dict[str, int]:
        return {str(i): peer_count(a.stats.get("data_pos"), 0) for i, a in self.actors.items()
                if "data_pos" in a.stats}

    # ------------------------------------------------------------- reporting
    def connected(self) -> int:
        return sum(1 for a in self.actors.values() if a.hello)

    def alive(self, now: float, within_s: float) -> int:
        """Actors heard from within ``within_s`` that have not said Bye."""
        return sum(1 for a in self.actors.values()
                   if not a.bye and now - a.last_seen < within_s)

    def drained(self) -> tuple[bool, bool]:
        """(every actor said Bye, and every group they said they sent arrived)."""
        byes = all(a.bye for a in self.actors.values())
        return byes, byes and all(a.lost() <= 0 for a in self.actors.values())

    def summary(self) -> dict:
        """Per actor: sent, received, trained, dropped by reason, lost, incarnations, and
        its prompts: taken (trained or dropped with a reason), duplicates (dropped, not
        trained twice) and skipped (below its last stream position, never taken).
        ``sent`` and ``lost`` are -1 for an actor that never said Bye (still open)."""
        return {i: {"sent": a.sent() if a.bye else -1, "received": a.received_total,
                    "trained": a.trained, "dropped": dict(a.dropped),
                    "lost": max(a.lost(), 0) if a.bye else -1,
                    "incarnations": len(a.sent_by_pid),
                    "prompts": {"taken": a.prompts.taken(),
                                "duplicates": a.prompts.duplicates,
                                "skipped": a.prompts.skipped(
                                    peer_count(a.stats.get("data_pos"), 0))}}
                for i, a in self.actors.items()}

    def not_back(self, now: float) -> list[dict]:
        """The actors that never said Bye (their host vanished, or they died unseen), each
        with its host, seconds since it was last heard from, the groups it said it sent
        in its last heartbeat and the groups received from it."""
        return [{"actor": i, "host": a.host, "silent_s": round(now - a.last_seen, 1),
                 "said_sent": a.sent(), "received": a.received_total}
                for i, a in sorted(self.actors.items()) if not a.bye and a.last_seen]

    def incarnations(self) -> dict:
        """Per actor and incarnation (pid): [groups it said it sent, groups received
        from it], and ``closed``: the pid whose Bye gave its final count ("" before; a
        string, so that metrics plots skip it)."""
        return {str(i): {"closed": str(a.pid) if a.bye else "",
                         "by_pid": {str(p): [a.sent_by_pid.get(p, 0), a.received_by_pid.get(p, 0)]
                                    for p in sorted(set(a.sent_by_pid) | set(a.received_by_pid))}}
                for i, a in self.actors.items()}

    def metrics(self, now: float) -> tuple[dict, dict]:
        """(groups dropped by reason over all actors, per-actor ``actor<i>/<key>``
        values: the actor's last reported stats plus trained, received, incarnations
        and seconds since it was last heard from, -1 if never)."""
        dropped: Counter = Counter()
        for a in self.actors.values():
            dropped.update(a.dropped)
        per_actor = {f"actor{i}/{k}": v for i, a in self.actors.items()
                     for k, v in a.stats.items()}
        for i, a in self.actors.items():
            per_actor |= {f"actor{i}/trained": a.trained, f"actor{i}/received": a.received_total,
                          f"actor{i}/incarnations": len(a.sent_by_pid),
                          f"actor{i}/silent_s": now - a.last_seen if a.last_seen else -1.0}
        return dict(dropped), per_actor


def _parse(ledger: dict, what: str) -> dict[int, ActorLedger]:
    """{actor id: ActorLedger} from saved state; bad input names the entry."""
    if not isinstance(ledger, dict):
        raise ValueError(f"{what}: expected an object of actors, got {type(ledger).__name__}")
    out = {}
    for key, entry in ledger.items():
        try:
            out[int(key)] = ActorLedger.from_state(entry)
        except (TypeError, ValueError, AttributeError) as exc:
            raise ValueError(f"{what}: actor entry {key!r} is malformed: {exc}") from exc
    return out
