"""S/N of branch decisions against their own sampling noise (arpo_async/jobs/null_stats.py),
three ways: a hand case, a loop reference straight from the formula (with the bootstrap
redrawn from the same generator), and hypothesis properties."""

from __future__ import annotations

import statistics

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from arpo_async.jobs.null_stats import (
    Decision,
    Trajectory,
    bootstrap_ci,
    sample_var,
    signal_to_noise,
)


def _rng(seed: int = 0) -> np.random.Generator:
    return np.random.default_rng(seed)


def test_by_hand():
    # prompt A: trajectories with H_init 1 and 3 (pooled: 2 squared deviations, 1 df);
    # decisions dH 1 (post 0, 2: var 2) and dH 3 (post 0, 4: var 8). Prompt B: one
    # trajectory, H_init 5 (no pair: no df); dH 2 (post 1, 3: var 2).
    a = [Trajectory(1.0, (Decision(1.0, (0.0, 2.0)),)),
         Trajectory(3.0, (Decision(3.0, (0.0, 4.0)),))]
    b = [Trajectory(5.0, (Decision(2.0, (1.0, 3.0)),))]
    values, metrics = signal_to_noise([a, b], _rng(), n_boot=50)
    # var(1, 3, 2) = 1; mean post var (2 + 8 + 2) / 3 = 4; H_init var 2 / 1
    assert values["dh_var"] == pytest.approx(1.0)
    assert values["init_var"] == pytest.approx(2.0)
    assert values["signal_to_noise_post_only"] == pytest.approx(1 / 4)
    assert values["signal_to_noise"] == pytest.approx(1 / (4 + 2))
    assert metrics["decisions"] == 3 and metrics["prompts"] == 2
    assert metrics["decisions_unusable"] == 0 and metrics["init_pairs_df"] == 1


def test_unusable_decisions_and_too_few():
    ok = Decision(1.0, (0.0, 1.0))
    one_window = Decision(5.0, (0.0,))  # a variance needs two resamples
    unknown = Decision(float("nan"), (0.0, 1.0))
    values, metrics = signal_to_noise([[Trajectory(0.0, (ok, one_window, unknown))]], _rng(),
                                      n_boot=20)
    assert metrics["decisions"] == 1 and metrics["decisions_unusable"] == 2
    assert values["signal_to_noise"] is None and values["ci"] == [None, None]
    # no H_init pair in any prompt: the post-only ratio is still defined
    single = [[Trajectory(0.0, (Decision(float(i), (0.0, 1.0)),))] for i in range(3)]
    values, _ = signal_to_noise(single, _rng(), n_boot=20)
    assert values["signal_to_noise"] is None and values["signal_to_noise_post_only"] == 2.0
    assert sample_var([1.0, float("nan")]) != sample_var([1.0, float("nan")])  # nan


def test_refuses_an_unseeded_generator():
    with pytest.raises(TypeError):
        bootstrap_ci(np.zeros((2, 6)), None)


# ----------------------------------------------------------------------------- reference


def _ratios(groups):
    """From the formula, with loops: pooled dH, per-decision sample variances, H_init's
    pooled within-prompt variance."""
    dh, post, ss, df = [], [], 0.0, 0
    for g in groups:
        inits = []
        for t in g:
            inits.append(t.h_init)
            for d in t.decisions:
                dh.append(d.dh)
                post.append(statistics.variance(d.h_post))
        if len(inits) >= 2:
            ss += statistics.variance(inits) * (len(inits) - 1)
            df += len(inits) - 1
    if len(dh) < 2:
        return float("nan"), float("nan")
    s = statistics.variance(dh)
    both = s / (statistics.fmean(post) + ss / df) if df else float("nan")
    return both, s / statistics.fmean(post)


def _reference(prompts, seed, n_boot, level=0.90):
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, len(prompts), size=(n_boot, len(prompts)))
    draws = [_ratios([prompts[g] for g in row]) for row in idx]
    tail = (1 - level) / 2 * 100
    cis = [np.percentile([d[j] for d in draws if d[j] == d[j]], [tail, 100 - tail])
           for j in range(2)]
    return _ratios(prompts), cis[0], cis[1]


def _random_prompts(rng, n_prompts=12, repeats=5):
    out = []
    for _ in range(n_prompts):
        out.append([Trajectory(float(rng.normal(3, 0.5)), tuple(
            Decision(float(rng.normal(0, 2)), tuple(rng.normal(4, 1, repeats)))
            for _ in range(int(rng.integers(1, 3))))) for _ in range(int(rng.integers(1, 4)))])
    return out


@pytest.mark.parametrize("seed", range(3))
def test_matches_the_reference(seed):
    prompts = _random_prompts(np.random.default_rng(seed))
    values, _ = signal_to_noise(prompts, np.random.default_rng(seed + 100), n_boot=100)
    (both, post), ci_both, ci_post = _reference(prompts, seed + 100, 100)
    assert values["signal_to_noise"] == pytest.approx(both)
    assert values["signal_to_noise_post_only"] == pytest.approx(post)
    assert values["ci"] == pytest.approx(list(ci_both))
    assert values["ci_post_only"] == pytest.approx(list(ci_post))


# ----------------------------------------------------------------------------- properties

# entropies at 0.01 nat: two values closer than a float's resolution at an offset would
# become equal there (0 and 1e-150 + 0.1), which no rescaling of a real H does
_h = st.integers(-500, 500).map(lambda i: i / 100)
_decision = st.builds(Decision, _h, st.tuples(_h, _h, _h))
_trajectory = st.builds(Trajectory, _h, st.lists(_decision, min_size=1, max_size=2).map(tuple))
_prompts = st.lists(st.lists(_trajectory, min_size=1, max_size=3), min_size=2, max_size=6)


@settings(max_examples=60, deadline=None)
@given(_prompts, st.floats(0.1, 10), st.floats(-3, 3))
def test_invariant_to_the_scale_and_offset_of_h(prompts, scale, offset):
    """S/N is a ratio of variances: the same in any unit of H, and an offset of every
    window (a constant bias of the estimator) cancels in dH and in the variances."""
    moved = [[Trajectory(t.h_init * scale + offset, tuple(
        Decision(d.dh * scale, tuple(h * scale + offset for h in d.h_post))
        for d in t.decisions)) for t in p] for p in prompts]
    a, _ = signal_to_noise(prompts, _rng(), n_boot=20)
    b, _ = signal_to_noise(moved, _rng(), n_boot=20)
    if a["signal_to_noise"] is not None and a["post_var_mean"] > 1e-3 \
            and a["init_var"] > 1e-3 and a["dh_var"] > 1e-3:
        assert b["signal_to_noise"] == pytest.approx(a["signal_to_noise"], rel=1e-6)
        # an interval is undefined (None) where too few draws were: in both units alike
        assert [x is None for x in b["ci"]] == [x is None for x in a["ci"]]
        assert [x for x in b["ci"] if x is not None] == pytest.approx(
            [x for x in a["ci"] if x is not None], rel=1e-6)


@settings(max_examples=60, deadline=None)
@given(_prompts, st.integers(0, 2**31))
def test_ordered_and_bounded(prompts, seed):
    """Counting H_init's noise too never raises S/N; a bootstrap interval is ordered; the
    same seed gives the same interval."""
    values, metrics = signal_to_noise(prompts, _rng(seed), n_boot=40)
    assert metrics["decisions"] == sum(len(t.decisions) for p in prompts for t in p)
    if values["signal_to_noise"] is not None:
        assert values["signal_to_noise"] <= values["signal_to_noise_post_only"] + 1e-9
        assert values["signal_to_noise"] >= -1e-9
        lo, hi = values["ci"]
        if lo is not None:
            assert lo <= hi
    assert signal_to_noise(prompts, _rng(seed), n_boot=40)[0] == values


@settings(max_examples=40, deadline=None, derandomize=True)
@given(st.integers(0, 2**31))
def test_pure_noise_reads_about_one(seed):
    """dH drawn as one post window minus the trajectory's H_init, with the laws of the
    resamples and of the prompt's other trajectories: S/N is about 1 (40 prompts x 3
    trajectories: a ratio of variances of 120 draws, std about 0.13, so the bounds are
    over 3.5 std away; derandomized, so the same 40 worlds run every time)."""
    rng = np.random.default_rng(seed)
    prompts = []
    for _ in range(40):
        mu = rng.normal(0, 3)  # a prompt's level: moves both windows, cancels in dH
        trajectories = []
        for _ in range(3):
            h_init = float(rng.normal(mu, 0.5))
            trajectories.append(Trajectory(h_init, (Decision(
                float(rng.normal(mu, 1)) - h_init, tuple(rng.normal(mu, 1, 8))),)))
        prompts.append(trajectories)
    values, _ = signal_to_noise(prompts, _rng(), n_boot=20)
    assert 0.55 < values["signal_to_noise"] < 1.6
    assert 0.7 < values["signal_to_noise_post_only"] < 2.0  # 1 + 0.25 / 1
