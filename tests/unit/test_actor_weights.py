"""The actor's weight path (actors/actor.py with actors/weight_sync.py): the configured
channel is picked once the learner answered, ZeroMQ updates reach the engine with their
bfloat16 names, and a learner that fell behind is followed back. Fakes for the engine and
the control socket; the messages are the real protocol ones (and go through its
encoder where the wire matters)."""

from __future__ import annotations

import numpy as np

from actors.actor import Actor
from arpo_async.core import protocol as P
from arpo_async.core.config import config_from_dict


class Engine:
    """Records what it was asked to load; NCCL receive only when ``nccl``."""

    def __init__(self, version=0, nccl=False):
        self.version, self.loaded, self.init_info = version, [], None
        self.nccl_workers = 1
        if nccl:
            self.receive_weights_nccl = self._receive
            self.init_weight_transfer = self._init

    async def update_weights(self, tensors, version, bf16_names=()):
        self.loaded.append(("zmq", version, sorted(tensors), list(bf16_names)))
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


class LegacyEngine(Engine):
    """An engine (or wrapper) whose update_weights predates ``bf16_names``."""

    async def update_weights(self, tensors, version):
        return await super().update_weights(tensors, version)


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
        if isinstance(msg, P.WeightsRequest):
            return self.weights.pop(0)
        if isinstance(msg, P.TicketRequest):
            return P.TicketGrant(0, self.version, stop=True)
        if isinstance(msg, P.NcclJoinRequest):
            return P.NcclJoinReply(ok=True, master_address="127.0.0.1", master_port=1,
                                   world_size=2, buffer_bytes=64, num_buffers=2)
        if isinstance(msg, P.NcclWeightsRequest):
            header, self.header = self.header, None
            return header or P.Ack(ok=True, learner_version=self.version)
        return P.Ack(ok=True, learner_version=self.version)


class Source:
    position = 0
    skipped_long = 0  # prompts too long for the engine (PromptSource)


def make_actor(tmp_path, engine, control, sync="zmq"):
    tree = {"run": {"dir": str(tmp_path), "probe_logprobs": False},
            "actors": {"concurrent_groups": 1, "weight_poll_s": 0.01}}
    if sync == "nccl":
        tree |= {"cluster": {"device": "cuda"}, "learner": {"weight_sync": "nccl"}}
    return Actor(config_from_dict(tree), 4, engine, rollout=None, source=Source(),
                 sender=None, control=control, vocab_size=100)


def wire(update: P.WeightsUpdate) -> P.WeightsUpdate:
    return P.decode(P.encode(update))


async def test_bf16_names_reach_the_engine(tmp_path):
    bits = np.arange(6, dtype=np.uint16).reshape(2, 3)
    update = wire(P.WeightsUpdate(version=2, tensors={"w": bits, "b": np.ones(3, np.float32)},
                                  bf16_names=["w"]))
    engine = Engine()
    actor = make_actor(tmp_path, engine, Control([update]))
    await actor.sync_weights()
    assert engine.loaded == [("zmq", 2, ["b", "w"], ["w"])]
    assert (actor.updates, actor.pause_s, engine.version) == (1, 0.25, 2)


async def test_float32_updates_still_load_into_engines_without_the_argument(tmp_path):
    update = wire(P.WeightsUpdate(version=1, tensors={"w": np.ones(3, np.float32)}))
    engine = LegacyEngine()
    actor = make_actor(tmp_path, engine, Control([update, P.Ack(ok=True)]))
    await actor.sync_weights()
    await actor.sync_weights()  # nothing newer: nothing loaded, nothing counted
    assert engine.loaded == [("zmq", 1, ["w"], [])] and actor.updates == 1


async def test_an_actor_ahead_of_a_restarted_learner_loads_its_older_version(tmp_path):
    older = P.WeightsUpdate(version=2, tensors={"w": np.ones(3, np.float32)})
    engine = Engine(version=5)
    control = Control([older, older])
    actor = make_actor(tmp_path, engine, control)
    await actor.sync_weights()  # the learner's version is unknown: an older one is ignored
    assert engine.version == 5
    actor._learner_version = 2  # a reply said the learner publishes v2
    await actor.sync_weights()
    asked = [m.have_version for m in control.sent if isinstance(m, P.WeightsRequest)]
    assert asked == [5, -1] and engine.version == 2 and actor.updates == 1


async def test_run_uses_nccl_when_configured_and_the_engine_can(tmp_path):
    engine = Engine(nccl=True)
    control = Control(header=P.NcclWeightsHeader(3, ["w"], ["bfloat16"], [[4]]))
    actor = make_actor(tmp_path, engine, control, sync="nccl")
    await actor.run()
    assert actor.weights.channel == "nccl" and engine.init_info["world_size"] == 2
    assert engine.loaded == [("nccl", 3, ["w"], [])]
    kinds = [type(m).__name__ for m in control.sent]
    assert kinds[:3] == ["Hello", "NcclJoinRequest", "NcclWeightsRequest"]
    assert "WeightsRequest" not in kinds and kinds[-1] == "Bye"


async def test_run_keeps_zeromq_by_default_even_for_an_nccl_capable_engine(tmp_path):
    update = P.WeightsUpdate(version=3, tensors={"w": np.ones(4, np.float32)})
    engine = Engine(nccl=True)
    control = Control([update])
    actor = make_actor(tmp_path, engine, control)
    await actor.run()
    assert actor.weights.channel == "zmq" and engine.init_info is None
    assert engine.loaded == [("zmq", 3, ["w"], [])]
    assert not any(isinstance(m, (P.NcclJoinRequest, P.NcclWeightsRequest))
                   for m in control.sent)
