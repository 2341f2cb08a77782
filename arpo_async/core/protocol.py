"""Every message that crosses a process boundary, as a typed schema with a version.

Wire format: frame 0 is a msgpack map ``{"p": PROTOCOL_VERSION, "kind": str,
"body": {...}, "arrays": [[name, dtype, shape], ...]}``; frames 1..n are the raw bytes of
the arrays, in order (numpy arrays never travel inside msgpack: a raw frame is ten times
faster for weights). ``decode`` validates the header, every body field's type and every
array's dtype, shape and byte size, and raises ``ProtocolError`` with a reason; it never
trusts a length it has not checked against the frames.

Fields are only ever added, with defaults, so an older peer still decodes a newer
message. Defaults are evaluated per message (``default_factory``), never at import.
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass, field
from enum import Enum, IntEnum
from typing import Any, ClassVar

import numpy as np

# msgpack is imported in encode/decode: pure modules may use the words without the wire.

PROTOCOL_VERSION = 1
DEFAULT_MAX_BYTES = 256 * 2**20

_ALLOWED_DTYPES = {"int32", "int64", "uint8", "uint16", "float32", "float16", "bfloat16", "int8",
                   "bool"}
_MAX_NDIM = 32  # numpy's own limit is 64; no tensor here has more than a handful


class ProtocolError(ValueError):
    """A message that cannot be accepted; ``reason`` is a short counter key."""

    def __init__(self, reason: str, detail: str = ""):
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason


# ----------------------------------------------------------------------------- words


class GrantReason(str, Enum):
    """Why a ``TicketGrant`` holds fewer tickets than asked for (NONE: all granted).
    On the wire it is its string value, so older peers read it unchanged."""

    NONE = ""
    CAPACITY = "capacity"  # the staleness bound (staleness.py): tickets free up as it trains
    STALE_WEIGHTS = "stale_weights"  # the actor's weights are too old: fetch new ones first
    STALE_AHEAD = "stale_ahead"  # the actor is ahead of a restarted learner: fetch its weights
    HELLO_REQUIRED = "hello_required"  # the learner has not met this actor process: say Hello
    WAITING_FOR_ACTORS = "waiting_for_actors"  # the start gate waits for the other actors
    FAIR_SHARE = "fair_share"  # this actor holds its share of the staleness window
    STOPPING = "stopping"  # the run is over (``stop`` is set too)

    @classmethod
    def of(cls, value: str) -> GrantReason | None:
        """The reason a peer sent, or None for one this version does not know."""
        return cls._value2member_map_.get(value)

    @property
    def needs_weights(self) -> bool:
        """The actor must fetch the published weights before it asks again."""
        return self in (GrantReason.STALE_WEIGHTS, GrantReason.STALE_AHEAD)

    @property
    def busy(self) -> bool:
        """Tickets free up by themselves as the learner trains: ask again soon."""
        return self is GrantReason.CAPACITY


class AckReason(str, Enum):
    """The ``Ack.reason`` values a peer acts on; any other reason is a detail to log."""

    HELLO_REQUIRED = "hello_required"  # the learner has not met this actor process
    BAD_REQUEST = "bad_request"  # a negative actor id or count: refused, counted
    NO_FAST_WEIGHTS = "no_fast_weights"  # NCCL weights asked of a learner.weight_sync=zmq run


class ExitCode(IntEnum):
    """How a role process (learner, actor) ends, for the supervisor."""

    OK = 0  # finished: the learner ended the run, or reached its steps or time
    FAILED = 1  # an error: the supervisor restarts the role (with backoff)
    CONFIG = 2  # bad config or arguments: a restart would fail the same way
    # EX_UNAVAILABLE: an actor heard nothing from the learner for transport.connect_timeout_s
    # (its host vanished, or the run ended unseen); a restart would only wait as long again
    LEARNER_GONE = 69
    RESTART = 75  # EX_TEMPFAIL: the process cannot go on (a stuck NCCL group); restart it
    INTERRUPTED = 130  # Ctrl-C / SIGTERM


# ----------------------------------------------------------------------------- messages


@dataclass
class Trajectory:
    """One leaf of a group's tree. Arrays cover the response only (everything after
    the prompt): model tokens (mask 1) and tool-result tokens (mask 0)."""

    tokens: np.ndarray  # int32 token ids
    loss_mask: np.ndarray  # uint8, 1 = model token, 0 = tool-result token
    logprobs: np.ndarray  # float32 behaviour log-prob (0 where mask is 0)
    versions: np.ndarray  # int32 policy version that sampled the token (-1 where mask is 0)
    reward: float = 0.0
    score: float = 0.0  # correctness in [0, 1] (accuracy), separate from shaped reward
    parent: int = -1  # index of the leaf this one forked from, -1 for a global sample
    branch_point: int = 0  # response tokens shared with the parent
    tool_calls: int = 0  # tool calls in this leaf (shared prefix included)
    finish_reason: str = ""

    def __len__(self) -> int:
        return int(self.tokens.shape[0])


@dataclass
class TrajectoryGroup:
    """All leaves sampled for one prompt, sent as one message."""

    KIND: ClassVar[str] = "group"
    group_id: str
    actor_id: int
    prompt_id: str
    prompt_tokens: np.ndarray  # int32
    leaves: list[Trajectory]
    mode: str = "grpo"
    tool_calls_executed: int = 0  # calls actually run (shared prefixes not re-run)
    created_at: float = field(default_factory=time.time)
    sent_at: float = 0.0
    stats: dict[str, float] = field(default_factory=dict)

    def min_version(self) -> int:
        versions = [leaf.versions[leaf.loss_mask > 0] for leaf in self.leaves]
        versions = [v for v in versions if v.size]
        return int(min(v.min() for v in versions)) if versions else -1

    def num_tokens(self) -> int:
        return sum(len(leaf) for leaf in self.leaves)


@dataclass
class Hello:
    KIND: ClassVar[str] = "hello"
    actor_id: int
    pid: int
    host: str = ""
    version: int = -1
    sent_at: float = field(default_factory=time.time)


@dataclass
class Heartbeat:
    KIND: ClassVar[str] = "heartbeat"
    actor_id: int
    version: int
    stats: dict[str, float] = field(default_factory=dict)
    sent_at: float = field(default_factory=time.time)


@dataclass
class TicketRequest:
    """An actor asks to start ``n`` groups (admission control, staleness.py)."""

    KIND: ClassVar[str] = "ticket_request"
    actor_id: int
    version: int
    n: int = 1


@dataclass
class TicketGrant:
    KIND: ClassVar[str] = "ticket_grant"
    granted: int
    learner_version: int  # version of the newest published weights
    stop: bool = False  # the run is over: finish up and say Bye
    reason: str = ""


@dataclass
class WeightsRequest:
    KIND: ClassVar[str] = "weights_request"
    actor_id: int
    have_version: int


@dataclass
class WeightsUpdate:
    """Full weights; ``tensors`` maps parameter name to array (raw frames).

    numpy has no bfloat16, so a bfloat16 tensor travels as its raw bits in a uint16 array
    (``torch_tensor.view(torch.uint16).numpy()``) and its name is listed in
    ``bf16_names``; the receiver gets the same uint16 array and the same list back and
    restores it with ``torch.from_numpy(arr).view(torch.bfloat16)``.
    """

    KIND: ClassVar[str] = "weights"
    version: int
    tensors: dict[str, np.ndarray] = field(default_factory=dict)
    sent_at: float = field(default_factory=time.time)
    bf16_names: list[str] = field(default_factory=list)


@dataclass
class Bye:
    """An actor's last word: how many groups it sent in total (for exact accounting)."""

    KIND: ClassVar[str] = "bye"
    actor_id: int
    groups_sent: int
    stats: dict[str, float] = field(default_factory=dict)


@dataclass
class Ack:
    KIND: ClassVar[str] = "ack"
    ok: bool = True
    reason: str = ""
    learner_version: int = -1


@dataclass
class ConfigRequest:
    """An actor started on another machine (``launch actor --connect``) asks for the run's
    resolved config; ``actor_id`` -1 asks the learner to assign one."""

    KIND: ClassVar[str] = "config_request"
    actor_id: int = -1
    host: str = ""
    pid: int = 0


@dataclass
class ConfigReply:
    KIND: ClassVar[str] = "config_reply"
    config_yaml: str  # the learner's RUN_DIR/config.yaml
    actor_id: int  # the id this actor runs as


@dataclass
class NcclJoinRequest:
    """A vLLM GPU actor asks to receive weights over NCCL (learner.weight_sync=nccl)."""

    KIND: ClassVar[str] = "nccl_join"
    actor_id: int
    machine_id: str  # the kernel boot id: equal only on the same machine
    workers: int = 1  # the actor's vLLM worker processes (tensor parallel size)


@dataclass
class NcclJoinReply:
    """``ok``: join the group now (vLLM's NCCL weight-transfer init info); else ``reason``
    says why the actor keeps ZeroMQ."""

    KIND: ClassVar[str] = "nccl_join_reply"
    ok: bool
    reason: str = ""
    master_address: str = ""
    master_port: int = 0
    world_size: int = 0
    buffer_bytes: int = 0
    num_buffers: int = 0


@dataclass
class NcclWeightsRequest:
    """Sent at the actor's safe point: weights newer than ``have_version``, over NCCL."""

    KIND: ClassVar[str] = "nccl_weights_request"
    actor_id: int
    have_version: int


@dataclass
class NcclWeightsHeader:
    """What the broadcast that follows carries, in order (vLLM's update info)."""

    KIND: ClassVar[str] = "nccl_weights_header"
    version: int
    names: list[str] = field(default_factory=list)
    dtype_names: list[str] = field(default_factory=list)
    shapes: list[list[int]] = field(default_factory=list)


MESSAGES = {
    cls.KIND: cls
    for cls in (TrajectoryGroup, Hello, Heartbeat, TicketRequest, TicketGrant,
                WeightsRequest, WeightsUpdate, Bye, Ack, ConfigRequest, ConfigReply,
                NcclJoinRequest, NcclJoinReply, NcclWeightsRequest, NcclWeightsHeader)
}

# ----------------------------------------------------------------------------- encoding

_LEAF_ARRAYS = ("tokens", "loss_mask", "logprobs", "versions")
_LEAF_DTYPES = {"tokens": "int32", "loss_mask": "uint8", "logprobs": "float32",
                "versions": "int32"}
_LEAF_SCALARS = {"reward": float, "score": float, "parent": int, "branch_point": int,
                 "tool_calls": int, "finish_reason": str}


def _array_bytes(arr: np.ndarray) -> memoryview:
    # flat uint8 view: memoryview.cast refuses shapes with a zero in them, e.g. (0, 3)
    return memoryview(np.ascontiguousarray(arr).reshape(-1).view(np.uint8))


def _wire_array(name: str, arr: np.ndarray, bf16: bool) -> tuple[str, np.ndarray]:
    """(wire dtype name, array whose bytes are sent); rejects what ``decode`` would."""
    dtype = str(arr.dtype)
    if dtype == "bfloat16":  # an ml_dtypes array: send its bits
        return "bfloat16", arr.view(np.uint16)
    if bf16:
        if dtype not in ("uint16", "int16"):
            raise ProtocolError("bad_dtype", f"{name}: listed in bf16_names but is {dtype}, "
                                "expected the uint16 view of a bfloat16 tensor")
        return "bfloat16", arr.view(np.uint16)
    if dtype not in _ALLOWED_DTYPES:
        raise ProtocolError("bad_dtype", f"{name}: {dtype} cannot be sent "
                            f"(allowed: {sorted(_ALLOWED_DTYPES)})")
    return dtype, arr


def _plain(obj: Any) -> Any:
    """msgpack fallback: numpy scalars (np.float32 rewards, np.int64 ids) become Python's."""
    if isinstance(obj, np.generic):
        return obj.item()
    raise TypeError(f"cannot encode {type(obj).__name__} in a message body")


def encode(msg: Any) -> list[Any]:
    """Message -> list of frames (bytes / buffers) for ``send_multipart(copy=False)``."""
    kind = msg.KIND
    arrays: list[tuple[str, np.ndarray]] = []
    if isinstance(msg, TrajectoryGroup):
        body = {f.name: getattr(msg, f.name) for f in dataclasses.fields(msg)
                if f.name not in ("leaves", "prompt_tokens")}
        body["leaves"] = [{k: getattr(leaf, k) for k in _LEAF_SCALARS} | {"len": len(leaf)}
                          for leaf in msg.leaves]
        arrays.append(("prompt_tokens", np.asarray(msg.prompt_tokens, dtype=np.int32)))
        for name in _LEAF_ARRAYS:
            parts = [np.asarray(getattr(leaf, name), dtype=_LEAF_DTYPES[name])
                     for leaf in msg.leaves]
            arrays.append((name, np.concatenate(parts) if parts
                           else np.zeros(0, _LEAF_DTYPES[name])))
    elif isinstance(msg, WeightsUpdate):
        missing = set(msg.bf16_names) - set(msg.tensors)
        if missing:
            raise ProtocolError("bad_arrays", f"bf16_names not in tensors: {sorted(missing)[:5]}")
        body = {"version": msg.version, "sent_at": msg.sent_at}
        arrays = [(n, np.asarray(a)) for n, a in msg.tensors.items()]
    else:
        body = dataclasses.asdict(msg)
    bf16 = set(msg.bf16_names) if isinstance(msg, WeightsUpdate) else set()
    wire = [(n, *_wire_array(n, a, n in bf16)) for n, a in arrays]
    header = {"p": PROTOCOL_VERSION, "kind": kind, "body": body,
              "arrays": [[n, dtype, list(a.shape)] for n, dtype, a in wire]}
    import msgpack  # msgpack: not for the pure modules (see the note at the top)

    return ([msgpack.packb(header, use_bin_type=True, default=_plain)]
            + [_array_bytes(a) for _, _, a in wire])


def _check(cond: bool, reason: str, detail: str = "") -> None:
    if not cond:
        raise ProtocolError(reason, detail)


def _decode_arrays(spec: Any, frames: list) -> list[tuple[str, np.ndarray]]:
    _check(isinstance(spec, list), "bad_header", "arrays must be a list")
    _check(len(spec) == len(frames), "frame_count", f"{len(spec)} arrays, {len(frames)} frames")
    out, seen = [], set()
    for item, frame in zip(spec, frames):
        _check(isinstance(item, list) and len(item) == 3, "bad_header", "array spec")
        name, dtype, shape = item
        _check(isinstance(name, str), "bad_header", "array name")
        _check(name not in seen, "bad_arrays", f"duplicate array {name[:40]!r}")
        seen.add(name)
        _check(isinstance(dtype, str) and dtype in _ALLOWED_DTYPES, "bad_dtype",
               f"{name}: {dtype!r}"[:80])
        _check(isinstance(shape, list) and len(shape) <= _MAX_NDIM
               and all(type(s) is int and s >= 0 for s in shape),
               "bad_shape", f"{name}: {shape!r}"[:80])
        buf = memoryview(frame).cast("B") if not isinstance(frame, bytes) else frame
        np_dtype = np.dtype("uint16") if dtype == "bfloat16" else np.dtype(dtype)
        count = math.prod(shape)  # exact: np.prod wraps around on lying shapes
        _check(count * np_dtype.itemsize == len(buf), "bad_size",
               f"{name}: {len(buf)} bytes for {shape} {dtype}"[:120])
        try:
            arr = np.frombuffer(buf, dtype=np_dtype).reshape(shape)
        except ValueError as exc:  # e.g. a zero-size array with a dimension numpy rejects
            raise ProtocolError("bad_shape", f"{name}: {exc}"[:80]) from None
        out.append((name, arr))
    return out


def _typed(body: dict, key: str, typ: type | tuple, reason: str = "bad_field") -> Any:
    _check(key in body, "missing_field", key)
    val = body[key]
    if typ is float and isinstance(val, int) and not isinstance(val, bool):
        val = float(val)
    ok = isinstance(val, typ) and not (typ in (int, float) and isinstance(val, bool))
    _check(ok, reason, f"{key}: expected {getattr(typ, '__name__', typ)}, got {type(val).__name__}")
    return val


def _build(cls: type, body: dict) -> Any:
    kwargs = {}
    for f in dataclasses.fields(cls):
        if f.name not in body:
            _check(f.default is not dataclasses.MISSING
                   or f.default_factory is not dataclasses.MISSING, "missing_field", f.name)
            continue
        typ = {"int": int, "float": float, "str": str, "bool": bool}.get(str(f.type), None)
        if typ is not None:
            kwargs[f.name] = _typed(body, f.name, typ)
        elif str(f.type) == "list[str]":
            val = body[f.name]
            _check(isinstance(val, list) and all(isinstance(v, str) for v in val),
                   "bad_field", f"{f.name}: expected a list of strings")
            kwargs[f.name] = val
        elif str(f.type) == "list[list[int]]":
            val = body[f.name]
            _check(isinstance(val, list) and all(
                isinstance(v, list) and all(type(x) is int and x >= 0 for x in v) for v in val),
                "bad_field", f"{f.name}: expected a list of shapes")
            kwargs[f.name] = val
        elif str(f.type) == "dict[str, float]":
            val = body[f.name]
            _check(isinstance(val, dict) and all(isinstance(k, str) for k in val),
                   "bad_field", f"{f.name}: expected a map with string keys")
            kwargs[f.name] = {k: _typed(val, k, float) for k in val}
        else:
            kwargs[f.name] = body[f.name]
    return cls(**kwargs)


def _decode_group(body: dict, arrays: list[tuple[str, np.ndarray]]) -> TrajectoryGroup:
    named = dict(arrays)
    _check(set(named) == {"prompt_tokens", *_LEAF_ARRAYS}, "bad_arrays", str(sorted(named)))
    for name, dtype in _LEAF_DTYPES.items() | {("prompt_tokens", "int32")}:
        _check(str(named[name].dtype) == dtype and named[name].ndim == 1, "bad_dtype", name)
    leaves_meta = body.get("leaves")
    _check(isinstance(leaves_meta, list), "bad_field", "leaves")
    total = named["tokens"].shape[0]
    _check(all(named[n].shape[0] == total for n in _LEAF_ARRAYS), "bad_size", "leaf arrays")
    leaves, pos = [], 0
    for i, meta in enumerate(leaves_meta):
        _check(isinstance(meta, dict), "bad_field", f"leaves[{i}]")
        n = _typed(meta, "len", int)
        _check(0 <= n <= total - pos, "bad_size", f"leaves[{i}].len")
        scalars = {k: _typed(meta, k, t) for k, t in _LEAF_SCALARS.items()}
        _check(-1 <= scalars["parent"] < len(leaves_meta), "bad_field", f"leaves[{i}].parent")
        leaves.append(Trajectory(**{a: named[a][pos:pos + n] for a in _LEAF_ARRAYS}, **scalars))
        pos += n
    _check(pos == total, "bad_size", "leaf lengths do not cover the arrays")
    body = {k: v for k, v in body.items() if k != "leaves"}
    group = _build(TrajectoryGroup, body | {"prompt_tokens": named["prompt_tokens"],
                                            "leaves": leaves})
    _check(isinstance(group.group_id, str) and isinstance(group.prompt_id, str),
           "bad_field", "ids")
    return group


def _decode_weights(body: dict, spec: list, arrays: list) -> WeightsUpdate:
    bf16 = [name for name, dtype, _ in spec if dtype == "bfloat16"]
    return WeightsUpdate(version=_typed(body, "version", int), tensors=dict(arrays),
                         sent_at=_typed(body, "sent_at", float), bf16_names=bf16)


def decode(frames: list, max_bytes: int = DEFAULT_MAX_BYTES) -> Any:
    """Frames -> message object, or ProtocolError(reason)."""
    _check(len(frames) >= 1, "empty")
    size = sum(len(memoryview(f).cast("B")) if not isinstance(f, bytes) else len(f)
               for f in frames)
    _check(size <= max_bytes, "too_large", f"{size} bytes > {max_bytes}")
    import msgpack

    try:
        header = msgpack.unpackb(bytes(frames[0]), raw=False, strict_map_key=True)
    except (ValueError, TypeError, msgpack.UnpackException) as exc:  # ExtraData, OutOfData...
        raise ProtocolError("not_msgpack", type(exc).__name__) from None
    _check(isinstance(header, dict), "bad_header", "not a map")
    version = header.get("p")  # type first: True and 1.0 both compare equal to 1
    _check(type(version) is int and version == PROTOCOL_VERSION, "bad_version",
           repr(version)[:40])
    kind = header.get("kind")
    _check(isinstance(kind, str) and kind in MESSAGES, "unknown_kind", repr(kind)[:40])
    body = header.get("body")
    _check(isinstance(body, dict), "bad_header", "body")
    arrays = _decode_arrays(header.get("arrays", []), list(frames[1:]))
    cls = MESSAGES[kind]
    try:
        if cls is TrajectoryGroup:
            return _decode_group(body, arrays)
        if cls is WeightsUpdate:
            return _decode_weights(body, header.get("arrays", []), arrays)
        _check(not arrays, "bad_arrays", f"{kind} carries no arrays")
        return _build(cls, body)
    except ProtocolError:
        raise
    except (TypeError, ValueError, KeyError) as exc:
        raise ProtocolError("bad_field", str(exc)[:80]) from None
