"""The weight channels on CPU: the header and chunking the NCCL transfer relies on,
checked against vLLM 0.32's own code (actors/engines/vllm_weights.py,
arpo_async/core/weights/nccl.py); the learner's side (arpo_async/core/weights/): NCCL join
and offer, ZeroMQ's one encoding per version, the channels a run serves and the messages
each owns. The actor's side: tests/unit/test_actor_weights.py; the NCCL transfer itself
needs GPUs (tests/gpu/test_gpu_path.py); the ZeroMQ one runs over real sockets in
tests/integration/test_transport.py."""

from __future__ import annotations

import socket

import pytest
import torch

from actors.engines.vllm_weights import init_info_from, update_info_from
from arpo_async.core import protocol as P
from arpo_async.core.config import config_from_dict
from arpo_async.core.config.learner import WEIGHT_SYNC_CHANNELS
from arpo_async.core.host import machine_id
from arpo_async.core.transport.control import Encoded
from arpo_async.core.weights import build_weight_senders
from arpo_async.core.weights.nccl import (
    NcclJoinReply,
    NcclJoinRequest,
    NcclWeightSender,
    NcclWeightsHeader,
    NcclWeightsRequest,
    plan_chunks,
    weight_header,
)
from arpo_async.core.weights.zeromq import WeightsRequest, ZmqWeightSender


@pytest.fixture(scope="module")
def vllm_transfer():
    """vLLM's weight-transfer module (imports vLLM once: ~10 s)."""
    from vllm.distributed.weight_transfer import nccl_engine, packed_tensor

    return nccl_engine, packed_tensor


def snapshot():
    gen = torch.Generator().manual_seed(0)
    return {"model.embed_tokens.weight": torch.randn(64, 8, generator=gen),
            "model.norm.weight": torch.ones(8, dtype=torch.float16),
            "lm_head.weight": torch.randn(64, 8, generator=gen).to(torch.bfloat16)}


def test_header_names_torch_dtypes_in_snapshot_order():
    names, dtypes, shapes = weight_header(snapshot())
    assert names == ["model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"]
    assert dtypes == ["float32", "float16", "bfloat16"]
    assert shapes == [[64, 8], [8], [64, 8]]
    with pytest.raises(ValueError, match=r"weights\['x'\]: dtype int64"):
        weight_header({"x": torch.zeros(3, dtype=torch.int64)})


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
    reply = NcclJoinReply(ok=True, master_address="127.0.0.1", master_port=40123,
                            world_size=3, buffer_bytes=2**20, num_buffers=2)
    info = nccl.NCCLWeightTransferInitInfo(**init_info_from(reply))
    assert (info.rank_offset, info.world_size, info.packed) == (1, 3, True)
    names, dtypes, shapes = weight_header(snapshot())
    header = NcclWeightsHeader(5, names, dtypes, shapes)
    update = nccl.NCCLWeightTransferUpdateInfo(**update_info_from(header))
    assert update.names == names and update.shapes == shapes
    with pytest.raises(ValueError, match="2 names, 1 dtypes"):
        update_info_from(NcclWeightsHeader(1, ["a", "b"], ["float32"], [[1], [1]]))


# ----------------------------------------------------------------------------- learner


def server():
    return NcclWeightSender(device_index=0, buffer_bytes=2**20, timeout_s=5.0, start=False)


def test_join_only_from_this_machine_and_binds_a_rendezvous_port():
    srv = server()
    far = srv.handle(NcclJoinRequest(actor_id=3, machine_id="another-boot-id", workers=2))
    assert not far.ok and "another machine" in far.reason and srv._jobs.empty()
    near = srv.handle(NcclJoinRequest(actor_id=3, machine_id=machine_id(), workers=2))
    assert near.ok and near.world_size == 3 and near.buffer_bytes == 2**20
    kind, actor_id, sock, world = srv._jobs.get_nowait()
    assert (kind, actor_id, world) == ("join", 3, 3)
    assert sock.getsockname()[1] == near.master_port  # listening, so the actor can connect
    with socket.create_connection(("127.0.0.1", near.master_port), timeout=2):
        pass
    sock.close()


def test_offer_sends_the_header_of_the_newest_version_and_queues_exactly_it():
    srv = server()
    srv.handle(NcclJoinRequest(actor_id=1, machine_id=machine_id()))
    srv._jobs.get_nowait()[2].close()
    assert srv.handle(NcclWeightsRequest(1, -1)) == P.Ack(ok=True, learner_version=-1)
    weights = snapshot()
    srv.publish(4, weights)
    header = srv.handle(NcclWeightsRequest(actor_id=1, have_version=2))
    assert isinstance(header, NcclWeightsHeader) and header.version == 4
    assert (header.names, header.dtype_names, header.shapes) == weight_header(weights)
    kind, actor_id, snap = srv._jobs.get_nowait()
    assert (kind, actor_id, snap.version) == ("send", 1, 4)
    assert all(t is weights[n] for t, n in zip(snap.tensors, header.names))  # no copy
    assert srv.handle(NcclWeightsRequest(1, 4)).learner_version == 4  # up to date
    refused = srv.handle(NcclWeightsRequest(actor_id=9, have_version=0))
    assert not refused.ok and "no NCCL group" in refused.reason and srv._jobs.empty()


def test_zeromq_serves_one_encoding_per_version_and_acks_the_up_to_date():
    zmq = ZmqWeightSender()
    assert zmq.handle(WeightsRequest(0, -1)) == P.Ack(ok=True, learner_version=-1)
    zmq.publish(3, snapshot())
    first, second = zmq.handle(WeightsRequest(0, -1)), zmq.handle(WeightsRequest(1, 2))
    assert isinstance(first, Encoded) and first.frames is second.frames  # encoded once
    update = P.decode(first.frames)
    assert update.version == 3 and update.tensors["lm_head.weight"].dtype == torch.bfloat16
    assert torch.equal(update.tensors["lm_head.weight"], snapshot()["lm_head.weight"])
    assert zmq.handle(WeightsRequest(0, 3)) == P.Ack(ok=True, learner_version=3)
    assert zmq.served == {3: 2} and zmq.stats()["requests"] == 4
    with pytest.raises(ValueError, match="versions must increase"):
        zmq.publish(3, snapshot())


def test_the_learner_serves_zeromq_always_and_nccl_when_configured(monkeypatch):
    assert [s.channel for s in build_weight_senders(cfg("zmq"))] == ["zmq"]
    monkeypatch.setattr(NcclWeightSender, "create", classmethod(lambda cls, c: server()))
    senders = build_weight_senders(cfg("nccl"))
    assert [s.channel for s in senders] == ["zmq", "nccl"]
    assert [r.__name__ for s in senders for r in s.requests] == [
        "WeightsRequest", "NcclJoinRequest", "NcclWeightsRequest"]


def cfg(sync="nccl"):
    return config_from_dict({"cluster": {"device": "cuda"},
                             "learner": {"weight_sync": {"channel": sync}}})


def test_every_channel_owns_its_messages_and_the_protocol_knows_them():
    import importlib

    from arpo_async.core.weights import CHANNELS

    assert set(CHANNELS) == set(WEIGHT_SYNC_CHANNELS)  # each channel has its settings class
    for name, channel in CHANNELS.items():
        home = importlib.import_module(channel.sender.__module__)
        assert home.CHANNEL is channel, name
        for cls in channel.messages:
            assert cls.__module__ == home.__name__, (name, cls)  # defined in its room
            assert P.MESSAGES[cls.KIND] is cls  # registered: decode takes it
        # a request an actor sends names the channel, so a run without it refuses it
        assert all(getattr(r, "CHANNEL", name) == name for r in channel.messages)
    with pytest.raises(ValueError, match="both claim"):
        P.register_messages(type("Impostor", (), {"KIND": "weights"}))
