"""The delta weight channel's logic (arpo_async/core/weights/delta.py) through the real wire
format: which encoding each tensor gets, exactness bit for bit, the chain of kept steps,
and every way a step is refused (a corrupted step, a step for another base, a copy the
learner never published) ending in the learner's weights. The same channel through real
processes (a DeepSpeed learner, vLLM actors) is tests/integration/test_delta_sync.py."""

from __future__ import annotations

import pytest
import torch

from arpo_async.core import protocol as P
from arpo_async.core.protocol import ProtocolError
from arpo_async.core.weights import delta as D

NAMES = {"embed": (64, 32), "layer.w": (32, 32), "norm": (32,)}


def state(seed: int = 0, dtype=torch.bfloat16) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {n: (torch.randn(s, generator=g) * 0.02).to(dtype) for n, s in NAMES.items()}


def moved(s: dict, share: float, seed: int, only: str | None = None, how: str = "ulp") -> dict:
    """A fresh copy with ``share`` of each tensor's values (or only ``only``'s) moved: by
    one unit in the last place up (``ulp``, as a small training step moves bf16 values)
    or to their negative (``flip``: a bit-pattern jump no int8 difference holds)."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for n, t in s.items():
        t = t.clone()
        if only in (None, n):
            hit = torch.rand(t.shape, generator=g) < share
            if how == "ulp":
                D.bits(t)[hit.reshape(-1)] += 1
            else:
                t[hit] = -t[hit]
        out[n] = t
    return out


class Wire:
    """The learner's routing of one sender, both ways through the real wire format; a
    hook may replace a reply."""

    def __init__(self, sender):
        self.sender, self.hook, self.replies = sender, None, []

    async def request(self, msg):
        msg = P.decode(P.encode(msg))
        reply = self.sender.handle(msg)
        frames = reply.frames if hasattr(reply, "frames") else P.encode(reply)
        if self.hook is not None:
            frames = self.hook(msg, frames)
        out = P.decode([bytes(f) for f in frames])
        self.replies.append(out)
        return out


class Engine:
    def __init__(self, version: int = 0):
        self.version, self.loaded = version, None

    async def update_weights(self, tensors, version):
        self.loaded = {n: t.clone() for n, t in tensors.items()}
        self.version = version
        return 0.01


async def at_v0(keep: int = 4):
    """A sender that published v0, and a receiver that holds it (its first full copy):
    (sender, v0's state, wire, engine, receiver)."""
    sender, s = D.DeltaWeightSender(keep=keep), state()
    sender.publish(0, s)
    wire, engine = Wire(sender), Engine(0)
    rx = D.DeltaWeightReceiver(wire, 0)
    await rx.sync(engine)
    return sender, s, wire, engine, rx


def bases(wire: Wire) -> list[int]:
    """The base version of each update the wire carried (-1: a full copy), Acks left out."""
    return [r.base_version for r in wire.replies if isinstance(r, D.DeltaUpdate)]


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(D.bits(a[n]), D.bits(b[n])) for n in a)


def kinds(update) -> dict:
    return {**{n: "dense" for n in update.dense}, **{n: "index" for n in update.index},
            **{n: "mask" for n in update.mask}, **{n: "diff" for n in update.diff}}


NAMES["small"] = (64, 32)  # moved by one unit in the last place: the compressed diff


def test_each_tensor_gets_its_smallest_encoding_and_the_step_is_exact():
    old = state()
    new = {"embed": moved(old, 0.01, 1, "embed", "flip")["embed"],  # 1% flipped: positions
           "layer.w": moved(old, 0.3, 2, "layer.w", "flip")["layer.w"],  # 30%: a bitmask
           "norm": moved(old, 0.99, 3, "norm", "flip")["norm"],  # nearly all: whole
           "small": moved(old, 0.5, 4, "small")["small"]}  # half, by one ulp: diff
    new["small"].reshape(-1)[:3] *= -1  # and three sign flips, which go as positions
    parts = D.step(old, new)
    assert {n: sorted(set(p) - {"changed"}) for n, p in parts.items()} == {
        "embed": ["index", "values"], "layer.w": ["mask", "values"], "norm": ["dense"],
        "small": ["diff", "index", "values"]}
    assert parts["small"]["index"].tolist() == [0, 1, 2]
    msg = D.DeltaUpdate(1, 0, 0, 0)
    for name, fields in parts.items():
        for kind, t in fields.items():
            if kind != "changed":
                getattr(msg, kind)[name] = t
    msg = P.decode(P.encode(msg))
    base = {n: t.clone() for n, t in old.items()}
    assert sorted(D.apply_step(base, msg)) == sorted(NAMES)
    assert same(base, new)
    assert D.step(new, new) == {}  # nothing changed, nothing sent
    # overwrites: applying them again is a no-op (a diff adds: the receiver applies a step
    # only to its own base, test_a_step_for_another_base_...)
    for name in ("embed", "layer.w", "norm"):
        D.apply_step(base, D.DeltaUpdate(1, 0, 0, 0, **{
            k: {name: getattr(msg, k)[name]} for k in ("dense", "index", "mask", "values")
            if name in getattr(msg, k)}))
    assert same(base, new)


def test_a_diff_that_does_not_decompress_to_its_tensor_is_refused():
    import zstandard

    base = state()
    short = zstandard.ZstdCompressor().compress(bytes(10))
    bad = D.DeltaUpdate(1, 0, 0, 0, diff={"norm": torch.frombuffer(bytearray(short),
                                                                   dtype=torch.uint8)})
    with pytest.raises(ValueError, match="10 differences for 32 values"):
        D.apply_step(base, bad)
    junk = D.DeltaUpdate(1, 0, 0, 0, diff={"norm": torch.ones(8, dtype=torch.uint8)})
    with pytest.raises(ValueError, match="diff"):
        D.apply_step(base, junk)
    with pytest.raises(ValueError, match="a diff for a torch.float32"):
        D.apply_step(state(dtype=torch.float32), bad)


def test_a_part_that_does_not_fit_its_tensor_is_refused():
    base = state()
    bad = D.DeltaUpdate(1, 0, 0, 0, index={"norm": torch.tensor([40], dtype=torch.int32)},
                        values={"norm": torch.zeros(1, dtype=torch.bfloat16)})
    with pytest.raises(ValueError, match="outside"):
        D.apply_step(base, bad)
    with pytest.raises(ValueError, match="not a tensor"):
        D.apply_step(base, D.DeltaUpdate(1, 0, 0, 0, dense={"x": torch.zeros(2)}))
    with pytest.raises(ValueError, match="does not fit"):
        D.apply_step(base, D.DeltaUpdate(1, 0, 0, 0, dense={"norm": torch.zeros(32)}))


def test_checksums_that_are_not_integers_are_a_protocol_error():
    frames = P.encode(D.DeltaUpdate(1, 0, -1, 0, {"a": 1}))
    import msgpack

    header = msgpack.unpackb(frames[0])
    header["body"]["checksums"] = {"a": "x"}
    with pytest.raises(ProtocolError, match="bad_field"):
        P.decode([msgpack.packb(header)])


async def test_first_a_full_copy_then_steps_bit_for_bit_with_fewer_bytes():
    sender, s = D.DeltaWeightSender(keep=4), state()
    sender.publish(0, s)
    wire, engine = Wire(sender), Engine(0)
    rx = D.DeltaWeightReceiver(wire, 0)
    assert await rx.sync(engine) is None  # the engine holds v0 already: nothing loaded
    assert rx.version == 0 and rx.fulls == 1 and same(rx.base, s)
    for v in (1, 2, 3):
        s = moved(s, 0.02, v)
        sender.publish(v, s)
        got = await rx.sync(engine)
        assert got.version == v == engine.version and got.channel == "delta"
        assert same(engine.loaded, s)
        assert kinds(wire.replies[-2]) and wire.replies[-2].base_version == v - 1
        assert isinstance(wire.replies[-1], P.Ack)  # then up to date
    assert rx.steps == 3 and rx.fulls == 1
    stats = sender.stats()
    assert stats["steps_served"] == 3 and stats["full_served"] == 1
    assert stats["bytes_ratio"] < 0.5 and 0.01 < stats["changed_share"] < 0.03
    assert all(set(u.diff) >= {"embed", "layer.w", "small"} for u in wire.replies  # by an
               if isinstance(u, D.DeltaUpdate) and u.base_version >= 0)  # ulp: diffs
    assert await rx.sync(engine) is None  # up to date: an Ack, nothing loaded


async def test_an_actor_behind_walks_the_kept_steps_and_one_further_behind_gets_a_copy():
    sender, s, wire, engine, rx = await at_v0(keep=2)
    for v in (1, 2):
        s = moved(s, 0.02, v)
        sender.publish(v, s)
    wire.replies.clear()
    assert (await rx.sync(engine)).version == 2 and same(engine.loaded, s)
    assert bases(wire) == [0, 1]  # two steps, then the Ack
    for v in (3, 4, 5):  # keep=2: the step from v2 is gone
        s = moved(s, 0.02, v)
        sender.publish(v, s)
    wire.replies.clear()
    assert (await rx.sync(engine)).version == 5 and same(engine.loaded, s)
    assert bases(wire) == [-1]  # a full copy


async def test_a_corrupted_step_fails_its_checksum_and_a_full_copy_follows(monkeypatch):
    monkeypatch.setenv(D.FAULT_CORRUPT_DELTA, "0:2")
    sender, s = D.DeltaWeightSender(), state()
    sender.publish(0, s)
    wire, engine = Wire(sender), Engine(0)
    rx = D.DeltaWeightReceiver(wire, 0)
    for v in (1, 2, 3):
        s = moved(s, 0.02, v)
        sender.publish(v, s)
        assert (await rx.sync(engine)).version == v
        assert same(engine.loaded, s)
    assert rx.rejected == {"checksum": 1}
    assert bases(wire) == [-1, 1, -1, 2]  # v1 whole; the corrupted step, a copy; a step


async def test_a_step_for_another_base_is_refused_and_the_same_step_twice_is_skipped():
    sender, s, wire, engine, rx = await at_v0()
    s1 = moved(s, 0.02, 1)
    sender.publish(1, s1)
    s2 = moved(s1, 0.02, 2)
    sender.publish(2, s2)
    step_12 = sender._steps[1].frames
    # the actor at v0 is handed the step v1 -> v2: its base is not ours
    wire.hook = lambda msg, frames: step_12 if msg.have_version == 0 else frames
    assert (await rx.sync(engine)).version == 2 and same(engine.loaded, s2)
    assert rx.rejected == {"base": 1}
    # the last step again, as a reply arriving twice would: skipped, nothing refetched
    again = P.decode([bytes(f) for f in step_12])
    rx._take(again)
    assert same(rx.base, s2) and rx.rejected == {"base": 1}


async def test_a_restarted_actor_and_a_restarted_learner_each_get_a_full_copy():
    sender, s = D.DeltaWeightSender(), state()
    sender.publish(0, s)
    s1 = moved(s, 0.02, 1)
    sender.publish(1, s1)
    engine = Engine(0)
    rx = D.DeltaWeightReceiver(Wire(sender), 0)
    await rx.sync(engine)
    assert same(engine.loaded, s1)
    # the actor restarts between that and the next version: no copy of its own
    s2 = moved(s1, 0.02, 2)
    sender.publish(2, s2)
    wire = Wire(sender)
    rx = D.DeltaWeightReceiver(wire, 0)
    assert (await rx.sync(Engine(1))).version == 2
    assert bases(wire) == [-1]
    # a learner restarted from another history publishes v3 with other weights; its
    # steps' digests do not match our v2 copy, so a full copy comes
    other = D.DeltaWeightSender()
    t2 = moved(s, 0.05, 9)
    other.publish(2, t2)
    t3 = moved(t2, 0.02, 10)
    other.publish(3, t3)
    rx.control = wire = Wire(other)
    engine = Engine(2)
    assert (await rx.sync(engine)).version == 3 and same(engine.loaded, t3)
    assert bases(wire) == [-1]


async def test_an_older_full_copy_is_loaded_only_when_asked_for():
    sender, s = D.DeltaWeightSender(), state()
    sender.publish(3, s)  # a learner resumed at v3, behind the actor's v5
    engine = Engine(5)
    rx = D.DeltaWeightReceiver(Wire(sender), 0)
    assert await rx.sync(engine) is None and engine.loaded is None
    assert (await rx.sync(engine, -1)).version == 3 and same(engine.loaded, s)


def test_float32_steps_change_every_value_and_full_copies_are_sent(caplog):
    sender, s = D.DeltaWeightSender(), state(dtype=torch.float32)
    sender.publish(0, s)
    sender.publish(1, {n: t + 1e-4 for n, t in s.items()})
    assert sender.steps_too_large == 1 and not sender._steps
    assert "full copies are sent" in caplog.text
    assert sender.stats()["changed_share_last"] == 1.0


def test_versions_must_increase():
    sender = D.DeltaWeightSender()
    sender.publish(2, state())
    with pytest.raises(ValueError, match="must increase"):
        sender.publish(2, state())



async def test_a_learner_that_republishes_a_version_with_other_weights_is_followed():
    """The learner resumed and published the actor's version number with other bits: the
    digests differ, so a full copy comes and is loaded, though the number is the same."""
    sender, s = D.DeltaWeightSender(), state()
    sender.publish(0, s)
    s1 = moved(s, 0.02, 1)
    sender.publish(1, s1)
    engine = Engine(0)
    rx = D.DeltaWeightReceiver(Wire(sender), 0)
    assert (await rx.sync(engine)).version == 1
    other = D.DeltaWeightSender()
    t1 = moved(s, 0.05, 7)
    other.publish(1, t1)
    rx.control = wire = Wire(other)
    got = await rx.sync(engine)
    assert got.version == 1 and same(engine.loaded, t1) and bases(wire) == [-1]
    assert await rx.sync(engine) is None  # and then up to date


async def test_any_error_while_applying_drops_the_copy_and_a_full_copy_follows():
    sender, s, wire, engine, rx = await at_v0()
    s1 = moved(s, 0.3, 1, how="flip")  # masks
    sender.publish(1, s1)

    def bad_mask(msg, frames):  # a mask of the wrong dtype: numpy raises TypeError
        update = P.decode([bytes(f) for f in frames])
        if update.__class__ is D.DeltaUpdate and update.mask:
            name = next(iter(update.mask))
            update.mask[name] = update.mask[name].to(torch.int32)
            return P.encode(update)
        return frames

    wire.hook = bad_mask
    assert (await rx.sync(engine)).version == 1 and same(engine.loaded, s1)
    assert rx.rejected == {"apply": 1}


async def test_a_full_copy_that_fails_its_checks_is_not_fetched_again():
    sender, s = D.DeltaWeightSender(), state()
    sender.publish(0, s)
    wire = Wire(sender)

    def corrupt_full(msg, frames):
        update = P.decode([bytes(f) for f in frames])
        update.checksums = {k: v ^ 1 for k, v in update.checksums.items()}
        return P.encode(update)

    wire.hook = corrupt_full
    rx = D.DeltaWeightReceiver(wire, 0)
    with pytest.raises(RuntimeError, match="full copy of v0 fails its checks"):
        await rx.sync(Engine(-1))
    assert len(wire.replies) == 1 and rx.base is None


def test_an_actor_ahead_of_the_learner_is_told_so_not_sent_a_copy():
    sender = D.DeltaWeightSender()
    sender.publish(3, state())
    reply = sender.handle(D.DeltaRequest(0, 5, 123))
    assert isinstance(reply, P.Ack) and reply.ok and reply.learner_version == 3
    assert sender.stats()["full_served"] == 0


def test_steps_beyond_keep_are_dropped_and_a_load_is_counted_once_per_actor():
    sender, s = D.DeltaWeightSender(keep=2), state()
    sender.publish(0, s)
    for v in (1, 2, 3):
        s = moved(s, 0.02, v)
        sender.publish(v, s)
    assert sorted(sender._steps) == [1, 2]
    latest = sender._latest
    sender.handle(D.DeltaRequest(0, 2, sender._steps[2].base_digest))  # the last step
    sender.handle(D.DeltaRequest(0, -1, 0))  # refused it: the full copy, same load
    sender.handle(D.DeltaRequest(1, -1, 0))  # another actor's load
    assert sender.bytes_full_equivalent == 2 * latest.full_bytes
