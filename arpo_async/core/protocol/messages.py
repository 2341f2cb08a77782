"""The message schemas: every message that crosses a process boundary, a typed dataclass
with a ``KIND``, and the reasons and exit codes peers act on (pure: numpy only).

Fields are only ever added, with defaults, so an older peer still decodes a newer
message. Defaults are evaluated per message (``default_factory``), never at import."""


from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import Enum, IntEnum
from typing import ClassVar

import numpy as np



class ProtocolError(ValueError):
    """A message that cannot be accepted; ``reason`` is a short counter key."""

    def __init__(self, reason: str, detail: str = ""):
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason


# ----------------------------------------------------------------------------- words


class GrantReason(str, Enum):
    """Why a ``TicketGrant`` holds fewer tickets than asked for (NONE: all granted).
    On the wire it is its string value, so older peers read it unchanged."""

    NONE = ""
    CAPACITY = "capacity"  # the staleness bound (staleness.py): tickets free up as it trains
    STALE_WEIGHTS = "stale_weights"  # the actor's weights are too old: fetch new ones first
    STALE_AHEAD = "stale_ahead"  # the actor is ahead of a restarted learner: fetch its weights
    HELLO_REQUIRED = "hello_required"  # the learner has not met this actor process: say Hello
    WAITING_FOR_ACTORS = "waiting_for_actors"  # the start gate waits for the other actors
    FAIR_SHARE = "fair_share"  # this actor holds its share of the staleness window
    STOPPING = "stopping"  # the run is over (``stop`` is set too)
    # every group the run will train (learner.max_steps * batch_groups) has started; the
    # rest of the run needs none: ask again later, or wait for the stop
    RUN_FULL = "run_full"

    @classmethod
    def of(cls, value: str) -> GrantReason | None:
        """The reason a peer sent, or None for one this version does not know."""
        return cls._value2member_map_.get(value)

    @property
    def needs_weights(self) -> bool:
        """The actor must fetch the published weights before it asks again."""
        return self in (GrantReason.STALE_WEIGHTS, GrantReason.STALE_AHEAD)

    @property
    def busy(self) -> bool:
        """Tickets free up by themselves as the learner trains: ask again soon."""
        return self is GrantReason.CAPACITY


class AckReason(str, Enum):
    """The ``Ack.reason`` values a peer acts on; any other reason is a detail to log."""

    HELLO_REQUIRED = "hello_required"  # the learner has not met this actor process
    BAD_REQUEST = "bad_request"  # a negative actor id or count: refused, counted
    NO_FAST_WEIGHTS = "no_fast_weights"  # NCCL weights asked of a zmq-only run


class ExitCode(IntEnum):
    """How a role process (learner, actor) ends, for the supervisor."""

    OK = 0  # finished: the learner ended the run, or reached its steps or time
    FAILED = 1  # an error: the supervisor restarts the role (with backoff)
    CONFIG = 2  # bad config or arguments: a restart would fail the same way
    # EX_UNAVAILABLE: an actor heard nothing from the learner for transport.connect_timeout_s
    # (its host vanished, or the run ended unseen); a restart would only wait as long again
    LEARNER_GONE = 69
    RESTART = 75  # EX_TEMPFAIL: the process cannot go on (a stuck NCCL group); restart it
    INTERRUPTED = 130  # Ctrl-C / SIGTERM


# ----------------------------------------------------------------------------- messages


@dataclass
class Trajectory:
    """One leaf of a group's tree. Arrays cover the response only (everything after
    the prompt): model tokens (mask 1) and tool-result tokens (mask 0)."""

    tokens: np.ndarray  # int32 token ids
    loss_mask: np.ndarray  # uint8, 1 = model token, 0 = tool-result token
    logprobs: np.ndarray  # float32 behaviour log-prob (0 where mask is 0)
    versions: np.ndarray  # int32 policy version that sampled the token (-1 where mask is 0)
    reward: float = 0.0
    score: float = 0.0  # correctness in [0, 1] (accuracy), separate from shaped reward
    parent: int = -1  # index of the leaf this one forked from, -1 for a global sample
    branch_point: int = 0  # response tokens shared with the parent
    tool_calls: int = 0  # tool calls in this leaf (shared prefix included)
    finish_reason: str = ""

    def __len__(self) -> int:
        return int(self.tokens.shape[0])


@dataclass
class TrajectoryGroup:
    """All leaves sampled for one prompt, sent as one message."""

    KIND: ClassVar[str] = "group"
    group_id: str
    actor_id: int
    prompt_id: str
    prompt_tokens: np.ndarray  # int32
    leaves: list[Trajectory]
    mode: str = "grpo"
    tool_calls_executed: int = 0  # calls actually run (shared prefixes not re-run)
    created_at: float = field(default_factory=time.time)
    sent_at: float = 0.0
    stats: dict[str, float] = field(default_factory=dict)
    # One row per branch decision: [trajectory id (= its leaf's index), response index
    # where the decided round starts, dH, P (nan: no decision made), forks created]; for
    # the trees page (learner/trees.py), not for training.
    decisions: list[list[float]] = field(default_factory=list)
    kind: str = ""  # the prompt's task kind (its data row's "kind"), for per-kind figures
    # Where it came from, typed and checked at the wire (wire.py ``_check_origin``; the
    # learner's ledger, learner/ledger.py, reads nothing else): the actor's process, the
    # stream positions its draw consumed, [data_pos, data_end), and the ticket it used
    # (the weights' version and the actor's ticket epoch when granted). -1: not said, the
    # group is then not tracked. ``stats`` carries figures only.
    pid: int = -1
    data_pos: int = -1
    data_end: int = -1
    ticket_version: int = -1
    ticket_epoch: int = -1

    def min_version(self) -> int:
        versions = [leaf.versions[leaf.loss_mask > 0] for leaf in self.leaves]
        versions = [v for v in versions if v.size]
        return int(min(v.min() for v in versions)) if versions else -1

    def num_tokens(self) -> int:
        return sum(len(leaf) for leaf in self.leaves)


@dataclass
class Hello:
    KIND: ClassVar[str] = "hello"
    actor_id: int
    pid: int
    host: str = ""
    version: int = -1
    sent_at: float = field(default_factory=time.time)


@dataclass
class Heartbeat:
    KIND: ClassVar[str] = "heartbeat"
    actor_id: int
    version: int
    stats: dict[str, float] = field(default_factory=dict)
    sent_at: float = field(default_factory=time.time)


@dataclass
class TicketRequest:
    """An actor asks to start ``n`` groups (admission control, staleness.py)."""

    KIND: ClassVar[str] = "ticket_request"
    actor_id: int
    version: int
    n: int = 1


@dataclass
class TicketGrant:
    KIND: ClassVar[str] = "ticket_grant"
    granted: int
    learner_version: int  # version of the newest published weights
    stop: bool = False  # the run is over: finish up and say Bye
    reason: str = ""
    # how many times the learner has voided this actor's tickets (a Hello after a timeout,
    # a silence): a group reports the epoch of its ticket (``ticket_epoch``), so that
    # a group of a voided ticket is told apart from one of a ticket granted since
    epoch: int = 0


@dataclass
class Bye:
    """An actor's last word: how many groups it sent in total (for exact accounting)."""

    KIND: ClassVar[str] = "bye"
    actor_id: int
    groups_sent: int
    stats: dict[str, float] = field(default_factory=dict)


@dataclass
class Ack:
    KIND: ClassVar[str] = "ack"
    ok: bool = True
    reason: str = ""
    learner_version: int = -1
    # the reply to a Hello: the stream positions of this actor's prompts the learner has
    # (learner/ledger.py PromptRecord: every one below ``prompts_below`` and those in
    # ``prompts_above``); the actor draws again those it delivered that are missing.
    # -1: not known (the learner resumed a checkpoint that predates the record)
    prompts_below: int = -1
    prompts_above: list[int] = field(default_factory=list)


@dataclass
class ConfigRequest:
    """An actor started on another machine (``launch actor --connect``) asks for the run's
    resolved config; ``actor_id`` -1 asks the learner to assign one."""

    KIND: ClassVar[str] = "config_request"
    actor_id: int = -1
    host: str = ""
    pid: int = 0


@dataclass
class ConfigReply:
    KIND: ClassVar[str] = "config_reply"
    config_yaml: str  # the learner's RUN_DIR/config.yaml
    actor_id: int  # the id this actor runs as


MESSAGES = {
    cls.KIND: cls
    for cls in (TrajectoryGroup, Hello, Heartbeat, TicketRequest, TicketGrant, Bye, Ack,
                ConfigRequest, ConfigReply)
}


def register_messages(*classes: type) -> None:
    """Add a weight channel's messages (arpo_async/core/weights/) to what ``decode``
    accepts; a kind already taken by another class is a programming error."""
    for cls in classes:
        taken = MESSAGES.setdefault(cls.KIND, cls)
        if taken is not cls:
            raise ValueError(f"message kind {cls.KIND!r}: {cls.__name__} and "
                             f"{taken.__name__} both claim it")
