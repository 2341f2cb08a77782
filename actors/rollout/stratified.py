"""Random branching matched to ARPO per stratum (the ablation of issue 35): ARPO's group
and fork mechanics with the branch probability of each decision taken from a table,
``rollout.stratum_p``, keyed by the decision's stratum (the tool whose result preceded the
round and that call's index in the trajectory, ``search/1``; ``arpo.py``), and
``rollout.alpha`` for a stratum the table lacks. Entropy is still measured and recorded
(dH in ``decisions``) but never read.

Filled from the same seed's ``arpo`` run (its metrics' ``branch/stratum/*``), it forks as
often as ARPO did after each tool and at each depth, but at random states of that
stratum: it separates "entropy picks the states" from "entropy is higher after a search
than after Python", which a single rate (``beta=0``, ``alpha`` = ARPO's mean P) cannot."""

from __future__ import annotations

import numpy as np

from actors.rollout.arpo import ARPOPolicy
from actors.rollout.policy import Spawn


class StratifiedPolicy(ARPOPolicy):
    def __init__(self, cfg, rng: np.random.Generator):
        super().__init__(cfg, rng)
        self.table = dict(cfg.stratum_p)
        self.default = float(cfg.alpha)

    def tool_round(self, tid: int, at: int, h: float, short: bool) -> Spawn:
        return self.decide(tid, at, h, short, self.table.get(self.stratum(tid), self.default))
