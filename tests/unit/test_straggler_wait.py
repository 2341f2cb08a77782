"""A straggler is trained, not dropped (learner/service.py ``collect``): before a step that
would make a group still generating too old, the learner waits for it and trains the
oldest groups first. The arrivals are scripted (the service's receive is replaced), so
the straggler is forced: actor 0 holds two tickets granted on weights 0 while actor 1
delivers four groups and the learner would move to version 2."""

from __future__ import annotations

import sys

import numpy as np
import pytest

from arpo_async.core import protocol as P
from arpo_async.core.config import config_from_dict
from learner.service import LearnerService
from learner.tokens import ks_distance, prefill_figures


def _group(actor: int, version: int, n_tokens: int, pid: int) -> P.TrajectoryGroup:
    leaf = P.Trajectory(tokens=np.arange(10, 10 + n_tokens, dtype=np.int32),
                        loss_mask=np.ones(n_tokens, np.uint8),
                        logprobs=np.full(n_tokens, -0.5, np.float32),
                        versions=np.full(n_tokens, version, np.int32))
    return P.TrajectoryGroup(f"g{actor}-{version}-{n_tokens}", actor, "p",
                             np.arange(1, 5, dtype=np.int32), [leaf],
                             pid=pid, ticket_version=version)


@pytest.fixture
def make_service(tmp_path):
    made = []

    def make(straggler_wait_s: float) -> LearnerService:
        cfg = config_from_dict({"run": {"dir": str(tmp_path / str(len(made)))},
                                "actors": {"num": 2},
                                "learner": {"batch_groups": 2, "max_staleness": 1,
                                            "straggler_wait_s": straggler_wait_s}})
        svc = LearnerService(cfg, vocab_size=4096)
        made.append(svc)
        for actor in (0, 1):
            assert svc._handle(P.Hello(actor, pid=100 + actor), b"").ok
        return svc

    yield make
    for svc in made:
        svc.control.stop()
        svc.receiver.close()


def _script(svc: LearnerService, arrivals: list) -> None:
    """Replace the socket: each receive takes the next item (None: a poll that timed out)."""
    queue = list(arrivals)
    svc._recv = lambda timeout_s: queue.pop(0) if queue else None


def _tickets(svc: LearnerService, actor: int, version: int, n: int) -> int:
    return svc._handle(P.TicketRequest(actor, version, n), b"").granted


def _run(svc: LearnerService) -> list[list[str]]:
    """Three steps; the straggler's two long groups arrive last, after four polls."""
    assert _tickets(svc, 0, 0, 2) == 2 and _tickets(svc, 1, 0, 2) == 2
    straggler = [_group(0, 0, 40, 100), _group(0, 0, 50, 100)]
    _script(svc, [_group(1, 0, 5, 101), _group(1, 0, 6, 101)])
    steps = [svc.collect(2, timeout_s=5)]
    svc.mark_trained(steps[-1])  # version 1
    assert _tickets(svc, 1, 1, 2) == 2
    _script(svc, [_group(1, 1, 7, 101), _group(1, 1, 8, 101), None, None, None, None,
                  *straggler])
    steps.append(svc.collect(2, timeout_s=5))
    svc.mark_trained(steps[-1])  # version 2
    if svc.cfg.learner.straggler_wait_s == 0:
        for group in straggler:  # they arrive now, too old
            svc._accept(group)
    _script(svc, [])
    steps.append(svc.collect(2, timeout_s=5, should_stop=lambda: True))
    svc.mark_trained(steps[-1])
    return [[g.group_id for g in groups] for groups in steps]


def test_the_straggler_is_waited_for_and_trained_first(make_service):
    svc = make_service(straggler_wait_s=60)
    steps = _run(svc)
    assert steps == [["g1-0-5", "g1-0-6"], ["g0-0-40", "g0-0-50"], ["g1-1-7", "g1-1-8"]]
    snap = svc.snapshot()
    assert snap["dropped"] == {} and snap["staleness"]["lag_max"] == 1
    assert snap["staleness"]["lag_hist"] == {0: 2, 1: 4}  # at the version each trained on
    tokens = snap["tokens"]
    assert tokens["received"] == tokens["trained"] == 5 + 6 + 40 + 50 + 7 + 8
    assert tokens["yield"] == 1.0 and tokens["ks_run"] == 0.0
    assert snap["straggler_wait_s"] > 0
    assert svc.ledger.at_risk(10) == 0 and snap["admission"]["started"] == 6


def test_without_the_wait_the_long_groups_are_dropped_and_the_bias_shows(make_service):
    svc = make_service(straggler_wait_s=0)  # the old behaviour
    steps = _run(svc)
    assert steps == [["g1-0-5", "g1-0-6"], ["g1-1-7", "g1-1-8"], []]
    snap = svc.snapshot()
    assert snap["dropped"] == {"stale": 2}
    tokens = snap["tokens"]
    assert tokens["trained"] == 5 + 6 + 7 + 8 and tokens["dropped"] == {"stale": 90}
    assert tokens["yield"] == pytest.approx(26 / 116)
    assert tokens["ks_run"] == pytest.approx(ks_distance([5, 6, 7, 8, 40, 50], [5, 6, 7, 8]))
    assert tokens["ks_run"] == pytest.approx(1 / 3)


def test_a_straggler_that_never_comes_costs_at_most_the_wait(make_service):
    svc = make_service(straggler_wait_s=0.3)
    assert _tickets(svc, 0, 0, 2) == 2 and _tickets(svc, 1, 0, 2) == 2
    _script(svc, [_group(1, 0, 5, 101), _group(1, 0, 6, 101)])
    svc.mark_trained(svc.collect(2, timeout_s=5))
    assert _tickets(svc, 1, 1, 2) == 2
    _script(svc, [_group(1, 1, 7, 101), _group(1, 1, 8, 101)])
    assert [g.group_id for g in svc.collect(2, timeout_s=5)] == ["g1-1-7", "g1-1-8"]
    assert svc.events["straggler_wait_expired"] == 1
    assert 0.3 <= svc.straggler_wait_s < 5


def test_groups_held_past_the_end_are_dropped_as_shutdown(make_service):
    svc = make_service(straggler_wait_s=60)
    assert _tickets(svc, 1, 0, 2) == 2
    for group in (_group(1, 0, 5, 101), _group(1, 0, 6, 101)):
        svc._accept(group)  # both arrived
    _script(svc, [])
    assert len(svc.collect(1, timeout_s=5)) == 1
    for led in svc.ledger.actors.values():
        led.last_seen = 0.0  # long silent: the shutdown waits for no Bye
    svc.shutdown(wait_s=0)
    snap = svc.snapshot()
    assert snap["tokens"]["dropped"] == {"shutdown": 6}
    assert svc.ledger.summary()[1]["dropped"] == {"shutdown": 1}


@pytest.mark.parametrize("a, b, expected", [
    ([1, 2, 3], [1, 2, 3], 0.0), ([1, 2], [3, 4], 1.0), ([1, 2, 3, 4], [3, 4], 0.5),
    ([], [1], 0.0)])
def test_ks_distance_by_hand(a, b, expected):
    assert ks_distance(a, b) == pytest.approx(expected)


def test_a_group_gives_back_the_ticket_it_names_else_the_oldest():
    from learner.ledger import Ledger

    led = Ledger()
    led.hello(0, pid=7, version=0)
    led.actor(0).grant(2, 0)
    led.actor(0).grant(1, 3)
    assert led.at_risk(0) == 2 and led.at_risk(3) == 3
    assert led.receive(0, 7.0, 3.0)  # its ticket was granted on weights 3
    assert led.at_risk(0) == 2 and led.at_risk(3) == 2
    assert led.receive(0, 7.0, float("nan"))  # unknown (a peer's garbage): the oldest
    assert dict(led.actor(0).ticket_versions) == {0: 1}
    assert led.hello(0, pid=8, version=3) == ("restart", 1)  # void: none at risk
    assert led.at_risk(10) == 0


def test_a_duplicate_grant_nobody_used_does_not_swallow_later_tickets():
    """A learner frozen past the request timeout: a retried ticket request was granted
    twice, then the actor's Hello voided both. One group of the voided tickets arrives (an
    orphan); the duplicate never will. A ticket granted after the Hello must be taken back
    by its group, else the straggler wait counts it at risk for good (the frozen-learner
    test waited learner.straggler_wait_s = 300 s at every step after the freeze)."""
    from learner.ledger import Ledger

    led = Ledger()
    led.hello(0, pid=7, version=0)
    led.actor(0).grant(2, 0)  # the request and its retry, both granted on epoch 0
    epoch = led.actor(0).epoch
    assert led.hello(0, pid=7, version=0) == ("reconnect", 2)  # voids both
    assert led.actor(0).epoch == epoch + 1
    assert not led.receive(0, 7.0, 0.0, float(epoch))  # the one used: an orphan
    led.actor(0).grant(1, 1)  # granted after the Hello
    assert led.at_risk(1) == 1
    assert led.receive(0, 7.0, 1.0, float(epoch + 1))  # its group gives it back
    assert led.at_risk(sys.maxsize) == 0
    # an actor that does not report epochs (-1) keeps the counted orphans
    led.actor(0).grant(1, 2)
    led.hello(0, pid=7, version=2)
    assert not led.receive(0, 7.0, 2.0)  # the one orphan counted


def test_no_ticket_past_the_last_steps_groups(tmp_path):
    cfg = config_from_dict({"run": {"dir": str(tmp_path)}, "actors": {"num": 1},
                            "learner": {"batch_groups": 2, "max_steps": 1}})
    svc = LearnerService(cfg, vocab_size=4096)
    try:
        assert svc._handle(P.Hello(0, pid=5), b"").ok
        grant = svc._handle(P.TicketRequest(0, 0, 3), b"")
        assert grant.granted == 2
        grant = svc._handle(P.TicketRequest(0, 0, 1), b"")
        assert (grant.granted, grant.reason) == (0, P.GrantReason.RUN_FULL)
        svc.admission.release(1, "stale")  # a dropped group's place opens again
        assert svc._handle(P.TicketRequest(0, 0, 1), b"").granted == 1
    finally:
        svc.control.stop()
        svc.receiver.close()


def test_at_the_time_limit_the_groups_out_are_trained_not_dropped(make_service):
    """The time limit closes admission (tickets are answered stop) and the groups still
    out arrive and are trained; then collect returns none and the run ends."""
    svc = make_service(straggler_wait_s=60)
    assert _tickets(svc, 0, 0, 2) == 2 and _tickets(svc, 1, 0, 2) == 2
    _script(svc, [_group(1, 0, 5, 101), _group(1, 0, 6, 101)])
    svc.mark_trained(svc.collect(2, timeout_s=5))
    time_up = lambda: True  # noqa: E731
    _script(svc, [None, None, _group(0, 0, 40, 100), None, _group(0, 0, 50, 100)])
    last = svc.collect(2, timeout_s=5, should_stop=time_up)
    assert [g.group_id for g in last] == ["g0-0-40", "g0-0-50"] and svc.closing
    grant = svc._handle(P.TicketRequest(1, 1, 1), b"")
    assert grant.stop and grant.granted == 0
    svc.mark_trained(last)
    assert svc.collect(2, timeout_s=5, should_stop=time_up) == []
    tokens = svc.snapshot()["tokens"]
    assert tokens["trained"] == tokens["received"] == 101 and tokens["dropped"] == {}


def test_groups_that_never_come_at_the_end_cost_at_most_the_wait(make_service):
    svc = make_service(straggler_wait_s=0.3)
    assert _tickets(svc, 0, 0, 2) == 2 and _tickets(svc, 1, 0, 1) == 1
    _script(svc, [_group(1, 0, 5, 101)])
    got = svc.collect(2, timeout_s=5, should_stop=lambda: True)
    assert [g.group_id for g in got] == ["g1-0-5"]
    assert svc.events["closing_wait_expired"] == 1


def test_prefill_figures_sum_the_engines_counters():
    """The prefill side of the token ledger, by hand: two actors' engine counters."""
    a = {"engine/prompt_tokens": 1000.0, "engine/cached_tokens": 200.0,
         "engine/recomputed_tokens": 100.0, "engine/sampled_tokens": 100.0}
    b = {"engine/prompt_tokens": 500.0, "engine/cached_tokens": 0.0,
         "engine/recomputed_tokens": 0.0, "engine/sampled_tokens": 100.0, "other": 1.0}
    got = prefill_figures([a, b, {}])
    assert got["prompt_tokens"] == 1500 and got["sampled_tokens"] == 200
    assert got["prefill_per_sampled"] == (1500 - 200) / 200
    assert got["recomputed_per_sampled"] == 100 / 200
    assert prefill_figures([{"tokens_per_s": 3.0}]) == {}  # no engine counters (simulated)


def test_the_panel_shows_the_prefill_per_token():
    from arpo_async.core.config import SPINE_CONFIG, load_config
    from arpo_async.launcher.progress import Progress

    row = {"step": 3, "policy_version": 3, "reward_mean": 0.1, "wall_time": 30.0,
           "staleness_max": 1, "dropped_stale": 0, "actors_alive": 2, "wait_s": 0.1,
           "service": {"tokens": {"received": 10, "trained": 10, "yield": 1.0,
                                  "prefill": {"prefill_per_sampled": 6.54,
                                              "recomputed_per_sampled": 0.25}}}}
    fields = Progress(load_config(SPINE_CONFIG), quiet=True)._fields(row)
    assert fields["prefill per token"] == "6.5 (0.25 again)"
    assert fields["token yield"] == "1.000 (KS 0.00)"
