"""arpo_async.core.staleness: hand cases, and a deterministic simulation of actors and a
learner showing that the admission rule keeps every trained group within eta."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from arpo_async.core.staleness import Admission, StalenessFilter, group_lag


def test_group_lag():
    assert group_lag(5, 3) == 2 and group_lag(4, 4) == 0
    with pytest.raises(ValueError, match="group min -1"):
        group_lag(3, -1)


def test_admission_capacity_hand_case():
    adm = Admission(batch_groups=2, max_staleness=1)  # (1 + v + 1) * 2 may start
    assert adm.grant(3, learner_version=0, actor_version=0) == (3, "")
    assert adm.grant(3, 0, 0) == (1, "capacity")
    assert adm.grant(1, 0, 0) == (0, "capacity")
    adm.release(1, "stale")  # a dropped group reopens its slot
    assert adm.started == 3 and adm.grant(2, 0, 0) == (1, "capacity")
    assert adm.grant(2, 1, 1) == (2, "")  # one step later: 2 more
    c = adm.counters()
    assert c["granted"] == 7 and c["started"] == 6 and c["released_stale"] == 1
    assert c["denied_capacity"] == 2 + 1 + 1 and c["requests"] == 5


def test_admission_stale_weights_hand_case():
    adm = Admission(batch_groups=2, max_staleness=1)
    assert adm.grant(4, 0, 0) == (4, "")
    assert adm.grant(4, 2, 2) == (4, "")  # started = 8
    # Group s = 8 would be trained at version 4; weights 1 or 2 would give lag > 1.
    assert adm.grant(2, 3, 1) == (0, "stale_weights")  # a = 1 < v - eta
    assert adm.grant(2, 3, 2) == (0, "stale_weights")  # within v - eta, still too old
    assert adm.grant(2, 3, 3) == (2, "")
    assert adm.counters()["denied_stale_weights"] == 4
    assert adm.grant(1, 3, 7) == (0, "capacity")  # actor claims newer weights: capped at v
    assert adm.counters()["actor_ahead"] == 1


def test_a_group_trained_after_its_ticket_was_released_holds_capacity_again():
    # an actor holds 4 tickets (the whole window), goes silent: they are released; then
    # its groups arrive fresh and are trained: without adopt() 4 more could start now,
    # and every later step would admit 4 groups beyond what it can train fresh
    adm = Admission(batch_groups=2, max_staleness=1)
    assert adm.grant(4, 0, 0) == (4, "")
    adm.release(4, "actor_silent")
    adm.adopt(4)
    assert adm.started == 4 and adm.grant(1, 0, 0)[0] == 0
    assert adm.counters()["adopted"] == 4.0
    with pytest.raises(ValueError):
        adm.adopt(-1)


def test_admission_rejects_bad_calls():
    with pytest.raises(ValueError, match="batch_groups"):
        Admission(0, 1)
    adm = Admission(2, 0)
    with pytest.raises(ValueError, match="requested=-1"):
        adm.grant(-1, 0, 0)
    adm.grant(1, 0, 0)
    with pytest.raises(ValueError, match="only 1 groups started"):
        adm.release(2, "aborted")
    with pytest.raises(ValueError, match="reason"):
        adm.release(1, "")


def test_filter_hand_case():
    flt = StalenessFilter(max_staleness=1)
    assert flt.check(5, 4) == (True, "ok")
    assert flt.check(5, 5) == (True, "ok")
    assert flt.check(5, 3) == (False, "stale")
    assert flt.check(5, -1) == (False, "no_model_tokens")
    assert flt.check(3, 4) == (False, "future_version")
    s = flt.stats()
    assert s["accepted"] == 2 and s["dropped_stale"] == 1
    assert s["dropped_no_model_tokens"] == 1 and s["dropped_future_version"] == 1
    assert s["lag_mean"] == 0.5 and s["lag_max"] == 1 and s["lag_hist"] == {0: 1, 1: 1, 2: 1}


# ----------------------------------------------------------------------------- simulation

@dataclass
class _Actor:
    version: int = 0
    in_flight: list = field(default_factory=list)  # [finish_tick, min_version]


@dataclass
class _Run:
    trained_lags: list
    released: int
    flt: StalenessFilter
    adm: Admission
    max_untrained: int
    ticks: int


def _simulate(*, actors: int, slots: int, b: int, eta: int, steps: int, duration,
              train_ticks: int = 1, sync_every: int = 1, admission: bool = True) -> _Run:
    """Discrete-time actors and learner. Each tick: finished groups reach the learner's
    queue; the learner fills its batch in arrival order, dropping (and releasing) groups
    the filter rejects, and trains B at a time; actors with free slots ask for tickets
    and fetch the newest published weights when told their weights are stale. A group's
    min version is its actor's weights when it started (later in-place updates only
    make later tokens newer). With ``admission=False`` actors start groups freely and
    fetch weights only when idle."""
    adm, flt = Admission(b, eta), StalenessFilter(eta)
    fleet = [_Actor() for _ in range(actors)]
    queue: deque = deque()
    batch: list = []
    version, train_end, lags, released, max_untrained, tick = 0, None, [], 0, 0, 0
    while version < steps:
        tick += 1
        assert tick < 100_000, "deadlock"
        if train_end is not None and tick >= train_end:
            version, train_end = version + 1, None
            if version == steps:
                break
        published = version - version % sync_every
        for a in fleet:
            done = [g for g in a.in_flight if g[0] <= tick]
            a.in_flight = [g for g in a.in_flight if g[0] > tick]
            queue.extend(done)
        while train_end is None and queue and len(batch) < b:
            group = queue.popleft()
            keep, _ = flt.check(version, group[1])
            if keep:
                batch.append(group)
            else:
                released += 1
                if admission:
                    adm.release(1, "stale")
        if len(batch) == b:
            lags += [version - g[1] for g in batch]
            batch, train_end = [], tick + train_ticks
        for a in fleet:
            free = slots - len(a.in_flight)
            if not admission:
                if not a.in_flight:
                    a.version = published  # fetch only when idle
                n = free
            else:
                n, reason = adm.grant(free, version, a.version)
                if reason == "stale_weights":
                    a.version = published  # fetched; usable from the next tick
            a.in_flight += [[tick + duration(), a.version] for _ in range(n)]
        untrained = sum(len(a.in_flight) for a in fleet) + len(queue) + len(batch)
        max_untrained = max(max_untrained, untrained)
    return _Run(lags, released, flt, adm, max_untrained, tick)


@settings(max_examples=60, deadline=None)
@given(actors=st.integers(1, 3), slots=st.integers(1, 4), b=st.integers(1, 4),
       d=st.integers(1, 6), train_ticks=st.integers(1, 3), sync_every=st.integers(1, 3),
       extra=st.integers(0, 2))
def test_in_order_schedule_never_exceeds_eta(actors, slots, b, d, train_ticks, sync_every,
                                             extra):
    eta = sync_every - 1 + extra  # the bound the rule needs (module docstring)
    run = _simulate(actors=actors, slots=slots, b=b, eta=eta, steps=8, duration=lambda: d,
                    train_ticks=train_ticks, sync_every=sync_every)
    assert len(run.trained_lags) == 8 * b
    assert max(run.trained_lags) <= eta
    assert run.released == 0 and run.flt.stats()["dropped_stale"] == 0


def test_eta_zero_is_lockstep():
    run = _simulate(actors=3, slots=4, b=2, eta=0, steps=10, duration=lambda: 3)
    assert set(run.trained_lags) == {0}
    assert run.max_untrained <= 2  # never more than one batch generated ahead
    assert run.flt.stats()["lag_hist"] == {0: 20}


def test_async_overlap_uses_the_bound():
    lockstep = _simulate(actors=2, slots=4, b=2, eta=0, steps=12, duration=lambda: 3)
    overlap = _simulate(actors=2, slots=4, b=2, eta=2, steps=12, duration=lambda: 3)
    assert max(overlap.trained_lags) == 2 and overlap.released == 0
    assert overlap.ticks < lockstep.ticks  # generation overlapped training


@pytest.mark.parametrize("seed", range(5))
def test_out_of_order_stragglers_are_dropped_and_counted(seed):
    rng = np.random.default_rng(seed)
    run = _simulate(actors=3, slots=3, b=2, eta=1, steps=15,
                    duration=lambda: int(rng.integers(1, 12)))
    assert max(run.trained_lags) <= 1  # the filter's guarantee
    s, c = run.flt.stats(), run.adm.counters()
    # exact accounting: every check is an accepted or a counted drop, every drop released
    assert s["dropped_stale"] == run.released == c["released_stale"]
    assert sum(s["lag_hist"].values()) == s["accepted"] + s["dropped_stale"]
    assert s["accepted"] >= len(run.trained_lags)


def test_without_admission_the_filter_catches_stale_groups():
    run = _simulate(actors=3, slots=4, b=2, eta=1, steps=10, duration=lambda: 2,
                    admission=False)
    s = run.flt.stats()
    assert s["dropped_stale"] > 0 and max(run.trained_lags) <= 1
    assert max(s["lag_hist"]) > 1
