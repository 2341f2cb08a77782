"""The fault points: environment variables that make one process misbehave on purpose, at
an exact moment, so that an integration test can hold it there (pure; stdlib only).

Every fault point is one row of ``FAULT_POINTS``: its variable, what it does, the format
of its value and the role that reads it. Unset in every real run. A new fault point is a
row here (tests/unit/test_faults.py fails on an ``ARPO_FAULT_`` name the table lacks) and
a constant its role imports.

Values are read once, when the role builds the object that acts on them, by one parser per
format. A malformed value raises ``ValueError`` there (from ``int`` or ``float``): a test
that set it wrong fails at once instead of running without its fault.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

FAULT_STOP_AFTER_GRANT = "ARPO_FAULT_STOP_AFTER_GRANT"
FAULT_HOLD_FIRST_GROUP = "ARPO_FAULT_HOLD_FIRST_GROUP"
FAULT_CORRUPT_DELTA = "ARPO_FAULT_CORRUPT_DELTA"
FAULT_KILL_AFTER_DELTA = "ARPO_FAULT_KILL_AFTER_DELTA"
FAULT_HOLD_CHECKPOINT = "ARPO_FAULT_HOLD_CHECKPOINT"


@dataclass(frozen=True)
class FaultPoint:
    name: str  # the environment variable
    does: str  # what the process does when the value names it
    value: str  # the value's format
    role: str  # where it is read


FAULT_POINTS: dict[str, FaultPoint] = {p.name: p for p in (
    FaultPoint(FAULT_STOP_AFTER_GRANT,
               "that actor stops its own process group (SIGSTOP) once, right after it was "
               "granted a ticket with weights VERSION or newer loaded, so that a test holds "
               "it stopped with a ticket for exactly as long as it wants (a stop sent from "
               "outside races the group's end)",
               "ACTOR:VERSION", "actor (actors/actor.py)"),
    FaultPoint(FAULT_HOLD_FIRST_GROUP,
               "that actor holds its first group, once generated, SECONDS before sending it "
               "(as a slow last tool call would; heartbeats go on, so its ticket stays "
               "held), or until the learner published VERSION: a straggler for certain",
               "ACTOR:SECONDS[:VERSION]", "actor (actors/actor.py)"),
    FaultPoint(FAULT_CORRUPT_DELTA,
               "that actor's receiver changes one value of the first step delta it is given "
               "to VERSION or later, after it arrived (a corrupted delta: the checksum must "
               "catch it and a full copy follow)",
               "ACTOR:VERSION", "actor's delta weight receiver (arpo_async/core/weights/delta.py)"),
    FaultPoint(FAULT_KILL_AFTER_DELTA,
               "that actor kills its own process (SIGKILL) right after it first loaded "
               "VERSION or later through a step delta, once per run (a file in the run "
               "folder says it happened, with the version and the pid): it restarts with no "
               "copy of its own, between a delta and the next full copy",
               "ACTOR:VERSION", "actor's delta weight receiver (arpo_async/core/weights/delta.py)"),
    FaultPoint(FAULT_HOLD_CHECKPOINT,
               "rank 0 stops inside the checkpoint write of step STEP, its weights and "
               "optimizer state written into the partial folder and nothing committed, and "
               "waits there to be killed: a crash mid-write, exactly where the test wants it",
               "STEP", "learner rank 0 (learner/loop.py)"),
)}


def fault_value(name: str) -> str | None:
    """The value of fault point ``name`` as set (None when unset)."""
    return os.environ.get(name)


def actor_fault(name: str, actor_id: int) -> str | None:
    """For an ``ACTOR:REST`` fault point: REST when ACTOR is ``actor_id`` ("" when the value
    has no colon), else None (unset, empty, or another actor). ACTOR that is not an
    integer raises ValueError in every actor."""
    spec = fault_value(name) or ""
    who, _, rest = spec.partition(":")
    return rest if spec and int(who) == actor_id else None


def actor_fault_int(name: str, actor_id: int) -> int | None:
    """``ACTOR:VERSION``: VERSION for ``actor_id``, else None; raises ValueError when it is
    not an integer."""
    rest = actor_fault(name, actor_id)
    return None if rest is None else int(rest)


def actor_fault_floats(name: str, actor_id: int) -> list[float] | None:
    """``ACTOR:X[:Y...]``: [X, Y, ...] for ``actor_id``, else None; raises ValueError when
    one is not a number."""
    rest = actor_fault(name, actor_id)
    return None if rest is None else [float(x) for x in rest.split(":")]
