"""The learner's record of prompts per actor (learner/ledger.py ``PromptRecord``): every
group's stream position is taken once; a second group for a taken position (a restarted
actor drawing again the prompts it delivered after its earliest undelivered one) is
dropped as "duplicate" and never trained; positions below the actor's stream position
that were never taken are counted as skipped; a learner that resumes from a checkpoint
forgets the prompts taken after it (their training was undone); a group claiming positions
no draw spans is refused ("bad_origin"), none of them taken."""

from __future__ import annotations

import logging

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from arpo_async.core import protocol as P
from arpo_async.core.config import config_from_dict
from actors.actor import redo_positions
from learner.ledger import BAD_ORIGIN, DUPLICATE, MAX_SPAN, Ledger, PromptRecord
from learner.service import LearnerService


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 60), max_size=200))
def test_each_position_is_taken_once_whatever_the_order(positions):
    rec = PromptRecord()
    fresh = [rec.take(p) for p in positions]
    assert sum(fresh) == len(set(positions)) == rec.taken()
    assert rec.duplicates == len(positions) - len(set(positions))
    for upto in (0, 10, 61, 100):
        assert rec.skipped(upto) == len(set(range(upto)) - set(positions))
    assert rec.below == next(i for i in range(62) if i not in set(positions))
    again = PromptRecord.from_state(rec.to_state())
    assert again == rec


def test_a_restarted_actors_repeated_prompts_are_duplicates_not_skips():
    """Actor 0 delivers 0..9 out of order (5 still in flight when it dies), restarts at
    its earliest undelivered position (5) and delivers 5..14: 6..9 come twice."""
    ledger = Ledger()
    first = [0, 1, 2, 3, 4, 6, 7, 8, 9]
    second = list(range(5, 15))
    took = [ledger.claim_prompt(0, float(p)) for p in first + second]
    assert took == [""] * 9 + ["", DUPLICATE, DUPLICATE, DUPLICATE, DUPLICATE] + [""] * 5
    ledger.actor(0).stats["data_pos"] = 15.0
    assert ledger.summary()[0]["prompts"] == {"taken": 15, "duplicates": 4, "skipped": 0}
    # a group without a position (an older actor, an evaluation) is not tracked
    assert ledger.claim_prompt(0, None) == ledger.claim_prompt(0, float("nan")) == ""


def test_a_group_past_prompts_too_long_takes_their_positions_too():
    """An actor that passed over prompts too long for the model (counted there) sends the
    group with its span [data_pos, data_end): those positions are not skipped."""
    ledger = Ledger()
    assert ledger.claim_prompt(0, 0.0, 1.0) == ledger.claim_prompt(0, 1.0, 4.0) == ""
    assert ledger.claim_prompt(0, 2.0, 3.0) == DUPLICATE  # inside a span taken
    assert ledger.claim_prompt(0, 4.0, 5.0) == ""
    ledger.actor(0).stats["data_pos"] = 5.0
    assert ledger.summary()[0]["prompts"] == {"taken": 5, "duplicates": 1, "skipped": 0}


def test_resuming_from_a_checkpoint_forgets_the_prompts_taken_after_it():
    ledger = Ledger()
    for p in range(6):
        ledger.receive(0, 100.0)
        ledger.claim_prompt(0, float(p))
    ledger.mark_trained([0] * 6)
    ckpt = ledger.state()  # positions 0..5 trained
    for p in range(6, 10):
        ledger.receive(0, 100.0)
        ledger.claim_prompt(0, float(p))
    ledger.mark_trained([0] * 4)
    ledger.actor(0).stats["data_pos"] = 10.0
    resumed = Ledger.from_state(ckpt, newer=ledger.state())
    summary = resumed.summary()[0]
    assert summary["dropped"] == {"rolled_back": 4}
    # 6..9 were trained and rolled back: not taken now, so counted skipped unless a group
    # brings them again, which is then trained, not dropped as a duplicate
    assert summary["prompts"] == {"taken": 6, "duplicates": 0, "skipped": 4}
    assert (resumed.claim_prompt(0, 7.0), resumed.claim_prompt(0, 3.0)) == ("", DUPLICATE)


def test_a_claim_no_draw_spans_is_refused_and_takes_nothing(caplog):
    """A draw takes its own prompt's position and passes over at most the prompts too long
    for the model, so [data_pos, data_end) with data_end not past data_pos, not a whole
    number, or more than MAX_SPAN past it cannot be true: the hold fault's deadline
    (time.monotonic() + hold_s) once went out as data_end, and the learner took every
    position up to it, so the actor's next prompts were dropped as duplicates. Such a
    group is refused ("bad_origin"), nothing taken, the actor's first logged."""
    ledger = Ledger()
    deadline = 1234.567  # a clock's reading: past data_pos, inside MAX_SPAN
    caplog.set_level(logging.WARNING, "learner.ledger")
    for end in (deadline, 3.0, 2.0, 3.0 + MAX_SPAN + 1, -1.0, float("nan"), float("inf")):
        assert ledger.claim_prompt(0, 3.0, end) == BAD_ORIGIN, end
    assert ledger.claim_prompt(1, 0.0, 0.0) == BAD_ORIGIN  # another actor: its own first
    logged = [r.getMessage() for r in caplog.records if r.name == "learner.ledger"]
    assert len(logged) == 2 and "actor 0" in logged[0] and "1234.567" in logged[0], logged
    assert ledger.actor(0).prompts.taken() == 0  # nothing taken: each is skipped, not hidden
    # the prompt itself, claimed again by a true group, is taken; the widest span still is
    assert ledger.claim_prompt(0, 3.0, 4.0) == ""
    assert ledger.claim_prompt(0, 4.0, 4.0 + MAX_SPAN) == ""
    assert ledger.actor(0).prompts.taken() == 1 + MAX_SPAN


def _group(gid: str, pos: int, pid: int = 100) -> P.TrajectoryGroup:
    n = 6
    leaf = P.Trajectory(tokens=np.arange(10, 10 + n, dtype=np.int32),
                        loss_mask=np.ones(n, np.uint8), logprobs=np.full(n, -0.5, np.float32),
                        versions=np.zeros(n, np.int32))
    return P.TrajectoryGroup(gid, 0, f"p{pos}", np.arange(1, 5, dtype=np.int32), [leaf],
                             pid=pid, ticket_version=0, data_pos=pos)


@pytest.fixture
def service(tmp_path):
    cfg = config_from_dict({"run": {"dir": str(tmp_path)}, "actors": {"num": 1},
                            "learner": {"batch_groups": 2, "max_staleness": 1}})
    svc = LearnerService(cfg, vocab_size=4096)
    assert svc._handle(P.Hello(0, pid=100), b"").ok
    yield svc
    svc.control.stop()
    svc.receiver.close()


def test_the_learner_trains_a_prompt_once_and_releases_the_duplicates_ticket(service):
    granted = service._handle(P.TicketRequest(0, 0, 4), b"").granted
    assert granted == 4
    started = service.admission.started
    pos = {"a": 0, "b": 1, "a2": 0, "c": 2}  # a2: prompt 0 again
    for gid in ("a", "b", "a2", "c"):
        service._accept(_group(gid, pos[gid]))
    held = [h.group.group_id for h in service.held]
    assert len(held) == 3 and {pos[g] for g in held} == {0, 1, 2}, held
    led = service.ledger.summary()[0]
    assert led["received"] == 4 and led["dropped"] == {"duplicate": 1}
    assert led["prompts"]["duplicates"] == 1 and led["prompts"]["taken"] == 3
    assert service.tokens.figures()["dropped"] == {"duplicate": 6}
    # its ticket was released: the actor may have one more group in its place
    assert service.admission.started == started - 1


def test_the_learner_drops_a_group_whose_origin_cannot_be_true(service):
    """The group of the hold fault's name clash (its deadline sent as data_end: a float,
    which the wire now refuses, tests/unit/test_protocol.py; here a whole number past any
    draw's span) is dropped "bad_origin" with its ticket released, and takes no position:
    the actor's next prompt is trained, not dropped as a duplicate."""
    assert service._handle(P.TicketRequest(0, 0, 2), b"").granted == 2
    started = service.admission.started
    held = _group("held", 0)
    held.data_end = 1_000_000
    service._accept(held)
    service._accept(_group("next", 1))
    assert [h.group.group_id for h in service.held] == ["next"]
    led = service.ledger.summary()[0]
    assert led["dropped"] == {BAD_ORIGIN: 1} and led["prompts"]["taken"] == 1
    assert service.tokens.figures()["dropped"] == {BAD_ORIGIN: 6}
    assert service.admission.started == started - 1


def test_an_actor_draws_again_what_the_learner_lacks_and_nothing_else():
    # the learner has 0..4 and 7; the actor is at 10 with 8 in flight and 9 queued
    assert redo_positions(5, [7], 10, {8, 9}) == [5, 6]
    assert redo_positions(10, [], 10, set()) == []
    assert redo_positions(-1, [], 10, set()) == []  # a learner that does not know


def test_a_hello_is_answered_with_the_prompts_the_restored_learner_has(service):
    """The learner resumed from a checkpoint taken after prompts 0..2 of actor 0; it had
    taken 3..5 since (rolled back with the restore): the actor's Hello learns 0..2."""
    ckpt = Ledger()
    for p in range(3):
        ckpt.claim_prompt(0, float(p))
    newer = Ledger.from_state(ckpt.state())
    for p in range(3, 6):
        newer.claim_prompt(0, float(p))
    service.restore(1, ckpt.state(), newer.state())
    ack = service._handle(P.Hello(0, pid=200), b"")
    assert ack.ok and (ack.prompts_below, ack.prompts_above) == (3, [])
    assert redo_positions(ack.prompts_below, ack.prompts_above, 6, set()) == [3, 4, 5]
    # a checkpoint that predates the record: the learner does not know, the actor redoes
    # nothing
    service.restore(1, {"0": {"pid": 100, "trained": 3}})
    ack = service._handle(P.Hello(0, pid=201), b"")
    assert (ack.prompts_below, ack.prompts_above) == (-1, [])
