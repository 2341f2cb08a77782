"""The ZeroMQ weight channel (``learner.weight_sync.channel=zmq``; any actor on any machine, and
the fallback of every other channel): full weights over the control channel.

- learner: each published version is encoded once (a msgpack header plus one raw frame
  per tensor, arpo_async/core/protocol/wire.py) and every ``WeightsRequest`` newer than
  the asker's version is answered with the same frames, which the control server sends
  uncopied (``Encoded``): no copy per actor. An asker that is up to date gets
  ``Ack(ok=True)`` with the published version.
- actor: asks for weights newer than the engine's and loads the full update with
  ``engine.update_weights`` (vLLM: a safetensors file in /dev/shm reloaded in place by
  every worker)."""

from __future__ import annotations

import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, ClassVar

from arpo_async.core import protocol as P
from arpo_async.core.transport.control import Encoded, expect
from arpo_async.core.transport.sockets import nbytes
from arpo_async.core.weights.base import Channel, Loaded, Requester, WeightReceiver


@dataclass
class WeightsRequest:
    KIND: ClassVar[str] = "weights_request"
    actor_id: int
    have_version: int


@dataclass
class WeightsUpdate:
    """Full weights: parameter name -> torch tensor, each with its own dtype (bfloat16
    included), sent as raw frames and received as tensors of the same dtype and shape."""

    KIND: ClassVar[str] = "weights"
    TENSORS: ClassVar[tuple[str, ...]] = ("tensors",)  # fields whose tensors travel as frames
    version: int
    tensors: dict[str, Any] = field(default_factory=dict)
    sent_at: float = field(default_factory=time.time)


P.register_messages(WeightsRequest, WeightsUpdate)


class ZmqWeightSender:
    """The learner's side, a ``WeightSender`` over the control channel."""

    channel = "zmq"
    requests = (WeightsRequest,)

    def __init__(self):
        self._lock = threading.Lock()  # publish (main thread) vs handle (control thread)
        self._published: tuple[int, list | None, int] = (-1, None, 0)  # version, frames, bytes
        self.weights_requests = 0
        self.bytes_served = 0
        self.served: Counter = Counter()  # weights version -> replies carrying it

    def publish(self, version: int, tensors: dict) -> None:
        """Encode ``version`` once; every reply from now on sends the tensors' memory as it
        is at that moment, so they must not change afterwards."""
        frames = P.encode(WeightsUpdate(version=version, tensors=tensors))
        with self._lock:
            if version <= self._published[0]:
                raise ValueError(f"weights version {version} published after "
                                 f"{self._published[0]}: versions must increase")
            self._published = (version, frames, nbytes(frames))

    @property
    def version(self) -> int:
        return self._published[0]

    def handle(self, msg: WeightsRequest) -> Encoded | P.Ack:
        with self._lock:
            self.weights_requests += 1
            version, frames, size = self._published
            if frames is None or msg.have_version >= version:
                return P.Ack(ok=True, learner_version=version)
            self.bytes_served += size
            self.served[version] += 1
        return Encoded(frames)

    def stats(self) -> dict:
        return {"requests": self.weights_requests, "bytes_served": self.bytes_served,
                "version": self.version}

    def close(self) -> None:
        """Nothing to release: the frames go with the last reply that holds them."""


class ZmqWeightReceiver:
    """The actor's side, a ``WeightReceiver`` over the control channel."""

    channel = "zmq"

    def __init__(self, control: Requester, actor_id: int):
        self.control, self.actor_id = control, actor_id

    async def fetch(self, have_version: int) -> WeightsUpdate | None:
        """The learner's weights when newer than ``have_version``, else None."""
        reply = await self.control.request(WeightsRequest(self.actor_id, have_version))
        return expect(reply, WeightsUpdate, "weights request")

    async def sync(self, engine: Any, have_version: int | None = None) -> Loaded | None:
        have = engine.version if have_version is None else have_version
        update = await self.fetch(have)
        # an older version is loaded only when asked for (have = -1: the learner is behind)
        if update is None or update.version == engine.version or (
                update.version < engine.version and have >= engine.version):
            return None
        paused = await engine.update_weights(update.tensors, update.version)
        return Loaded(update.version, paused, self.channel)


async def _receiver(cfg: Any, control: Requester, engine: Any, actor_id: int,
                    fallback: WeightReceiver) -> WeightReceiver:
    return fallback


CHANNEL = Channel("zmq", (WeightsRequest, WeightsUpdate), lambda cfg: ZmqWeightSender(),
                  _receiver)
