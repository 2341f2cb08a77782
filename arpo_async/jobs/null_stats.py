"""Signal/noise of ARPO's branch decisions against the noise of the decision itself (pure).

A branch decision reads dH = H_post - H_init (ARPO arXiv 2507.19849, Sec. 3.2: H of the
first k tokens of the round after a tool result, minus H of the trajectory's first
round's first k tokens) and branches with P = clip(alpha + beta * dH, 0, 1). How much of
the spread of dH over decisions is sampling noise is measured where the decision is made:
the k-token window is sampled R times again at the decision's own prefix (the same tokens
up to and including the tool result): var(H_post | prefix).

* ``signal_to_noise`` = var(dH) / (mean var(H_post | prefix) + var(H_init | prompt)):
  1 when dH is sampling noise only (a world where a tool result changes nothing);
  1 + var(the entropy rise each state plants) / noise above it. var(H_init | prompt) is
  the pooled within-prompt variance of the real H_init of the prompt's trajectories that
  made a decision, not a resample at the prompt: those trajectories are selected (their
  first round called a tool), and first rounds resampled at the prompt are not. Needs two
  such trajectories of some prompt (``analyze entropy --k 2`` or more).
* ``signal_to_noise_post_only`` = var(dH) / mean var(H_post | prefix): the noise of the
  post-tool window alone (the review of issue 29 measured this one: 3.4 on the noisy
  suite's SFT model). It counts H_init's own sampling noise as signal, so it reads
  1 + var(H_init) / var(H_post) in that null world (2 when both windows follow one law).

Variances are unbiased (ddof = 1), so the ratio's expectation in the null world is about
1, not (n - 1) / n. The 90% interval is a percentile bootstrap over prompts (a prompt's
decisions share its state and its H_init spread, so prompts, not decisions, are the
independent units), drawn from an injected seeded generator; each prompt is summarised
by sums (``prompt_sums``), so a draw is a sum of rows.

Why not the old null (other samples' first rounds cut to the decision's length): a first
round is sampled at the prompt, not at the decision's state, and post-tool windows are
the noisier ones; on the noisy suite's SFT model it read S/N 29 where the decision's own
resampling reads 3.4 (issue 29).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

LEVEL = 0.90  # the bootstrap interval's coverage
N_BOOT = 1000  # bootstrap draws: 50 in each 5% tail, enough for a stable percentile


@dataclass(frozen=True)
class Decision:
    """One real branch decision: its dH and the H of its resampled windows."""

    dh: float  # H_post - H_init of the sampled trajectory
    h_post: tuple[float, ...]  # H of the R windows resampled at the decision's prefix


@dataclass(frozen=True)
class Trajectory:
    """A sampled trajectory's first-round H and the decisions it made."""

    h_init: float
    decisions: tuple[Decision, ...]


def sample_var(values: Sequence[float]) -> float:
    """Unbiased variance of the finite values; nan with fewer than two; exactly 0 when they
    are all equal (not the 1e-34 that rounding of their mean leaves: a zero noise is
    undefined S/N, not an S/N of 1e30)."""
    v = np.asarray(values, dtype=np.float64)
    v = v[np.isfinite(v)]
    if v.size < 2:
        return float("nan")
    return 0.0 if np.ptp(v) == 0 else float(v.var(ddof=1))


SUMS = ("n", "dh", "dh2", "v_post", "ss_init", "df_init")


def prompt_sums(prompts: Sequence[Sequence[Trajectory]]) -> np.ndarray:
    """Per prompt [G, 6]: usable decisions, their sum of dH, of dH^2, of var(H_post |
    prefix); the squared deviations of its trajectories' H_init from their mean, and
    their count - 1. A decision is usable when dH is finite and two of its resamples are;
    a trajectory's H_init counts when it has a usable decision (it shares the prompt and
    the selection of the decisions: its first round called a tool)."""
    rows = np.zeros((len(prompts), len(SUMS)))
    for g, trajectories in enumerate(prompts):
        h_init = []
        for t in trajectories:
            usable = [(d.dh, sample_var(d.h_post)) for d in t.decisions]
            usable = [u for u in usable if np.isfinite(u).all()]
            if not usable or not np.isfinite(t.h_init):
                continue
            h_init.append(t.h_init)
            dh, v = np.asarray(usable).T
            rows[g, :4] += (dh.size, dh.sum(), (dh ** 2).sum(), v.sum())
        if len(h_init) >= 2:
            rows[g, 4:] = (sample_var(h_init) * (len(h_init) - 1), len(h_init) - 1)
    return rows


def ratios(t: np.ndarray) -> np.ndarray:
    """[..., 2] from summed rows [..., 6]: S/N over both windows' noise and over the
    post-tool window's; nan where undefined (fewer than two decisions, no H_init pair,
    no noise)."""
    n, s1, s2, vp, ss, df = np.moveaxis(t, -1, 0)
    with np.errstate(divide="ignore", invalid="ignore"):
        centred = s2 - s1 ** 2 / n
        # dH all equal: the difference of two equal sums, which rounding leaves at 1e-16
        centred = np.where(np.abs(centred) <= 1e-12 * np.abs(s2), 0.0, centred)
        signal = centred / (n - 1)
        post = vp / n
        both = post + ss / df
        out = np.stack([signal / both, signal / post], axis=-1)
    return np.where(np.isfinite(out) & (n[..., None] >= 2), out, np.nan)


def bootstrap_ci(rows: np.ndarray, rng: np.random.Generator, n_boot: int = N_BOOT,
                 level: float = LEVEL) -> np.ndarray:
    """Percentile interval [2 (lo, hi), 2 (both, post only)] of ``ratios`` over prompts
    drawn with replacement (a prompt drawn twice counts twice); nan where fewer than half
    the draws were defined (the interval would mean little)."""
    if not isinstance(rng, np.random.Generator):
        raise TypeError("bootstrap_ci needs a seeded np.random.Generator")
    idx = rng.integers(0, len(rows), size=(n_boot, len(rows)))
    draws = ratios(rows[idx].sum(axis=1))
    out = np.full((2, 2), np.nan)
    tail = (1.0 - level) / 2 * 100
    for j in range(2):
        col = draws[:, j][np.isfinite(draws[:, j])]
        if col.size and col.size >= n_boot / 2:
            out[:, j] = np.percentile(col, [tail, 100 - tail])
    return out


def signal_to_noise(prompts: Sequence[Sequence[Trajectory]], rng: np.random.Generator,
                    n_boot: int = N_BOOT, level: float = LEVEL) -> tuple[dict, dict]:
    """S/N of the decisions of ``prompts`` (one list of trajectories per prompt) with
    bootstrap intervals over prompts (module docstring): (values, metrics). Values are
    None where undefined; metrics count what was used."""
    rows = prompt_sums(prompts)
    total = rows.sum(axis=0)
    both, post = ratios(total)
    ci = (bootstrap_ci(rows, rng, n_boot, level) if len(rows)
          else np.full((2, 2), np.nan))
    n, s1, s2, vp, ss, df = total

    def num(x: float) -> float | None:
        return float(x) if np.isfinite(x) else None

    values = {"signal_to_noise": num(both), "ci": [num(ci[0, 0]), num(ci[1, 0])],
              "signal_to_noise_post_only": num(post), "ci_post_only": [num(ci[0, 1]),
                                                                      num(ci[1, 1])],
              "dh_var": num((s2 - s1 ** 2 / n) / (n - 1)) if n >= 2 else None,
              "post_var_mean": num(vp / n) if n else None,
              "init_var": num(ss / df) if df else None}
    made = sum(len(t.decisions) for p in prompts for t in p)
    metrics = {"decisions": int(n), "decisions_unusable": made - int(n),
               "prompts": int((rows[:, 0] > 0).sum()), "init_pairs_df": int(df),
               "level": level, "n_boot": n_boot}
    return values, metrics
