"""The delta weight channel (``learner.weight_sync.channel=delta``; any actor on any
machine, over the control channel): after the first full copy, only the values that
changed, each result checked.

A version's step delta, made once when the learner publishes it, holds per tensor
whichever of these is smallest (``step``): nothing (no value changed); the difference of
each value's bit pattern from the old one as int8, zstd-compressed (2-byte dtypes: a
training step moves a bf16 value by a few units in its last place, so the differences
are small numbers, mostly 0 and +-1; the few that do not fit int8 go as positions and
values); the changed positions as int32 indices or as a bitmask, with the new values;
or the whole tensor. A value "changed" when its bits differ, so a model trained in
bfloat16 (``model.dtype``) sends what its bf16 rounding moved. In float32 every value
moves at every step, the step is as large as a full copy, and full copies are sent.

- learner (``DeltaWeightSender``): keeps the newest version (the tensors it was handed,
  not a copy), its full encoding, and the step deltas of the last
  ``learner.weight_sync.keep`` versions. A request names the version the actor holds and
  the digest of its copy (a hash of every tensor's checksum). An actor whose copy is one
  of the kept steps' bases gets the next step (it asks again until it is up to date),
  unless the steps to the newest version weigh as much as a full copy; any other actor
  (one that missed more versions, restarted, or holds a copy the learner never published)
  gets the full copy. Every reply is encoded once per version and sent uncopied.
- actor (``DeltaWeightReceiver``): keeps its own copy of the weights in the wire dtype
  (one model's worth of host memory), applies each step to it before generation pauses,
  checks every tensor the step changed against the learner's checksum (xxh3-64), and only
  then loads the result into the engine (``engine.update_weights``) in one pause, as a
  full copy would (SkyRL's order: fetch, then pause only to load). A step for another
  base, or a result that fails a checksum, drops the copy and asks for a full one. A step
  is applied only to its own base (version and digest), so one that arrives twice is
  skipped the second time: applying a delta twice changes nothing."""

from __future__ import annotations

import logging
import os
import threading
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, ClassVar


from arpo_async.core import protocol as P
from arpo_async.core.faults import FAULT_CORRUPT_DELTA, FAULT_KILL_AFTER_DELTA, actor_fault_int
from arpo_async.core.transport.control import Encoded, expect
from arpo_async.core.transport.sockets import nbytes
from arpo_async.core.weights.base import Channel, Loaded, Requester, WeightReceiver
from arpo_async.core.weights.delta_codec import apply_step, bits, checksum, digest, step

log = logging.getLogger("weights")


@dataclass
class DeltaRequest:
    KIND: ClassVar[str] = "delta_request"
    CHANNEL: ClassVar[str] = "delta"  # a weight channel's request (learner/service.py routes)
    actor_id: int
    have_version: int  # the version of the actor's own copy; -1: none (a full copy, please)
    have_digest: int  # that copy's digest


@dataclass
class DeltaUpdate:
    """One step from ``base_version`` to ``version``, or (``base_version`` -1) a full copy.
    ``checksums`` holds every tensor's checksum after the step; a tensor named in no
    tensor field is unchanged. ``index`` and ``mask`` say where ``values`` go."""

    KIND: ClassVar[str] = "delta_weights"
    CHANNEL: ClassVar[str] = "delta"
    TENSORS: ClassVar[tuple[str, ...]] = ("dense", "index", "mask", "values", "diff")
    version: int
    digest: int
    base_version: int
    base_digest: int
    checksums: dict[str, int] = field(default_factory=dict)
    dense: dict[str, Any] = field(default_factory=dict)  # whole tensors
    index: dict[str, Any] = field(default_factory=dict)  # int32 flat positions that changed
    mask: dict[str, Any] = field(default_factory=dict)  # uint8, np.packbits of the changed
    values: dict[str, Any] = field(default_factory=dict)  # the new values there, flat
    diff: dict[str, Any] = field(default_factory=dict)  # uint8: zstd of int8 bit differences


P.register_messages(DeltaRequest, DeltaUpdate)


# ------------------------------------------------------------------------ learner
@dataclass
class _Version:
    version: int
    digest: int
    tensors: dict
    checksums: dict[str, int]
    full: list  # the full copy's frames
    full_bytes: int


@dataclass
class _Step:
    base_digest: int
    frames: list
    size: int
    version: int  # the version it brings
    digest: int


class DeltaWeightSender:
    """The learner's side, a ``WeightSender`` over the control channel."""

    channel = "delta"
    requests = (DeltaRequest,)

    def __init__(self, keep: int = 4):
        self.keep = keep
        self._lock = threading.Lock()  # publish (main thread) vs handle (control thread)
        self._latest: _Version | None = None
        self._steps: dict[int, _Step] = {}  # by the version the step starts from
        self.requests_seen = 0
        self.served: Counter = Counter()  # "step" / "full" replies
        self.bytes_served = 0
        self.bytes_full_equivalent = 0  # what full copies would have cost for the same loads
        self.values_total = self.values_changed = 0  # over every published step
        self.changed_share_last = float("nan")
        self.steps_too_large = 0  # steps as large as a full copy (not kept)
        self._counted: dict[int, int] = {}  # actor -> the version last counted for it

    def publish(self, version: int, tensors: dict) -> None:
        """Encode ``version`` (a full copy, and the step from the previous version); the
        tensors are kept as they are, so they must not change afterwards."""
        checksums = {n: checksum(t) for n, t in tensors.items()}
        full = P.encode(DeltaUpdate(version, digest(checksums), -1, 0, checksums,
                                    dense=tensors))
        new = _Version(version, digest(checksums), tensors, checksums, full, nbytes(full))
        prev = self._latest
        if prev is not None and version <= prev.version:
            raise ValueError(f"weights version {version} published after {prev.version}: "
                             "versions must increase")
        kept = None
        if prev is not None and _same_shapes(prev.tensors, tensors):
            parts = step(prev.tensors, tensors)
            changed = sum(p["changed"] for p in parts.values())
            total = sum(t.numel() for t in tensors.values())
            self.values_total += total
            self.values_changed += changed
            self.changed_share_last = changed / max(total, 1)
            frames = P.encode(_step_message(new, prev, parts))
            size = nbytes(frames)
            if size < new.full_bytes:
                kept = _Step(prev.digest, frames, size, version, new.digest)
            else:
                self.steps_too_large += 1
                if self.steps_too_large == 1:
                    log.warning("delta weights: the step to v%d changes %.0f%% of the values "
                                "and is as large as a full copy; full copies are sent (a "
                                "delta pays when the model trains in bfloat16, model.dtype)",
                                version, 100 * self.changed_share_last)
        with self._lock:
            if kept is not None:
                self._steps[prev.version] = kept
            while len(self._steps) > max(self.keep, 1):
                del self._steps[min(self._steps)]
            self._latest = new

    @property
    def version(self) -> int:
        return -1 if self._latest is None else self._latest.version

    def handle(self, msg: DeltaRequest) -> Encoded | P.Ack:
        with self._lock:
            self.requests_seen += 1
            latest = self._latest
            if latest is None:
                return P.Ack(ok=True, learner_version=-1)
            if msg.have_version > latest.version or (
                    msg.have_version == latest.version and msg.have_digest == latest.digest):
                # up to date; or ahead of a learner that resumed behind it (as zmq.py: an
                # actor that wants to follow it asks with no copy, -1)
                return P.Ack(ok=True, learner_version=latest.version)
            chain, at = [], (msg.have_version, msg.have_digest)
            while at[0] in self._steps and self._steps[at[0]].base_digest == at[1]:
                link = self._steps[at[0]]
                chain.append(link)
                at = (link.version, link.digest)
                if link.version == latest.version:
                    break
            if chain and at == (latest.version, latest.digest) and \
                    sum(s.size for s in chain) < latest.full_bytes:
                frames, size, kind, done = chain[0].frames, chain[0].size, "step", len(chain) == 1
            else:
                frames, size, kind, done = latest.full, latest.full_bytes, "full", True
            self.served[kind] += 1
            self.bytes_served += size
            if done and self._counted.get(msg.actor_id) != latest.version:
                # a load that a full copy would have cost, once per actor and version (a
                # step refused and the full copy after it are one load)
                self._counted[msg.actor_id] = latest.version
                self.bytes_full_equivalent += latest.full_bytes
        return Encoded(frames)

    def stats(self) -> dict:
        return {"requests": self.requests_seen, "steps_served": self.served["step"],
                "full_served": self.served["full"], "bytes_served": self.bytes_served,
                "bytes_full_equivalent": self.bytes_full_equivalent,
                "bytes_ratio": self.bytes_served / max(self.bytes_full_equivalent, 1),
                "changed_share": self.values_changed / max(self.values_total, 1),
                "changed_share_last": self.changed_share_last,
                "steps_too_large": self.steps_too_large, "version": self.version}

    def close(self) -> None:
        """Nothing to release."""


def _same_shapes(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(
        a[n].shape == b[n].shape and a[n].dtype == b[n].dtype for n in b)


def _step_message(new: _Version, prev: _Version, parts: dict) -> DeltaUpdate:
    msg = DeltaUpdate(new.version, new.digest, prev.version, prev.digest, new.checksums)
    for name, fields in parts.items():
        for kind, t in fields.items():
            if kind != "changed":
                getattr(msg, kind)[name] = t
    return msg


# ------------------------------------------------------------------------ actor
class DeltaRejected(ValueError):
    """A step that cannot be applied to this actor's copy (the reason is the message)."""


class DeltaWeightReceiver:
    """The actor's side, a ``WeightReceiver`` over the control channel; keeps the actor's
    own copy of the weights (``base``)."""

    channel = "delta"

    def __init__(self, control: Requester, actor_id: int, run_dir: str | None = None):
        self.control, self.actor_id, self.run_dir = control, actor_id, run_dir
        self.base: dict | None = None
        self.version, self.digest = -1, 0
        self.checksums: dict[str, int] = {}
        # the digest of the weights this receiver last loaded into the engine (None: the
        # engine holds its checkpoint, taken to be the learner's version of that number)
        self.loaded_digest: int | None = None
        self.rejected: Counter = Counter()  # reason -> steps refused (then a full copy)
        self.steps = self.fulls = 0
        # the fault points (arpo_async/core/faults.py); None in every real run
        self._corrupt = actor_fault_int(FAULT_CORRUPT_DELTA, actor_id)
        self._kill = actor_fault_int(FAULT_KILL_AFTER_DELTA, actor_id)

    def drop(self) -> None:
        self.base, self.version, self.digest, self.checksums = None, -1, 0, {}

    async def sync(self, engine: Any, have_version: int | None = None) -> Loaded | None:
        have = engine.version if have_version is None else have_version
        if self.base is not None and (self.version != engine.version or have != self.version):
            self.drop()  # the engine holds other weights than our copy: start again
        steps, fulls = self.steps, self.fulls
        for _ in range(64):  # a chain is at most learner.weight_sync.keep steps
            reply = await self.control.request(DeltaRequest(self.actor_id, self.version,
                                                            self.digest))
            update = expect(reply, DeltaUpdate, "delta weights request")
            if update is None:
                break
            if update.base_version < 0 and update.version < engine.version <= have:
                return None  # the learner is behind us and we did not ask to follow it
            try:
                self._take(update)
            except DeltaRejected as exc:
                if update.base_version < 0 or self.fulls > fulls:
                    self.drop()  # the learner's own full copy fails its checks: no retry
                    raise RuntimeError(f"delta weights: the full copy of v{update.version} "
                                       f"fails its checks ({exc})") from None
                self.rejected[str(exc).split(":")[0]] += 1
                log.warning("actor %d: delta to v%d refused (%s); asking for a full copy",
                            self.actor_id, update.version, exc)
                self.drop()
        else:
            raise RuntimeError("delta weights: no end to the learner's steps")
        if self.base is None:
            return None
        if self.version == engine.version and self.loaded_digest in (None, self.digest):
            self.loaded_digest = self.digest
            return None  # what the engine holds already
        paused = await engine.update_weights(self.base, self.version)
        self.loaded_digest = self.digest
        if self._kill is not None and self.version >= self._kill and self.steps > steps:
            self._fault_kill()
        return Loaded(self.version, paused, self.channel)

    def _fault_kill(self) -> None:
        import signal
        from pathlib import Path

        done = Path(self.run_dir or ".") / f"fault_kill_after_delta.actor{self.actor_id}"
        if not done.exists():
            done.write_text(f"{self.version} {os.getpid()}")
            os.kill(os.getpid(), signal.SIGKILL)

    def _take(self, update: DeltaUpdate) -> None:
        if update.base_version < 0:  # a full copy: our own writable tensors
            self.base = None  # the old copy goes first (two models in memory, not three)
            self.base = {n: t.clone() for n, t in update.dense.items()}
            changed = list(self.base)
            self.fulls += 1
        elif (update.version, update.digest) == (self.version, self.digest):
            return  # applied already
        elif self.base is None or (update.base_version, update.base_digest) != (
                self.version, self.digest):
            raise DeltaRejected(f"base: the step is for v{update.base_version}, this copy is "
                                f"v{self.version}")
        else:
            if self._corrupt is not None and update.version >= self._corrupt:
                self._corrupt = None
                _corrupt_one(update)
            try:
                changed = apply_step(self.base, update)
            except Exception as exc:  # the copy may be half-written: the caller drops it
                raise DeltaRejected(f"apply: {type(exc).__name__}: {exc}") from None
            self.steps += 1
        if set(update.checksums) != set(self.base):
            raise DeltaRejected("names: the checksums name other tensors than this model's")
        for name in changed:
            if checksum(self.base[name]) != update.checksums[name]:
                raise DeltaRejected(f"checksum: {name} differs from the learner's after the "
                                    f"step to v{update.version}")
        unchanged = set(self.base) - set(changed)
        if any(self.checksums.get(n) != update.checksums[n] for n in unchanged):
            raise DeltaRejected("checksum: a tensor the step left alone differs")
        self.version, self.digest = update.version, update.digest
        self.checksums = dict(update.checksums)

    def stats(self) -> dict[str, float]:
        """Counters for the actor's stats (``weights/...``)."""
        return {"steps": float(self.steps), "fulls": float(self.fulls),
                "rejected": float(sum(self.rejected.values()))}


def _corrupt_one(update: DeltaUpdate) -> None:
    """The fault point: one value of the step changed after it arrived, at a position no
    other part of the step writes."""
    import torch
    import zstandard

    if update.diff:
        name = next(iter(update.diff))
        d = bytearray(zstandard.ZstdDecompressor().decompress(
            update.diff[name].numpy().tobytes()))
        far = set(update.index[name].tolist()) if name in update.index else set()
        i = next(i for i in range(len(d)) if i not in far)
        d[i] = (d[i] + 1) % 256
        update.diff[name] = torch.frombuffer(
            bytearray(zstandard.ZstdCompressor().compress(bytes(d))), dtype=torch.uint8)
        return
    part = update.values or update.dense
    name = next(iter(part))
    t = part[name].clone()  # received tensors are read-only views of the frames
    bits(t)[:1] ^= 1  # one bit of the first value
    part[name] = t


def _sender(cfg: Any) -> DeltaWeightSender:
    return DeltaWeightSender(keep=cfg.learner.weight_sync.keep)


async def _receiver(cfg: Any, control: Requester, engine: Any, actor_id: int,
                    fallback: WeightReceiver) -> WeightReceiver:
    return DeltaWeightReceiver(control, actor_id, str(cfg.run.dir))


CHANNEL = Channel("delta", (DeltaRequest, DeltaUpdate), _sender, _receiver)
