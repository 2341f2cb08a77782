"""The weight channels (actors/weight_sync.py, learner/weight_sync.py) on CPU: the header
and chunking the NCCL transfer relies on, checked against vLLM 0.32's own code; the
learner's join/offer logic; the actor's choice of channel and its fallback to ZeroMQ.
The transfer itself needs GPUs: tests/gpu/test_gpu_path.py."""

from __future__ import annotations

import socket

import numpy as np
import pytest

from actors.weight_sync import (
    NcclUnavailable,
    NcclWeights,
    ZmqWeights,
    build_weight_sync,
    init_info_from,
    update_info_from,
)
from arpo_async.core import protocol as P
from arpo_async.core.config import config_from_dict
from arpo_async.core.host import machine_id
from learner.weight_sync import NcclWeightServer, plan_chunks, weight_header


@pytest.fixture(scope="module")
def vllm_transfer():
    """vLLM's weight-transfer module (imports vLLM once: ~10 s)."""
    from vllm.distributed.weight_transfer import nccl_engine, packed_tensor

    return nccl_engine, packed_tensor


def snapshot():
    rng = np.random.default_rng(0)
    return {"model.embed_tokens.weight": rng.standard_normal((64, 8)).astype(np.float32),
            "model.norm.weight": np.ones(8, np.float16),
            "lm_head.weight": rng.integers(0, 2**16, (64, 8), dtype=np.uint16)}  # bf16 bits


def test_header_names_torch_dtypes_in_snapshot_order():
    names, dtypes, shapes = weight_header(snapshot(), bf16_names=["lm_head.weight"])
    assert names == ["model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"]
    assert dtypes == ["float32", "float16", "bfloat16"]
    assert shapes == [[64, 8], [8], [64, 8]]
    with pytest.raises(ValueError, match=r"weights\['x'\]: dtype int64"):
        weight_header({"x": np.zeros(3, np.int64)})


@pytest.mark.filterwarnings("ignore:Tensor .* exceeds buffer_size_bytes")
@pytest.mark.parametrize("sizes, buffer", [
    ([10, 20, 30, 40], 25), ([10, 20, 30, 40], 1000), ([100], 10), ([5, 5, 5, 5], 10),
    ([0, 7, 0, 3, 9], 7), (list(range(1, 40)), 64),
])
def test_chunks_follow_vllms_packing_rule(vllm_transfer, sizes, buffer):
    import torch

    _, packed = vllm_transfer
    tensors = [(f"t{i}", torch.zeros(n, dtype=torch.uint8)) for i, n in enumerate(sizes)]
    it, theirs = iter(tensors), []
    while (chunk := packed.pack_tensors(it, lambda item: item[1], buffer)) is not None:
        theirs.append([int(name[1:]) for name in chunk.names])
    assert plan_chunks(sizes, buffer) == theirs


def test_join_and_update_info_are_what_vllms_nccl_engine_accepts(vllm_transfer):
    nccl, _ = vllm_transfer
    reply = P.NcclJoinReply(ok=True, master_address="127.0.0.1", master_port=40123,
                            world_size=3, buffer_bytes=2**20, num_buffers=2)
    info = nccl.NCCLWeightTransferInitInfo(**init_info_from(reply))
    assert (info.rank_offset, info.world_size, info.packed) == (1, 3, True)
    names, dtypes, shapes = weight_header(snapshot())
    header = P.NcclWeightsHeader(5, names, dtypes, shapes)
    update = nccl.NCCLWeightTransferUpdateInfo(**update_info_from(header))
    assert update.names == names and update.shapes == shapes
    with pytest.raises(ValueError, match="2 names, 1 dtypes"):
        update_info_from(P.NcclWeightsHeader(1, ["a", "b"], ["float32"], [[1], [1]]))


# ----------------------------------------------------------------------------- learner


def server():
    return NcclWeightServer(device_index=0, buffer_bytes=2**20, timeout_s=5.0, start=False)


def test_join_only_from_this_machine_and_binds_a_rendezvous_port():
    srv = server()
    far = srv.handle(P.NcclJoinRequest(actor_id=3, machine_id="another-boot-id", workers=2))
    assert not far.ok and "another machine" in far.reason and srv._jobs.empty()
    near = srv.handle(P.NcclJoinRequest(actor_id=3, machine_id=machine_id(), workers=2))
    assert near.ok and near.world_size == 3 and near.buffer_bytes == 2**20
    kind, actor_id, sock, world = srv._jobs.get_nowait()
    assert (kind, actor_id, world) == ("join", 3, 3)
    assert sock.getsockname()[1] == near.master_port  # listening, so the actor can connect
    with socket.create_connection(("127.0.0.1", near.master_port), timeout=2):
        pass
    sock.close()


def test_offer_sends_the_header_of_the_newest_version_and_queues_exactly_it():
    srv = server()
    srv.handle(P.NcclJoinRequest(actor_id=1, machine_id=machine_id()))
    srv._jobs.get_nowait()[2].close()
    assert srv.handle(P.NcclWeightsRequest(1, -1)) == P.Ack(ok=True, learner_version=-1)
    weights = snapshot()
    srv.publish(4, weights, bf16_names=["lm_head.weight"])
    header = srv.handle(P.NcclWeightsRequest(actor_id=1, have_version=2))
    assert isinstance(header, P.NcclWeightsHeader) and header.version == 4
    assert (header.names, header.dtype_names, header.shapes) == weight_header(weights)
    kind, actor_id, snap = srv._jobs.get_nowait()
    assert (kind, actor_id, snap.version) == ("send", 1, 4)
    assert all(a is weights[n] for a, n in zip(snap.arrays, header.names))  # no copy
    assert srv.handle(P.NcclWeightsRequest(1, 4)).learner_version == 4  # up to date
    refused = srv.handle(P.NcclWeightsRequest(actor_id=9, have_version=0))
    assert not refused.ok and "no NCCL group" in refused.reason and srv._jobs.empty()


# ----------------------------------------------------------------------------- actor


class FakeControl:
    """Answers requests with scripted replies; records what was asked."""

    def __init__(self, *replies):
        self.replies, self.sent = list(replies), []

    async def request(self, msg):
        self.sent.append(msg)
        return self.replies.pop(0)

    async def fetch_weights(self, have_version, actor_id):
        self.sent.append(("fetch", have_version, actor_id))
        return self.replies.pop(0)


class ZmqOnlyEngine:
    """Records loads (like the transformers engine: no NCCL receive)."""

    def __init__(self):
        self.version, self.loaded, self.nccl_workers, self.init_info = 0, [], 2, None

    async def update_weights(self, tensors, version):
        self.loaded.append(("zmq", version))
        self.version = version
        return 0.5


class FakeEngine(ZmqOnlyEngine):
    """``receive_weights_nccl`` asks for the header as VLLMEngine does."""

    async def init_weight_transfer(self, info):
        self.init_info = info

    async def receive_weights_nccl(self, fetch_header, timeout_s):
        header = await fetch_header()
        if header is None:
            return None
        self.loaded.append(("nccl", header.version))
        self.version = header.version
        return header.version, 0.1


def cfg(sync="nccl"):
    return config_from_dict({"cluster": {"device": "cuda"}, "learner": {"weight_sync": sync}})


async def test_zeromq_unless_nccl_is_configured_and_possible():
    assert isinstance(await build_weight_sync(cfg("zmq"), FakeControl(), FakeEngine(), 0),
                      ZmqWeights)
    no_support = await build_weight_sync(cfg(), FakeControl(), ZmqOnlyEngine(), 0)
    assert isinstance(no_support, ZmqWeights)
    refused = FakeControl(P.NcclJoinReply(ok=False, reason="actor runs on another machine"))
    assert isinstance(await build_weight_sync(cfg(), refused, FakeEngine(), 0), ZmqWeights)
    assert refused.sent[0].machine_id == machine_id() and refused.sent[0].workers == 2


async def test_nccl_join_then_updates_and_zeromq_after_the_learner_drops_the_group():
    join = P.NcclJoinReply(ok=True, master_address="127.0.0.1", master_port=1, world_size=3,
                           buffer_bytes=64, num_buffers=2)
    header = P.NcclWeightsHeader(2, ["w"], ["float32"], [[4]])
    update = P.WeightsUpdate(version=3, tensors={"w": np.zeros(4, np.float32)})
    control = FakeControl(join, P.Ack(ok=True, learner_version=0), header,
                          P.Ack(ok=False, reason="no NCCL group for this actor"), update)
    engine = FakeEngine()
    sync = await build_weight_sync(cfg(), control, engine, actor_id=7)
    assert isinstance(sync, NcclWeights) and engine.init_info == init_info_from(join)
    assert await sync.sync(engine) is None  # nothing newer
    got = await sync.sync(engine)
    assert (got.version, got.channel) == (2, "nccl")
    got = await sync.sync(engine)  # the learner aborted the group: ZeroMQ from now on
    assert (got.version, got.channel, got.paused_s) == (3, "zmq", 0.5)
    assert "no NCCL group" in sync.broken
    assert engine.loaded == [("nccl", 2), ("zmq", 3)]
    asked = [m for m in control.sent if isinstance(m, P.NcclWeightsRequest)]
    assert [(m.actor_id, m.have_version) for m in asked] == [(7, 0), (7, 0), (7, 2)]


async def test_header_error_surfaces_as_nccl_unavailable():
    sync = NcclWeights(FakeControl(P.TicketGrant(0, 0)), 0, ZmqWeights(None, 0), 1.0)
    with pytest.raises(NcclUnavailable, match="TicketGrant"):
        await sync._header(0)


async def test_zeromq_loads_an_older_version_only_when_asked_to():
    """A learner that resumed from an older checkpoint publishes an older version: the
    actor loads it only when it passes have_version=-1 (it knows the learner is behind)."""
    older = P.WeightsUpdate(version=2, tensors={"w": np.zeros(4, np.float32)})
    engine = ZmqOnlyEngine()
    engine.version = 5
    sync = ZmqWeights(FakeControl(older, older), actor_id=0)
    assert await sync.sync(engine) is None
    got = await sync.sync(engine, have_version=-1)
    assert (got.version, engine.version) == (2, 2)
    assert [m[1] for m in sync.control.sent] == [5, -1]
