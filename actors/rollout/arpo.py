"""ARPO's entropy-based adaptive rollout (arXiv 2507.19849 Sec. 3.2): N global samples,
and a fork at the round after a tool result with probability
P = clip(alpha + beta * (H_t - H_init), 0, 1), until the group has M leaves. The rules are
``actors/branching.py``'s ``BranchPlanner`` (pure, tested alone); this module connects it
to the rollout's events (``policy.py``).

Every decision is also counted in its *stratum*: the tool whose result preceded the round
and that call's index in the trajectory (``search/1``, ``python/2``; a fork inherits its
parent's calls). ``stats()`` carries each stratum's decisions and summed P
(``stratum/<tool>/<index>/n``, ``.../p_sum``): what ``rollout.mode=stratified``
(``stratified.py``) matches to place as many forks per stratum by chance."""

from __future__ import annotations

import numpy as np

from actors.branching import BranchPlanner, BranchSettings
from actors.rollout.policy import GroupPolicy, Spawn
from toolenv.base import ToolResult
from toolenv.tags import ToolCall


class ARPOPolicy(GroupPolicy):
    def __init__(self, cfg, rng: np.random.Generator, initial: int | None = None):
        super().__init__()
        self.settings = BranchSettings.from_config(cfg)
        self.planner = BranchPlanner(self.settings, rng, initial=initial)
        self.calls: dict[int, tuple[str, int]] = {}  # tid -> (last tool, calls made)
        self.strata: dict[str, list[float]] = {}  # stratum -> [decisions, summed P]

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

    def observe_tool(self, tid: int, at: int, call: ToolCall, result: ToolResult) -> None:
        # a call that could not run (an unknown or malformed name) is its own stratum
        name = "invalid" if call.error or not call.name else call.name.replace("/", "_")
        self.calls[tid] = (name, self.calls.get(tid, ("", 0))[1] + 1)

    def stratum(self, tid: int) -> str:
        """The stratum of ``tid``'s decision now: its last tool and that call's index."""
        tool, n = self.calls.get(tid, ("none", 0))
        return f"{tool}/{n}"

    def tool_round(self, tid: int, at: int, h: float, short: bool) -> Spawn:
        return self.decide(tid, at, h, short, None)

    def decide(self, tid: int, at: int, h: float, short: bool, p: float | None) -> Spawn:
        """The planner's decision (with P ``p`` when given, else alpha + beta dH),
        recorded in ``decisions`` and in the decision's stratum."""
        stratum = self.stratum(tid)
        forks, info = self.planner.after_tool_round(tid, h, short, p_given=p)
        self.decisions.append([float(tid), float(at), info["dh"], info["p"], info["forks"]])
        if info["p"] == info["p"]:  # nan: no decision (a short round skipped)
            cell = self.strata.setdefault(stratum, [0.0, 0.0])
            cell[0] += 1.0
            cell[1] += info["p"]
        for child in forks:
            self.calls[child] = self.calls.get(tid, ("none", 0))
        return Spawn(forks=forks)

    def finished(self, tid: int) -> list[int]:
        """The fill rule: with nothing of the group live, every missing global sample
        (``rollout.fill=all``) or one (``one_per_round``, the authors')."""
        self.planner.finish(tid)
        return self.planner.fill()

    def stats(self) -> dict[str, float]:
        out = self.planner.stats()
        for stratum, (n, p_sum) in self.strata.items():
            out[f"stratum/{stratum}/n"], out[f"stratum/{stratum}/p_sum"] = n, p_sum
        return out
