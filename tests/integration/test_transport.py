"""The ZeroMQ transport over real loopback sockets: delivery, backpressure, garbage, the
control channel, the ZeroMQ weight channel (arpo_async/core/weights/zeromq.py, both
sides) to many actors, timeouts, restarts, and CurveZMQ."""

from __future__ import annotations

import asyncio
import logging
import os
import stat
import subprocess
import sys
import time
from contextlib import ExitStack
from pathlib import Path

import numpy as np
import pytest
import torch
import zmq

from arpo_async.core import keys as K
from arpo_async.core.ports import free_port
from arpo_async.core.protocol import (
    Ack,
    Bye,
    Heartbeat,
    Hello,
    ProtocolError,
    TicketGrant,
    TicketRequest,
    Trajectory,
    TrajectoryGroup,
    decode,
    encode,
)
from arpo_async.core.transport.control import ControlClient, ControlServer, TransportTimeout
from arpo_async.core.transport.trajectory import TrajectoryReceiver, TrajectorySender
from arpo_async.core.weights.zeromq import ZmqWeightReceiver, ZmqWeightSender

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]
LOOPBACK = "tcp://127.0.0.1:0"
REPO = Path(__file__).resolve().parents[2]


def make_group(i: int, n_tokens: int = 8, actor_id: int = 0) -> TrajectoryGroup:
    rng = np.random.default_rng(i)
    leaves = [Trajectory(tokens=rng.integers(0, 1000, n, dtype=np.int32),
                         loss_mask=(rng.random(n) < 0.8).astype(np.uint8),
                         logprobs=-rng.random(n, dtype=np.float32),
                         versions=np.full(n, i, np.int32), reward=float(i), parent=j - 1)
              for j, n in enumerate((n_tokens, n_tokens // 2))]
    return TrajectoryGroup(group_id=f"g{i}", actor_id=actor_id, prompt_id=f"p{i}",
                           prompt_tokens=np.arange(5, dtype=np.int32), leaves=leaves,
                           stats={"i": float(i)})


def assert_same_group(a: TrajectoryGroup, b: TrajectoryGroup) -> None:
    assert (a.group_id, a.actor_id, a.prompt_id, a.stats) == (b.group_id, b.actor_id,
                                                              b.prompt_id, b.stats)
    assert np.array_equal(a.prompt_tokens, b.prompt_tokens) and len(a.leaves) == len(b.leaves)
    for x, y in zip(a.leaves, b.leaves):
        for name in ("tokens", "loss_mask", "logprobs", "versions"):
            assert np.array_equal(getattr(x, name), getattr(y, name)), name
        assert (x.reward, x.parent) == (y.reward, y.parent)


def weights_set(seed: int, scale: int = 1) -> dict[str, torch.Tensor]:
    """Tensors of several dtypes, bfloat16 among them."""
    gen = torch.Generator().manual_seed(seed)
    return {"embed": torch.randn(256 * scale, 64, generator=gen),
            "norm": torch.randn(64, generator=gen).to(torch.float16),
            "ids": torch.arange(10, dtype=torch.int64),
            "flags": torch.rand(7, generator=gen) < 0.5,
            "w_bf16": torch.randn(10 * scale, 100, generator=gen).to(torch.bfloat16)}


def free_endpoint() -> str:
    return f"tcp://127.0.0.1:{free_port()}"


class Handler:
    """A learner-like control handler that records what it saw."""

    def __init__(self, learner_version: int = 7):
        self.learner_version, self.seen = learner_version, []

    def __call__(self, msg, peer: bytes):
        self.seen.append((msg, peer))
        if isinstance(msg, TicketRequest):
            return TicketGrant(granted=msg.n, learner_version=self.learner_version)
        if isinstance(msg, Heartbeat):
            raise RuntimeError("boom")  # noqa: TRY004 -- a deliberate handler bug
        if isinstance(msg, Bye):
            return None
        return Ack(ok=True, learner_version=self.learner_version)


def start_server(stack: ExitStack, bind: str = LOOPBACK, handler=None, **kw) -> ControlServer:
    server = ControlServer(bind, handler or Handler(), **kw)
    stack.callback(server.stop)
    server.start()
    return server


def client(stack: ExitStack, endpoint: str, **kw) -> ControlClient:
    c = ControlClient(endpoint, **kw)
    stack.callback(c.close)
    return c


def weights_server(stack: ExitStack, **kw) -> tuple[ControlServer, ZmqWeightSender]:
    """A control server whose handler is the learner's ZeroMQ weight channel."""
    weights = ZmqWeightSender()
    return start_server(stack, handler=lambda msg, peer: weights.handle(msg), **kw), weights


def fetch(c: ControlClient, have_version: int, actor_id: int = 0):
    return ZmqWeightReceiver(c, actor_id).fetch(have_version)


# ----------------------------------------------------------------------------- trajectories


async def test_groups_travel_from_actor_to_learner_intact():
    with ExitStack() as stack:
        rx = stack.enter_context(TrajectoryReceiver(LOOPBACK))
        tx = TrajectorySender(rx.endpoint, hwm=4, timeout_s=5)
        stack.callback(tx.close, 0)
        sent = [make_group(i, n_tokens=10 + i) for i in range(3)]
        before = time.time()
        for g in sent:
            await tx.send(g)
        got = [await asyncio.to_thread(rx.recv, 5.0) for _ in sent]
        for a, b in zip(sent, got):
            assert_same_group(a, b)
            assert b.sent_at >= before  # stamped by the sender, carried over the wire
        assert (tx.sent, rx.received) == (3, 3) and not rx.rejected
        assert rx.recv(0.05) is None


async def test_backpressure_blocks_the_sender_and_loses_nothing():
    n, tokens = 40, 80_000  # 1.5 MB a group: 60 MB is more than the socket buffers hold
    with ExitStack() as stack:
        rx = stack.enter_context(TrajectoryReceiver(LOOPBACK, hwm=2))
        tx = TrajectorySender(rx.endpoint, hwm=2, timeout_s=0.4)
        stack.callback(tx.close, 0)
        done = []

        async def produce():
            for i in range(n):
                await tx.send(make_group(i, n_tokens=tokens))
                done.append(i)

        producer = asyncio.create_task(produce())
        await asyncio.sleep(1.5)  # nobody reads: the sender must be stuck
        stuck_at = len(done)
        assert not producer.done() and stuck_at < n, stuck_at
        assert tx.stalls >= 1  # waited past timeout_s, warned, kept waiting

        def drain():
            return [rx.recv(10.0) for _ in range(n)]

        got = await asyncio.to_thread(drain)
        await asyncio.wait_for(producer, 10)
        assert [g.group_id for g in got] == [f"g{i}" for i in range(n)]
        assert all(len(g.leaves[0]) == tokens for g in got)
        assert rx.recv(0.3) is None  # exactly n, no duplicates
        assert tx.sent == rx.received == n and tx.blocked_s > 1.0 and not rx.rejected


async def test_garbage_is_counted_by_reason_and_the_next_group_arrives():
    limit = 1 << 20
    with ExitStack() as stack:
        rx = stack.enter_context(TrajectoryReceiver(LOOPBACK, max_bytes=limit))
        ctx = zmq.Context()
        stack.callback(ctx.term)
        raw = ctx.socket(zmq.PUSH)
        stack.callback(raw.close, 0)
        raw.connect(rx.endpoint)
        rng = np.random.default_rng(0)
        raw.send(b"\xc1" + rng.bytes(200))  # 0xc1 is never valid msgpack
        raw.send(b"\x00" * (limit + limit // 2))  # over max_bytes, under the hard limit
        raw.send_multipart(encode(Hello(actor_id=1, pid=2)))  # valid, but not a group
        header, *arrays = encode(make_group(1))
        raw.send_multipart([header, *arrays[:-1]])  # a frame missing
        raw.send_multipart(encode(make_group(2)))
        got = await asyncio.to_thread(rx.recv, 5.0)
        assert got is not None and got.group_id == "g2"
        assert rx.rejected == {"not_msgpack": 1, "too_large": 1, "wrong_kind": 1,
                               "frame_count": 1}
        assert rx.received == 1 and rx.recv(0.1) is None


async def test_a_frame_over_the_hard_limit_only_costs_its_own_connection():
    limit = 1 << 20
    with ExitStack() as stack:
        rx = stack.enter_context(TrajectoryReceiver(LOOPBACK, max_bytes=limit))
        ctx = zmq.Context()
        stack.callback(ctx.term)
        raw = ctx.socket(zmq.PUSH)
        stack.callback(raw.close, 0)
        raw.connect(rx.endpoint)
        raw.send(b"\x00" * (3 * limit))  # libzmq drops this peer without reading it all
        tx = TrajectorySender(rx.endpoint, timeout_s=5)
        stack.callback(tx.close, 0)
        await tx.send(make_group(3))
        got = await asyncio.to_thread(rx.recv, 5.0)
        assert got is not None and got.group_id == "g3" and not rx.rejected


# ----------------------------------------------------------------------------- control


async def test_handshake_tickets_and_handler_errors():
    with ExitStack() as stack:
        handler = Handler(learner_version=7)
        server = start_server(stack, handler=handler)
        c = client(stack, server.endpoint, timeout_s=5)
        ack = await c.hello(Hello(actor_id=3, pid=os.getpid(), host="h"))
        assert ack == Ack(ok=True, reason="", learner_version=7)
        grants = await asyncio.gather(*[
            c.request(TicketRequest(actor_id=3, version=0, n=k)) for k in range(1, 21)])
        assert [g.granted for g in grants] == list(range(1, 21))  # replies matched by req_id
        failed = await c.request(Heartbeat(actor_id=3, version=0))
        assert not failed.ok and "RuntimeError: boom" in failed.reason
        assert await c.request(Bye(actor_id=3, groups_sent=0)) == Ack()  # None -> Ack()
        assert (await c.hello(Hello(actor_id=3, pid=1))).ok  # the thread survived the error
        peers = {peer for _, peer in handler.seen}
        assert len(peers) == 1 and len(handler.seen) == 24
        assert isinstance(handler.seen[0][0], Hello) and handler.seen[0][0].actor_id == 3


async def test_malformed_requests_are_answered_or_counted():
    with ExitStack() as stack:
        server = start_server(stack)
        ctx = zmq.Context()
        stack.callback(ctx.term)
        raw = ctx.socket(zmq.DEALER)
        stack.callback(raw.close, 0)
        raw.connect(server.endpoint)
        raw.send_multipart([(1).to_bytes(8, "big"), b"\xc1junk"])
        assert raw.poll(5000)
        req_id, *reply = raw.recv_multipart()
        ack = decode(reply)
        assert req_id == (1).to_bytes(8, "big") and not ack.ok and "not_msgpack" in ack.reason
        raw.send_multipart([b"short", *encode(Hello(1, 1))])  # no 8-byte request id
        raw.send(b"alone")
        deadline = time.monotonic() + 5
        while server.rejected["bad_envelope"] < 2 and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        assert server.rejected == {"not_msgpack": 1, "bad_envelope": 2}
        assert raw.poll(200) == 0  # nothing answers an envelope it cannot route back


async def test_late_replies_are_discarded_and_replies_stay_matched():
    def slow(msg, peer):
        if isinstance(msg, Hello) and msg.actor_id == 99:
            time.sleep(0.6)  # outlives the client's timeout
        return Ack(learner_version=msg.actor_id)

    with ExitStack() as stack:
        server = start_server(stack, handler=slow)
        c = client(stack, server.endpoint, timeout_s=5)
        with pytest.raises(TransportTimeout):
            await c.hello(Hello(actor_id=99, pid=1), timeout_s=0.2)
        assert (await c.hello(Hello(actor_id=5, pid=1))).learner_version == 5
        assert c.late_replies == 1 and c.timeouts == 1 and not c._pending


async def test_malformed_replies_fail_the_request_and_are_counted():
    with ExitStack() as stack:
        ctx = zmq.Context()
        stack.callback(ctx.term)
        router = ctx.socket(zmq.ROUTER)
        stack.callback(router.close, 0)
        port = router.bind_to_random_port("tcp://127.0.0.1")
        c = client(stack, f"tcp://127.0.0.1:{port}", timeout_s=5)

        def fake_learner():
            assert router.poll(5000)
            identity, req_id, *_ = router.recv_multipart()
            router.send_multipart([identity, (12345).to_bytes(8, "big"), *encode(Ack())])
            router.send_multipart([identity, b"x"])  # no request id at all
            router.send_multipart([identity, req_id, b"\xc1junk"])

        fake = asyncio.create_task(asyncio.to_thread(fake_learner))
        with pytest.raises(ProtocolError, match="not_msgpack"):
            await c.hello(Hello(1, 1))
        await fake
        assert c.malformed == {"bad_envelope": 1, "not_msgpack": 1} and c.late_replies == 1


async def test_weights_reach_four_clients_identically_and_zero_copy_per_version():
    tensors = weights_set(0, scale=8)
    with ExitStack() as stack:
        server, weights = weights_server(stack)
        weights.publish(1, tensors)
        fresh = weights_set(0, scale=8)
        clients = [client(stack, server.endpoint, timeout_s=10) for _ in range(4)]
        updates = await asyncio.gather(*[fetch(c, -1, i) for i, c in enumerate(clients)])
        for u in updates:
            assert u.version == 1 and set(u.tensors) == set(fresh)
            for name, ref in fresh.items():
                assert u.tensors[name].dtype == ref.dtype and torch.equal(u.tensors[name],
                                                                          ref), name
        assert await fetch(clients[0], 1) is None  # up to date: just an Ack
        nbytes = weights.stats()["bytes_served"] // 4
        assert weights.served == {1: 4} and nbytes > sum(a.nbytes for a in fresh.values())

        v2 = weights_set(1, scale=8)
        weights.publish(2, v2)
        v2["embed"][0, 0] += 1.0  # handed over, not copied: a later reply sends the change
        got = await asyncio.gather(*[fetch(c, have, i)
                                     for i, (c, have) in enumerate(zip(clients, (-1, 0, 1, 2)))])
        assert [u.version if u else None for u in got] == [2, 2, 2, None]
        assert torch.equal(got[0].tensors["embed"], v2["embed"])
        assert weights.served == {1: 4, 2: 3} and weights.weights_requests == 9
        assert server.stats()["requests"] == 9
        with pytest.raises(ValueError, match="versions must increase"):
            weights.publish(2, v2)


async def test_a_request_to_a_dead_server_times_out_on_time():
    with ExitStack() as stack:
        c = client(stack, free_endpoint(), timeout_s=0.5)
        for call in (c.hello(Hello(1, 1)), fetch(c, -1, 1)):
            t0 = time.monotonic()
            with pytest.raises(TransportTimeout, match="within 0.5 s"):
                await call
            assert 0.45 <= time.monotonic() - t0 < 1.5
        assert c.timeouts == 2 and not c._pending


async def test_clients_reconnect_when_the_learner_restarts_on_the_same_ports():
    with ExitStack() as stack:
        first = ControlServer(LOOPBACK, Handler(learner_version=1))
        first.start()
        endpoint = first.endpoint
        rx = TrajectoryReceiver(LOOPBACK)
        traj_endpoint = rx.endpoint
        c = client(stack, endpoint, timeout_s=10)
        tx = TrajectorySender(traj_endpoint, timeout_s=5)
        stack.callback(tx.close, 0)
        assert (await c.hello(Hello(1, 1))).learner_version == 1
        await tx.send(make_group(1))
        assert rx.recv(5.0).group_id == "g1"
        first.stop()
        rx.close()

        pending = asyncio.create_task(c.hello(Hello(1, 1)))
        await tx.send(make_group(2))  # queued while the learner is down
        await asyncio.sleep(0.3)
        assert not pending.done()
        second = start_server(stack, endpoint, handler=Handler(learner_version=2))
        rx2 = stack.enter_context(TrajectoryReceiver(traj_endpoint))
        assert (await asyncio.wait_for(pending, 10)).learner_version == 2
        assert (await c.hello(Hello(1, 1))).learner_version == 2
        got = await asyncio.to_thread(rx2.recv, 5.0)
        assert got is not None and got.group_id == "g2"
        assert second.endpoint == endpoint


async def test_weights_fetch_throughput_50mb(record_property):
    tensors = {f"layer{i}": torch.from_numpy(np.random.default_rng(i).standard_normal(
        50 * 2**20 // 4 // 10, dtype=np.float32)) for i in range(10)}
    with ExitStack() as stack:
        server, weights = weights_server(stack)
        weights.publish(1, tensors)
        c = client(stack, server.endpoint, timeout_s=20)
        times = []
        for _ in range(3):
            t0 = time.perf_counter()
            update = await fetch(c, -1)
            times.append(time.perf_counter() - t0)
            assert torch.equal(update.tensors["layer9"], tensors["layer9"])
            del update
        mb = sum(a.nbytes for a in tensors.values()) / 1e6
        rates = [mb / t for t in times]
        record_property("weights_fetch_mb_per_s", rates)
        print(f"\n50 MB weights fetch: {', '.join(f'{r:.0f}' for r in rates)} MB/s "
              f"({', '.join(f'{t * 1e3:.0f}' for t in times)} ms)")


# ----------------------------------------------------------------------------- CurveZMQ


def test_keys_cli_writes_private_secrets_and_loads(tmp_path):
    keys_cli = [sys.executable, "-m", "arpo_async.core.keys", str(tmp_path)]
    run = subprocess.run(keys_cli, cwd=REPO, check=False, capture_output=True, text=True,
                         timeout=30)
    assert run.returncode == 0, run.stderr
    d = tmp_path / "keys"
    assert stat.S_IMODE(d.stat().st_mode) == 0o700
    for name in ("server", "client"):
        assert stat.S_IMODE((d / f"{name}.key_secret").stat().st_mode) == 0o600
        assert stat.S_IMODE((d / f"{name}.key").stat().st_mode) == 0o644
    again = subprocess.run(keys_cli, cwd=REPO, check=False, capture_output=True, text=True,
                           timeout=30)
    assert again.returncode == 1 and "--force" in again.stderr
    server, cl = K.load_server_keys(d), K.load_client_keys(d)
    assert server.allowed_clients == [cl.public] and cl.server_public == server.public
    assert server.secret != cl.secret and len(server.public) == 40
    (d / "client.key_secret").write_text("garbage")
    with pytest.raises(ValueError, match="client.key_secret"):
        K.load_client_keys(d)
    with pytest.raises(FileNotFoundError, match="nowhere"):
        K.load_server_keys(tmp_path / "nowhere")


def test_require_security_by_host(tmp_path, caplog):
    for host in ("127.0.0.1", "localhost", "::1", "[::1]", "127.3.4.5"):
        assert K.is_loopback(host) and K.require_security(host, False, tmp_path) is None
    for host in ("0.0.0.0", "10.1.2.3", "*", "learner.example.org"):
        assert not K.is_loopback(host)
        with pytest.raises(K.SecurityError, match="transport.insecure"):
            K.require_security(host, False, tmp_path / "keys")
    with caplog.at_level(logging.WARNING, logger="arpo_async.core.keys"):
        assert K.require_security("0.0.0.0", True, None) is None
    assert "WITHOUT encryption" in caplog.text
    K.generate(tmp_path)
    for host in ("0.0.0.0", "127.0.0.1"):  # keys present: used, whatever the host
        assert isinstance(K.require_security(host, False, tmp_path / "keys"), K.ServerKeys)


async def test_curve_admits_the_listed_client_and_shuts_out_the_rest(tmp_path):
    K.generate(tmp_path)
    server_keys, good = K.load_server_keys(tmp_path / "keys"), K.load_client_keys(tmp_path / "keys")
    public, secret = zmq.curve_keypair()
    stranger = K.ClientKeys(public=public, secret=secret, server_public=server_keys.public)
    tensors = weights_set(2)
    with ExitStack() as stack:
        rx = stack.enter_context(TrajectoryReceiver(LOOPBACK, curve=server_keys))
        server, weights = weights_server(stack, curve=server_keys)
        weights.publish(1, tensors)

        # What the listed client gets has generous bounds (a loaded machine is slow to
        # handshake); the bounds on what the others must never get only set how long we look.
        tx = TrajectorySender(rx.endpoint, timeout_s=30, curve=good)
        stack.callback(tx.close, 0)
        c = client(stack, server.endpoint, timeout_s=30, curve=good)
        await tx.send(make_group(1))
        assert (await asyncio.to_thread(rx.recv, 30.0)).group_id == "g1"
        update = await fetch(c, -1)
        assert torch.equal(update.tensors["embed"], tensors["embed"])

        for keys in (stranger, None):  # an unknown key, and no encryption at all
            bad_tx = TrajectorySender(rx.endpoint, timeout_s=5, curve=keys)
            stack.callback(bad_tx.close, 0)
            bad_c = client(stack, server.endpoint, timeout_s=1.0, curve=keys)
            # The group queues in the actor, or waits for a connection, depending on where
            # libzmq's refuse-and-reconnect cycle is when it is sent (on a loaded machine
            # it waited, and the test with it, until pytest-timeout); never delivered.
            sending = asyncio.create_task(bad_tx.send(make_group(99)))
            assert await asyncio.to_thread(rx.recv, 1.0) is None
            sending.cancel()
            await asyncio.gather(sending, return_exceptions=True)
            with pytest.raises(TransportTimeout):
                await fetch(bad_c, -1, 9)
        assert rx.received == 1 and weights.served == {1: 1}
        await tx.send(make_group(2))  # the authorised actor is unaffected
        assert (await asyncio.to_thread(rx.recv, 30.0)).group_id == "g2"
        # A wrong key is counted when the ZAP thread denies it; a peer without any keys
        # never reaches ZAP and is counted by the handshake watch, which rx.recv reads.
        counted = await asyncio.to_thread(refusals_counted, rx, server, 30.0)
        assert counted, (rx.rejected, server.rejected)


def refusals_counted(rx: TrajectoryReceiver, server: ControlServer, timeout_s: float) -> bool:
    """Whether both ends count both kinds of refused peer within ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert rx.recv(0.05) is None  # reads rx's handshake watch; nothing else may arrive
        if all(counts[reason] >= 1 for counts in (rx.rejected, server.rejected)
               for reason in ("curve_denied", "handshake_failed")):
            return True
    return False


async def test_wrong_reply_kinds_are_errors_and_no_weights_is_none():
    with ExitStack() as stack:
        server = start_server(stack, handler=lambda m, p: TicketGrant(0, 0))
        c = client(stack, server.endpoint, timeout_s=5)
        with pytest.raises(ProtocolError, match="wrong_kind"):
            await c.hello(Hello(1, 1))
        with pytest.raises(ProtocolError, match="refused.*weights request: TicketGrant"):
            await fetch(c, -1)
        server, weights = weights_server(stack)
        c = client(stack, server.endpoint, timeout_s=5)
        assert await fetch(c, -1) is None  # nothing published yet
        assert weights.stats() == {"requests": 1, "bytes_served": 0, "version": -1}
