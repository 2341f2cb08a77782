"""The actor's weight path (actors/actor.py with arpo_async/core/weights/): the configured
channel is picked once the learner answered (ZeroMQ unless NCCL is configured, the engine
can receive over it and the learner lets it join), ZeroMQ updates reach the engine with
their bfloat16 names, a refusal is an error and "nothing newer" is None, a learner that
drops the NCCL group turns the actor to ZeroMQ, and a learner that fell behind is
followed back. Fakes for the engine and the control socket; the messages are the real
protocol ones (and go through its encoder where the wire matters)."""

from __future__ import annotations

import pytest
import torch

from actors.actor import Actor
from arpo_async.core import protocol as P
from arpo_async.core.config import config_from_dict
from arpo_async.core.host import machine_id
from arpo_async.core.weights import build_weight_receiver
from arpo_async.core.weights.nccl import (
    NcclJoinReply,
    NcclJoinRequest,
    NcclUnavailable,
    NcclWeightReceiver,
    NcclWeightsHeader,
    NcclWeightsRequest,
)
from arpo_async.core.weights.zeromq import WeightsRequest, WeightsUpdate, ZmqWeightReceiver


class Engine:
    """Records what it was asked to load; NCCL receive only when ``nccl``."""

    def __init__(self, version=0, nccl=False):
        self.version, self.loaded, self.init_info = version, [], None
        self.nccl_workers = 1
        if nccl:
            self.receive_weights_nccl = self._receive
            self.init_weight_transfer = self._init

    async def update_weights(self, tensors, version):
        self.loaded.append(("zmq", version, sorted(tensors),
                            sorted(n for n, t in tensors.items() if t.dtype == torch.bfloat16)))
        self.version = version
        return 0.25

    async def _init(self, info):
        self.init_info = info

    async def _receive(self, fetch_header, timeout_s):
        header = await fetch_header()
        if header is None:
            return None
        self.loaded.append(("nccl", header.version, list(header.names), []))
        self.version = header.version
        return header.version, 0.125


class Control:
    """The learner's control socket, scripted: ``weights`` answers WeightsRequests in
    order; tickets say stop at once; NCCL joins are granted."""

    def __init__(self, weights=(), header=None, version=3):
        self.weights, self.header, self.version, self.sent = list(weights), header, version, []
        self.endpoint = "fake"

    async def hello(self, msg):
        self.sent.append(msg)
        return P.Ack(ok=True, learner_version=self.version)

    async def request(self, msg):
        self.sent.append(msg)
        if isinstance(msg, WeightsRequest):
            return self.weights.pop(0)
        if isinstance(msg, P.TicketRequest):
            return P.TicketGrant(0, self.version, stop=True)
        if isinstance(msg, NcclJoinRequest):
            return NcclJoinReply(ok=True, master_address="127.0.0.1", master_port=1,
                                   world_size=2, buffer_bytes=64, num_buffers=2)
        if isinstance(msg, NcclWeightsRequest):
            header, self.header = self.header, None
            return header or P.Ack(ok=True, learner_version=self.version)
        return P.Ack(ok=True, learner_version=self.version)


class Scripted:
    """Answers requests with scripted replies, in order; records what was asked."""

    def __init__(self, *replies):
        self.replies, self.sent = list(replies), []

    async def request(self, msg):
        self.sent.append(msg)
        return self.replies.pop(0)


class Source:
    position = 0
    skipped_long = 0  # prompts too long for the engine (PromptSource)


def make_actor(tmp_path, engine, control, sync="zmq"):
    tree = {"run": {"dir": str(tmp_path), "probe_logprobs": False},
            "actors": {"concurrent_groups": 1, "weight_poll_s": 0.01}}
    if sync == "nccl":
        tree |= {"cluster": {"device": "cuda"}, "learner": {"weight_sync": {"channel": "nccl"}}}
    return Actor(config_from_dict(tree), 4, engine, rollout=None, source=Source(),
                 sender=None, control=control, vocab_size=100)


def wire(update: WeightsUpdate) -> WeightsUpdate:
    return P.decode(P.encode(update))


async def test_bfloat16_tensors_reach_the_engine_as_bfloat16(tmp_path):
    w = torch.arange(6, dtype=torch.bfloat16).reshape(2, 3)
    update = wire(WeightsUpdate(version=2, tensors={"w": w, "b": torch.ones(3)}))
    engine = Engine()
    actor = make_actor(tmp_path, engine, Control([update]))
    await actor.sync_weights()
    assert engine.loaded == [("zmq", 2, ["b", "w"], ["w"])]
    assert (actor.updates, actor.pause_s, engine.version) == (1, 0.25, 2)


async def test_nothing_newer_loads_nothing(tmp_path):
    update = wire(WeightsUpdate(version=1, tensors={"w": torch.ones(3)}))
    engine = Engine()
    actor = make_actor(tmp_path, engine, Control([update, P.Ack(ok=True)]))
    await actor.sync_weights()
    await actor.sync_weights()  # nothing newer: nothing loaded, nothing counted
    assert engine.loaded == [("zmq", 1, ["w"], [])] and actor.updates == 1


async def test_an_actor_ahead_of_a_restarted_learner_loads_its_older_version(tmp_path):
    older = WeightsUpdate(version=2, tensors={"w": torch.ones(3)})
    engine = Engine(version=5)
    control = Control([older, older])
    actor = make_actor(tmp_path, engine, control)
    await actor.sync_weights()  # the learner's version is unknown: an older one is ignored
    assert engine.version == 5
    actor.control.learner_version = 2  # a reply said the learner publishes v2
    await actor.sync_weights()
    asked = [m.have_version for m in control.sent if isinstance(m, WeightsRequest)]
    assert asked == [5, -1] and engine.version == 2 and actor.updates == 1


async def test_run_uses_nccl_when_configured_and_the_engine_can(tmp_path):
    engine = Engine(nccl=True)
    control = Control(header=NcclWeightsHeader(3, ["w"], ["bfloat16"], [[4]]))
    actor = make_actor(tmp_path, engine, control, sync="nccl")
    await actor.run()
    assert actor.weights.channel == "nccl" and engine.init_info.world_size == 2
    assert engine.loaded == [("nccl", 3, ["w"], [])]
    kinds = [type(m).__name__ for m in control.sent]
    assert kinds[:3] == ["Hello", "NcclJoinRequest", "NcclWeightsRequest"]
    assert "WeightsRequest" not in kinds and kinds[-1] == "Bye"


async def test_run_keeps_zeromq_by_default_even_for_an_nccl_capable_engine(tmp_path):
    update = WeightsUpdate(version=3, tensors={"w": torch.ones(4)})
    engine = Engine(nccl=True)
    control = Control([update])
    actor = make_actor(tmp_path, engine, control)
    await actor.run()
    assert actor.weights.channel == "zmq" and engine.init_info is None
    assert engine.loaded == [("zmq", 3, ["w"], [])]
    assert not any(isinstance(m, (NcclJoinRequest, NcclWeightsRequest))
                   for m in control.sent)


# ----------------------------------------------------------------------------- the channels


def nccl_cfg(sync="nccl"):
    return config_from_dict({"cluster": {"device": "cuda"},
                             "learner": {"weight_sync": {"channel": sync}}})


async def test_zeromq_unless_nccl_is_configured_and_possible():
    capable = Engine(nccl=True)
    assert isinstance(await build_weight_receiver(nccl_cfg("zmq"), Scripted(), capable, 0),
                      ZmqWeightReceiver)
    no_support = await build_weight_receiver(nccl_cfg(), Scripted(), Engine(), 0)
    assert isinstance(no_support, ZmqWeightReceiver)
    refused = Scripted(NcclJoinReply(ok=False, reason="actor runs on another machine"))
    assert isinstance(await build_weight_receiver(nccl_cfg(), refused, capable, 0),
                      ZmqWeightReceiver)
    assert refused.sent[0].machine_id == machine_id() and refused.sent[0].workers == 1


async def test_nccl_join_then_updates_and_zeromq_after_the_learner_drops_the_group():
    join = NcclJoinReply(ok=True, master_address="127.0.0.1", master_port=1, world_size=3,
                           buffer_bytes=64, num_buffers=2)
    header = NcclWeightsHeader(2, ["w"], ["float32"], [[4]])
    update = WeightsUpdate(version=3, tensors={"w": torch.zeros(4)})
    control = Scripted(join, P.Ack(ok=True, learner_version=0), header,
                       P.Ack(ok=False, reason="no NCCL group for this actor"), update)
    engine = Engine(nccl=True)
    sync = await build_weight_receiver(nccl_cfg(), control, engine, actor_id=7)
    assert isinstance(sync, NcclWeightReceiver) and engine.init_info is join
    assert await sync.sync(engine) is None  # nothing newer
    got = await sync.sync(engine)
    assert (got.version, got.channel) == (2, "nccl")
    got = await sync.sync(engine)  # the learner aborted the group: ZeroMQ from now on
    assert (got.version, got.channel, got.paused_s) == (3, "zmq", 0.25)
    assert "no NCCL group" in sync.broken
    assert engine.loaded == [("nccl", 2, ["w"], []), ("zmq", 3, ["w"], [])]
    asked = [m for m in control.sent if isinstance(m, NcclWeightsRequest)]
    assert [(m.actor_id, m.have_version) for m in asked] == [(7, 0), (7, 0), (7, 2)]


async def test_replies_that_are_neither_weights_nor_nothing_newer_are_errors():
    nccl = NcclWeightReceiver(Scripted(P.TicketGrant(0, 0)), 0, ZmqWeightReceiver(None, 0),
                              1.0)
    with pytest.raises(NcclUnavailable, match="TicketGrant"):
        await nccl._header(0)
    zmq = ZmqWeightReceiver(Scripted(P.Ack(ok=True, learner_version=4),
                                     P.Ack(ok=False, reason="hello_required")), 3)
    assert await zmq.fetch(4) is None
    with pytest.raises(P.ProtocolError, match="weights request: hello_required"):
        await zmq.fetch(4)
    assert [(m.actor_id, m.have_version) for m in zmq.control.sent] == [(3, 4), (3, 4)]
