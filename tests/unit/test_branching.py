"""actors.branching: hand values, a slow reference of ARPO's rollout steps, and
properties (budget, determinism, per-trajectory baselines across interleaved groups)."""

from __future__ import annotations

import math
from collections import deque

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from actors.branching import (
    BranchPlanner,
    BranchSettings,
    aepo_global_samples,
    aepo_penalty_factor,
    branch_probability,
)
from arpo_async.core.config import AepoRollout, ArpoRollout, GrpoRollout


def _planner(seed=0, initial=None, **kw):
    base = {"group_size": 8, "initial_samples": 4, "branch_factor": 1, "alpha": 0.5,
            "beta": 0.2}
    return BranchPlanner(BranchSettings(**(base | kw)), np.random.default_rng(seed), initial)


# ----------------------------------------------------------------------------- hand values

def test_branch_probability_hand_values():
    assert branch_probability(0.7, 0.2, 0.5, 0.2) == pytest.approx(0.6)
    assert branch_probability(0.2, 0.7, 0.5, 0.2) == pytest.approx(0.4)
    assert branch_probability(0.0, 1.0, 0.5, 2.0) == 0.0  # clipped below
    assert branch_probability(1.0, 0.0, 0.9, 1.0) == 1.0  # clipped above
    assert branch_probability(math.nan, 0.3, 0.5, 0.2) == 0.5  # unknown: dH = 0
    assert branch_probability(0.3, math.nan, 0.5, 0.2) == 0.5


def test_aepo_global_samples_hand_values():
    # sigma(2 * (0.9 - mean(0.2, 0.4))) = sigma(1.2) = 0.7685; 16 * 0.7685 = 12.3 -> 12
    assert aepo_global_samples(0.9, [0.2, 0.4], 16, 2.0) == 12
    assert aepo_global_samples(0.5, 0.5, 8, 1.0) == 4  # no gap: half
    assert aepo_global_samples(0.5, [], 8, 1.0) == 4  # no tool signal: half
    assert aepo_global_samples(1.0, 0.0, 8, 50.0) == 8  # root far more uncertain: all global
    assert aepo_global_samples(0.0, 1.0, 8, 50.0) == 1  # clamped to >= 1
    assert aepo_global_samples(0.3, [math.nan], 8, 1.0) == 4
    assert aepo_global_samples(0.9, 0.1, 1, 1.0) == 1
    assert aepo_global_samples(0.0, np.float32(1.0), 8, 1e4) == 1  # no overflow, numpy ok
    assert aepo_global_samples(1.0, np.array([0.0, 0.0]), 8, 1e4) == 8
    with pytest.raises(ValueError, match="budget"):
        aepo_global_samples(0.1, 0.1, 0, 1.0)


def test_aepo_penalty_factor():
    assert aepo_penalty_factor(0, 0.05) == 1.0
    assert aepo_penalty_factor(3, 0.05) == pytest.approx(0.85)
    assert aepo_penalty_factor(40, 0.05) == 0.0


def test_fork_inherits_baseline_and_branches_at_result():
    pl = _planner(threshold_mode=True, branch_factor=2)
    ids = pl.start()
    assert ids == [0, 1, 2, 3] and pl.live == {0, 1, 2, 3}
    pl.record_initial_entropy(0, 0.2)
    forks, m = pl.after_tool_round(0, 0.7)  # P = 0.5 + 0.2 * 0.5 = 0.6 >= 0.5
    assert forks == [4, 5] and m["dh"] == pytest.approx(0.5) and m["p"] == pytest.approx(0.6)
    assert all(pl.parent_of(f) == 0 and pl.h_init_of(f) == 0.2 for f in forks)
    with pytest.raises(ValueError, match="fork"):
        pl.record_initial_entropy(4, 0.9)  # a fork shares its parent's first round
    # the fork's later decision uses the inherited baseline 0.2
    _, m = pl.after_tool_round(4, 0.1)
    assert m["dh"] == pytest.approx(-0.1)
    assert pl.remaining_budget() == 2


def test_threshold_mode_is_deterministic_and_draws_nothing():
    pl = _planner(threshold_mode=True, group_size=16)
    rng_before = pl._rng.bit_generator.state
    pl.start()
    pl.record_initial_entropy(0, 0.5)
    assert pl.after_tool_round(0, 0.5)[0] == [4]  # P = 0.5 exactly: branch
    assert pl.after_tool_round(0, 0.49)[0] == []  # P = 0.498: no branch
    assert pl._rng.bit_generator.state == rng_before


def test_aepo_consecutive_branch_penalty():
    pl = _planner(threshold_mode=True, beta=0.0, aepo_penalty=0.05, group_size=16)
    pl.start()
    pl.record_initial_entropy(0, 0.4)
    forks, m = pl.after_tool_round(0, 0.4)  # l = 0: P = 0.5 -> branch
    assert forks and m["streak"] == 0 and pl.streak_of(0) == 1
    assert pl.streak_of(forks[0]) == 1  # the fork's lineage just branched too
    forks2, m = pl.after_tool_round(0, 0.4)  # l = 1: P = 0.475 -> no branch, reset
    assert forks2 == [] and m["p"] == pytest.approx(0.475) and pl.streak_of(0) == 0
    assert pl.after_tool_round(0, 0.4)[0]  # l = 0 again: branches
    assert pl.after_tool_round(forks[0], 0.4)[1]["p"] == pytest.approx(0.475)


def test_budget_blocks_forks_and_fill_rule():
    pl = _planner(threshold_mode=True, group_size=5, initial_samples=2, branch_factor=3)
    assert pl.fill_count() == 0  # nothing started yet
    pl.start()
    pl.record_initial_entropy(0, 0.1)
    forks, _ = pl.after_tool_round(0, 0.9)
    assert forks == [2, 3, 4]  # Z = 3 fits exactly
    forks, m = pl.after_tool_round(0, 0.9)
    assert forks == [] and m["blocked_by_budget"] == 1.0
    for t in (0, 2, 3):
        pl.finish(t)
    assert pl.fill_count() == 0  # 1 and 4 are still live
    pl.finish(1)
    pl.finish(4)
    assert pl.done and pl.leaves == (0, 2, 3, 1, 4)
    with pytest.raises(RuntimeError, match="budget"):
        pl.new_root()

    pl = _planner(group_size=5, initial_samples=2)
    for t in pl.start():
        pl.record_initial_entropy(t, 0.3)
        pl.finish(t)
    assert pl.fill_count() == 3 and pl.fill() == [2, 3, 4] and pl.fill_count() == 0
    for t in (2, 3, 4):
        pl.finish(t)
    assert pl.done and pl.stats()["fills"] == 3 and pl.stats()["global_samples"] == 5


def test_grpo_never_forks_and_consumes_no_randomness():
    cfg = GrpoRollout(group_size=6, initial_samples=2)
    s = BranchSettings.from_config(cfg)
    assert s.initial_samples == 6 and not s.branching
    pl = BranchPlanner(s, np.random.default_rng(0))
    state = pl._rng.bit_generator.state
    ids = pl.start()
    pl.record_initial_entropy(ids[0], 0.0)
    assert pl.after_tool_round(ids[0], 1.0)[0] == []
    assert pl._rng.bit_generator.state == state


def test_from_config_modes():
    arpo = BranchSettings.from_config(ArpoRollout())
    assert arpo.branching and arpo.aepo_penalty == 0.0 and not arpo.dynamic_budget
    assert (arpo.group_size, arpo.initial_samples) == (8, 4)
    aepo = BranchSettings.from_config(AepoRollout())
    assert aepo.aepo_penalty == 0.05 and aepo.dynamic_budget and aepo.budget_beta == 0.5
    assert aepo.entropy_reduce == "sum"
    with pytest.raises(ValueError, match="initial_samples"):
        BranchSettings.from_config(ArpoRollout(group_size=2, initial_samples=3))


def test_misuse_is_rejected_with_the_trajectory_named():
    pl = _planner()
    with pytest.raises(TypeError):
        BranchPlanner(pl.settings, rng=42)
    pl.start()
    with pytest.raises(RuntimeError, match="twice"):
        pl.start()
    with pytest.raises(ValueError, match="trajectory 1: after_tool_round before"):
        pl.after_tool_round(1, 0.5)
    pl.record_initial_entropy(1, 0.5)
    with pytest.raises(ValueError, match="already recorded"):
        pl.record_initial_entropy(1, 0.5)
    pl.finish(1)
    with pytest.raises(ValueError, match="trajectory 1 is not live"):
        pl.finish(1)
    with pytest.raises(KeyError, match="unknown trajectory id 9"):
        pl.parent_of(9)
    with pytest.raises(ValueError, match=r"initial=9 outside"):
        _planner(initial=9)


# ----------------------------------------------------------------------------- simulation

def _script(driver: np.random.Generator, rounds: int) -> list[float]:
    return [float(x) for x in driver.uniform(0.0, 1.0, size=rounds)]


def _simulate(pl: BranchPlanner, driver_seed: int, max_tools: int = 3) -> list[tuple]:
    """Lockstep rollout of one group driven by the planner. Each trajectory has a tool
    count and per-round entropies drawn from the driver's own generator; a fork resamples
    its parent's decision round (no decision on that round) with a fresh script."""
    driver = np.random.default_rng(driver_seed)
    queue: deque[tuple] = deque()  # (id, round, tools, entropies, decide on this round)

    def new_roots(ids):
        for t in ids:
            tools = int(driver.integers(0, max_tools + 1))
            queue.append((t, 0, tools, _script(driver, tools + 1), False))

    new_roots(pl.start())
    log = []
    while queue or pl.fill_count():
        if not queue:
            new_roots(pl.fill())
            continue
        t, rnd, tools, hs, decide = queue.popleft()
        if rnd == 0:
            pl.record_initial_entropy(t, hs[0])
        elif decide:
            forks, m = pl.after_tool_round(t, hs[rnd])
            log.append(("decide", t, rnd, round(m["p"], 9), tuple(forks)))
            for f in forks:
                queue.append((f, rnd, tools, hs[:rnd] + _script(driver, tools + 1 - rnd), False))
        if rnd >= tools:
            pl.finish(t)
            log.append(("finish", t))
        else:
            queue.append((t, rnd + 1, tools, hs, True))
        assert len(pl.leaves) + len(pl.live) <= pl.settings.group_size
    return log


def _reference(s: BranchSettings, seed: int, driver_seed: int, max_tools: int = 3) -> list:
    """docs/design.md "ARPO branching" written out directly, same event order as _simulate."""
    rng, driver = np.random.default_rng(seed), np.random.default_rng(driver_seed)
    h_init, parents, live, leaves, log = {}, [], set(), [], []
    queue: deque = deque()

    def spawn(parent, base, rnd, tools, hs):
        parents.append(parent)
        live.add(len(parents) - 1)
        h_init[len(parents) - 1] = base
        queue.append((len(parents) - 1, rnd, tools, hs, False))

    def spawn_roots(count):
        for _ in range(count):
            tools = int(driver.integers(0, max_tools + 1))
            spawn(-1, None, 0, tools, _script(driver, tools + 1))

    spawn_roots(s.initial_samples)
    while queue or (not live and len(leaves) < s.group_size):
        if not queue:
            spawn_roots(s.group_size - len(leaves))
            continue
        t, rnd, tools, hs, decide = queue.popleft()
        if rnd == 0:
            h_init[t] = hs[0]
        elif decide:
            p = min(1.0, max(0.0, s.alpha + s.beta * (hs[rnd] - h_init[t])))
            room = s.group_size - len(leaves) - len(live)
            n = min(s.branch_factor, room) if rng.random() < p else 0
            log.append(("decide", t, rnd, round(p, 9),
                        tuple(range(len(parents), len(parents) + n))))
            for _ in range(n):
                spawn(t, h_init[t], rnd, tools, hs[:rnd] + _script(driver, tools + 1 - rnd))
        if rnd >= tools:
            live.discard(t)
            leaves.append(t)
            log.append(("finish", t))
        else:
            queue.append((t, rnd + 1, tools, hs, True))
    return log


@pytest.mark.parametrize("seed", range(6))
def test_planner_matches_slow_reference(seed):
    s = BranchSettings(group_size=10, initial_samples=3, branch_factor=2, alpha=0.4, beta=0.8)
    assert _simulate(BranchPlanner(s, np.random.default_rng(seed)), 100 + seed) == \
        _reference(s, seed, 100 + seed)


def test_same_seed_same_tree_and_different_seeds_differ():
    s = BranchSettings(group_size=12, initial_samples=4, alpha=0.5, beta=0.2)
    trees = []
    for seed in range(8):
        a, b = (BranchPlanner(s, np.random.default_rng(seed)) for _ in range(2))
        log_a, log_b = _simulate(a, 7), _simulate(b, 7)
        assert log_a == log_b and a.parents() == b.parents()
        trees.append(tuple(a.parents()))
    assert len(set(trees)) > 1  # the planner's seed, not the driver's, shaped the trees


@settings(max_examples=80, deadline=None)
@given(m=st.integers(1, 12), n_frac=st.floats(0.0, 1.0), z=st.integers(1, 4),
       alpha=st.floats(0.0, 1.0), beta=st.floats(-2.0, 2.0), threshold=st.booleans(),
       penalty=st.floats(0.0, 0.5), seed=st.integers(0, 2**32 - 1),
       driver=st.integers(0, 2**32 - 1))
def test_budget_is_never_exceeded_and_always_filled(m, n_frac, z, alpha, beta, threshold,
                                                     penalty, seed, driver):
    n = max(1, round(n_frac * m))
    s = BranchSettings(group_size=m, initial_samples=n, branch_factor=z, alpha=alpha,
                       beta=beta, threshold_mode=threshold, aepo_penalty=penalty)
    pl = BranchPlanner(s, np.random.default_rng(seed))
    _simulate(pl, driver)  # asserts leaves + live <= M after every event
    assert pl.done and sorted(pl.leaves) == list(range(m))
    assert all(p < i for i, p in enumerate(pl.parents()))  # parents precede forks
    st_ = pl.stats()
    assert st_["forks"] + st_["global_samples"] == m


# ----------------------------------------------------------------------------- interleaving

def test_baselines_stay_per_trajectory_across_interleaved_groups_and_steps():
    """Two prompts' groups run at once, started at different learner steps, with ids
    that collide (both have a trajectory 0); a third group reuses the first's slot after
    it finished. Every dH must be against the trajectory's own H_init."""
    s = BranchSettings(group_size=4, initial_samples=2, alpha=0.5, beta=1.0,
                       threshold_mode=True)
    a = BranchPlanner(s, np.random.default_rng(1))  # "learner step 3"
    a.start()
    a.record_initial_entropy(0, 0.1)
    a.record_initial_entropy(1, 0.3)
    b = BranchPlanner(s, np.random.default_rng(2))  # "learner step 4", while a runs
    b.start()
    b.record_initial_entropy(0, 0.9)
    _, ma = a.after_tool_round(0, 0.5)
    _, mb = b.after_tool_round(0, 0.5)
    assert ma["dh"] == pytest.approx(0.4) and mb["dh"] == pytest.approx(-0.4)
    b.record_initial_entropy(1, 0.6)
    forks_a, _ = a.after_tool_round(1, 0.8)  # a/0 forked a/2 above; this forks a/3
    _, mb1 = b.after_tool_round(1, 0.2)
    assert mb1["dh"] == pytest.approx(-0.4) and forks_a == [3]
    _, mf = a.after_tool_round(3, 0.35)  # fork of a/1 uses a/1's baseline 0.3
    assert mf["dh"] == pytest.approx(0.05)
    for t in sorted(a.live):
        a.finish(t)
    a.fill()
    for t in sorted(a.live):
        a.finish(t)
    assert a.done
    c = BranchPlanner(s, np.random.default_rng(3))  # next prompt in a's slot
    c.start()
    with pytest.raises(ValueError, match="before record_initial_entropy"):
        c.after_tool_round(0, 0.5)  # no baseline leaks in from a's trajectory 0
    _, mb2 = b.after_tool_round(0, 0.95)  # b is still measured against 0.9
    assert mb2["dh"] == pytest.approx(0.05)
