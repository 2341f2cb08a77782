"""Protocol: every message kind round-trips exactly; decode rejects anything else with a
ProtocolError that carries a reason, and never raises anything but ProtocolError."""

from __future__ import annotations

import dataclasses
import math
import time

import msgpack
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from arpo_async.core import protocol as P
from arpo_async.core.weights.nccl import (
    NcclJoinReply,
    NcclJoinRequest,
    NcclWeightsHeader,
    NcclWeightsRequest,
)
from arpo_async.core.weights.delta import DeltaRequest, DeltaUpdate
from arpo_async.core.weights.zeromq import WeightsRequest, WeightsUpdate

FUZZ = settings(max_examples=150, deadline=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

int64 = st.integers(-2**63, 2**63 - 1)
floats = st.floats(width=64)  # nan and inf included: msgpack carries them bit-exact
text = st.text(max_size=12)
stats = st.dictionaries(text, floats, max_size=4)
WIRE_DTYPES = ["int32", "int64", "uint8", "uint16", "float32", "float16", "int8", "bool"]


@st.composite
def leaves(draw, n_leaves: int, index: int) -> P.Trajectory:
    n = draw(st.integers(0, 30))
    return P.Trajectory(
        tokens=draw(hnp.arrays(np.int32, n)),
        loss_mask=draw(hnp.arrays(np.uint8, n, elements=st.integers(0, 1))),
        logprobs=draw(hnp.arrays(np.float32, n)),
        versions=draw(hnp.arrays(np.int32, n, elements=st.integers(-1, 10**6))),
        reward=draw(floats), score=draw(floats),
        parent=draw(st.integers(-1, n_leaves - 1)),
        branch_point=draw(st.integers(0, 10**6)), tool_calls=draw(st.integers(0, 50)),
        finish_reason=draw(text))


@st.composite
def groups(draw) -> P.TrajectoryGroup:
    n = draw(st.integers(0, 6))
    return P.TrajectoryGroup(
        group_id=draw(text), actor_id=draw(int64), prompt_id=draw(text),
        prompt_tokens=draw(hnp.arrays(np.int32, st.integers(0, 50))),
        leaves=[draw(leaves(n, i)) for i in range(n)],
        mode=draw(text), tool_calls_executed=draw(st.integers(0, 10**6)),
        created_at=draw(floats), sent_at=draw(floats), stats=draw(stats))


@st.composite
def weights(draw) -> WeightsUpdate:
    return WeightsUpdate(version=draw(int64), tensors=draw(tensor_dicts()), sent_at=draw(floats))


@st.composite
def deltas(draw) -> DeltaUpdate:
    """A delta step's fields, each a dict of tensors; checksums and digests are uint64."""
    uint64 = st.integers(0, 2**64 - 1)
    return DeltaUpdate(version=draw(int64), digest=draw(uint64), base_version=draw(int64),
                       base_digest=draw(uint64),
                       checksums=draw(st.dictionaries(text, uint64, max_size=3)),
                       **{f: draw(tensor_dicts(3)) for f in DeltaUpdate.TENSORS})


@st.composite
def tensor_dicts(draw, max_size: int = 6) -> dict:
    """Torch tensors of every wire dtype, bfloat16 with any bits (NaNs included)."""
    names = draw(st.lists(st.text(min_size=1, max_size=20).filter(lambda n: "/" not in n),
                          unique=True, max_size=max_size))
    tensors = {}
    for name in names:
        shape = hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=5)
        if draw(st.booleans()):  # a bfloat16 tensor
            bits = torch.from_numpy(draw(hnp.arrays(np.int16, shape)).copy())
            tensors[name] = bits.view(torch.bfloat16)
        else:
            tensors[name] = torch.from_numpy(
                draw(hnp.arrays(st.sampled_from(WIRE_DTYPES), shape)).copy())
    return tensors


def _builds(cls, **kw):
    return st.builds(cls, **kw)


# one strategy per message kind; ``messages`` draws from all of them
KIND_STRATEGIES = [
    groups(), weights(), deltas(),
    _builds(DeltaRequest, actor_id=int64, have_version=int64,
            have_digest=st.integers(0, 2**64 - 1)),
    _builds(P.Hello, actor_id=int64, pid=int64, host=text, version=int64, sent_at=floats),
    _builds(P.Heartbeat, actor_id=int64, version=int64, stats=stats, sent_at=floats),
    _builds(P.TicketRequest, actor_id=int64, version=int64, n=int64),
    _builds(P.TicketGrant, granted=int64, learner_version=int64, stop=st.booleans(),
            reason=text),
    _builds(WeightsRequest, actor_id=int64, have_version=int64),
    _builds(P.Bye, actor_id=int64, groups_sent=int64, stats=stats),
    _builds(P.Ack, ok=st.booleans(), reason=text, learner_version=int64,
            prompts_below=int64, prompts_above=st.lists(st.integers(0, 2**62), max_size=4)),
    _builds(P.ConfigRequest, actor_id=int64, host=text, pid=int64),
    _builds(P.ConfigReply, config_yaml=text, actor_id=int64),
    _builds(NcclJoinRequest, actor_id=int64, machine_id=text, workers=int64),
    _builds(NcclJoinReply, ok=st.booleans(), reason=text, master_address=text,
            master_port=int64, world_size=int64, buffer_bytes=int64, num_buffers=int64),
    _builds(NcclWeightsRequest, actor_id=int64, have_version=int64),
    _builds(NcclWeightsHeader, version=int64, names=st.lists(text, max_size=3),
            dtype_names=st.lists(text, max_size=3),
            shapes=st.lists(st.lists(st.integers(0, 2**40), max_size=3), max_size=3)),
]
messages = st.one_of(*KIND_STRATEGIES)

# a value msgpack can carry, of any type: what a confused or hostile peer might put anywhere
msgpack_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**63, 2**64 - 1) | floats | text | st.binary(),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(text, inner, max_size=3),
    max_leaves=6)


def wire(msg) -> list[bytes]:
    """What actually travels: every frame as bytes."""
    return [bytes(f) for f in P.encode(msg)]


def assert_same(a, b, where: str = "msg") -> None:
    if dataclasses.is_dataclass(a):
        assert type(a) is type(b), where
        for f in dataclasses.fields(a):
            assert_same(getattr(a, f.name), getattr(b, f.name), f"{where}.{f.name}")
    elif isinstance(a, np.ndarray):
        assert isinstance(b, np.ndarray), where
        assert (a.dtype, a.shape) == (b.dtype, b.shape), where
        assert a.tobytes() == b.tobytes(), where
    elif isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), where
        assert (a.dtype, a.shape) == (b.dtype, b.shape), where
        assert _bits(a) == _bits(b), where
    elif isinstance(a, float):
        assert type(b) is float and (a == b or (math.isnan(a) and math.isnan(b))), where
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{where}[{i}]")
    elif isinstance(a, dict):
        assert list(a) == list(b), where
        for k in a:
            assert_same(a[k], b[k], f"{where}[{k!r}]")
    else:
        assert type(a) is type(b) and a == b, where


def _bits(t: torch.Tensor) -> bytes:
    return (t.view(torch.int16) if t.dtype == torch.bfloat16 else t).numpy().tobytes()


def conforms(value, typ: str) -> bool:
    """Does a decoded field hold what its dataclass annotation declares?"""
    return CONFORMS[typ](value)


CONFORMS = {
    "int": lambda v: type(v) is int, "float": lambda v: type(v) is float,
    "str": lambda v: type(v) is str, "bool": lambda v: type(v) is bool,
    "np.ndarray": lambda v: isinstance(v, np.ndarray),
    "dict[str, float]": lambda v: isinstance(v, dict) and all(
        type(k) is str and type(x) is float for k, x in v.items()),
    "dict[str, int]": lambda v: isinstance(v, dict) and all(
        type(k) is str and type(x) is int for k, x in v.items()),
    "dict[str, Any]": lambda v: isinstance(v, dict) and all(  # TENSORS fields
        type(k) is str and isinstance(x, torch.Tensor) for k, x in v.items()),
    "list[str]": lambda v: isinstance(v, list) and all(type(x) is str for x in v),
    "list[int]": lambda v: isinstance(v, list) and all(type(x) is int for x in v),
    "list[list[int]]": lambda v: isinstance(v, list) and all(
        isinstance(x, list) and all(type(i) is int for i in x) for x in v),
    "list[list[float]]": lambda v: isinstance(v, list) and all(
        isinstance(x, list) and all(type(i) is float for i in x) for x in v),
    "list[Trajectory]": lambda v: isinstance(v, list) and all(
        isinstance(x, P.Trajectory) and all_fields_conform(x) for x in v),
}


def test_every_field_type_of_every_message_has_a_conformance_check():
    """The hostile-frame tests below check decoded fields with ``conforms``; a field type
    missing there would fail only when a mangled frame happens to decode."""
    types = {str(f.type) for cls in [*P.MESSAGES.values(), P.Trajectory]
             for f in dataclasses.fields(cls)}
    assert types <= set(CONFORMS), sorted(types - set(CONFORMS))


def all_fields_conform(msg) -> bool:
    return all(conforms(getattr(msg, f.name), str(f.type)) for f in dataclasses.fields(msg))


def repack(frames: list[bytes], mutate) -> list[bytes]:
    header = msgpack.unpackb(frames[0], raw=False)
    mutate(header)
    return [msgpack.packb(header, use_bin_type=True)] + frames[1:]


def assert_rejects(frames, reason: str | None = None, **kw) -> P.ProtocolError:
    with pytest.raises(P.ProtocolError) as info:
        P.decode(frames, **kw)
    assert info.value.reason, "a ProtocolError must carry a reason"
    if reason is not None:
        assert info.value.reason == reason, str(info.value)
    return info.value


# ----------------------------------------------------------------------------- round trips


@FUZZ
@given(messages)
def test_every_message_kind_round_trips_exactly(msg):
    assert_same(msg, P.decode(wire(msg)))
    assert_same(msg, P.decode(P.encode(msg)))  # zero-copy buffers decode the same


def _kinds_drawn(strategy) -> set[str]:
    kinds = set()

    @settings(max_examples=1, deadline=None, derandomize=True, database=None)
    @given(strategy)
    def collect(msg):
        kinds.add(msg.KIND)

    collect()
    return kinds


def test_every_kind_is_covered_by_the_round_trip_strategy():
    """Each kind's strategy is drawn from on its own (one example each, derandomized):
    coverage by construction, not by how many examples a one_of happened to draw."""
    seen = set()
    for strategy in KIND_STRATEGIES:
        kinds = _kinds_drawn(strategy)
        assert len(kinds) == 1, (strategy, kinds)
        seen |= kinds
    assert seen == set(P.MESSAGES)


def test_group_round_trip_keeps_leaf_boundaries_and_tree():
    leaves = [P.Trajectory(tokens=np.arange(n, dtype=np.int32) + 100 * n,
                           loss_mask=(np.arange(n) % 2).astype(np.uint8),
                           logprobs=-np.linspace(0, 1, n, dtype=np.float32),
                           versions=np.full(n, 3, np.int32), reward=0.5 * n, parent=parent,
                           branch_point=n // 2, tool_calls=1, finish_reason="stop")
              for n, parent in ((3, -1), (0, 0), (5, 0))]
    group = P.TrajectoryGroup("g", 1, "p", np.array([7, 8], np.int32), leaves, mode="arpo")
    out = P.decode(wire(group))
    assert [len(leaf) for leaf in out.leaves] == [3, 0, 5]
    assert out.leaves[2].tokens.tolist() == [500, 501, 502, 503, 504]
    assert [leaf.parent for leaf in out.leaves] == [-1, 0, 0]
    assert [leaf.branch_point for leaf in out.leaves] == [1, 0, 2]
    assert out.min_version() == 3 and out.num_tokens() == 8


def test_tensors_arrive_with_their_own_dtype_bfloat16_included():
    ref = torch.randn(4, 3, dtype=torch.bfloat16)
    msg = WeightsUpdate(5, {"w": ref, "b": torch.arange(3, dtype=torch.float32)})
    out = P.decode(wire(msg))
    assert out.tensors["w"].dtype == torch.bfloat16 and torch.equal(out.tensors["w"], ref)
    assert out.tensors["b"].dtype == torch.float32
    header = msgpack.unpackb(wire(msg)[0])
    assert header["arrays"] == [["tensors/w", "bfloat16", [4, 3]],
                                ["tensors/b", "float32", [3]]]
    assert "bf16_names" not in header["body"]  # the dtype is the tensor's, nowhere else


def test_encode_rejects_what_decode_would_reject():
    with pytest.raises(P.ProtocolError, match="float64"):
        P.encode(WeightsUpdate(1, {"x": torch.zeros(2, dtype=torch.float64)}))
    with pytest.raises(P.ProtocolError, match="complex64"):
        P.encode(WeightsUpdate(1, {"x": torch.zeros(2, dtype=torch.complex64)}))


def test_tensor_arrays_must_name_a_tensor_field():
    frames = wire(WeightsUpdate(1, {"a": torch.zeros(2)}))
    for name in ("a", "other/a", "tensors/"):
        renamed = repack(frames, lambda h, n=name: h["arrays"][0].__setitem__(0, n))
        assert_rejects(renamed, "bad_arrays")
    body = repack(frames, lambda h: h["body"].update(tensors={}))
    assert_rejects(body, "bad_field")


def test_numpy_scalars_in_bodies_encode_as_plain_numbers():
    leaf = P.Trajectory(np.zeros(1, np.int32), np.ones(1, np.uint8), np.zeros(1, np.float32),
                        np.zeros(1, np.int32), reward=np.float32(0.25), tool_calls=np.int64(2))
    group = P.TrajectoryGroup("g", np.int64(3), "p", np.zeros(1, np.int32), [leaf],
                              stats={"t": np.float64(1.5)})
    out = P.decode(wire(group))
    assert out.actor_id == 3 and out.leaves[0].reward == 0.25 and out.leaves[0].tool_calls == 2
    assert all_fields_conform(out)


def test_default_timestamps_are_taken_per_message():
    first = [P.Hello(1, 1), P.Heartbeat(1, 0), WeightsUpdate(0),
             P.TrajectoryGroup("g", 0, "p", np.zeros(0, np.int32), [])]
    time.sleep(0.02)
    second = [P.Hello(1, 1), P.Heartbeat(1, 0), WeightsUpdate(0),
              P.TrajectoryGroup("g", 0, "p", np.zeros(0, np.int32), [])]
    stamp = {"hello": "sent_at", "heartbeat": "sent_at", "weights": "sent_at",
             "group": "created_at"}
    for a, b in zip(first, second):
        ta, tb = getattr(a, stamp[a.KIND]), getattr(b, stamp[b.KIND])
        assert tb - ta >= 0.015, a.KIND
        assert abs(time.time() - tb) < 5, a.KIND
    assert P.Hello(1, 1).sent_at != first[0].sent_at
    assert first[1].stats is not second[1].stats  # mutable defaults are not shared either


# ----------------------------------------------------------------------------- fuzzing decode


@FUZZ
@given(st.lists(st.binary(max_size=300), max_size=4))
def test_random_bytes_raise_protocol_error_only(frames):
    assert_rejects(frames)


@FUZZ
@given(messages, st.data())
def test_truncated_or_missing_frames_are_rejected(msg, data):
    frames = wire(msg)
    cut = data.draw(st.sampled_from([i for i, f in enumerate(frames) if f]))
    at = data.draw(st.integers(0, len(frames[cut]) - 1))
    assert_rejects(frames[:cut] + [frames[cut][:at]] + frames[cut + 1:])
    if len(frames) > 1:
        assert_rejects(frames[:-1], "frame_count")
    assert_rejects(frames + [b"\0" * 4], "frame_count")


@FUZZ
@given(messages)
def test_size_limit_is_enforced(msg):
    frames = wire(msg)
    size = sum(map(len, frames))
    assert_rejects(frames, "too_large", max_bytes=size - 1)
    assert_same(msg, P.decode(frames, max_bytes=size))


@FUZZ
@given(messages, msgpack_values.filter(lambda v: not (type(v) is int and v == 1)))
def test_wrong_protocol_version_is_rejected(msg, version):
    assert_rejects(repack(wire(msg), lambda h: h.update(p=version)), "bad_version")


@FUZZ
@given(messages, st.one_of(text, msgpack_values).filter(lambda k: k not in P.MESSAGES
                                                        if isinstance(k, str) else True))
def test_unknown_kind_is_rejected(msg, kind):
    assert_rejects(repack(wire(msg), lambda h: h.update(kind=kind)), "unknown_kind")


@FUZZ
@given(messages, st.sampled_from(["p", "kind", "body", "arrays"]), msgpack_values, st.booleans())
def test_mangled_headers_raise_protocol_error_only(msg, key, value, delete):
    frames = repack(wire(msg), lambda h: h.pop(key) if delete else h.update({key: value}))
    try:
        out = P.decode(frames)
    except P.ProtocolError as exc:
        assert exc.reason
    else:  # only a mutation that changes nothing of substance may pass
        assert type(out) is type(msg) and all_fields_conform(out)


@FUZZ
@given(messages, msgpack_values, st.data())
def test_wrong_types_in_valid_msgpack_never_pass_as_the_declared_type(msg, value, data):
    header = msgpack.unpackb(wire(msg)[0], raw=False)
    body = header["body"]
    target = body
    if body.get("leaves") and data.draw(st.booleans()):  # sometimes a leaf's field
        target = data.draw(st.sampled_from(body["leaves"]))
    if not target:
        return
    target[data.draw(st.sampled_from(sorted(target)))] = value
    frames = [msgpack.packb(header, use_bin_type=True)] + wire(msg)[1:]
    try:
        out = P.decode(frames)
    except P.ProtocolError as exc:
        assert exc.reason
    else:
        assert type(out) is type(msg) and all_fields_conform(out)


@FUZZ
@given(st.one_of(groups(), weights()), st.data())
def test_array_specs_lying_about_sizes_never_pass(msg, data):
    header = msgpack.unpackb(wire(msg)[0], raw=False)
    if not header["arrays"]:
        return
    i = data.draw(st.integers(0, len(header["arrays"]) - 1))
    field = data.draw(st.sampled_from(["shape", "dtype"]))
    if field == "shape":
        header["arrays"][i][2] = data.draw(st.one_of(
            st.lists(st.integers(-3, 2**64 - 1), max_size=5),
            st.lists(st.integers(0, 4), min_size=33, max_size=40), msgpack_values))
    else:
        header["arrays"][i][1] = data.draw(st.one_of(
            st.sampled_from(["float64", "complex64", "object", "<f4", "V8"]), msgpack_values))
    frames = [msgpack.packb(header, use_bin_type=True)] + wire(msg)[1:]
    try:
        out = P.decode(frames)
    except P.ProtocolError as exc:
        assert exc.reason
    else:  # a consistent "lie" (same bytes, another legal shape) is just a valid message
        assert type(out) is type(msg) and all_fields_conform(out)
        arrays = (out.tensors.values() if isinstance(out, WeightsUpdate)
                  else [out.prompt_tokens] + [a for leaf in out.leaves
                                              for a in (leaf.tokens, leaf.logprobs)])
        assert sum(a.nbytes for a in arrays) <= sum(map(len, frames[1:]))


def _weights_frames(spec_edit, payload: bytes = b"") -> list[bytes]:
    header = {"p": P.PROTOCOL_VERSION, "kind": "weights",
              "body": {"version": 1, "sent_at": 0.0}, "arrays": [spec_edit]}
    return [msgpack.packb(header, use_bin_type=True), payload]


@pytest.mark.parametrize("spec, payload, reason", [
    (["w", "float32", [2**62, 4]], b"", "bad_size"),  # wraps to 0 bytes with np.prod
    (["w", "float32", [0, 2**64 - 1]], b"", "bad_shape"),  # zero bytes, impossible shape
    (["w", "float32", [3]], b"\0" * 8, "bad_size"),
    (["w", "float32", [-1, -2]], b"\0" * 8, "bad_shape"),
    (["w", "float32", [2.0]], b"\0" * 8, "bad_shape"),
    (["w", "float32", [True, 2]], b"\0" * 8, "bad_shape"),
    (["w", "float32", [1] * 33], b"\0" * 4, "bad_shape"),
    (["w", ["float32"], [2]], b"\0" * 8, "bad_dtype"),  # unhashable dtype
    (["w", {"a": 1}, [2]], b"\0" * 8, "bad_dtype"),
    (["w", "float64", [1]], b"\0" * 8, "bad_dtype"),
    ([1, "float32", [2]], b"\0" * 8, "bad_header"),
    (["w", "float32"], b"\0" * 8, "bad_header"),
])
def test_lying_array_specs_name_the_reason(spec, payload, reason):
    assert_rejects(_weights_frames(spec, payload), reason)


def test_unhashable_kind_and_boolean_version_are_rejected():
    frames = wire(P.Ack())
    assert_rejects(repack(frames, lambda h: h.update(kind=["ack"])), "unknown_kind")
    assert_rejects(repack(frames, lambda h: h.update(kind={"a": 1})), "unknown_kind")
    assert_rejects(repack(frames, lambda h: h.update(p=True)), "bad_version")
    assert_rejects(repack(frames, lambda h: h.update(p=1.0)), "bad_version")


def test_duplicate_array_names_are_rejected():
    frames = wire(WeightsUpdate(1, {"a": torch.zeros(2)}))
    header = msgpack.unpackb(frames[0])
    header["arrays"].append(header["arrays"][0])
    assert_rejects([msgpack.packb(header)] + frames[1:] * 2, "bad_arrays")


def test_group_arrays_must_have_their_declared_dtypes():
    group = P.TrajectoryGroup("g", 0, "p", np.arange(4, dtype=np.int32), [])
    for dtype in ("float32", "uint8"):  # same size and a different size
        frames = wire(group)
        header = msgpack.unpackb(frames[0])
        spec = next(s for s in header["arrays"] if s[0] == "prompt_tokens")
        spec[1] = dtype
        if dtype == "uint8":
            spec[2] = [16]
        assert_rejects([msgpack.packb(header)] + frames[1:], "bad_dtype")


def test_stats_values_must_be_numbers():
    frames = wire(P.Heartbeat(1, 2, stats={"a": 1.0}))
    assert_rejects(repack(frames, lambda h: h["body"].update(stats={"a": "x"})), "bad_field")
    assert_rejects(repack(frames, lambda h: h["body"].update(stats={"a": True})), "bad_field")
    ok = P.decode(repack(frames, lambda h: h["body"].update(stats={"a": 3})))
    assert ok.stats == {"a": 3.0} and type(ok.stats["a"]) is float


def test_a_valid_message_of_an_unexpected_shape_of_leaves_is_rejected():
    leaf = P.Trajectory(np.arange(4, dtype=np.int32), np.ones(4, np.uint8),
                        np.zeros(4, np.float32), np.zeros(4, np.int32))
    frames = wire(P.TrajectoryGroup("g", 0, "p", np.zeros(1, np.int32), [leaf]))
    assert_rejects(repack(frames, lambda h: h["body"]["leaves"][0].update(len=5)), "bad_size")
    assert_rejects(repack(frames, lambda h: h["body"]["leaves"][0].update(len=3)), "bad_size")
    assert_rejects(repack(frames, lambda h: h["body"]["leaves"][0].update(parent=1)),
                   "bad_field")
    assert_rejects(repack(frames, lambda h: h["body"].pop("group_id")), "missing_field")


def test_group_decisions_round_trip_and_are_checked():
    rows = [[0.0, 5.0, 0.25, 0.55, 1.0], [1.0, 9.0, float("nan"), float("nan"), 0.0]]
    group = P.TrajectoryGroup("g", 0, "p", np.zeros(1, np.int32), [], decisions=rows)
    got = P.decode(wire(group)).decisions
    np.testing.assert_equal(np.array(got), np.array(rows))
    assert P.decode(wire(P.TrajectoryGroup("g", 0, "p", np.zeros(1, np.int32), []))
                    ).decisions == []
    frames = wire(group)
    for bad in ([["x"]], [[True, 1.0]], [1.0], "rows"):
        assert_rejects(repack(frames, lambda h, bad=bad: h["body"].update(decisions=bad)),
                       "bad_field")


def test_group_kind_round_trips_and_is_checked():
    group = P.TrajectoryGroup("g", 0, "p", np.zeros(1, np.int32), [], kind="lookup")
    assert P.decode(wire(group)).kind == "lookup"
    frames = wire(group)
    # a sender from before the field: the group arrives without a kind
    assert P.decode(repack(frames, lambda h: h["body"].pop("kind"))).kind == ""
    assert_rejects(repack(frames, lambda h: h["body"].update(kind=3)), "bad_field")


def test_group_origin_is_typed_and_checked_at_the_wire():
    """The origin the ledger reads (pid, [data_pos, data_end), ticket version and epoch)
    travels as whole numbers the decoder checks; a figure in ``stats`` is never read as
    one. The hold fault's deadline-as-data_end (a float) is refused here."""
    group = P.TrajectoryGroup("g", 0, "p", np.zeros(1, np.int32), [], pid=7, data_pos=3,
                              data_end=5, ticket_version=2, ticket_epoch=1)
    got = P.decode(wire(group))
    assert (got.pid, got.data_pos, got.data_end, got.ticket_version, got.ticket_epoch) == \
        (7, 3, 5, 2, 1)
    assert P.decode(wire(P.TrajectoryGroup("g", 0, "p", np.zeros(1, np.int32), []))
                    ).data_pos == -1  # not said: not tracked
    frames = wire(group)
    for bad in ({"data_end": 1234.567}, {"data_end": 3}, {"data_end": 2},
                {"data_pos": -1}, {"pid": -5}, {"ticket_epoch": "1"}, {"data_pos": True}):
        assert_rejects(repack(frames, lambda h, bad=bad: h["body"].update(bad)), "bad_field")
