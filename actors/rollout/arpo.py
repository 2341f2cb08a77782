"""ARPO's entropy-based adaptive rollout (arXiv 2507.19849 Sec. 3.2): N global samples,
and a fork at the round after a tool result with probability
P = clip(alpha + beta * (H_t - H_init), 0, 1), until the group has M leaves. The rules are
``actors/branching.py``'s ``BranchPlanner`` (pure, tested alone); this module connects it
to the rollout's events (``policy.py``)."""

from __future__ import annotations

import numpy as np

from actors.branching import BranchPlanner, BranchSettings
from actors.rollout.policy import GroupPolicy, Spawn


class ARPOPolicy(GroupPolicy):
    def __init__(self, cfg, rng: np.random.Generator, initial: int | None = None):
        super().__init__()
        self.settings = BranchSettings.from_config(cfg)
        self.planner = BranchPlanner(self.settings, rng, initial=initial)

    def start(self) -> list[int]:
        return self.planner.start()

    def parent_of(self, tid: int) -> int:
        return self.planner.parent_of(tid)

    def reads_first_round(self, tid: int) -> bool:
        """A global sample's first round gives its H_init; a fork's only with
        ``rollout.fork_h_init=own`` (else it inherits its parent's)."""
        return self.planner.parent_of(tid) == -1 or self.settings.fork_h_init == "own"

    def first_round(self, tid: int, h: float, short: bool) -> None:
        self.planner.record_initial_entropy(tid, h, short)

    def tool_round(self, tid: int, at: int, h: float, short: bool) -> Spawn:
        forks, info = self.planner.after_tool_round(tid, h, short)
        self.decisions.append([float(tid), float(at), info["dh"], info["p"], info["forks"]])
        return Spawn(forks=forks)

    def finished(self, tid: int) -> list[int]:
        """The fill rule: with nothing of the group live, every missing global sample
        (``rollout.fill=all``) or one (``one_per_round``, the authors')."""
        self.planner.finish(tid)
        return self.planner.fill()

    def stats(self) -> dict[str, float]:
        return self.planner.stats()
