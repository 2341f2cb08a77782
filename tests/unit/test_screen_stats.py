"""The rules screen (arpo_async/jobs/screen_stats.py) three ways: hand values on tiny
records, references written from the definitions (exact enumeration of within-prompt
permutations, the per-call contrast and the cross-fitted class means as loops),
hypothesis properties; and the screen calibrated on synthetic worlds whose answer is
known (planted: entropy marks the open states; null: nothing does)."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from arpo_async.jobs.screen_stats import (
    RULES,
    cross_fit_stratum,
    permutation_p,
    rule_weights,
    screen,
    screen_table,
    states_from_records,
)


def _state(p, rewards, calls=None, h_max=0.5, tool="search", kind="ok", call_index=1):
    s = {"p": p, "rewards": rewards, "tool": tool, "kind": kind, "dh": 0.0}
    if calls is not None:
        s.update(calls=calls, h_max=h_max, call_index=call_index)
    return s


def _records(new: bool = True):
    c = (lambda n: [n] * 4) if new else (lambda n: None)
    recs = [
        {"index": 0, "global": [1, 0, 1, 1], "states": [
            _state(0.8, [1, 0, 1, 0], c(2), 0.9), _state(0.2, [1, 1, 1, 1], c(1), 0.1)]},
        {"index": 1, "global": [0, 0, 0, 0], "states": [
            _state(0.5, [0, 0, 0, 1], c(0), 0.4, kind="error"),
            _state(0.5, [0, 0, 0, 0], c(2), 0.3), _state(0.4, [1], c(1))]},  # k=1: no D
    ]
    if new:
        for r in recs:
            r["global_calls"] = [2, 2, 2, 2]
    return recs


# ----------------------------------------------------------------------------- hand values
def test_rules_by_hand():
    states, m = states_from_records(_records())
    assert m == {"prompts": 2, "states": 4, "missing": []}
    d = [4 / 6, 0.0, 3 / 6, 0.0]
    np.testing.assert_allclose(states.d, d)
    rules, _ = screen(states, np.random.default_rng(0), n_perm=200)
    mean_d = sum(d) / 4
    arpo = (0.8 * d[0] + 0.5 * d[2]) / (0.8 + 0.2 + 0.5 + 0.5) / mean_d
    assert rules["arpo"]["ratio"] == pytest.approx(arpo)
    assert rules["random"]["ratio"] == pytest.approx(1.0)
    assert rules["oracle"]["ratio"] == pytest.approx(sum(x * x for x in d) / sum(d) / mean_d)
    # prompt_pq: prompt 0 has p = 3/4 (w 3/16), prompt 1 p = 0 (w 0): forks only in prompt 0
    assert rules["prompt_pq"]["ratio"] == pytest.approx((d[0] + d[1]) / 2 / mean_d)
    assert rules["prompt_pq"]["perm_p"] == 1.0  # constant within prompts: p 1 by design
    # max_token: ranks of h_max (0.9, 0.1, 0.4, 0.3) -> (4, 1, 3, 2) / 4
    w = np.array([4, 1, 3, 2]) / 4
    assert rules["max_token"]["ratio"] == pytest.approx((w @ d / w.sum()) / mean_d)
    # per call: random's sum D / sum calls (2 + 1 + 0 + 2) against global G / 2 calls;
    # prompt 0's global [1, 0, 1, 1] has G = 3/6, prompt 1's none
    g = (3 / 6 + 0.0) / (2 + 2)
    assert rules["random"]["per_call"] == pytest.approx(sum(d) / 5 / g)
    assert rules["arpo"]["diff_vs_arpo"] == 0.0
    assert math.isnan(rules["random"]["perm_p"]) and math.isnan(rules["oracle"]["perm_p"])
    assert len(screen_table(rules)) == len(RULES) + 1


def test_old_records_load_and_the_rules_that_need_new_fields_say_so():
    states, m = states_from_records(_records(new=False))
    assert set(m["missing"]) == {"h_max", "call_index", "calls"}
    rules, _ = screen(states, np.random.default_rng(0), n_perm=100)
    assert math.isfinite(rules["arpo"]["ratio"]) and math.isnan(rules["arpo"]["per_call"])
    for name in ("max_token", "stratum"):
        assert math.isnan(rules[name]["ratio"]) and "older run" in rules[name]["note"]


# ----------------------------------------------------------------------------- references
def test_permutation_p_matches_exact_enumeration():
    """Two prompts of three states: all 36 within-prompt permutations enumerated."""
    recs = [{"index": i, "global": [0, 1], "global_calls": [1, 1], "states": [
        _state(p, r, [1, 1]) for p, r in zip(ps, rs)]}
        for i, (ps, rs) in enumerate([((0.9, 0.3, 0.5), ([1, 0], [1, 1], [0, 0, 1, 0])),
                                      ((0.7, 0.2, 0.6), ([0, 0, 1], [1, 0], [1, 1]))])]
    states, _ = states_from_records(recs)
    w, d = states.p, states.d
    observed = (w @ d / w.sum()) / d.mean()
    perms = [np.concatenate([w[:3][list(a)], w[3:][list(b)]])
             for a in itertools.permutations(range(3)) for b in itertools.permutations(range(3))]
    exact = np.mean([(q @ d / q.sum()) / d.mean() >= observed - 1e-12 for q in perms])
    p, _ = permutation_p(states, w, np.random.default_rng(3), 40000)
    assert p == pytest.approx(exact, abs=0.01)


def test_stratum_matches_the_cross_fit_loop():
    rng = np.random.default_rng(4)
    recs = [{"index": i, "global": [0, 1], "global_calls": [1, 1], "states": [
        _state(0.5, rng.integers(0, 2, 4).tolist(), [1] * 4, kind=str(rng.integers(0, 3)),
               call_index=int(rng.integers(1, 3))) for _ in range(int(rng.integers(1, 5)))]}
        for i in range(12)]
    states, _ = states_from_records(recs)
    w, _ = cross_fit_stratum(states, np.random.default_rng(9))
    half = np.random.default_rng(9).permutation(12)[6:]
    for i in range(states.d.size):
        fold = states.prompt[i] in half
        fit = [j for j in range(states.d.size) if (states.prompt[j] in half) != fold]
        same = [states.d[j] for j in fit if states.cls[j] == states.cls[i]]
        want = np.mean(same) if same else np.mean([states.d[j] for j in fit])
        assert w[i] == pytest.approx(want)


# ----------------------------------------------------------------------------- properties
rewards = st.lists(st.integers(0, 1), min_size=2, max_size=6)
state_st = st.tuples(st.floats(0.01, 1.0), rewards, st.integers(0, 3), st.floats(0, 1))
record_st = st.lists(st.lists(state_st, min_size=1, max_size=5), min_size=2, max_size=6)


def _recs(prompts):
    return [{"index": i, "global": [0, 1, 1], "global_calls": [1, 2, 3],
             "states": [_state(p, r, [c] * len(r), h) for p, r, c, h in states]}
            for i, states in enumerate(prompts)]


@settings(max_examples=60, deadline=None)
@given(record_st, st.integers(0, 2**31))
def test_screen_properties(prompts, seed):
    states, _ = states_from_records(_recs(prompts))
    rules, _ = screen(states, np.random.default_rng(seed), n_perm=50)
    if states.d.sum() == 0:
        assert all(math.isnan(f["ratio"]) for f in rules.values())
        return
    assert rules["random"]["ratio"] == pytest.approx(1.0)
    assert rules["oracle"]["ratio"] >= 1 - 1e-9  # sum D^2 / sum D >= mean D
    for name, f in rules.items():
        if math.isfinite(f["perm_p"]):
            assert 0 < f["perm_p"] <= 1
        if math.isfinite(f["ci_low"]) and name != "random":
            assert f["ci_low"] <= f["ci_high"]
    assert rules["prompt_pq"]["perm_p"] in (1.0,) or math.isnan(rules["prompt_pq"]["perm_p"])


@settings(max_examples=60, deadline=None)
@given(record_st, st.floats(0.1, 10.0))
def test_figures_ignore_the_scale_of_the_weights(prompts, c):
    states, _ = states_from_records(_recs(prompts))
    w, _ = rule_weights(states, np.random.default_rng(0))
    scaled = states.__class__(**{**states.__dict__, "p": states.p * c})
    a, _ = screen(states, np.random.default_rng(1), n_perm=30)
    b, _ = screen(scaled, np.random.default_rng(1), n_perm=30)
    for key in ("ratio", "per_call", "perm_p"):
        assert b["arpo"][key] == pytest.approx(a["arpo"][key], nan_ok=True)


# ----------------------------------------------------------------------------- calibration
def synthetic_records(rng: np.random.Generator, planted: bool, prompts: int = 60,
                      k: int = 8) -> list[dict]:
    """Prompts of 2-8 states; a state is open (continuations succeed with probability
    U(0.2, 0.8)) with probability 0.3, else settled. Planted: dH and h_max higher at open
    states; null: both drawn apart from openness. Calls after a fork 0-2, global 2-3."""
    recs = []
    for i in range(prompts):
        states = []
        for j in range(int(rng.integers(2, 9))):
            open_ = rng.random() < 0.3
            q = rng.uniform(0.2, 0.8) if open_ else float(rng.integers(0, 2))
            lift = 1.5 * open_ if planted else 0.0
            dh = rng.normal() + lift
            states.append({"p": float(np.clip(0.5 + 0.2 * dh, 0, 1)), "dh": dh,
                           "h_max": float(rng.random() + 0.5 * lift),
                           "rewards": (rng.random(k) < q).astype(float).tolist(),
                           "calls": rng.integers(0, 3, k).tolist(), "call_index": j + 1,
                           "tool": "search", "kind": str(rng.integers(0, 2))})
        qg = rng.uniform(0.1, 0.9)
        recs.append({"index": i, "global": (rng.random(k) < qg).astype(float).tolist(),
                     "global_calls": rng.integers(2, 4, k).tolist(), "states": states})
    return recs


def test_planted_world_entropy_rules_beat_random_and_null_world_no_rule_but_oracle():
    planted, _ = screen(states_from_records(synthetic_records(
        np.random.default_rng(21), True))[0], np.random.default_rng(0), 2000)
    null, _ = screen(states_from_records(synthetic_records(
        np.random.default_rng(22), False))[0], np.random.default_rng(0), 2000)
    print("planted", {k: round(v["ratio"], 3) for k, v in planted.items()})
    print("null", {k: (round(v["ratio"], 3), v["perm_p"]) for k, v in null.items()})
    for name in ("oracle", "arpo", "max_token"):
        assert planted[name]["ci_low"] > 1.0, (name, planted[name])
    for name in ("arpo", "max_token"):
        assert planted[name]["perm_p"] < 0.01, (name, planted[name])
    assert null["oracle"]["ci_low"] > 1.0
    for name in ("arpo", "max_token", "stratum", "prompt_pq"):
        assert null[name]["perm_p"] > 0.05, (name, null[name])
        assert null[name]["ci_low"] <= 1.0 <= null[name]["ci_high"], (name, null[name])
