"""AEPO's dynamic entropy-balanced rollout (arXiv 2510.14545 Sec. 3): ARPO's branching
with the consecutive-branch penalty (in ``BranchPlanner``'s settings), and entropy
pre-monitoring: trajectory 0 starts alone as a probe; its root entropy and its first
post-tool entropy give m = M * sigmoid(beta * (H_root - H_tool)) global samples; the probe
and m - 1 fresh ones make exactly m, and M - m are left to branching (refilled with global
samples only if branching leaves them). A probe that ends without a tool call measures no
gap: m = M / 2."""

from __future__ import annotations

import numpy as np

from actors.branching import aepo_global_samples
from actors.rollout.arpo import ARPOPolicy
from actors.rollout.policy import Spawn


class AEPOPolicy(ARPOPolicy):
    def __init__(self, cfg, rng: np.random.Generator):
        dynamic = cfg.aepo_dynamic_budget
        super().__init__(cfg, rng, initial=1 if dynamic else None)
        self.probe_pending = dynamic  # trajectory 0 measures; m is not known yet
        self.h_root: list[float] = []  # first-round entropies of the global samples
        self.h_tool: list[float] = []  # the probe's post-tool entropy
        self.m = 0  # global samples the probe's measurement asked for

    def first_round(self, tid: int, h: float, short: bool) -> None:
        super().first_round(tid, h, short)
        if self.parent_of(tid) == -1:
            self.h_root.append(h)

    def tool_round(self, tid: int, at: int, h: float, short: bool) -> Spawn:
        if self.probe_pending and tid == 0:  # the probe's round: measure only
            self.h_tool.append(h)
            return Spawn(roots=self._split_budget())
        return super().tool_round(tid, at, h, short)

    def finished(self, tid: int) -> list[int]:
        self.planner.finish(tid)
        roots = self._split_budget() if self.probe_pending else []
        return roots + self.planner.fill()

    def _split_budget(self) -> list[int]:
        self.probe_pending = False
        h_root = self.h_root[0] if self.h_root else float("nan")
        self.m = aepo_global_samples(h_root, self.h_tool, self.settings.group_size,
                                     self.settings.budget_beta)
        # nothing branched yet: the budget holds them all
        return [self.planner.new_root() for _ in range(self.m - 1)]

    def stats(self) -> dict[str, float]:
        return super().stats() | ({"aepo_m": float(self.m)} if self.m else {})
