"""The one interface of an actor's weight channels (ZeroMQ: zeromq.py, NCCL: nccl.py):
``sync`` loads weights newer than the engine's into it at a safe point and says what it
loaded. Each channel asks the learner through the actor's one control client
(actors/control.py), so its requests are retried and followed by a Hello like any other."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol


@dataclass
class Loaded:
    version: int  # the version now loaded
    paused_s: float  # seconds generation was held
    channel: str  # "zmq" or "nccl"


class Requester(Protocol):
    async def request(self, msg: Any) -> Any:
        """The learner's reply to ``msg``."""


class WeightReceiver(Protocol):
    channel: str

    async def sync(self, engine: Any, have_version: int | None = None) -> Loaded | None:
        """Load weights newer than ``have_version`` (default ``engine.version``; -1 takes
        whatever the learner publishes, e.g. an older version after it resumed from a
        checkpoint); None when there is nothing to load."""
