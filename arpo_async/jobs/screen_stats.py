"""One screen, every rule, the same states: fork-placement rules scored on the probed
post-tool states of ``analyze branching`` (issue 53, item 1). Pure math, no model.

A **rule** gives each probed state s a fork weight w_s >= 0 (a fork rate up to scale;
every figure below is invariant to the scale of w):

* ``arpo``: the state's P = clip(alpha + beta dH, 0, 1) as the rollout computed it (the
  authors' estimator and settings when the bench runs with them);
* ``max_token``: the window's most uncertain token, ``h_max`` (the rollout's
  ``entropy_reduce=max`` value). Rank-based: w = mid-rank of h_max among the states / n,
  so no beta has to be chosen for its scale; a state without h_max gets the middle rank;
* ``stratum``: D-hat of the state's class (tool, result kind, call index), cross-fitted:
  prompts split in two folds by a seeded permutation, each fold scored with the mean D of
  its class in the other fold (a class unseen there gets that fold's overall mean D);
* ``prompt_pq``: p(1 - p) of the prompt's own K global rewards (clipped to [0, 1]),
  p their mean; the same for every state of a prompt;
* ``random``: 1 everywhere, the reference row (its ratio is exactly 1);
* ``oracle``: D itself, the ceiling.

Figures per rule (D_s the discordance of s's K continuations, ``premise_stats``):

* **ratio** = (sum w D / sum w) / mean D: a fork placed by the rule against one placed
  uniformly at random on the same states;
* **diff** = ratio(rule) - ratio(arpo), paired (the same states, the same D);
* **per_call** = (sum_s w_s D_s / sum_s w_s c_s) / (sum_q G_q / sum_q g_q): the
  discordance a fork buys per tool call its continuation executes (c_s: the mean over
  s's K continuations of the calls each executed after the fork) against what a fresh
  global sample buys per call (G_q: the discordance of prompt q's K global samples, g_q:
  their mean tool calls per sample; every probed prompt counts once, states or not).
  Above 1: at the same tool budget, forks placed by the rule find more discordant pairs
  than fresh samples. Needs the prober's ``calls`` and ``global_calls`` (nan without).
* intervals over prompts: Fieller's (``premise_stats.fieller_ci``) for ratio and
  per_call (unbounded, (-inf, inf), when the denominator is not clearly above 0 on these
  prompts; the oracle's often is, its weights being the sparse D itself), the clustered
  delta method for diff; random's is its point, 1;
* **perm_p**: within-prompt permutation p-value of the ratio (null: the rule's weights
  are exchangeable among a prompt's states): weights shuffled within each prompt
  ``n_perm`` times, p = (1 + #{perm ratio >= observed}) / (1 + n_perm), seeded generator
  injected. ``prompt_pq`` is constant within a prompt, so its p is 1 by construction
  (this null cannot see placement between prompts); ``random`` and ``oracle`` get none.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from statistics import NormalDist

import numpy as np

from arpo_async.jobs.premise_stats import discordance, fieller_ci, ratio_parts

RULES = ("arpo", "max_token", "stratum", "prompt_pq", "random", "oracle")
NO_P = ("random", "oracle")


@dataclass(frozen=True)
class ScreenStates:
    """The probed states with a finite D, sorted by prompt; per-prompt arrays [Q] for
    every probed prompt. nan marks a field an older prober did not record."""

    prompt: np.ndarray  # [S] prompt index 0..Q-1, non-decreasing
    p: np.ndarray  # [S] ARPO's P as the rollout computed it
    h_max: np.ndarray  # [S] the window's largest token entropy
    cls: list  # [S] (tool, kind, call index)
    d: np.ndarray  # [S] discordance of the K continuations
    calls: np.ndarray  # [S] mean tool calls of the continuations after the fork
    g: np.ndarray  # [Q] discordance of the prompt's global samples
    g_calls: np.ndarray  # [Q] mean tool calls of a global sample
    g_mean: np.ndarray  # [Q] mean global reward, clipped to [0, 1]


def states_from_records(records: Sequence[dict]) -> tuple[ScreenStates, dict]:
    """``ScreenStates`` from the prober's JSON lines (old lines load: missing fields nan)."""
    cols: dict[str, list] = {k: [] for k in ("prompt", "p", "h_max", "cls", "d", "calls")}
    g, g_calls, g_mean = [], [], []
    for q, rec in enumerate(sorted(records, key=lambda r: r["index"])):
        g.append(discordance(rec["global"])[0])
        gc = rec.get("global_calls")
        g_calls.append(float(np.mean(gc)) if gc else math.nan)
        g_mean.append(float(np.clip(rec["global"], 0, 1).mean()) if rec["global"] else math.nan)
        for s in rec["states"]:
            d = discordance(s["rewards"])[0]
            if not math.isfinite(d):
                continue
            calls = s.get("calls")
            cols["prompt"].append(q)
            cols["p"].append(s["p"])
            cols["h_max"].append(_num(s.get("h_max")))
            cols["cls"].append((s.get("tool"), s.get("kind"), s.get("call_index")))
            cols["d"].append(d)
            cols["calls"].append(float(np.mean(calls)) if calls else math.nan)
    arr = {k: np.asarray(v, np.float64) for k, v in cols.items() if k != "cls"}
    states = ScreenStates(arr["prompt"].astype(np.int64), arr["p"], arr["h_max"], cols["cls"],
                          arr["d"], arr["calls"], np.asarray(g, np.float64),
                          np.asarray(g_calls, np.float64), np.asarray(g_mean, np.float64))
    missing = [name for name, ok in (
        ("h_max", np.isfinite(states.h_max).any()),
        ("call_index", any(c[2] is not None for c in states.cls)),
        ("calls", np.isfinite(states.calls).all() and np.isfinite(states.g_calls).all()))
        if not ok]
    return states, {"prompts": len(g), "states": int(states.d.size), "missing": missing}


def _num(x) -> float:
    return math.nan if x is None else float(x)


# ----------------------------------------------------------------------------- the rules
def rule_weights(st: ScreenStates, rng: np.random.Generator) -> tuple[dict, dict]:
    """{rule: w [S] or None (the fields it needs are missing)}; ``rng`` draws the folds."""
    if not isinstance(rng, np.random.Generator):
        raise TypeError("rule_weights needs a seeded numpy Generator (no global random)")
    n = st.d.size
    h = st.h_max
    max_token = None
    if np.isfinite(h).any():
        known = np.isfinite(h)
        ranks = np.full(n, 0.5)
        ranks[known] = _midrank(h[known]) / known.sum()
        max_token = ranks
    has_index = any(c[2] is not None for c in st.cls)
    stratum, m_fold = cross_fit_stratum(st, rng) if has_index else (None, {})
    pq = st.g_mean * (1 - st.g_mean)
    weights = {"arpo": st.p.copy(), "max_token": max_token, "stratum": stratum,
               "prompt_pq": pq[st.prompt], "random": np.ones(n), "oracle": st.d.copy()}
    return weights, {"stratum": m_fold}


def _midrank(x: np.ndarray) -> np.ndarray:
    """1-based ranks, ties given their mean rank."""
    order = np.argsort(x, kind="stable")
    ranks = np.empty(x.size)
    ranks[order] = np.arange(1, x.size + 1)
    _, inv = np.unique(x, return_inverse=True)
    return np.bincount(inv, ranks)[inv] / np.bincount(inv)[inv]


def cross_fit_stratum(st: ScreenStates, rng: np.random.Generator) -> tuple[np.ndarray, dict]:
    """2-fold cross-fitted class mean of D (module docstring): w for each state."""
    q = st.g.size
    fold_of_prompt = np.zeros(q, np.int64)
    fold_of_prompt[rng.permutation(q)[q // 2:]] = 1
    fold = fold_of_prompt[st.prompt]
    w = np.empty(st.d.size)
    unseen = 0
    for f in (0, 1):
        fit = fold != f
        means: dict = {}
        for c, d in zip((st.cls[i] for i in np.flatnonzero(fit)), st.d[fit]):
            means.setdefault(c, []).append(d)
        overall = float(st.d[fit].mean()) if fit.any() else math.nan
        for i in np.flatnonzero(~fit):
            seen = means.get(st.cls[i])
            unseen += seen is None
            w[i] = float(np.mean(seen)) if seen is not None else overall
    w = np.where(np.isfinite(w), w, 0.0)  # a fold with no states to fit: no forks there
    return w, {"classes": len(set(st.cls)), "unseen": unseen}


# ----------------------------------------------------------------------------- figures
def _sums(st: ScreenStates, w: np.ndarray) -> np.ndarray:
    """Per-prompt rows [Q, 8]: sum wD, sum w, sum D, n, sum w*calls, G, g_calls, 1."""
    q = st.g.size
    cols = [w * st.d, w, st.d, np.ones_like(w), w * st.calls]
    rows = np.stack([np.bincount(st.prompt, c, minlength=q) for c in cols], axis=1)
    return np.column_stack([rows, st.g, st.g_calls, np.ones(q)])


def ratio_of(rows: np.ndarray) -> float:
    t = rows.sum(axis=0)
    with np.errstate(divide="ignore", invalid="ignore"):
        r = (t[0] / t[1]) / (t[2] / t[3])
    return float(r) if np.isfinite(r) else math.nan


def per_call_parts(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """per_call = sum wD / (sum w c * sum G / sum g) as per-prompt (u, v), v linearised."""
    wd, wc, g, gc = rows[:, 0], rows[:, 4], rows[:, 5], rows[:, 6]
    twc, tg, tgc = wc.sum(), g.sum(), gc.sum()
    if not tgc or not np.isfinite(tgc * twc):
        return wd, np.full_like(wd, math.nan)
    return wd, wc * tg / tgc + twc * g / tgc - twc * tg * gc / tgc**2


def _parts_value(u: np.ndarray, v: np.ndarray) -> float:
    with np.errstate(divide="ignore", invalid="ignore"):
        r = u.sum() / v.sum()
    return float(r) if np.isfinite(r) else math.nan


def diff_ci(rows_a: np.ndarray, rows_b: np.ndarray, level: float) -> tuple[float, tuple]:
    """ratio(a) - ratio(b) with its clustered delta-method interval."""
    (ua, va), (ub, vb) = ratio_parts(rows_a[:, :4]), ratio_parts(rows_b[:, :4])
    ta, tb = _parts_value(ua, va), _parts_value(ub, vb)
    c = ua.size
    if not (math.isfinite(ta) and math.isfinite(tb)) or c < 2:
        return math.nan, (math.nan, math.nan)
    psi = (ua - ta * va) / va.sum() - (ub - tb * vb) / vb.sum()
    se = math.sqrt(c / (c - 1) * float(((psi - psi.mean()) ** 2).sum()))
    z = NormalDist().inv_cdf((1 + level) / 2)
    return ta - tb, (ta - tb - z * se, ta - tb + z * se)


def permutation_p(st: ScreenStates, w: np.ndarray, rng: np.random.Generator,
                  n_perm: int = 2000) -> tuple[float, dict]:
    """One-sided p of the ratio under within-prompt exchangeability of ``w``."""
    if not isinstance(rng, np.random.Generator):
        raise TypeError("permutation_p needs a seeded numpy Generator (no global random)")
    observed = ratio_of(_sums(st, w))
    if not math.isfinite(observed):
        return math.nan, {"n_perm": n_perm, "observed": observed}
    order = np.argsort(st.prompt[None, :] + rng.random((n_perm, st.d.size)), axis=1)
    wp = w[order]  # prompts are sorted, so each row permutes within prompts only
    with np.errstate(divide="ignore", invalid="ignore"):
        perm = (wp @ st.d / wp.sum(axis=1)) / st.d.mean()
    hits = int(np.sum(perm >= observed * (1 - 1e-12)))  # ties (equal sums) count as >=
    return (1 + hits) / (1 + n_perm), {"n_perm": n_perm, "observed": observed,
                                       "perm_mean": float(np.nanmean(perm))}


def screen(st: ScreenStates, rng: np.random.Generator, n_perm: int = 2000,
           level: float = 0.9) -> tuple[dict, dict]:
    """{rule: figures} for every rule of ``RULES`` (module docstring)."""
    weights, m_rules = rule_weights(st, rng)
    base = _sums(st, weights["arpo"])
    out = {}
    for name in RULES:
        w = weights[name]
        if w is None or st.d.size == 0:
            out[name] = _empty("the prober recorded no field this rule needs (older run)")
            continue
        rows = _sums(st, w)
        (lo, hi), m = fieller_ci(*ratio_parts(rows[:, :4]), level)
        if name == "random":  # exactly 1 on any sample: its interval is the point
            (lo, hi), m = (1.0, 1.0), {}
        diff, (dlo, dhi) = diff_ci(rows, base, level)
        u, v = per_call_parts(rows)
        (clo, chi), _ = (fieller_ci(u, v, level) if np.isfinite(v).all()
                         else ((math.nan, math.nan), {}))
        p = math.nan if name in NO_P else permutation_p(st, w, rng, n_perm)[0]
        out[name] = {"ratio": ratio_of(rows), "ci_low": lo, "ci_high": hi,
                     "diff_vs_arpo": diff, "diff_ci_low": dlo, "diff_ci_high": dhi,
                     "perm_p": p, "per_call": _parts_value(u, v) if np.isfinite(v).all()
                     else math.nan, "per_call_ci_low": clo, "per_call_ci_high": chi,
                     "w_mean": float(w.mean()), "unbounded": m.get("unbounded", False)}
    return out, {"level": level, "n_perm": n_perm, **m_rules}


def _empty(note: str) -> dict:
    keys = ("ratio", "ci_low", "ci_high", "diff_vs_arpo", "diff_ci_low", "diff_ci_high",
            "perm_p", "per_call", "per_call_ci_low", "per_call_ci_high", "w_mean")
    return {**dict.fromkeys(keys, math.nan), "note": note}


def screen_table(rules: dict, level: float = 0.9) -> list[str]:
    """The screen as text lines, one per rule."""
    pct = f"{100 * level:.0f}%"
    lines = [f"  {'rule':10} {'ratio':>6} {pct + ' CI':>15}  {'diff vs arpo':>12} "
             f"{pct + ' CI':>17}  {'perm p':>6}  {'per call':>8} {pct + ' CI':>15}"]
    for name, f in rules.items():
        p = "   -  " if math.isnan(f["perm_p"]) else f"{f['perm_p']:6.3f}"
        line = (f"  {name:10} {f['ratio']:6.3f} {_ci(f['ci_low'], f['ci_high']):>15}  "
                f"{f['diff_vs_arpo']:+12.3f} {_ci(f['diff_ci_low'], f['diff_ci_high']):>17}  "
                f"{p}  {f['per_call']:8.3f} "
                f"{_ci(f['per_call_ci_low'], f['per_call_ci_high']):>15}")
        lines.append(line + (f"  ({f['note']})" if f.get("note") else ""))
    return lines


def _ci(lo: float, hi: float) -> str:
    return f"{lo:.3f}-{hi:.3f}" if math.isfinite(lo) and math.isfinite(hi) else \
        f"({lo:.2f}, {hi:.2f})"
