"""actors.branching's reference options: a fork's own H_init (``rollout.fork_h_init=own``,
the authors' code), no decision on short rounds (``rollout.short_round=skip``), one fill
at a time (``rollout.fill=one_per_round``) and AEPO's rule as the authors' code has it
(``rollout.aepo_rule=authors``)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from actors.branching import BranchPlanner, BranchSettings
from arpo_async.core.config import AepoRollout, ArpoRollout


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
    s = BranchSettings.from_config(ArpoRollout(fork_h_init="own", short_round="skip"))
    assert (s.fork_h_init, s.short_round) == ("own", "skip")
    with pytest.raises(ValueError, match="fork_h_init"):
        BranchSettings(group_size=2, initial_samples=1, fork_h_init="sibling")


def test_one_per_round_fills_one_root_at_a_time():
    pl = _planner(group_size=4, initial_samples=1, fill="one_per_round")
    pl.start()
    assert pl.fill_count() == 0  # 0 is live
    pl.finish(0)
    assert pl.fill_count() == 1 and pl.fill() == [1] and pl.fill_count() == 0
    pl.record_initial_entropy(1, 2.0)
    (fork,), _ = pl.after_tool_round(1, 3.0)  # the new root branches before the next fill
    pl.finish(1)
    assert pl.fill_count() == 0  # its fork is live
    pl.finish(fork)
    assert pl.fill() == [3] and pl.remaining_budget() == 0
    pl.finish(3)
    assert pl.done and pl.stats()["fills"] == 2 and pl.parents() == [-1, -1, 1, -1]


def test_authors_aepo_rule_branches_on_a_high_draw():
    """(u + beta dH) f >= alpha: a high draw branches, the reverse of u < P; the chance
    reported as p is the share of draws that branch."""
    from actors.branching import aepo_authors_branches, aepo_authors_probability

    assert aepo_authors_branches(0.9, 0.0, 0.5, 0.2, 1.0)
    assert not aepo_authors_branches(0.1, 0.0, 0.5, 0.2, 1.0)
    assert aepo_authors_branches(0.4, 1.0, 0.5, 0.2, 1.0)  # 0.6 >= 0.5
    assert not aepo_authors_branches(0.52, 0.0, 0.5, 0.2, 0.95)  # 0.494 < 0.5
    u = (np.arange(100_000) + 0.5) / 100_000
    for dh, f in [(0.0, 1.0), (1.0, 0.9), (-2.0, 1.0), (0.3, 0.0), (4.0, 0.5)]:
        share = np.mean([aepo_authors_branches(x, dh, 0.5, 0.2, f) for x in u[::50]])
        assert share == pytest.approx(aepo_authors_probability(dh, 0.5, 0.2, f), abs=1e-3)
    pl = _planner(threshold_mode=False, aepo_rule="authors", aepo_penalty=0.05)
    pl.start()
    pl.record_initial_entropy(0, 2.0)
    _, m = pl.after_tool_round(0, 3.0)
    assert m["p"] == pytest.approx(0.7)  # 1 - 0.5 + 0.2


def test_from_config_carries_fill_and_the_aepo_rule_in_aepo_mode_only():
    s = BranchSettings.from_config(AepoRollout(fill="one_per_round", aepo_rule="authors"))
    assert (s.fill, s.aepo_rule) == ("one_per_round", "authors")
    s = BranchSettings.from_config(ArpoRollout())
    assert (s.fill, s.aepo_rule) == ("all", "scaled")
    with pytest.raises(ValueError, match="aepo_rule"):  # AEPO's keys: in aepo mode only
        ArpoRollout(aepo_rule="authors")
    with pytest.raises(ValueError, match="fill"):
        BranchSettings(group_size=2, initial_samples=1, fill="some")
