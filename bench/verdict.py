"""The verdict's statistics and curves for bench/arpo_vs_grpo.py (issue 35): Student t
intervals, the stratum table the matched random arm reads from an arpo run, the learning
curve of an arm (its checkpoints at every ``--curve-every`` executed tool calls, each
evaluated on the held-out prompts) and the tool calls an arm needs to reach a target.
The endpoints are declared in git before the runs (bench/declared.py, bench/declared/).

Student's t without scipy: the two quantiles a paired design needs (t(0.975) for the
interval, t(0.80) for power) are tabled, and the two-sided p-value is the exact closed form
for integer degrees of freedom (Abramowitz & Stegun 26.7.3-4); a test checks each table
entry against that form.

Pure apart from reading run folders and writing the plot; tests/unit/test_verdict.py."""

from __future__ import annotations

import json
import math
from pathlib import Path

# two-sided 95% quantiles of Student's t, by degrees of freedom (no scipy here)
_T975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306,
         9: 2.262, 10: 2.228, 11: 2.201, 12: 2.179, 13: 2.160, 14: 2.145, 15: 2.131,
         16: 2.120, 17: 2.110, 18: 2.101, 19: 2.093, 20: 2.086, 21: 2.080, 22: 2.074,
         23: 2.069, 24: 2.064, 25: 2.060, 26: 2.056, 27: 2.052, 28: 2.048, 29: 2.045,
         30: 2.042, 40: 2.021, 60: 2.000, 120: 1.980}
# one-sided 80% quantiles (power 0.80 of a paired design), by degrees of freedom
_T80 = {1: 1.376, 2: 1.061, 3: 0.978, 4: 0.941, 5: 0.920, 6: 0.906, 7: 0.896, 8: 0.889,
        9: 0.883, 10: 0.879, 11: 0.876, 12: 0.873, 13: 0.870, 14: 0.868, 15: 0.866,
        16: 0.865, 17: 0.863, 18: 0.862, 19: 0.861, 20: 0.860, 21: 0.859, 22: 0.858,
        23: 0.858, 24: 0.857, 25: 0.856, 26: 0.856, 27: 0.855, 28: 0.855, 29: 0.854,
        30: 0.854, 40: 0.851, 60: 0.848, 120: 0.845}


def _tabled(table: dict[int, float], df: int) -> float:
    if df < 1:
        return math.nan
    return table.get(df) or table[max(k for k in table if k <= df)]


def t975(df: int) -> float:
    """Two-sided 95% Student t quantile (the next smaller tabled df above 30: wider)."""
    return _tabled(_T975, df)


def t80(df: int) -> float:
    """One-sided 80% Student t quantile (the next smaller tabled df above 30: larger)."""
    return _tabled(_T80, df)


def t_two_sided_p(t: float, df: int) -> float:
    """P(|T| >= |t|) for Student's t with integer ``df`` >= 1, exact: 1 - A(t|df) with
    A&S 26.7.3 (odd df) and 26.7.4 (even df), theta = atan(|t| / sqrt(df))."""
    if df < 1 or t != t:
        return math.nan
    theta = math.atan(abs(t) / math.sqrt(df))
    s, c = math.sin(theta), math.cos(theta)
    if df % 2:  # (2/pi)(theta + sin(cos + 2/3 cos^3 + ... up to cos^(df-2)))
        term = c
        total = c if df > 1 else 0.0
        for k in range(3, df - 1, 2):
            term *= c * c * (k - 1) / k
            total += term
        a = 2 / math.pi * (theta + s * total)
    else:  # sin(1 + 1/2 cos^2 + 1.3/2.4 cos^4 + ... up to cos^(df-2))
        term = total = 1.0
        for k in range(2, df - 1, 2):
            term *= c * c * (k - 1) / k
            total += term
        a = s * total
    return min(1.0, max(0.0, 1.0 - a))


def mean_ci(values: list[float]) -> dict:
    """Mean, standard error and the 95% t interval of ``values`` (nan and None left out)."""
    vals = [float(v) for v in values if v is not None and v == v]
    n = len(vals)
    if not n:
        return {"n": 0, "mean": math.nan, "se": math.nan, "lo": math.nan, "hi": math.nan}
    m = sum(vals) / n
    se = math.sqrt(sum((v - m) ** 2 for v in vals) / (n - 1) / n) if n > 1 else math.nan
    half = t975(n - 1) * se
    return {"n": n, "mean": m, "se": se, "lo": m - half, "hi": m + half}


def stratum_table(run_dir: Path, min_decisions: int = 20) -> dict[str, float]:
    """Mean branch probability per stratum (``tool/index``) over a run's decisions, from
    its metrics' ``branch/stratum/*`` sums; strata with fewer than ``min_decisions`` are
    left to ``rollout.alpha``."""
    from arpo_async.core.metrics import read_metrics

    n: dict[str, float] = {}
    p: dict[str, float] = {}
    for row in read_metrics(run_dir):
        for key, value in row.items():
            if key.startswith("branch/stratum/"):
                stratum, _, what = key.removeprefix("branch/stratum/").rpartition("/")
                (n if what == "n" else p)[stratum] = (n if what == "n" else p).get(
                    stratum, 0.0) + float(value)
    return {s: round(p.get(s, 0.0) / c, 4) for s, c in sorted(n.items()) if c >= min_decisions}


def checkpoint_calls(ckpt: Path) -> int:
    """Executed tool calls trained up to a checkpoint (its metadata)."""
    from arpo_async.core.rundir import META

    return int(json.loads((ckpt / META).read_text()).get("tool_calls_trained", 0))


def calls_to_reach(curve: list[tuple[float, float]], target: float,
                   budget: float = 0.0) -> tuple[float, bool]:
    """(tool calls, reached) at which the curve [(calls, accuracy), ...] (calls rising,
    the SFT point first) first reaches ``target``, linear between points; not reached:
    censored (False) at the budget, or at the last point when it lies past the budget (an
    arm cut short is not counted as cheaper)."""
    for (c0, a0), (c1, a1) in zip(curve, curve[1:]):
        if a1 >= target > a0:
            return c0 + (target - a0) / (a1 - a0) * (c1 - c0), True
    if curve and curve[0][1] >= target:
        return curve[0][0], True
    return (max(curve[-1][0], budget) if curve else math.nan), False


def curve_bands(rows: list[dict], sft_acc: float, every: int) -> dict[str, list[dict]]:
    """Per arm, mean accuracy and s.e. over seeds at each multiple of ``every`` tool calls
    (each seed's curve read linearly at that point)."""
    out: dict[str, list[dict]] = {}
    for arm in dict.fromkeys(r["arm"] for r in rows):
        curves = [[(0.0, sft_acc)] + [(c["calls"], c["pass@1"]) for c in r.get("curve", [])]
                  for r in rows if r["arm"] == arm]
        top = min(c[-1][0] for c in curves)
        points = []
        for x in range(0, int(top) + 1, every):
            stats = mean_ci([_at(c, x) for c in curves])
            points.append({"calls": x, "mean": stats["mean"], "se": stats["se"],
                           "n": stats["n"]})
        out[arm] = points
    return out


def _at(curve: list[tuple[float, float]], x: float) -> float:
    for (c0, a0), (c1, a1) in zip(curve, curve[1:]):
        if c0 <= x <= c1:
            return a0 if c1 == c0 else a0 + (x - c0) / (c1 - c0) * (a1 - a0)
    return curve[-1][1] if x >= curve[-1][0] else curve[0][1]


def plot_curves(bands: dict[str, list[dict]], sft_acc: float, gain: float, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4))
    for arm, points in bands.items():
        x = [p["calls"] for p in points]
        m = [p["mean"] for p in points]
        se = [0.0 if p["se"] != p["se"] else p["se"] for p in points]
        ax.plot(x, m, label=arm)
        ax.fill_between(x, [a - b for a, b in zip(m, se)], [a + b for a, b in zip(m, se)],
                        alpha=0.2)
    ax.axhline(sft_acc + gain, color="grey", ls=":", lw=1, label=f"SFT + {100 * gain:g} points")
    ax.set_xlabel("executed tool calls trained")
    ax.set_ylabel("held-out pass@1 (mean ± s.e. over seeds)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
