"""ARPO's entropy-based adaptive rollout as a small per-prompt state machine (pure).

One ``BranchPlanner`` per prompt group decides, from round entropies the rollout feeds
it, when a trajectory forks and how many fresh global samples to start. It never sees
tokens: the rollout owns them and records each leaf's parent and branch point.

The rules (docs/design.md "ARPO branching"; ARPO arXiv 2507.19849 Sec. 3.2):

1. Start N global samples (``start()``); budget M leaves in total.
2. H_init is the window entropy of a trajectory's first round, recorded per
   *trajectory id* (``record_initial_entropy``). A fork inherits its parent's H_init:
   it shares that first round (``fork_h_init="parent"``, the paper's definition); with
   ``"own"`` (the authors' code) the entropy of the fork's own first round, the round
   after the tool result it resampled, becomes its H_init.
3. For the round that follows a tool result, H_t is its window entropy and
   dH_t = H_t - H_init; P_t = clip(alpha + beta * dH_t, 0, 1) (ARPO's
   P_t = alpha + beta * dH_t). With probability P_t (one draw from the injected
   generator per call), or deterministically when P_t >= ``branch_threshold`` in
   threshold mode (ARPO's "Branch(Z) if P_t > tau"), Z forks are created, never more
   than M - (leaves + live). ``short_round="skip"``: a round shorter than the entropy
   window gets no decision (no draw, no fork; counted as ``skipped_short``), nor does any
   round of a trajectory whose H_init came from a short round.
4. ``fill()``: when nothing of the prompt is live and fewer than M leaves exist, start
   fresh global samples: every missing one at once (``fill="all"``), or one
   (``fill="one_per_round"``, the authors' code: one per rollout round, and that sample
   may branch before the next is started).

Where the fork happens (fixing the reference's "one tool call late" bug): the decision
is made from the round that *follows* a tool result, and each fork starts from the
tokens up to and including that result, so it resamples exactly that round. The rollout
therefore keeps the length at the end of each tool result (the branch point) until the
next round's decision, and calls ``after_tool_round`` once per round that follows a tool
call the trajectory ran itself; a fork's first round is the resample of its parent's
decision round and gets no decision of its own (else one point could fork forks).

AEPO (arXiv 2510.14545, Sec. 3 "dynamic entropy-balanced rollout"):

* entropy pre-monitoring: a probe's root entropy H_root and mean post-tool entropy
  H_tool split the budget, m = k * sigmoid(beta * (H_root - H_tool)) global samples
  (``aepo_global_samples``, rounded half-up, clamped to [1, M]; the authors' code uses
  int(k * sigma) + 1), the rest left to branching;
* consecutive-branch penalty, with f = max(0, 1 - penalty * l), l = consecutive tool
  rounds on this lineage that branched (a fork starts with its parent's count; a round
  that does not branch resets it to 0): P_t *= f (``aepo_rule="scaled"``), or the
  authors' rule, branch iff clip((u + beta * dH_t) * f, 0, 1) >= alpha
  (``aepo_rule="authors"``, ``aepo_authors_branches``).

docs/design.md "Differences from the authors' code" lists where this module still departs
from the authors' rollout (their counter is per prompt, their probe a separate rollout).

Trajectory ids are 0, 1, 2, ... in creation order, so a parent's id is always smaller
than its forks'. Every created trajectory ends as exactly one leaf, so leaves sorted by
id are 0..M-1 and ``parent_of(i)`` is directly the protocol's ``Trajectory.parent``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass(frozen=True)
class BranchSettings:
    group_size: int  # M: leaves per prompt
    initial_samples: int  # N: global samples started first
    branch_factor: int = 1  # Z: forks per branching event
    entropy_window: int = 20  # k: tokens of a round whose entropy is read (rollout side)
    entropy_reduce: str = "sum"  # how the k token entropies make the round's: sum|mean|max
    alpha: float = 0.5  # base branch probability
    beta: float = 0.2  # branch probability per unit of entropy rise
    threshold_mode: bool = False  # branch iff P >= branch_threshold (no random draw)
    branch_threshold: float = 0.5  # tau of threshold mode
    branching: bool = True  # False: plain GRPO sampling, never fork
    aepo_penalty: float = 0.0  # AEPO: P *= 1 - penalty * l after l consecutive branches
    dynamic_budget: bool = False  # AEPO: N comes from aepo_global_samples
    budget_beta: float = 0.5  # AEPO: slope of the sigmoid budget split
    fork_h_init: str = "parent"  # a fork's H_init: its parent's, or its own first round's
    short_round: str = "as_is"  # skip: no decision on a round shorter than the window
    fill: str = "all"  # nothing live, leaves < M: start all missing roots, or one_per_round
    aepo_rule: str = "scaled"  # AEPO: u < P * f (scaled), or (u + beta dH) f >= alpha (authors)

    def __post_init__(self) -> None:
        if self.group_size < 1:
            raise ValueError(f"group_size (M) must be >= 1, got {self.group_size}")
        if not 1 <= self.initial_samples <= self.group_size:
            raise ValueError(f"initial_samples (N={self.initial_samples}) must be in "
                             f"[1, group_size M={self.group_size}]")
        if self.branch_factor < 1 or self.entropy_window < 1:
            raise ValueError("branch_factor (Z) and entropy_window (k) must be >= 1")
        if not 0.0 <= self.aepo_penalty <= 1.0:
            raise ValueError(f"aepo_penalty must be in [0, 1], got {self.aepo_penalty}")
        if self.fork_h_init not in ("parent", "own"):
            raise ValueError(f"fork_h_init must be parent or own, got {self.fork_h_init!r}")
        if self.fill not in ("all", "one_per_round"):
            raise ValueError(f"fill must be all or one_per_round, got {self.fill!r}")
        if self.aepo_rule not in ("scaled", "authors"):
            raise ValueError(f"aepo_rule must be scaled or authors, got {self.aepo_rule!r}")

    @classmethod
    def from_config(cls, rollout_cfg: Any) -> BranchSettings:
        """From the ``rollout`` section (``arpo_async.core.config.RolloutConfig``): grpo
        samples all M at once and never forks; arpo/aepo branch; the AEPO switches exist in
        aepo mode only."""
        mode = rollout_cfg.mode
        m = rollout_cfg.group_size
        aepo = mode == "aepo"
        return cls(
            group_size=m,
            initial_samples=m if mode == "grpo" else rollout_cfg.initial_samples,
            branch_factor=rollout_cfg.branch_factor,
            entropy_window=rollout_cfg.entropy_window,
            entropy_reduce=rollout_cfg.entropy_reduce,
            alpha=rollout_cfg.alpha,
            beta=rollout_cfg.beta,
            threshold_mode=rollout_cfg.threshold_mode,
            branch_threshold=rollout_cfg.branch_threshold,
            branching=mode != "grpo",
            aepo_penalty=rollout_cfg.aepo_branch_penalty if aepo else 0.0,
            dynamic_budget=aepo and rollout_cfg.aepo_dynamic_budget,
            **({"budget_beta": rollout_cfg.aepo_budget_beta} if aepo else {}),
            fork_h_init=rollout_cfg.fork_h_init,
            short_round=rollout_cfg.short_round,
            fill=rollout_cfg.fill,
            aepo_rule=rollout_cfg.aepo_rule if aepo else "scaled",
        )


def _finite(x: float | None) -> bool:
    return x is not None and math.isfinite(x)


def branch_probability(h_t: float, h_init: float, alpha: float, beta: float) -> float:
    """P_t = clip(alpha + beta * (H_t - H_init), 0, 1); an unknown (nan) entropy on
    either side counts as no change (dH = 0)."""
    dh = h_t - h_init if _finite(h_t) and _finite(h_init) else 0.0
    return float(min(1.0, max(0.0, alpha + beta * dh)))


def aepo_penalty_factor(consecutive: int, penalty: float) -> float:
    """AEPO's consecutive-branch penalty: 1 - penalty * l, floored at 0."""
    return max(0.0, 1.0 - penalty * consecutive)


def aepo_authors_branches(u: float, dh: float, alpha: float, beta: float,
                          factor: float) -> bool:
    """AEPO's branch rule as the authors' code has it: draw u in [0, 1), branch iff
    clip((u + beta * dH) * factor, 0, 1) >= alpha (factor: ``aepo_penalty_factor``)."""
    return min(1.0, max(0.0, (u + beta * dh) * factor)) >= alpha


def aepo_authors_probability(dh: float, alpha: float, beta: float, factor: float) -> float:
    """The chance that ``aepo_authors_branches`` branches for u uniform on [0, 1):
    clip(1 - alpha / factor + beta * dH, 0, 1) (1 - alpha + beta dH without penalty,
    ARPO's P when alpha = 0.5)."""
    if alpha <= 0.0:
        return 1.0
    if factor <= 0.0:
        return 0.0
    return float(min(1.0, max(0.0, 1.0 - alpha / factor + beta * dh)))


def aepo_global_samples(h_root: float, h_tool: float | Sequence[float], budget: int,
                        beta: float) -> int:
    """AEPO entropy pre-monitoring: m = budget * sigmoid(beta * (H_root - mean H_tool)),
    rounded half-up and clamped to [1, budget]. ``h_tool`` may be the probe's list of
    post-tool round entropies; an empty list or nan means no tool signal (gap 0)."""
    if budget < 1:
        raise ValueError(f"aepo_global_samples: budget={budget}; need >= 1")
    if np.ndim(h_tool) == 0:
        h_tool = float(h_tool)
    else:
        finite = [float(h) for h in h_tool if _finite(float(h))]
        h_tool = float(np.mean(finite)) if finite else math.nan
    gap = h_root - h_tool if _finite(h_root) and _finite(h_tool) else 0.0
    x = beta * gap
    sigmoid = 1.0 / (1.0 + math.exp(-x)) if x >= 0 else math.exp(x) / (1.0 + math.exp(x))
    m = math.floor(budget * sigmoid + 0.5)
    return int(min(budget, max(1, m)))


P_BAND = 0.05  # |P - 0.5| <= P_BAND: the decision is about a coin flip, entropy barely acts


class BranchPlanner:
    """Branching state of ONE prompt group; create one per group, never reuse it."""

    def __init__(self, settings: BranchSettings, rng: np.random.Generator,
                 initial: int | None = None):
        if not isinstance(rng, np.random.Generator):
            raise TypeError("BranchPlanner needs a seeded numpy Generator (no global random)")
        self.settings = settings
        self._rng = rng
        self._initial = settings.initial_samples if initial is None else int(initial)
        if not 1 <= self._initial <= settings.group_size:
            raise ValueError(f"initial={self._initial} outside [1, M={settings.group_size}]")
        self._parent: list[int] = []
        self._h_init: list[float | None] = []
        self._short_init: list[bool] = []  # H_init came from a round shorter than the window
        self._streak: list[int] = []
        self._live: set[int] = set()
        self._leaves: list[int] = []
        self._count = {"global_samples": 0, "fills": 0, "forks": 0, "tool_rounds": 0,
                       "branch_events": 0, "blocked_by_budget": 0, "entropy_missing": 0,
                       "p_outside_band": 0, "skipped_short": 0}
        self._p_sum = self._p_sq_sum = self._dh_sum = 0.0
        self._p_min, self._p_max = math.inf, -math.inf

    # ------------------------------------------------------------------ queries
    @property
    def live(self) -> frozenset[int]:
        return frozenset(self._live)

    @property
    def leaves(self) -> tuple[int, ...]:
        return tuple(self._leaves)

    @property
    def created(self) -> int:
        return len(self._parent)

    @property
    def done(self) -> bool:
        return self.created > 0 and not self._live and self.fill_count() == 0

    def remaining_budget(self) -> int:
        """M minus (leaves + live): trajectories that may still be created."""
        return self.settings.group_size - len(self._leaves) - len(self._live)

    def parent_of(self, traj_id: int) -> int:
        self._check_id(traj_id)
        return self._parent[traj_id]

    def h_init_of(self, traj_id: int) -> float | None:
        self._check_id(traj_id)
        return self._h_init[traj_id]

    def streak_of(self, traj_id: int) -> int:
        self._check_id(traj_id)
        return self._streak[traj_id]

    def parents(self) -> list[int]:
        """Parent id of every trajectory, indexed by id (-1: global sample)."""
        return list(self._parent)

    def fill_count(self) -> int:
        """Fresh global samples needed now: 0 while any trajectory is live (or before
        ``start``), else M - leaves (``fill="all"``) or at most one (``one_per_round``)."""
        if self.created == 0 or self._live:
            return 0
        missing = self.settings.group_size - len(self._leaves)
        return min(1, missing) if self.settings.fill == "one_per_round" else missing

    def stats(self) -> dict[str, float]:
        """Counters and the branch probabilities' sums of this group, to be added up
        across groups (learner/rollout_metrics.py): ``tool_rounds`` decisions,
        ``p_outside_band`` (decisions with P outside [0.5 - P_BAND, 0.5 + P_BAND]), ``p_sum``,
        ``p_sq_sum``, ``p_min``, ``p_max`` (0 without decisions), ``dh_sum``, means."""
        rounds = self._count["tool_rounds"]
        out = {k: float(v) for k, v in self._count.items()}
        out["leaves"] = float(len(self._leaves))
        out |= {"p_sum": self._p_sum, "p_sq_sum": self._p_sq_sum, "dh_sum": self._dh_sum,
                "p_min": self._p_min if rounds else 0.0, "p_max": self._p_max if rounds else 0.0,
                "p_mean": self._p_sum / rounds if rounds else 0.0,
                "dh_mean": self._dh_sum / rounds if rounds else 0.0}
        return out

    # ------------------------------------------------------------------ events
    def start(self) -> list[int]:
        """Create the initial global samples; returns their ids."""
        if self.created:
            raise RuntimeError("BranchPlanner.start called twice (one planner per group)")
        return [self.new_root() for _ in range(self._initial)]

    def new_root(self) -> int:
        """Create one fresh global sample (counts against the budget)."""
        if self.remaining_budget() < 1:
            raise RuntimeError(f"budget exhausted: {len(self._leaves)} leaves + "
                               f"{len(self._live)} live = M={self.settings.group_size}")
        self._count["global_samples"] += 1
        return self._create(parent=-1, h_init=None, streak=0)

    def fill(self) -> list[int]:
        """Start ``fill_count()`` fresh global samples (DESIGN step 4); returns ids."""
        ids = [self.new_root() for _ in range(self.fill_count())]
        self._count["fills"] += len(ids)
        return ids

    def record_initial_entropy(self, traj_id: int, h: float, short: bool = False) -> None:
        """H_init of a global sample (or, with ``fork_h_init="own"``, of a fork): window
        entropy of its first round (nan: unknown); ``short``: that round was shorter than
        the window."""
        self._require_live(traj_id)
        if self._parent[traj_id] != -1 and self.settings.fork_h_init == "parent":
            raise ValueError(f"trajectory {traj_id} is a fork; it inherits H_init from "
                             f"{self._parent[traj_id]}")
        if self._h_init[traj_id] is not None:
            raise ValueError(f"trajectory {traj_id}: H_init already recorded")
        self._h_init[traj_id] = float(h)
        self._short_init[traj_id] = bool(short)
        if not _finite(float(h)):
            self._count["entropy_missing"] += 1

    def after_tool_round(self, traj_id: int, h_t: float, short: bool = False,
                         p_given: float | None = None) -> tuple[list[int], dict[str, float]]:
        """Decide on the round that followed a tool result of ``traj_id``; returns the ids
        of the forks to create (children of ``traj_id``, to start from the end of that
        tool result) and the decision's metrics. ``short``: that round was shorter than the
        entropy window (``short_round="skip"`` then makes no decision). ``p_given``: the
        branch probability to draw with instead of alpha + beta dH (a placement that
        ignores entropy, ``rollout.mode=stratified``); dH is still recorded."""
        self._require_live(traj_id)
        h_init = self._h_init[traj_id]
        if h_init is None:
            raise ValueError(f"trajectory {traj_id}: after_tool_round before "
                             "record_initial_entropy")
        s = self.settings
        if s.short_round == "skip" and (short or self._short_init[traj_id]):
            self._count["skipped_short"] += 1
            return [], {"p": math.nan, "dh": math.nan, "h_t": float(h_t),
                        "h_init": float(h_init), "streak": float(self._streak[traj_id]),
                        "forks": 0.0, "blocked_by_budget": 0.0, "skipped_short": 1.0}
        known = _finite(h_t) and _finite(h_init)
        dh = h_t - h_init if known else 0.0
        streak = self._streak[traj_id]
        factor = aepo_penalty_factor(streak, s.aepo_penalty)
        authors = s.aepo_rule == "authors"
        if p_given is not None:
            p, authors = min(1.0, max(0.0, float(p_given))) * factor, False
        else:
            p = (aepo_authors_probability(dh, s.alpha, s.beta, factor) if authors
                 else branch_probability(h_t, h_init, s.alpha, s.beta) * factor)
        draw = self._rng.random() if s.branching and not s.threshold_mode else math.nan
        if not s.branching:
            want = False
        elif s.threshold_mode:
            want = p >= s.branch_threshold
        else:
            want = (aepo_authors_branches(draw, dh, s.alpha, s.beta, factor) if authors
                    else draw < p)
        n = min(s.branch_factor, self.remaining_budget()) if want else 0
        inherited = h_init if s.fork_h_init == "parent" else None
        forks = [self._create(traj_id, inherited, streak + 1, self._short_init[traj_id])
                 for _ in range(n)]
        self._streak[traj_id] = streak + 1 if n else 0
        self._tally(known, p, dh, want, n)
        return forks, {"p": p, "dh": dh, "h_t": float(h_t), "h_init": float(h_init),
                       "streak": float(streak), "forks": float(n),
                       "blocked_by_budget": float(want and n == 0)}

    def finish(self, traj_id: int) -> None:
        """The trajectory reached a leaf (answer, EOS, length or tool limit, abort)."""
        self._require_live(traj_id)
        self._live.remove(traj_id)
        self._leaves.append(traj_id)

    # ------------------------------------------------------------------ internals
    def _create(self, parent: int, h_init: float | None, streak: int,
                short_init: bool = False) -> int:
        traj_id = len(self._parent)
        self._parent.append(parent)
        self._h_init.append(h_init)
        self._short_init.append(short_init and h_init is not None)
        self._streak.append(streak)
        self._live.add(traj_id)
        return traj_id

    def _tally(self, known: bool, p: float, dh: float, want: bool, n: int) -> None:
        self._count["tool_rounds"] += 1
        self._count["entropy_missing"] += 0 if known else 1
        self._count["branch_events"] += 1 if n else 0
        self._count["forks"] += n
        self._count["blocked_by_budget"] += 1 if want and n == 0 else 0
        self._count["p_outside_band"] += 1 if abs(p - 0.5) > P_BAND else 0
        self._p_sum += p
        self._p_sq_sum += p * p
        self._p_min, self._p_max = min(self._p_min, p), max(self._p_max, p)
        self._dh_sum += dh

    def _check_id(self, traj_id: int) -> None:
        if not 0 <= traj_id < len(self._parent):
            raise KeyError(f"unknown trajectory id {traj_id} (this group has "
                           f"{len(self._parent)})")

    def _require_live(self, traj_id: int) -> None:
        self._check_id(traj_id)
        if traj_id not in self._live:
            raise ValueError(f"trajectory {traj_id} is not live (already a leaf)")
