"""An actor's ZeroMQ weight channel (the learner's side: learner/weights/zeromq.py): ask
for weights newer than the engine's over the control channel and load the full update
with ``engine.update_weights`` (vLLM: a safetensors file in /dev/shm reloaded in place by
every worker)."""

from __future__ import annotations

from typing import Any

from actors.weights.base import Loaded, Requester
from arpo_async.core import protocol as P
from arpo_async.core.transport.control import expect


class ZmqWeightReceiver:
    """A ``WeightReceiver`` (actors/weights/base.py) over the control channel."""

    channel = "zmq"

    def __init__(self, control: Requester, actor_id: int):
        self.control, self.actor_id = control, actor_id

    async def fetch(self, have_version: int) -> P.WeightsUpdate | None:
        """The learner's weights when newer than ``have_version``, else None."""
        reply = await self.control.request(P.WeightsRequest(self.actor_id, have_version))
        return expect(reply, P.WeightsUpdate, "weights request")

    async def sync(self, engine: Any, have_version: int | None = None) -> Loaded | None:
        have = engine.version if have_version is None else have_version
        update = await self.fetch(have)
        # an older version is loaded only when asked for (have = -1: the learner is behind)
        if update is None or update.version == engine.version or (
                update.version < engine.version and have >= engine.version):
            return None
        paused = await engine.update_weights(update.tensors, update.version)
        return Loaded(update.version, paused, self.channel)
