"""The premise intervals calibrated where outcomes rarely split (issue 53, item 1.3).

Simulated null worlds of 60 prompts with 2-8 post-tool states each (about 300 states):
a prompt is open with probability 0.3, an open prompt's states are open with a
probability set by the target mean D; an open state's continuations succeed with a
probability drawn from U(0.03, 0.5), a settled one's all succeed or all fail; D is the
discordance of K = 8 binary continuations; P = clip(0.5 + 0.2 dH, 0, 1) with dH ~ N(0, 1)
drawn apart from D, so the true useful-fork ratio is 1. At mean D 0.01 and 0.03 the 90%
Fieller interval (the default of ``premise_figures``) must cover 1 in 0.88-0.92 of the
worlds, and the old percentile bootstrap must fall short (below 0.88 at mean D 0.01),
which shows the test can fail. 1200 worlds per level: the coverage estimate's s.e. is
about 0.009."""

from __future__ import annotations

import numpy as np
import pytest

from arpo_async.jobs.premise_stats import (
    bootstrap_ci,
    cluster_sums,
    fieller_ci,
    premise_figures,
    ratio_from_sums,
    ratio_parts,
)

K, PROMPTS, MAX_STATES = 8, 60, 8
WORLDS = 1200


def sparse_worlds(rng: np.random.Generator, worlds: int, open_share: float,
                  planted: float = 0.0) -> np.ndarray:
    """Per-prompt rows [worlds, PROMPTS, 5] of (sum PD, sum P, sum D, n, G) (module
    docstring); ``planted`` shifts dH up at open states (0: the null)."""
    shape = (worlds, PROMPTS, MAX_STATES)
    n = rng.integers(2, MAX_STATES + 1, size=shape[:2])
    real = np.arange(MAX_STATES) < n[..., None]
    open_prompt = rng.random((*shape[:2], 1)) < 0.3
    open_ = (rng.random(shape) < open_share / 0.3) & open_prompt & real
    q = np.where(open_, rng.uniform(0.03, 0.5, shape), rng.integers(0, 2, shape))
    m = (rng.random((*shape, K)) < q[..., None]).sum(-1)
    d = 2 * m * (K - m) / (K * (K - 1)) * real
    p = np.clip(0.5 + 0.2 * (rng.normal(size=shape) + planted * open_), 0, 1) * real
    return np.stack([(p * d).sum(-1), p.sum(-1), d.sum(-1), n.astype(float),
                     np.full(shape[:2], 0.3)], axis=-1)


def coverage(rows: np.ndarray, method: str, rng: np.random.Generator) -> tuple[float, float]:
    """(share of worlds whose interval covers 1, mean D) over the worlds with a ratio."""
    hits, defined = 0, 0
    for world in rows:
        if not np.isfinite(ratio_from_sums(world.sum(0))):
            continue  # no discordant state at all: no ratio to cover
        defined += 1
        if method == "fieller":
            (lo, hi), _ = fieller_ci(*ratio_parts(world), 0.9)
        else:
            (lo, hi), _ = bootstrap_ci(world, ratio_from_sums, rng, 400, 0.9)
        hits += lo <= 1.0 <= hi
    return hits / defined, float(rows[..., 2].sum() / rows[..., 3].sum())


@pytest.mark.parametrize(("open_share", "d_target"), [(0.028, 0.01), (0.085, 0.03)])
def test_fieller_covers_at_sparse_d_and_the_percentile_bootstrap_does_not(open_share,
                                                                          d_target):
    rows = sparse_worlds(np.random.default_rng([53, int(d_target * 1000)]), WORLDS,
                         open_share)
    fieller, d_mean = coverage(rows, "fieller", np.random.default_rng(1))
    percentile, _ = coverage(rows, "percentile", np.random.default_rng(2))
    print(f"mean D {d_mean:.4f}: Fieller {fieller:.3f}, percentile {percentile:.3f}")
    assert d_mean == pytest.approx(d_target, rel=0.15)
    assert 0.88 <= fieller <= 0.92, fieller
    assert percentile < fieller
    if d_target == 0.01:
        assert percentile < 0.88, percentile


def test_premise_figures_uses_the_calibrated_interval():
    rows = sparse_worlds(np.random.default_rng(7), 1, 0.085, planted=2.0)[0]
    clusters = [([r[1] / r[3]] * int(r[3]), [r[2] / r[3]] * int(r[3]), 0.3) for r in rows]
    f, m = premise_figures(clusters, np.random.default_rng(0))
    sums = np.stack([cluster_sums(p, d, g) for p, d, g in clusters])
    (lo, hi), _ = fieller_ci(*ratio_parts(sums), 0.9)
    assert (f["ci_low"], f["ci_high"]) == pytest.approx((lo, hi))
    assert m["interval"] == "fieller" and f["ci_low"] <= f["useful_fork_ratio"] <= f["ci_high"]
    old, m_old = premise_figures(clusters, np.random.default_rng(0), 200, method="percentile")
    assert m_old["interval"] == "percentile" and old["useful_fork_ratio"] == \
        f["useful_fork_ratio"]


def test_fieller_matches_a_scan_of_the_test_it_inverts():
    """The interval is every theta0 whose clustered z statistic is within 1.645."""
    rng = np.random.default_rng(11)
    for _ in range(20):
        u, v = rng.random(30) * (rng.random(30) < 0.5), rng.random(30) + 0.2
        (lo, hi), _ = fieller_ci(u, v, 0.9)
        grid = np.linspace(0, 2 * u.sum() / v.sum() + 1, 20001)
        z = u[None] - grid[:, None] * v[None]
        var = 30 / 29 * ((z - z.mean(1, keepdims=True)) ** 2).sum(1)
        inside = grid[z.sum(1) ** 2 <= 1.6448536269514722**2 * var]
        step = grid[1] - grid[0]
        assert lo == pytest.approx(inside.min(), abs=step) and hi == pytest.approx(
            inside.max(), abs=step)
    assert np.isnan(fieller_ci(np.array([1.0, 0.0]), np.array([0.0, 0.0]))[0][0])
    (lo, hi), m = fieller_ci(np.array([1.0, 2.0, 0.0]), np.array([1.0, -1.0, 0.1]))
    assert m["unbounded"] and (lo, hi) == (-np.inf, np.inf)  # denominator not clear of 0
