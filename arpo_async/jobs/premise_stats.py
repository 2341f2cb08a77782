"""The outcome test of ARPO's premise as pure math: reward discordance, the useful-fork
ratio, fork against global discordance, a bootstrap over prompts and correlations.

ARPO (arXiv 2507.19849, Sec. 3.2) forks after a tool result with probability
P_s = clip(alpha + beta * dH_s, 0, 1). Its premise: a rise of entropy after a tool result
marks a state whose continuations may end differently, so a fork there is worth its cost.
``arpo_async/jobs/analyze_branching.py`` completes K continuations from every post-tool
state s of sampled trajectories and hands their rewards here. Definitions:

* **discordance** D_s: the share of the K(K-1)/2 pairs i < j of continuations whose
  rewards differ (|r_i - r_j| > ``DISCORD_TOL``), the unbiased estimate of the probability
  that two continuations from s disagree. For a binary reward with mean p over the K it is
  2 p (1 - p) K / (K - 1); for graded rewards (QA F1, the two-tool bonus) any difference
  counts, not its size.
* **useful-fork ratio** = (sum_s P_s D_s / sum_s P_s) / mean_s D_s: the expected
  discordance of a fork placed by ARPO's P over that of a fork placed at random at the
  same mean rate (each state equally likely). 1: entropy places forks no better than
  chance; above 1, better.
* **fork_vs_global** = sum_s D_s / sum_s G_prompt(s): post-tool states against K fresh
  samples of the same prompt (G, their discordance), each state paired with its prompt.
* **Intervals over prompts** (the clusters: a prompt's states are not independent).
  Every figure above is a ratio of sums, so a prompt enters as one row of sums
  (``cluster_sums``). The default interval is **Fieller's** for a ratio of cluster totals
  (``fieller_ci``): theta0 is inside when the prompt-clustered z statistic of
  sum_c (u_c - theta0 v_c) is within the normal quantile, u the numerator's and v the
  denominator's per-prompt contributions (a denominator that is a product or quotient of
  totals, like mean D * mean P, enters by its linearisation, which sums to it exactly).
  Why not the percentile bootstrap (``method="percentile"``, kept): where outcomes rarely
  split (mean D 0.01-0.03: a handful of discordant states among hundreds) its 90%
  interval covered the truth 0.80 and 0.87 of the time in simulated worlds of 60 prompts
  and 300 states, Fieller's 0.90 and 0.91 (tests/unit/test_screen_calibration.py). The
  test statistic is self-normalised, so a few large terms do not break it as they break
  the bootstrap distribution of a ratio; a denominator not clearly above 0 gives an
  unbounded interval instead of a falsely narrow one. Believe either from a few dozen
  prompts on.
* **Pearson correlation**, overall and by a key (tool, tool-result kind).

Each function returns ``(value, metrics)``; nothing here imports a model, engine or tool.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable, Sequence
from statistics import NormalDist

import numpy as np

DISCORD_TOL = 1e-6  # rewards closer than this count as the same outcome
SUMS = ("pd", "p", "d", "n", "g")  # a prompt's row: sums of P*D, P, D, states, G


def discordance(rewards: Sequence[float], tol: float = DISCORD_TOL) -> tuple[float, dict]:
    """Share of pairs i < j with |r_i - r_j| > tol; nan with fewer than two rewards."""
    r = np.asarray(rewards, dtype=np.float64)
    k = r.size
    if k < 2:
        return math.nan, {"k": k, "pairs": 0, "disagree": 0}
    differ = np.abs(r[:, None] - r[None, :]) > tol
    disagree = int(np.triu(differ, 1).sum())
    pairs = k * (k - 1) // 2
    return disagree / pairs, {"k": k, "pairs": pairs, "disagree": disagree}


def useful_fork_ratio(p: Sequence[float], d: Sequence[float]) -> tuple[float, dict]:
    """(sum P D / sum P) / mean D over the states with a finite D; nan when no fork would
    be placed (sum P = 0) or no state is discordant (mean D = 0)."""
    p_a, d_a = _aligned(p, d)
    keep = np.isfinite(d_a)
    p_a, d_a = p_a[keep], d_a[keep]
    if np.any(~np.isfinite(p_a)) or np.any((p_a < 0) | (p_a > 1)):
        raise ValueError("useful_fork_ratio: every P must be a probability in [0, 1]")
    n = int(d_a.size)
    forked = float(p_a @ d_a / p_a.sum()) if n and p_a.sum() > 0 else math.nan
    at_random = float(d_a.mean()) if n else math.nan
    ratio = forked / at_random if at_random and math.isfinite(forked) else math.nan
    return ratio, {"n": n, "p_mean": float(p_a.mean()) if n else math.nan,
                   "d_forked": forked, "d_random": at_random}


def cluster_sums(p: Sequence[float], d: Sequence[float], g: Sequence[float]) -> np.ndarray:
    """One prompt's row of ``SUMS`` over its states with a finite D (P, D, and G = the
    prompt's global discordance, per state)."""
    p_a, d_a = _aligned(p, d)
    g_a = np.broadcast_to(np.asarray(g, dtype=np.float64), d_a.shape)
    keep = np.isfinite(d_a)
    p_a, d_a, g_a = p_a[keep], d_a[keep], g_a[keep]
    return np.array([p_a @ d_a, p_a.sum(), d_a.sum(), float(d_a.size), g_a.sum()])


def ratio_from_sums(t: np.ndarray) -> np.ndarray:
    """The useful-fork ratio from summed rows (``SUMS`` on the last axis)."""
    with np.errstate(divide="ignore", invalid="ignore"):
        r = (t[..., 0] / t[..., 1]) / (t[..., 2] / t[..., 3])
    return np.where(np.isfinite(r), r, np.nan)


def fork_vs_global_from_sums(t: np.ndarray) -> np.ndarray:
    """sum D / sum G from summed rows."""
    with np.errstate(divide="ignore", invalid="ignore"):
        r = t[..., 2] / t[..., 4]
    return np.where(np.isfinite(r), r, np.nan)


def bootstrap_ci(rows: np.ndarray, statistic: Callable[[np.ndarray], np.ndarray],
                 rng: np.random.Generator, n_boot: int = 2000, level: float = 0.9
                 ) -> tuple[tuple[float, float], dict]:
    """Percentile interval of ``statistic`` (of summed rows) over ``n_boot`` resamples of
    the clusters ``rows`` [C, m] with replacement. Replicates where the statistic is
    undefined (nan) are left out and counted."""
    if not isinstance(rng, np.random.Generator):
        raise TypeError("bootstrap_ci needs a seeded numpy Generator (no global random)")
    if not 0 < level < 1 or n_boot < 1:
        raise ValueError(f"bootstrap_ci: level in (0, 1) and n_boot >= 1; got {level}, "
                         f"{n_boot}")
    rows = np.asarray(rows, dtype=np.float64)
    c = rows.shape[0]
    if c == 0:
        return (math.nan, math.nan), {"n_boot": n_boot, "undefined": n_boot, "level": level}
    idx = rng.integers(0, c, size=(n_boot, c))
    stats = statistic(rows[idx].sum(axis=1))
    ok = stats[np.isfinite(stats)]
    metrics = {"n_boot": n_boot, "undefined": int(n_boot - ok.size), "level": level}
    if not ok.size:
        return (math.nan, math.nan), metrics
    lo, hi = np.quantile(ok, [(1 - level) / 2, (1 + level) / 2])
    return (float(lo), float(hi)), metrics


def fieller_ci(u: np.ndarray, v: np.ndarray, level: float = 0.9
               ) -> tuple[tuple[float, float], dict]:
    """Fieller's interval for theta = sum u / sum v over clusters (per-cluster u, v [C]):
    every theta0 with (sum u - theta0 sum v)^2 <= z^2 Var(theta0), Var the clustered
    variance C/(C-1) sum_c (z_c - mean z)^2 of z_c = u_c - theta0 v_c. A quadratic in
    theta0; when the denominator is not clearly nonzero (leading coefficient <= 0) the
    set is unbounded: (-inf, inf), ``unbounded`` in the metrics."""
    u, v = np.asarray(u, np.float64), np.asarray(v, np.float64)
    c = u.size
    metrics = {"clusters": c, "level": level, "unbounded": False}
    if c < 2 or not v.sum():
        return (math.nan, math.nan), metrics
    z2 = NormalDist().inv_cdf((1 + level) / 2) ** 2
    uc, vc, f = u - u.mean(), v - v.mean(), c / (c - 1)
    s_uu, s_vv, s_uv = f * (uc @ uc), f * (vc @ vc), f * (uc @ vc)
    su, sv = u.sum(), v.sum()
    qa, qb, qc = sv * sv - z2 * s_vv, -2 * (su * sv - z2 * s_uv), su * su - z2 * s_uu
    disc = qb * qb - 4 * qa * qc
    if qa <= 0 or disc < 0:
        metrics["unbounded"] = True
        return (-math.inf, math.inf), metrics
    root = math.sqrt(disc)
    return ((-qb - root) / (2 * qa), (-qb + root) / (2 * qa)), metrics


def ratio_parts(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The useful-fork ratio sum PD / (sum D * sum P / n) as per-prompt (u, v) for
    ``fieller_ci``: v linearises the denominator (it sums to it exactly)."""
    pd, p, d, n = (rows[:, i] for i in range(4))
    tp, td, tn = p.sum(), d.sum(), n.sum()
    if not tn:
        return pd, np.zeros_like(pd)
    return pd, d * tp / tn + td * p / tn - td * tp * n / tn**2


def premise_figures(clusters: Sequence[tuple[Sequence[float], Sequence[float], float]],
                    rng: np.random.Generator, n_boot: int = 2000, level: float = 0.9,
                    method: str = "fieller") -> tuple[dict, dict]:
    """The ratio and fork_vs_global with their intervals over prompts, from one
    (P per state, D per state, G of the prompt) per prompt. ``method``: ``fieller``
    (``fieller_ci``; ``rng`` and ``n_boot`` unused) or ``percentile`` (``bootstrap_ci``)."""
    if method not in ("fieller", "percentile"):
        raise ValueError(f"premise_figures: method={method!r}; expected fieller|percentile")
    rows = (np.stack([cluster_sums(p, d, g) for p, d, g in clusters]) if clusters
            else np.zeros((0, len(SUMS))))
    total = rows.sum(axis=0)
    ratio = float(ratio_from_sums(total))
    fvg = float(fork_vs_global_from_sums(total))
    if method == "fieller":
        (lo, hi), m_ratio = fieller_ci(*ratio_parts(rows), level)
        (flo, fhi), m_fvg = fieller_ci(rows[:, 2], rows[:, 4], level)
    else:
        (lo, hi), m_ratio = bootstrap_ci(rows, ratio_from_sums, rng, n_boot, level)
        (flo, fhi), m_fvg = bootstrap_ci(rows, fork_vs_global_from_sums, rng, n_boot, level)
    n = total[3]
    figures = {"useful_fork_ratio": ratio, "ci_low": lo, "ci_high": hi,
               "fork_vs_global": fvg, "fvg_ci_low": flo, "fvg_ci_high": fhi}
    metrics = {"prompts": len(clusters), "states": int(n), "level": level,
               "interval": method,
               "p_mean": total[1] / n if n else math.nan,
               "d_mean": total[2] / n if n else math.nan,
               "d_forked": total[0] / total[1] if total[1] else math.nan,
               "g_mean": total[4] / n if n else math.nan,
               "ratio_interval": m_ratio, "fvg_interval": m_fvg}
    return figures, metrics


def pearson(x: Sequence[float], y: Sequence[float]) -> tuple[float, dict]:
    """Pearson's r over the pairs where both are finite; nan with fewer than 3 pairs or
    a constant side."""
    x_a, y_a = _aligned(x, y)
    keep = np.isfinite(x_a) & np.isfinite(y_a)
    n = int(keep.sum())
    if n < 3:
        return math.nan, {"n": n}
    x_c, y_c = x_a[keep] - x_a[keep].mean(), y_a[keep] - y_a[keep].mean()
    den = math.sqrt(float(x_c @ x_c) * float(y_c @ y_c))
    r = float(np.clip(x_c @ y_c / den, -1.0, 1.0)) if den > 0 else math.nan
    return r, {"n": n}


def correlation_by(keys: Sequence[Hashable], x: Sequence[float], y: Sequence[float]
                   ) -> tuple[dict, dict]:
    """Pearson's r of x and y within each key: {key: {"r", "n"}}."""
    if not len(keys) == len(x) == len(y):
        raise ValueError(f"correlation_by: {len(keys)} keys, {len(x)} x, {len(y)} y")
    out = {}
    for key in sorted(set(keys), key=str):
        sel = [i for i, k in enumerate(keys) if k == key]
        r, m = pearson([x[i] for i in sel], [y[i] for i in sel])
        out[key] = {"r": r, "n": m["n"]}
    return out, {"groups": len(out)}


def _aligned(a: Sequence[float], b: Sequence[float]) -> tuple[np.ndarray, np.ndarray]:
    a_a, b_a = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    if a_a.shape != b_a.shape or a_a.ndim != 1:
        raise ValueError(f"expected two 1-d sequences of one length, got {a_a.shape} and "
                         f"{b_a.shape}")
    return a_a, b_a
