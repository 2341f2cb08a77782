"""A step's branch figures add the groups' planner sums up (learner/rollout_metrics.py),
checked by hand and against the planner's own per-decision metrics."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from actors.branching import BranchPlanner, BranchSettings
from learner.rollout_metrics import KEYS, rollout_metrics


def _group(stats: dict, leaves: int, executed: int):
    return SimpleNamespace(stats={f"branch/{k}": v for k, v in stats.items()},
                           leaves=[None] * leaves, tool_calls_executed=executed)


def test_hand_case():
    a = _group({"tool_rounds": 2, "p_sum": 1.2, "p_sq_sum": 0.74, "p_min": 0.5, "p_max": 0.7,
                "dh_sum": 0.4, "forks": 1, "fills": 0}, leaves=4, executed=3)
    b = _group({"tool_rounds": 1, "p_sum": 0.9, "p_sq_sum": 0.81, "p_min": 0.9, "p_max": 0.9,
                "dh_sum": 2.0, "forks": 1, "fills": 2}, leaves=4, executed=1)
    plain = _group({}, leaves=4, executed=0)  # a GRPO group without tools: no planner stats
    m = rollout_metrics([a, b, plain])
    ps = np.array([0.5, 0.7, 0.9])
    assert m["branch/p_mean"] == pytest.approx(ps.mean())
    assert m["branch/p_std"] == pytest.approx(ps.std())
    assert (m["branch/p_min"], m["branch/p_max"]) == (0.5, 0.9)
    assert m["branch/dh_mean"] == pytest.approx(2.4 / 3)
    assert (m["branch/decisions"], m["branch/forks"], m["branch/fills"]) == (3, 2, 2)
    assert m["branch/leaves_per_group"] == 4 and m["tools/executed_per_leaf"] == 4 / 12


def test_every_key_without_decisions():
    m = rollout_metrics([_group({}, leaves=4, executed=0)])
    assert set(m) == set(KEYS)
    assert m["branch/forks"] == 0 and m["branch/p_min"] == 0 and m["branch/p_std"] == 0


def test_planner_sums_match_its_decisions():
    settings = BranchSettings(group_size=8, initial_samples=2, alpha=0.5, beta=0.2)
    planner = BranchPlanner(settings, np.random.default_rng(0))
    ids = planner.start()
    for tid in ids:
        planner.record_initial_entropy(tid, 3.0)
    ps = []
    for h in (2.0, 4.5, 6.0, 3.0):  # summed window entropies (rollout.entropy_reduce=sum)
        _, d = planner.after_tool_round(ids[0], h)
        ps.append(d["p"])
    stats = planner.stats()
    m = rollout_metrics([_group(stats, leaves=1, executed=4)])
    assert ps == pytest.approx([0.3, 0.8, 1.0, 0.5])  # clip(0.5 + 0.2 * dH, 0, 1)
    assert m["branch/p_mean"] == pytest.approx(np.mean(ps))
    assert m["branch/p_std"] == pytest.approx(np.std(ps))
    assert (m["branch/p_min"], m["branch/p_max"]) == (pytest.approx(0.3), 1.0)
    assert m["branch/decisions"] == 4 and m["branch/forks"] == stats["forks"]
    assert m["branch/p_outside_band"] == 3  # 0.3, 0.8 and 1.0; 0.5 is inside [0.45, 0.55]


def _scored(rewards: list[float], kind: str = ""):
    return SimpleNamespace(leaves=[SimpleNamespace(reward=r) for r in rewards], kind=kind)


def test_nonzero_variance_share_by_kind():
    from arpo_async.core.metrics import variance_summary
    from learner.rollout_metrics import variance_metrics

    step = [_scored([1, 0, 0, 0], "arith"), _scored([1, 1, 1, 1], "arith"),
            _scored([0, 0, 0, 0], "lookup"), _scored([0.0, 0.1], "lookup"), _scored([1])]
    m = variance_metrics(step)
    assert m["groups/nonzero_var"] == 2 and m["groups/nonzero_var_share"] == 2 / 5
    assert (m["groups/kind/arith/n"], m["groups/kind/arith/nonzero_var"]) == (2, 1)
    assert (m["groups/kind/lookup/n"], m["groups/kind/lookup/nonzero_var"]) == (2, 1)
    assert (m["groups/kind/-/n"], m["groups/kind/-/nonzero_var"]) == (1, 0)  # one leaf
    assert variance_metrics([]) == {"groups/nonzero_var": 0.0, "groups/nonzero_var_share": 0.0}
    # a run: 10 steps; the first (5 groups, 2 varied) and the last (all 4 varied) tenth
    rows = [{"groups": 5, **m}] + [{"groups": 4, "groups/nonzero_var": 4,
                                    "groups/kind/arith/n": 4,
                                    "groups/kind/arith/nonzero_var": 4}] * 9
    s = variance_summary(rows)
    assert s["share"] == round(38 / 41, 4)
    assert (s["first_tenth"], s["last_tenth"]) == (0.4, 1.0)
    assert s["by_kind"] == {"-": 0.0, "arith": round(37 / 38, 4), "lookup": 0.5}
    assert variance_summary([{"groups": 4}])["share"] is None  # a run from before the metric


def test_each_policy_declares_how_its_figures_add_up():
    """AEPO's budget split (``aepo_m``) arrives as the mean over the step's groups; a figure
    no declaration covers is counted, not added up by guess; ARPO's own are unchanged."""
    from arpo_async.core.config.actors import AepoRollout, ArpoRollout

    def g(**stats):
        return _group(stats, leaves=4, executed=1)

    a = g(tool_rounds=1, p_sum=0.6, p_sq_sum=0.36, p_min=0.6, p_max=0.6, aepo_m=3,
          blocked_by_budget=1, new_figure=7)
    b = g(tool_rounds=1, p_sum=0.4, p_sq_sum=0.16, p_min=0.4, p_max=0.4, aepo_m=5,
          blocked_by_budget=2)
    m = rollout_metrics([a, b], AepoRollout.STATS)
    assert m["branch/aepo_m"] == 4.0 and m["branch/blocked_by_budget"] == 3.0
    assert m["branch/undeclared"] == 1.0  # new_figure
    assert m["branch/p_mean"] == pytest.approx(0.5) and m["branch/p_min"] == 0.4
    assert {k: v for k, v in m.items() if k in KEYS} == rollout_metrics([a, b])
    # under ARPO's declaration aepo_m is undeclared too
    assert rollout_metrics([a, b], ArpoRollout.STATS)["branch/undeclared"] == 2.0


def test_every_figure_a_real_planner_reports_is_declared():
    from arpo_async.core.config.actors import ROLLOUT_MODES

    settings = BranchSettings(group_size=8, initial_samples=2, alpha=0.5, beta=0.2)
    planner = BranchPlanner(settings, np.random.default_rng(0))
    ids = planner.start()
    for tid in ids:
        planner.record_initial_entropy(tid, 3.0)
    planner.after_tool_round(ids[0], 4.0)
    stats = {**planner.stats(), "stratum/search/1/n": 1.0, "stratum/search/1/p_sum": 0.7,
             "aepo_m": 4.0}
    for mode, cls in ROLLOUT_MODES.items():
        report = stats if mode == "aepo" else {k: v for k, v in stats.items() if k != "aepo_m"}
        m = rollout_metrics([_group(report, leaves=2, executed=1)], cls.STATS)
        assert "branch/undeclared" not in m, mode
