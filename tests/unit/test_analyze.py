"""The entropy-by-position profile of ``python -m arpo_async.jobs.analyze entropy``, by
hand on a two-call trajectory (pure: no model)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from arpo_async.jobs.analyze import estimate_error, finding, position_profile, rounds_of

NAN = math.nan


def test_rounds_of():
    assert rounds_of(np.array([1, 1, 0, 0, 1, 0, 1, 1], np.uint8)) == [(0, 2), (4, 5), (6, 8)]
    assert rounds_of(np.array([0, 0])) == [] and rounds_of(np.array([1])) == [(0, 1)]


def _leaf():
    # round 0: 3 tokens, calls python; result (2 tool tokens); round 1: 2 tokens, calls
    # search; result (1 token); round 2: 3 tokens, answers
    mask = np.array([1, 1, 1, 0, 0, 1, 1, 0, 1, 1, 1], np.uint8)
    ent = np.array([.1, .2, .3, NAN, NAN, .8, .6, NAN, .5, .4, .3])
    return {"mask": mask, "entropy": ent, "estimate": ent + 0.01,
            "tools": ["python", "search", None]}


def test_profile_by_hand():
    p = position_profile([_leaf()], k=2)
    assert p["n_tool_calls"] == 2
    # before: the last 2 tokens of rounds 0 and 1 -> positions -2, -1
    assert p["before_tool"]["by_position"] == pytest.approx([(0.2 + 0.8) / 2, (0.3 + 0.6) / 2])
    # after: the first 2 tokens of rounds 1 and 2
    assert p["after_tool"]["by_position"] == pytest.approx([(0.8 + 0.5) / 2, (0.6 + 0.4) / 2])
    assert p["first_round"]["mean"] == pytest.approx(0.15)
    assert p["by_round"] == pytest.approx({"0": 0.15, "1": 0.7, "2": 0.45})
    assert p["by_tool"]["python"]["after_mean"] == pytest.approx(0.7)
    assert p["by_tool"]["search"]["after_mean"] == pytest.approx(0.45)
    assert finding(p).startswith("entropy rises after tool results")


def test_estimate_error_on_h_and_dh():
    e = estimate_error([_leaf()], k=2, reduce="sum")
    assert e["decisions"] == 2 and e["h_mae"] == pytest.approx(0.02)  # 2 tokens x 0.01
    assert e["dh_mae"] == pytest.approx(0.0)  # the same offset on both sides cancels
    assert e["dh_exact_mean_abs"] == pytest.approx(((1.4 - 0.3) + (0.9 - 0.3)) / 2)


def test_no_call_no_finding():
    leaf = {"mask": np.array([1, 1]), "entropy": np.array([.1, .2]), "tools": [None]}
    p = position_profile([leaf], k=4)
    assert p["n_tool_calls"] == 0 and "nothing to compare" in finding(p)


class _Seen(Exception):
    pass


@pytest.mark.parametrize("what", ["entropy", "branching"])
def test_overrides_after_options_reach_the_config(monkeypatch, what):
    """``analyze entropy RUN --k 4 rollout.short_round=as_is``: argparse alone refuses an
    override written after an option; it must reach the run's config like one before."""
    import arpo_async.jobs.analyze as analyze

    def seen(args):
        raise _Seen(args.overrides)

    monkeypatch.setattr(analyze, "_inputs", seen)
    for argv in ([what, "RUN", "rollout.alpha=0.3", "--k", "4", "rollout.beta=0.1"],
                 [what, "RUN", "--k", "4", "rollout.alpha=0.3", "rollout.beta=0.1"]):
        with pytest.raises(_Seen) as got:
            analyze.main(argv)
        assert got.value.args[0] == ["rollout.alpha=0.3", "rollout.beta=0.1"], argv
    for bad in ([what, "RUN", "--k", "4", "--nope"], [what, "RUN", "--k", "4", "stray"],
                ["trees", "RUN", "rollout.alpha=0.3"]):
        with pytest.raises(SystemExit):
            analyze.main(bad)
