"""Bounded staleness: admission control for actors and the learner's lag filter (pure).

Versions: the learner's version v is the number of optimizer steps taken; every token
carries the version of the weights that sampled it. A group's lag when it is trained is
v - min_t v_t over its model tokens (docs/design.md "Staleness and admission", after AReaL's bounded
staleness eta).

Admission (``Admission``, in the learner, rank 0): the learner hands out tickets to
start groups so that (groups started) <= (eta + v + 1) * B, B groups per step. A ticket
also depends on the asking actor's weights: if groups are trained in the order they
start, the s-th started group (s from 0) is trained at version floor(s / B), and its
tokens are no older than the actor's weights a, so its lag is at most eta exactly when
s < (eta + a + 1) * B. The grant is therefore

    n = min(requested, (eta + min(v, a) + 1) * B - started),

reason "capacity" when the learner's bound limits it, "stale_weights" when the actor's
weights do (it must fetch newer weights first; this always covers a < v - eta). With
the rule obeyed and groups trained in start order no group ever exceeds lag eta. Groups
finish out of order (the long trajectories last): the learner therefore trains the oldest
groups it holds first and, before a step that would push a straggler past eta, waits for
the groups whose tickets were granted on weights eta versions behind
(learner/service.py ``collect``, up to ``learner.straggler_wait_s``); a group that is still
too old when it arrives is dropped by ``StalenessFilter`` and counted.
Groups that were granted but will never be trained (dropped as stale, aborted, lost with
a dead actor) must be ``release``d, else capacity never reopens and the run deadlocks;
groups trained without a counted ticket are ``adopt``ed, so that ``started`` keeps
counting every trained group.
Nothing is dropped silently: every grant, release and drop is counted by reason.

The rule needs eta >= sync_every - 1: actors only see published versions, so with
sync_every = 2 and eta = 0 no group could ever be trained fresh enough.
"""

from __future__ import annotations

from collections import Counter

from arpo_async.core.protocol import GrantReason


def group_lag(learner_version: int, min_version: int) -> int:
    """Versions between the learner and a group's oldest model token."""
    if learner_version < 0 or min_version < 0:
        raise ValueError(f"group_lag: versions must be >= 0, got learner {learner_version}, "
                         f"group min {min_version}")
    return learner_version - min_version


class Admission:
    """Tickets to start groups, so that staleness stays within eta."""

    def __init__(self, batch_groups: int, max_staleness: int):
        if batch_groups < 1 or max_staleness < 0:
            raise ValueError(f"Admission: batch_groups={batch_groups} must be >= 1, "
                             f"max_staleness={max_staleness} >= 0")
        self.batch_groups = batch_groups
        self.max_staleness = max_staleness
        self._granted = 0
        self._released: Counter[str] = Counter()
        self._count: Counter[str] = Counter()

    @property
    def started(self) -> int:
        """Groups granted and not released: those counted against capacity."""
        return self._granted - sum(self._released.values())

    def limit(self, version: int) -> int:
        """Most groups that may have started for weights of ``version``."""
        return (self.max_staleness + version + 1) * self.batch_groups

    def grant(self, requested: int, learner_version: int,
              actor_version: int) -> tuple[int, GrantReason]:
        """How many of ``requested`` new groups may start now, and why not all ("" when
        all): ``GrantReason.CAPACITY`` or ``GrantReason.STALE_WEIGHTS``."""
        if requested < 0 or learner_version < 0:
            raise ValueError(f"grant: requested={requested}, learner_version="
                             f"{learner_version}; both must be >= 0")
        self._count["requests"] += 1
        if actor_version > learner_version:  # a newer actor than learner: a bug upstream
            self._count["actor_ahead"] += 1
            actor_version = learner_version
        by_learner = self.limit(learner_version) - self.started
        by_actor = self.limit(actor_version) - self.started
        n = max(0, min(requested, by_learner, by_actor))
        reason = GrantReason.NONE
        if n < requested:
            reason = GrantReason.STALE_WEIGHTS if by_actor < by_learner and by_actor < requested \
                else GrantReason.CAPACITY
            self._count[f"denied_{reason.value}"] += requested - n
        self._granted += n
        return n, reason

    def release(self, n: int, reason: str) -> None:
        """Give back ``n`` granted groups that will never be trained (``reason``: e.g.
        "stale", "aborted", "actor_lost"), reopening their capacity."""
        if not reason:
            raise ValueError("release: a reason is required (counted per reason)")
        if not 0 <= n <= self.started:
            raise ValueError(f"release({n}, {reason!r}): only {self.started} groups started")
        self._released[reason] += n

    def adopt(self, n: int) -> None:
        """Count ``n`` groups that arrived without a counted ticket and will be trained
        (their ticket was released while their actor was silent or reconnecting, or a
        learner that died granted it): they hold capacity like any started group. Left
        out, each would keep one slot too many open for the rest of the run, so that the
        learner admits more groups than it can train fresh and drops the excess as stale
        (after one reconnect, a quarter of every later group)."""
        if n < 0:
            raise ValueError(f"adopt({n}): n must be >= 0")
        self._granted += n
        self._count["adopted"] += n

    def counters(self) -> dict[str, float]:
        """granted, started, released (+ released_<reason>), requests, and
        denied_<reason>: groups asked for and refused, summed over requests (an actor
        that polls counts each refusal again)."""
        out = {"granted": float(self._granted), "started": float(self.started),
               "released": float(sum(self._released.values()))}
        out |= {k: float(v) for k, v in self._count.items()}
        out |= {f"released_{k}": float(v) for k, v in self._released.items()}
        return out


class StalenessFilter:
    """The learner's last check before training a group: keep iff lag <= eta."""

    def __init__(self, max_staleness: int):
        if max_staleness < 0:
            raise ValueError(f"StalenessFilter: max_staleness={max_staleness} must be >= 0")
        self.max_staleness = max_staleness
        self._count: Counter[str] = Counter()
        self._hist: Counter[int] = Counter()  # lag -> groups checked (kept and dropped)
        self._lag_sum = 0
        self._lag_max = 0

    def reason(self, learner_version: int, min_version: int) -> str:
        """Why a group could not be trained at ``learner_version`` ("" when it could),
        counting nothing: the learner asks this of the groups it holds back for a later
        step, and ``check``s only those it trains or drops."""
        if min_version < 0:
            return "no_model_tokens"
        if min_version > learner_version:
            return "future_version"
        if group_lag(learner_version, min_version) > self.max_staleness:
            return "stale"
        return ""

    def check(self, learner_version: int, min_version: int) -> tuple[bool, str]:
        """(keep, reason): "ok", or the counter key of the drop: "stale" (lag > eta),
        "no_model_tokens" (min_version -1), "future_version" (a token newer than the
        learner: a bookkeeping bug upstream)."""
        why = self.reason(learner_version, min_version)
        if why in ("no_model_tokens", "future_version"):
            return self._drop(why)
        lag = group_lag(learner_version, min_version)
        self._hist[lag] += 1
        if why:
            return self._drop(why)
        self._count["accepted"] += 1
        self._lag_sum += lag
        self._lag_max = max(self._lag_max, lag)
        return True, "ok"

    def _drop(self, reason: str) -> tuple[bool, str]:
        self._count[f"dropped_{reason}"] += 1
        return False, reason

    def stats(self) -> dict:
        """accepted, dropped_<reason>, lag_mean / lag_max over accepted groups, and
        lag_hist {lag: groups} over every group with a valid lag (kept or dropped)."""
        accepted = self._count["accepted"]
        out: dict = {"accepted": accepted, "dropped_stale": self._count["dropped_stale"]}
        out |= {k: v for k, v in self._count.items() if k.startswith("dropped_")}
        out["lag_mean"] = self._lag_sum / accepted if accepted else 0.0
        out["lag_max"] = self._lag_max
        out["lag_hist"] = dict(sorted(self._hist.items()))
        return out
