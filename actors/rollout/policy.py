"""The group policy contract: for ONE prompt group, which trajectories start and where
they fork. The rollout (``agent.py``) owns the tokens, the rounds and the tool calls
(``path.py``); the policy sees trajectory ids and round entropies only, at four events:

- ``start()``: the ids of the trajectories to start first;
- ``first_round(tid, h, short)``: the window entropy of a trajectory's first round (read
  only when ``reads_first_round(tid)``);
- ``tool_round(tid, at, h, short)``: the window entropy of the round that followed a
  tool result the trajectory ran itself; ``at`` is the length at the end of that result,
  where its forks start. It returns a ``Spawn``: forks of ``tid`` (each resamples that
  round) and fresh global samples;
- ``finished(tid)``: the trajectory became a leaf; returns fresh global samples to start.

Ids are 0, 1, 2, ... in creation order; every created id ends as exactly one leaf, and
``parent_of`` gives the protocol's ``Trajectory.parent`` (-1: a global sample).
``observe_tool`` sees each tool result (the premise analysis keeps them). ``decisions``
and ``stats()`` go into the ``TrajectoryGroup`` (``decisions`` rows: tid, at, dH, P,
forks).

A policy class is constructed once per group as ``cls(rollout_cfg, rng)`` (the
``rollout`` config section and the actor's seeded generator) and registered in
``actors/rollout/__init__.py`` ``POLICIES`` under its ``rollout.mode``; docs/extending.md
shows one written from scratch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from toolenv.base import ToolResult
from toolenv.tags import ToolCall


@dataclass
class Spawn:
    """Trajectories to start after a tool round."""

    forks: list[int] = field(default_factory=list)  # children of the trajectory that ran it
    roots: list[int] = field(default_factory=list)  # fresh global samples


class GroupPolicy:
    """Base of the group policies; the defaults read every first round and fork nothing."""

    def __init__(self) -> None:
        self.decisions: list[list[float]] = []

    def start(self) -> list[int]:
        raise NotImplementedError

    def parent_of(self, tid: int) -> int:
        raise NotImplementedError

    def reads_first_round(self, tid: int) -> bool:
        return True

    def first_round(self, tid: int, h: float, short: bool) -> None:
        pass

    def tool_round(self, tid: int, at: int, h: float, short: bool) -> Spawn:
        return Spawn()

    def observe_tool(self, tid: int, at: int, call: ToolCall, result: ToolResult) -> None:
        pass

    def finished(self, tid: int) -> list[int]:
        return []

    def stats(self) -> dict[str, float]:
        return {}
