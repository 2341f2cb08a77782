"""The outcome test's math (arpo_async/jobs/premise_stats.py) three ways: hand values,
references written from the definitions (a double loop over pairs, forks placed by
drawing with probability P, the normal-theory interval, numpy's corrcoef), hypothesis
properties; and the bootstrap interval calibrated on null worlds (coverage of 1)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from arpo_async.jobs.premise_stats import (
    bootstrap_ci,
    cluster_sums,
    correlation_by,
    discordance,
    fork_vs_global_from_sums,
    pearson,
    premise_figures,
    ratio_from_sums,
    useful_fork_ratio,
)

ROOT = Path(__file__).resolve().parents[2]
probs = st.one_of(st.just(0.0), st.floats(1e-6, 1.0))  # no subnormal products


# ----------------------------------------------------------------------------- hand values
def test_discordance_by_hand():
    assert discordance([1, 1, 0, 0])[0] == pytest.approx(4 / 6)  # 4 of 6 pairs differ
    assert discordance([1, 1, 1])[0] == 0.0
    assert discordance([1, 0])[0] == 1.0
    assert discordance([0.5, 0.5, 1.0])[0] == pytest.approx(2 / 3)  # graded: any difference
    assert discordance([-1, 0, 1])[0] == 1.0
    assert discordance([0.3, 0.3 + 1e-9])[0] == 0.0  # within the tolerance
    assert math.isnan(discordance([1])[0]) and math.isnan(discordance([])[0])
    assert discordance([1, 0, 0])[1] == {"k": 3, "pairs": 3, "disagree": 2}


def test_ratio_by_hand():
    # forks only where D = 1, half the states discordant: twice the random rate
    assert useful_fork_ratio([1, 0], [1, 0])[0] == pytest.approx(2.0)
    assert useful_fork_ratio([0.5, 0.5], [0.2, 0.6])[0] == pytest.approx(1.0)
    # P (0.2, 0.6), D (0, 1): forked 0.6/0.8 = 0.75, random 0.5
    r, m = useful_fork_ratio([0.2, 0.6], [0.0, 1.0])
    assert r == pytest.approx(1.5) and m["d_forked"] == pytest.approx(0.75)
    assert useful_fork_ratio([0.2, 0.6, 0.9], [0.0, 1.0, math.nan])[0] == pytest.approx(1.5)
    assert math.isnan(useful_fork_ratio([0, 0], [1, 0])[0])  # no fork placed
    assert math.isnan(useful_fork_ratio([1, 1], [0, 0])[0])  # nothing to find
    with pytest.raises(ValueError, match="probability"):
        useful_fork_ratio([1.5, 0], [1, 0])


def test_sums_and_fork_vs_global_by_hand():
    row = cluster_sums([0.5, 1.0, 0.2], [0.4, 0.0, math.nan], 0.8)
    np.testing.assert_allclose(row, [0.2, 1.5, 0.4, 2, 1.6])
    assert fork_vs_global_from_sums(row) == pytest.approx(0.25)
    assert ratio_from_sums(row) == pytest.approx((0.2 / 1.5) / 0.2)
    two = np.stack([row, cluster_sums([1.0], [1.0], 0.5)])
    assert float(ratio_from_sums(two.sum(0))) == pytest.approx((1.2 / 2.5) / (1.4 / 3))
    assert math.isnan(float(fork_vs_global_from_sums(np.array([0, 1, 0, 1, 0.0]))))


def test_pearson_and_groups_by_hand():
    assert pearson([1, 2, 3], [2, 4, 6])[0] == pytest.approx(1.0)
    assert pearson([1, 2, 3], [3, 2, 1])[0] == pytest.approx(-1.0)
    assert math.isnan(pearson([1, 2], [1, 2])[0])  # too few
    assert math.isnan(pearson([1, 1, 1], [1, 2, 3])[0])  # constant side
    assert pearson([1, 2, math.nan, 3], [1, 2, 5, 3])[1]["n"] == 3
    groups, _ = correlation_by(["a", "a", "a", "b", "b", "b"], [1, 2, 3, 1, 2, 3],
                               [1, 2, 3, 3, 2, 1])
    assert groups["a"]["r"] == pytest.approx(1.0) and groups["b"]["r"] == pytest.approx(-1.0)
    assert groups["a"]["n"] == 3


# ----------------------------------------------------------------------------- references
def _pairs_reference(r):
    k = len(r)
    differ = [abs(r[i] - r[j]) > 1e-6 for i in range(k) for j in range(i + 1, k)]
    return sum(differ) / len(differ)


def test_discordance_matches_the_pair_loop_and_the_binary_formula():
    rng = np.random.default_rng(0)
    for _ in range(200):
        k = int(rng.integers(2, 12))
        r = rng.choice([-1.0, 0.0, 0.5, 1.0, 1.1], size=k).tolist()
        assert discordance(r)[0] == pytest.approx(_pairs_reference(r))
        b = rng.integers(0, 2, size=k)
        p = b.mean()
        assert discordance(b)[0] == pytest.approx(2 * p * (1 - p) * k / (k - 1))


def test_ratio_matches_forks_placed_by_drawing():
    """Forks placed at each state with probability P, pooled over many draws: the mean D of
    the placed forks over the mean D of all states is the ratio."""
    rng = np.random.default_rng(1)
    p, d = rng.random(30), rng.random(30) * (rng.random(30) < 0.6)
    placed = rng.random((20000, 30)) < p
    by_drawing = (placed * d).sum() / placed.sum() / d.mean()
    assert useful_fork_ratio(p, d)[0] == pytest.approx(by_drawing, rel=0.01)


def test_bootstrap_matches_the_normal_interval_of_a_mean():
    """With one state per prompt, P = 1 and G = 1, fork_vs_global is the mean of D; its
    90% interval is close to mean +- 1.645 s / sqrt(n)."""
    rng = np.random.default_rng(2)
    d = rng.random(400)
    rows = np.stack([cluster_sums([1.0], [x], 1.0) for x in d])
    (lo, hi), m = bootstrap_ci(rows, fork_vs_global_from_sums, np.random.default_rng(3), 4000)
    half = 1.645 * d.std(ddof=1) / math.sqrt(d.size)
    assert lo == pytest.approx(d.mean() - half, abs=0.15 * half)
    assert hi == pytest.approx(d.mean() + half, abs=0.15 * half)
    assert m["undefined"] == 0


def test_pearson_matches_numpy():
    rng = np.random.default_rng(4)
    for _ in range(50):
        x = rng.normal(size=20)
        y = 0.5 * x + rng.normal(size=20)
        assert pearson(x, y)[0] == pytest.approx(np.corrcoef(x, y)[0, 1])


# ----------------------------------------------------------------------------- properties
@settings(max_examples=200, deadline=None)
@given(st.lists(probs, min_size=1, max_size=30), st.floats(0.01, 1.0))
def test_ratio_is_one_when_d_is_constant(p, c):
    if sum(p) > 0:
        assert useful_fork_ratio(p, [c] * len(p))[0] == pytest.approx(1.0)


@settings(max_examples=200, deadline=None)
@given(st.lists(probs, min_size=1, max_size=30), st.floats(0.01, 1.0))
def test_ratio_is_one_when_p_is_constant(d, c):
    if sum(d) > 0:
        assert useful_fork_ratio([c] * len(d), d)[0] == pytest.approx(1.0)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(probs, probs), min_size=2, max_size=30))
def test_comonotone_p_and_d_give_at_least_one_and_antitone_at_most_one(pairs):
    """Chebyshev's sum inequality: P and D sorted the same way give ratio >= 1."""
    p = sorted(a for a, _ in pairs)
    d = sorted(b for _, b in pairs)
    if sum(p) == 0 or sum(d) == 0:
        return
    assert useful_fork_ratio(p, d)[0] >= 1 - 1e-9
    assert useful_fork_ratio(p, d[::-1])[0] <= 1 + 1e-9


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(probs, probs), min_size=1, max_size=30), st.floats(0.05, 1.0))
def test_ratio_ignores_the_scale_of_p_and_the_order_of_states(pairs, c):
    p, d = [a for a, _ in pairs], [b for _, b in pairs]
    r = useful_fork_ratio(p, d)[0]
    if math.isnan(r):
        return
    assert useful_fork_ratio([c * x for x in p], d)[0] == pytest.approx(r)
    assert useful_fork_ratio(p[::-1], d[::-1])[0] == pytest.approx(r)
    rows = np.stack([cluster_sums([a], [b], 0.5) for a, b in pairs])
    assert float(ratio_from_sums(rows.sum(0))) == pytest.approx(r)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.sampled_from([-1.0, 0.0, 0.25, 1.0]), min_size=2, max_size=12))
def test_discordance_is_a_probability_that_ignores_order(r):
    d = discordance(r)[0]
    assert 0.0 <= d <= 1.0
    assert discordance(r[::-1])[0] == d and discordance(sorted(r))[0] == d
    assert (d == 0.0) == (len(set(r)) == 1)


@settings(max_examples=50, deadline=None)
@given(st.lists(st.tuples(probs, probs, probs), min_size=1, max_size=20),
       st.integers(0, 2**32 - 1))
def test_bootstrap_is_ordered_and_seeded(rows, seed):
    clusters = [([a], [b], c) for a, b, c in rows]
    f1, _ = premise_figures(clusters, np.random.default_rng(seed), 200)
    f2, _ = premise_figures(clusters, np.random.default_rng(seed), 200)
    assert json.dumps(f1) == json.dumps(f2)
    if not math.isnan(f1["ci_low"]):
        assert f1["ci_low"] <= f1["ci_high"]


def test_bootstrap_refuses_an_unseeded_generator():
    with pytest.raises(TypeError, match="seeded"):
        bootstrap_ci(np.ones((3, 5)), ratio_from_sums, None)


# ----------------------------------------------------------------------------- calibration
def _world(rng, planted: bool, prompts: int = 40):
    """Prompts of 2-4 states; D is 0 or 0.5 (settled or open), P = 0.5 + 0.2 dH. Null: dH
    independent of D; planted: dH higher where D is."""
    clusters = []
    for _ in range(prompts):
        n = int(rng.integers(2, 5))
        open_ = rng.random(n) < 0.4
        d = np.where(open_, 0.5, 0.0) * (rng.random(n) < 0.9)
        dh = rng.normal(size=n) + (1.0 * open_ if planted else 0.0)
        clusters.append((np.clip(0.5 + 0.2 * dh, 0, 1), d, 0.4))
    return clusters


def test_null_worlds_cover_one_and_planted_worlds_exclude_it():
    rng = np.random.default_rng(5)
    covers, lows = 0, []
    for _ in range(150):
        f, _ = premise_figures(_world(rng, planted=False), rng, 500)
        covers += f["ci_low"] <= 1.0 <= f["ci_high"]
    assert 0.8 <= covers / 150 <= 0.97, covers  # a 90% interval, give or take chance
    for _ in range(20):
        f, _ = premise_figures(_world(rng, planted=True), rng, 500)
        lows.append(f["ci_low"])
    assert min(lows) > 1.0, lows


def test_premise_stats_imports_no_heavy_package():
    code = ("import sys, importlib.abc\n"
            "class B(importlib.abc.MetaPathFinder):\n"
            "    def find_spec(self, name, path=None, target=None):\n"
            "        if name.split('.')[0] in {'torch', 'vllm', 'transformers', 'zmq', "
            "'deepspeed', 'pydantic', 'yaml'}:\n"
            "            raise ImportError(name)\n"
            "sys.meta_path.insert(0, B())\n"
            "import arpo_async.jobs.premise_stats\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr[-2000:]
