"""What the rollouts of a step did, from the groups' own statistics (pure).

Each ARPO/AEPO group carries its branch planner's sums (actors/branching.py
``BranchPlanner.stats``, prefixed ``branch/``); a step's figures add them up over the
step's groups, so a mean is over every branch decision of the step, not a mean of group
means. Every key of ``KEYS`` is present on every step: a step without decisions (GRPO, or
no tool call yet) reports 0 for the probabilities and 0 forks. The strata's sums
(``branch/stratum/<tool>/<index>/n`` and ``.../p_sum``) appear on the steps that have them.

``variance_metrics`` says how many of the step's groups can teach anything at all: a group
whose leaves all got the same reward has advantage 0 everywhere (learner/advantages.py), so
its tokens cost a learner pass and move nothing. Overall and per task kind."""

from __future__ import annotations

import math

KEYS = ("branch/p_mean", "branch/p_std", "branch/p_min", "branch/p_max", "branch/dh_mean",
        "branch/decisions", "branch/forks", "branch/fills", "branch/leaves_per_group",
        "branch/p_outside_band", "branch/skipped_short", "tools/executed_per_leaf",
        "rollout/context_full", "rollout/resumed_tokens")


def rollout_metrics(groups: list, declared: dict[str, str] | None = None) -> dict[str, float]:
    """The step's ``branch/*``, ``tools/executed_per_leaf``, ``rollout/context_full`` and
    ``rollout/resumed_tokens`` figures; with ``declared`` (the rollout mode's ``STATS``,
    arpo_async/core/config/actors.py), every other figure its policy reports, reduced as
    declared (``reduce_stats``)."""
    return _fixed(groups) | (reduce_stats(groups, declared) if declared else {})


def _fixed(groups: list) -> dict[str, float]:
    def total(key: str) -> float:
        return float(sum(g.stats.get(f"branch/{key}", 0.0) for g in groups))

    decisions = total("tool_rounds")
    leaves = sum(len(g.leaves) for g in groups)
    p_mean = total("p_sum") / decisions if decisions else 0.0
    var = total("p_sq_sum") / decisions - p_mean ** 2 if decisions else 0.0
    decided = [g.stats for g in groups if g.stats.get("branch/tool_rounds", 0) > 0]
    strata: dict[str, float] = {}  # decisions and summed P per stratum (actors/rollout/arpo.py)
    for g in groups:
        for key, value in g.stats.items():
            if key.startswith("branch/stratum/"):
                strata[key] = strata.get(key, 0.0) + float(value)
    return strata | {
        "branch/p_mean": p_mean, "branch/p_std": math.sqrt(max(var, 0.0)),
        "branch/p_min": min((s["branch/p_min"] for s in decided), default=0.0),
        "branch/p_max": max((s["branch/p_max"] for s in decided), default=0.0),
        "branch/dh_mean": total("dh_sum") / decisions if decisions else 0.0,
        "branch/decisions": decisions, "branch/forks": total("forks"),
        "branch/fills": total("fills"),
        # decisions whose P is outside [0.45, 0.55] (actors/branching.py P_BAND)
        "branch/p_outside_band": total("p_outside_band"),
        # post-tool rounds shorter than the entropy window, left without a decision
        # (rollout.short_round=skip)
        "branch/skipped_short": total("skipped_short"),
        "branch/leaves_per_group": leaves / len(groups) if groups else 0.0,
        "tools/executed_per_leaf": (sum(g.tool_calls_executed for g in groups) / leaves
                                    if leaves else 0.0),
        # trajectories that ended as length because prompt + tokens filled max_model_len
        "rollout/context_full": float(sum(g.stats.get("rollout/context_full", 0.0)
                                          for g in groups)),
        # model tokens an actor's journal carried across its restart (actors/journal.py)
        "rollout/resumed_tokens": float(sum(g.stats.get("rollout/resumed_tokens", 0.0)
                                            for g in groups)),
    }



def variance_metrics(groups: list) -> dict[str, float]:
    """``groups/nonzero_var`` (groups whose leaves' rewards differ), its share of the step's
    groups, and per task kind ``groups/kind/<kind>/n`` and ``.../nonzero_var`` (sums, so a
    run's share per kind is a ratio of sums, arpo_async/core/metrics.py
    ``variance_summary``; a group without a kind counts as ``-``)."""
    out: dict[str, float] = {}
    for g in groups:
        rewards = [leaf.reward for leaf in g.leaves]
        varied = float(len(rewards) > 1 and max(rewards) > min(rewards))
        kind = getattr(g, "kind", "") or "-"
        out["groups/nonzero_var"] = out.get("groups/nonzero_var", 0.0) + varied
        for key, value in ((f"groups/kind/{kind}/n", 1.0),
                           (f"groups/kind/{kind}/nonzero_var", varied)):
            out[key] = out.get(key, 0.0) + value
    varied = out.setdefault("groups/nonzero_var", 0.0)
    out["groups/nonzero_var_share"] = varied / len(groups) if groups else 0.0
    return out


def _declared_op(key: str, declared: dict[str, str]) -> str | None:
    if key in declared:
        return declared[key]
    for pattern, op in declared.items():
        if pattern.endswith("/*") and key.startswith(pattern[:-1]):
            return op
    return None


_REDUCE = {"sum": sum, "min": min, "max": max,
           "mean": lambda values: sum(values) / len(values)}


def reduce_stats(groups: list, declared: dict[str, str]) -> dict[str, float]:
    """``branch/<key>`` for every figure the step's groups report that ``rollout_metrics``
    does not derive itself, reduced over the groups that report it by the op the policy
    declared (sum, min, max, mean; "derived": left to ``rollout_metrics``); and
    ``branch/undeclared``, the number of keys no declaration covers (not reduced: a
    policy's new figure must say how it adds up)."""
    values: dict[str, list[float]] = {}
    for g in groups:
        for key, value in g.stats.items():
            if key.startswith("branch/"):
                values.setdefault(key.removeprefix("branch/"), []).append(float(value))
    fixed = set(KEYS)
    out: dict[str, float] = {}
    undeclared = 0
    for key, vals in values.items():
        op = _declared_op(key, declared)
        if op is None:
            undeclared += 1
        elif op in _REDUCE and f"branch/{key}" not in fixed:
            out[f"branch/{key}"] = float(_REDUCE[op](vals))
    if undeclared:
        out["branch/undeclared"] = float(undeclared)
    return out
