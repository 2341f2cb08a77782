"""The verdict's statistics and curves for bench/arpo_vs_grpo.py (issue 35): Student t
intervals, the stratum table the matched random arm reads from an arpo run, the learning
curve of an arm (its checkpoints at every ``--curve-every`` executed tool calls, each
evaluated on the held-out prompts), the tool calls an arm needs to reach a target, and
the endpoints declared before the runs.

Pure apart from reading run folders and writing the plot; tests/unit/test_verdict.py."""

from __future__ import annotations

import json
import math
from pathlib import Path

# two-sided 95% quantiles of Student's t, by degrees of freedom (no scipy here)
_T975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306,
         9: 2.262, 10: 2.228, 11: 2.201, 12: 2.179, 13: 2.160, 14: 2.145, 15: 2.131,
         16: 2.120, 17: 2.110, 18: 2.101, 19: 2.093, 20: 2.086, 25: 2.060, 30: 2.042,
         40: 2.021, 60: 2.000, 120: 1.980}

# What the verdict reads, fixed before any arm runs (written to OUT/endpoints.json; a rerun
# with other endpoints, arms, seeds, budget or evaluation refuses to mix them).
ENDPOINTS = {
    "primary": "recovery: held-out share of samples that met a wrong search result (one "
               "the suite's retriever notes as such; on a suite without the note, one whose "
               "first document names none of the question's entities) and still answered "
               "right, after RL, arm minus grpo, paired per seed",
    "secondary": ["pass@1 and pass@k on the held-out prompts x k samples after RL, paired "
                  "per seed (arpo - random, arpo - random_strat, arpo - grpo)",
                  "executed tool calls to reach the SFT model's pass@1 + 0.05 (linear "
                  "between the curve's checkpoints; not reached: censored at the budget)"],
    "intervals": "mean +- t(0.975, n-1) * s.e. over seeds",
}


def t975(df: int) -> float:
    """Two-sided 95% Student t quantile (the next smaller tabled df above 30: wider)."""
    if df < 1:
        return math.nan
    return _T975.get(df) or _T975[max(k for k in _T975 if k <= df)]


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


def declare(out: Path, design: dict, redeclare: bool = False) -> dict:
    """Write OUT/endpoints.json (the endpoints and the design) before the first arm runs;
    on a rerun, refuse a design that differs from the one declared."""
    path = out / "endpoints.json"
    want = {"endpoints": ENDPOINTS, **design}
    if path.is_file() and not redeclare:
        had = json.loads(path.read_text())
        diff = sorted(k for k in want if k != "declared_at" and had.get(k) != want[k])
        if diff:
            raise SystemExit(f"{path}: declared with other {', '.join(diff)}; run with the "
                             "declared design, another --out, or --redeclare")
        return had
    path.write_text(json.dumps(want, indent=1) + "\n")
    return want
