"""Where the learner's control handler (learner/service.py) sends each request: weight
requests to the weight channel that declares them (arpo_async/core/weights/), NCCL ones of a
ZeroMQ run refused by name, bad counts refused and counted, a remote actor's request for
an id answered with one. The handler is called directly (the sockets are bound, no
process is started)."""

from __future__ import annotations

import numpy as np
import pytest

from arpo_async.core import protocol as P
from arpo_async.core.config import config_from_dict
from arpo_async.core.transport.control import Encoded
from arpo_async.core.weights.nccl import NcclWeightsRequest
from arpo_async.core.weights.zeromq import WeightsRequest
from learner.service import _SHUTDOWN_QUIET_S, LearnerService, may_stop


@pytest.fixture
def service(tmp_path):
    cfg = config_from_dict({"run": {"dir": str(tmp_path)}, "actors": {"num": 2}})
    svc = LearnerService(cfg, vocab_size=64)
    yield svc
    svc.control.stop()
    svc.receiver.close()


def test_requests_go_to_their_channel_or_are_refused_by_name(service):
    ask = lambda msg: service._handle(msg, b"peer")  # noqa: E731
    assert ask(WeightsRequest(0, -1)) == P.Ack(ok=True, learner_version=-1)
    service.publish(0, {"w": np.ones(4, np.float32)})
    update = ask(WeightsRequest(0, -1))
    assert isinstance(update, Encoded) and P.decode(update.frames).version == 0
    nccl = ask(NcclWeightsRequest(0, -1))
    assert nccl == P.Ack(ok=False, reason=P.AckReason.NO_FAST_WEIGHTS)
    for bad in (P.TicketRequest(0, 0, -1), WeightsRequest(-3, -1), P.Hello(-1, 1)):
        assert ask(bad).reason == P.AckReason.BAD_REQUEST
    assert service.events["bad_request"] == 3
    reply = ask(P.ConfigRequest(actor_id=-1, host="node-b", pid=7))
    assert isinstance(reply, P.ConfigReply) and reply.actor_id == 2  # after the local 0, 1
    snap = service.snapshot()
    assert snap["weights"]["zmq"]["requests"] == 2 and snap["weights"]["zmq"]["version"] == 0


def test_shutdown_waits_after_the_last_bye_for_the_groups_it_announced():
    """The faults run's lost group: the last group came 4 s before the last Bye, and the
    group that Bye announced was still on its way. The quiet period counts from the Bye
    too (learner/service.py may_stop)."""
    quiet = _SHUTDOWN_QUIET_S
    assert not may_stop(now=10.0, last_group=5.0, byes_at=9.9, byes=True, done=False)
    assert may_stop(now=9.9 + quiet + 0.1, last_group=5.0, byes_at=9.9, byes=True,
                    done=False)
    assert not may_stop(now=100.0, last_group=5.0, byes_at=None, byes=False, done=False)
    assert may_stop(now=10.0, last_group=9.9, byes_at=9.9, byes=True, done=True)
