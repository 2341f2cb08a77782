"""The rollout contract: how an actor turns one prompt into one trajectory group.

A ``Rollout`` is what the actor runs per prompt: the plain group sampler (``plain.py``: M
independent samples, no tools) and the tool-interleaved rollout (``agent.py``, whose group
policy says where trajectories start and fork) share it. Every token of a leaf carries its
behaviour log-prob and the policy version of the weights that sampled it.

``Occupancy`` counts a rollout's trajectories that are generating (spawned and not
finished, and not waiting for a tool): the actor's trajectory-level scheduler
(actors/actor.py) starts the next group whenever the count falls below its target.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from typing import Protocol

from arpo_async.core.protocol import TrajectoryGroup
from toolenv.tasks.prompts import Prompt


class Rollout(Protocol):
    occupancy: Occupancy

    async def run(self, prompt: Prompt, actor_id: int, journal=None) -> TrajectoryGroup:
        """Counts the group's first trajectories in ``occupancy`` before its first await.
        ``journal`` (actors/journal.py ``GroupJournal``, or None): where the group's events
        are recorded, and the tree to finish when it was left in flight."""


class Occupancy:
    """Trajectories generating now, the time average of that count, and a wait for it to
    fall below a target. All changes happen on the event loop."""

    def __init__(self) -> None:
        self.count = 0
        self._since = self._t0 = time.monotonic()
        self._area = 0.0
        self._changed = asyncio.Event()

    def add(self, n: int) -> None:
        now = time.monotonic()
        self._area += self.count * (now - self._since)
        self._since = now
        self.count += n
        if self.count < 0:
            raise RuntimeError("occupancy below 0: a trajectory left twice")
        self._changed.set()

    def track(self, task: asyncio.Future) -> asyncio.Future:
        """Count ``task`` as generating until it is done (however it ends, even cancelled
        before it started)."""
        self.add(1)
        task.add_done_callback(lambda _: self.add(-1))
        return task

    @contextlib.contextmanager
    def waiting(self):
        """A tool call: the trajectory is not generating meanwhile."""
        self.add(-1)
        try:
            yield
        finally:
            self.add(1)

    async def below(self, target: int) -> None:
        while self.count >= target:
            self._changed.clear()
            await self._changed.wait()

    def area(self) -> float:
        """Integral of the count over time since this object was made (trajectory-s)."""
        return self._area + self.count * (time.monotonic() - self._since)

    def mean(self) -> float:
        """Time-averaged count since this object was made."""
        return self.area() / max(time.monotonic() - self._t0, 1e-9)


def new_group_id(actor_id: int) -> str:
    return f"a{actor_id}-{uuid.uuid4().hex[:12]}"
