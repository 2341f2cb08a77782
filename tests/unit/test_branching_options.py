"""actors.branching's reference options: a fork's own H_init (``rollout.fork_h_init=own``,
the authors' code) and no decision on short rounds (``rollout.short_round=skip``)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from actors.branching import BranchPlanner, BranchSettings
from arpo_async.core.config import RolloutConfig


def _planner(seed=0, **kw):
    base = {"group_size": 8, "initial_samples": 2, "alpha": 0.5, "beta": 0.2,
            "threshold_mode": True}
    return BranchPlanner(BranchSettings(**(base | kw)), np.random.default_rng(seed))


def test_own_h_init_comes_from_the_forks_first_round():
    pl = _planner(fork_h_init="own")
    pl.start()
    pl.record_initial_entropy(0, 2.0)
    (fork,), _ = pl.after_tool_round(0, 3.0)  # P = 0.7: forks
    assert pl.h_init_of(fork) is None  # not inherited
    with pytest.raises(ValueError, match="before record_initial_entropy"):
        pl.after_tool_round(fork, 1.0)
    pl.record_initial_entropy(fork, 3.5)  # its first round: the resampled post-tool round
    _, m = pl.after_tool_round(fork, 4.0)
    assert m["h_init"] == 3.5 and m["dh"] == pytest.approx(0.5)
    with pytest.raises(ValueError, match="already recorded"):
        pl.record_initial_entropy(fork, 1.0)


def test_parent_h_init_is_inherited():
    pl = _planner()
    pl.start()
    pl.record_initial_entropy(0, 2.0)
    (fork,), _ = pl.after_tool_round(0, 3.0)
    assert pl.h_init_of(fork) == 2.0
    with pytest.raises(ValueError, match="inherits H_init"):
        pl.record_initial_entropy(fork, 3.5)


def test_skip_short_rounds_draws_nothing_and_counts():
    pl = _planner(short_round="skip", threshold_mode=False)
    pl.start()
    pl.record_initial_entropy(0, 2.0)
    pl.record_initial_entropy(1, 0.4, short=True)  # a 4-token first round
    state = pl._rng.bit_generator.state
    forks, m = pl.after_tool_round(0, 9.0, short=True)  # would be P = 1
    assert forks == [] and m["skipped_short"] == 1.0 and math.isnan(m["p"])
    forks, _ = pl.after_tool_round(1, 9.0)  # a full round, but its baseline was short
    assert forks == []
    assert pl._rng.bit_generator.state == state  # no draw was made
    forks, m = pl.after_tool_round(0, 9.0)  # a full round on a full baseline decides
    assert forks and m["p"] == 1.0
    stats = pl.stats()
    assert stats["skipped_short"] == 2 and stats["tool_rounds"] == 1


def test_as_is_decides_on_short_rounds():
    pl = _planner()
    pl.start()
    pl.record_initial_entropy(0, 2.0, short=True)
    _, m = pl.after_tool_round(0, 0.5, short=True)
    assert m["p"] == pytest.approx(0.2) and pl.stats()["skipped_short"] == 0


def test_from_config_carries_the_options():
    s = BranchSettings.from_config(RolloutConfig(fork_h_init="own", short_round="skip"))
    assert (s.fork_h_init, s.short_round) == ("own", "skip")
    with pytest.raises(ValueError, match="fork_h_init"):
        BranchSettings(group_size=2, initial_samples=1, fork_h_init="sibling")
