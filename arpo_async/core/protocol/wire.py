"""The wire format of the messages in arpo_async/core/protocol/messages.py.

Frame 0 is a msgpack map ``{"p": PROTOCOL_VERSION, "kind": str, "body": {...}, "arrays":
[[name, dtype, shape], ...]}``; frames 1..n are the raw bytes of the arrays, in order
(arrays never travel inside msgpack: a raw frame is ten times faster for weights).

Two kinds of message carry arrays. A trajectory group travels as the tree it is: its
leaves' numpy arrays concatenated per field, a fork's from its branch point on (the
tokens, mask, behaviour log-probs and versions before it are its parent's, and are sent
once, with the parent; a fork whose prefix differs from its parent's goes whole), and
``decode`` gives every leaf back whole. A message that names fields in ``TENSORS`` (the
ZeroMQ weight channel's ``WeightsUpdate``) carries dicts of torch tensors, by one rule
for any such message: each tensor is the array ``FIELD/NAME`` with its torch dtype in the
header (bfloat16 too, whose bits numpy holds as uint16 on the way), and comes out as a
tensor of that dtype and shape. The dtype travels with the tensor; nothing else says
which tensors are bfloat16.
``decode`` validates the header, every body field's type and every array's dtype, shape
and byte size, and raises ``ProtocolError`` with a reason; it never trusts a length it
has not checked against the frames."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np

from arpo_async.core.protocol.messages import MESSAGES, ProtocolError, Trajectory, TrajectoryGroup

# msgpack is imported in encode/decode, torch where a message carries tensors: the
# package's names are imported by pure modules (arpo_async/core/staleness.py reads
# GrantReason), which never touch the wire.

# 2: tensors carry their dtype (1 listed bfloat16 names beside them); 3: a fork carries
# its own tokens only (the prefix it shares with its parent travels once)
PROTOCOL_VERSION = 3
DEFAULT_MAX_BYTES = 256 * 2**20

_ALLOWED_DTYPES = {"int32", "int64", "uint8", "uint16", "float32", "float16", "bfloat16", "int8",
                   "bool"}
_MAX_NDIM = 32  # numpy's own limit is 64; no tensor here has more than a handful


_LEAF_ARRAYS = ("tokens", "loss_mask", "logprobs", "versions")
_LEAF_DTYPES = {"tokens": "int32", "loss_mask": "uint8", "logprobs": "float32",
                "versions": "int32"}
_LEAF_ENTRY_BYTES = sum(np.dtype(d).itemsize for d in _LEAF_DTYPES.values())  # 13
_LEAF_SCALARS = {"reward": float, "score": float, "parent": int, "branch_point": int,
                 "tool_calls": int, "finish_reason": str}


def _array_bytes(arr: np.ndarray) -> memoryview:
    # flat uint8 view: memoryview.cast refuses shapes with a zero in them, e.g. (0, 3)
    return memoryview(np.ascontiguousarray(arr).reshape(-1).view(np.uint8))


def _wire_array(name: str, arr: Any) -> tuple[str, np.ndarray]:
    """(wire dtype name, array whose bytes are sent) of a numpy array or a torch tensor;
    rejects what ``decode`` would."""
    if not isinstance(arr, np.ndarray):  # a torch tensor: its dtype goes into the header
        dtype = str(arr.dtype).removeprefix("torch.")
        if dtype not in _ALLOWED_DTYPES:
            raise ProtocolError("bad_dtype", f"{name}: {dtype} cannot be sent "
                                f"(allowed: {sorted(_ALLOWED_DTYPES)})")
        import torch

        t = arr.detach().cpu().contiguous()
        return dtype, (t.view(torch.uint16) if dtype == "bfloat16" else t).numpy()
    dtype = str(arr.dtype)
    if dtype not in _ALLOWED_DTYPES:
        raise ProtocolError("bad_dtype", f"{name}: {dtype} cannot be sent "
                            f"(allowed: {sorted(_ALLOWED_DTYPES)})")
    return dtype, arr


def _plain(obj: Any) -> Any:
    """msgpack fallback: numpy scalars (np.float32 rewards, np.int64 ids) become Python's."""
    if isinstance(obj, np.generic):
        return obj.item()
    raise TypeError(f"cannot encode {type(obj).__name__} in a message body")


def _rooted(leaves: list[Trajectory]) -> list[bool]:
    """Per leaf: its parents lead to a global sample (no cycle, none out of range); each
    leaf walked once."""
    n = len(leaves)
    ok: list[bool | None] = [None] * n
    for i in range(n):
        chain, on, j = [], set(), i
        while 0 <= j < n and ok[j] is None and j not in on:
            chain.append(j)
            on.add(j)
            j = leaves[j].parent
        found = j < 0 if not 0 <= j < n else (ok[j] is True and j not in on)
        for c in chain:
            ok[c] = found
    return ok


def _shared(leaves: list[Trajectory], i: int, rooted: list[bool]) -> int:
    """Leading entries leaf ``i`` takes from its parent on the wire: its branch point when
    all four arrays agree with the parent's there (a fork copies them) and its parents
    lead to a global sample, else 0."""
    leaf = leaves[i]
    bp, p = leaf.branch_point, leaf.parent
    if (p < 0 or p >= len(leaves) or bp <= 0 or bp > min(len(leaf), len(leaves[p]))
            or not rooted[i]):
        return 0
    parent = leaves[p]
    same = all(np.asarray(getattr(leaf, a)[:bp], dtype=_LEAF_DTYPES[a]).tobytes()
               == np.asarray(getattr(parent, a)[:bp], dtype=_LEAF_DTYPES[a]).tobytes()
               for a in _LEAF_ARRAYS)  # bitwise: -0.0 is not 0.0, a NaN is itself
    return bp if same else 0


def encode(msg: Any) -> list[Any]:
    """Message -> list of frames (bytes / buffers) for ``send_multipart(copy=False)``."""
    kind = msg.KIND
    arrays: list[tuple[str, np.ndarray]] = []
    if isinstance(msg, TrajectoryGroup):
        body = {f.name: getattr(msg, f.name) for f in dataclasses.fields(msg)
                if f.name not in ("leaves", "prompt_tokens")}
        rooted = _rooted(msg.leaves)
        shared = [_shared(msg.leaves, i, rooted) for i in range(len(msg.leaves))]
        body["leaves"] = [{k: getattr(leaf, k) for k in _LEAF_SCALARS}
                          | {"len": len(leaf), "shared": n}
                          for leaf, n in zip(msg.leaves, shared)]
        arrays.append(("prompt_tokens", np.asarray(msg.prompt_tokens, dtype=np.int32)))
        for name in _LEAF_ARRAYS:
            parts = [np.asarray(getattr(leaf, name), dtype=_LEAF_DTYPES[name])[n:]
                     for leaf, n in zip(msg.leaves, shared)]
            arrays.append((name, np.concatenate(parts) if parts
                           else np.zeros(0, _LEAF_DTYPES[name])))
    else:
        tensors = getattr(msg, "TENSORS", ())
        body = {f.name: getattr(msg, f.name) for f in dataclasses.fields(msg)
                if f.name not in tensors}  # flat fields: msgpack takes them as they are
        for f in tensors:
            arrays += [(f"{f}/{n}", t) for n, t in getattr(msg, f).items()]
    wire = [(n, *_wire_array(n, a)) for n, a in arrays]
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
        elif str(f.type) == "list[int]":
            val = body[f.name]
            _check(isinstance(val, list) and all(type(x) is int and x >= 0 for x in val),
                   "bad_field", f"{f.name}: expected a list of non-negative integers")
            kwargs[f.name] = val
        elif str(f.type) == "list[list[int]]":
            val = body[f.name]
            _check(isinstance(val, list) and all(
                isinstance(v, list) and all(type(x) is int and x >= 0 for x in v) for v in val),
                "bad_field", f"{f.name}: expected a list of shapes")
            kwargs[f.name] = val
        elif str(f.type) == "list[list[float]]":
            val = body[f.name]
            _check(isinstance(val, list) and all(
                isinstance(v, list) and all(type(x) in (int, float) for x in v) for v in val),
                "bad_field", f"{f.name}: expected a list of rows of numbers")
            kwargs[f.name] = [[float(x) for x in v] for v in val]
        elif str(f.type) == "dict[str, int]":
            val = body[f.name]
            _check(isinstance(val, dict) and all(isinstance(k, str) for k in val),
                   "bad_field", f"{f.name}: expected a map with string keys")
            kwargs[f.name] = {k: _typed(val, k, int) for k in val}
        elif str(f.type) == "dict[str, float]":
            val = body[f.name]
            _check(isinstance(val, dict) and all(isinstance(k, str) for k in val),
                   "bad_field", f"{f.name}: expected a map with string keys")
            kwargs[f.name] = {k: _typed(val, k, float) for k in val}
        else:
            kwargs[f.name] = body[f.name]
    return cls(**kwargs)


def _decode_group(body: dict, arrays: list[tuple[str, np.ndarray]],
                  max_bytes: int = DEFAULT_MAX_BYTES) -> TrajectoryGroup:
    named = dict(arrays)
    _check(set(named) == {"prompt_tokens", *_LEAF_ARRAYS}, "bad_arrays", str(sorted(named)))
    for name, dtype in _LEAF_DTYPES.items() | {("prompt_tokens", "int32")}:
        _check(str(named[name].dtype) == dtype and named[name].ndim == 1, "bad_dtype", name)
    leaves_meta = body.get("leaves")
    _check(isinstance(leaves_meta, list), "bad_field", "leaves")
    total = named["tokens"].shape[0]
    _check(all(named[n].shape[0] == total for n in _LEAF_ARRAYS), "bad_size", "leaf arrays")
    metas, own, pos = [], [], 0
    for i, meta in enumerate(leaves_meta):
        _check(isinstance(meta, dict), "bad_field", f"leaves[{i}]")
        n, shared = _typed(meta, "len", int), _typed(meta, "shared", int)
        scalars = {k: _typed(meta, k, t) for k, t in _LEAF_SCALARS.items()}
        _check(-1 <= scalars["parent"] < len(leaves_meta), "bad_field", f"leaves[{i}].parent")
        _check(0 <= shared <= n and (shared == 0 or (scalars["parent"] >= 0
                                                     and shared == scalars["branch_point"])),
               "bad_field", f"leaves[{i}].shared")
        _check(n - shared <= total - pos, "bad_size", f"leaves[{i}].len")
        metas.append((n, shared, scalars))
        own.append({a: named[a][pos:pos + n - shared] for a in _LEAF_ARRAYS})
        pos += n - shared
    _check(pos == total, "bad_size", "leaf lengths do not cover the arrays")
    for i, (_, shared, scalars) in enumerate(metas):
        if shared:
            _check(shared <= metas[scalars["parent"]][0], "bad_field", f"leaves[{i}].shared")
    # whole, the leaves may not take more memory than one message may (the bound a
    # group had when every leaf travelled whole)
    whole_bytes = sum(n for n, _, _ in metas) * _LEAF_ENTRY_BYTES
    _check(whole_bytes <= max_bytes, "too_large", f"leaves whole: {whole_bytes} bytes")
    leaves = _whole(metas, own)
    body = {k: v for k, v in body.items() if k != "leaves"}
    group = _build(TrajectoryGroup, body | {"prompt_tokens": named["prompt_tokens"],
                                            "leaves": leaves})
    _check(isinstance(group.group_id, str) and isinstance(group.prompt_id, str),
           "bad_field", "ids")
    _check_origin(group)
    return group


def _check_origin(group: TrajectoryGroup) -> None:
    """An origin no draw can have is malformed: a field below -1 (not said), a data_end
    without its data_pos, or one not past it (a draw consumes its own prompt's position;
    a deadline once went out as a data_end: learner/ledger.py ``span_end`` also bounds how
    far past)."""
    for name in ("pid", "data_pos", "data_end", "ticket_version", "ticket_epoch"):
        _check(getattr(group, name) >= -1, "bad_field", f"{name}: below -1")
    if group.data_end != -1:
        _check(0 <= group.data_pos < group.data_end, "bad_field",
               f"data_end {group.data_end} not past data_pos {group.data_pos}")


def _whole(metas: list[tuple[int, int, dict]], own: list[dict]) -> list[Trajectory]:
    """Every leaf whole: a fork's shared prefix from its (whole) parent, then its own
    arrays; parents first (one pass from the leaves that share nothing), whatever their
    order in the message. A leaf left unreached shares through a cycle."""
    children: dict[int, list[int]] = {}
    for i, (_, shared, scalars) in enumerate(metas):
        if shared:
            children.setdefault(scalars["parent"], []).append(i)
    whole: list[dict | None] = [None] * len(metas)
    ready = [i for i, (_, shared, _) in enumerate(metas) if not shared]
    for i in ready:
        whole[i] = own[i]
    while ready:
        p = ready.pop()
        for c in children.get(p, ()):
            shared = metas[c][1]
            whole[c] = {a: np.concatenate([whole[p][a][:shared], own[c][a]])
                        for a in _LEAF_ARRAYS}
            ready.append(c)
    _check(all(w is not None for w in whole), "bad_field", "leaves: parents in a cycle")
    return [Trajectory(**arrays, **scalars) for arrays, (_, _, scalars) in zip(whole, metas)]


def _decode_tensors(cls: type, body: dict, spec: list,
                    arrays: list[tuple[str, np.ndarray]]) -> Any:
    """A message with ``TENSORS`` fields: each ``FIELD/NAME`` array becomes a torch tensor
    of the header's dtype in that field's dict."""
    import warnings

    import torch

    fields: dict[str, dict] = {f: {} for f in cls.TENSORS}
    for (_, dtype, _), (name, arr) in zip(spec, arrays):
        field, _, key = name.partition("/")
        _check(field in fields and key != "", "bad_arrays", f"{name[:40]!r}")
        with warnings.catch_warnings():  # views of the received frames, only ever read
            warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
            t = torch.from_numpy(arr)
        fields[field][key] = t.view(torch.bfloat16) if dtype == "bfloat16" else t
    _check(not set(fields) & set(body), "bad_field", "a tensor field in the body")
    return _build(cls, body | fields)


def decode(frames: list, max_bytes: int = DEFAULT_MAX_BYTES) -> Any:
    """Frames -> message object, or ProtocolError(reason)."""
    import msgpack

    _check(len(frames) >= 1, "empty")
    size = sum(len(memoryview(f).cast("B")) if not isinstance(f, bytes) else len(f)
               for f in frames)
    _check(size <= max_bytes, "too_large", f"{size} bytes > {max_bytes}")
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
            return _decode_group(body, arrays, max_bytes)
        if getattr(cls, "TENSORS", ()):
            return _decode_tensors(cls, body, header["arrays"], arrays)
        _check(not arrays, "bad_arrays", f"{kind} carries no arrays")
        return _build(cls, body)
    except ProtocolError:
        raise
    except (TypeError, ValueError, KeyError) as exc:
        raise ProtocolError("bad_field", str(exc)[:80]) from None
