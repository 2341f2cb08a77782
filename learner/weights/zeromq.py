"""The learner's ZeroMQ weight channel (any actor, any machine; the actor's side:
actors/weights/zeromq.py).

Each published version is encoded once (a msgpack header plus one raw frame per tensor,
arpo_async/core/protocol/) and every ``WeightsRequest`` newer than the asker's version
is answered with the same frames, which the control server sends uncopied
(``Encoded``): no copy per actor. An asker that is up to date gets ``Ack(ok=True)`` with
the published version."""

from __future__ import annotations

import threading
from collections import Counter

from arpo_async.core import protocol as P
from arpo_async.core.transport.control import Encoded
from arpo_async.core.transport.sockets import nbytes


class ZmqWeightSender:
    """A ``WeightSender`` (learner/weights/base.py) over the control channel."""

    channel = "zmq"
    requests = (P.WeightsRequest,)

    def __init__(self):
        self._lock = threading.Lock()  # publish (main thread) vs handle (control thread)
        self._published: tuple[int, list | None, int] = (-1, None, 0)  # version, frames, bytes
        self.weights_requests = 0
        self.bytes_served = 0
        self.served: Counter = Counter()  # weights version -> replies carrying it

    def publish(self, version: int, tensors: dict) -> None:
        """Encode ``version`` once; every reply from now on sends the tensors' memory as it
        is at that moment, so they must not change afterwards."""
        frames = P.encode(P.WeightsUpdate(version=version, tensors=tensors))
        with self._lock:
            if version <= self._published[0]:
                raise ValueError(f"weights version {version} published after "
                                 f"{self._published[0]}: versions must increase")
            self._published = (version, frames, nbytes(frames))

    @property
    def version(self) -> int:
        return self._published[0]

    def handle(self, msg: P.WeightsRequest) -> Encoded | P.Ack:
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
