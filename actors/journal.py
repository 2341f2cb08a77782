"""The journal of an actor's trees in flight: what a restarted actor needs to finish the
groups its previous incarnation had started, instead of generating them again.

One append-only file per actor, ``RUN_DIR/journal/actor<N>.bin``, next to the run's other
files. Each record is ``u32 length | u32 crc32 | msgpack body``, written with one
``os.write``: a process killed at any moment leaves whole records and at most one torn
one at the end, which loading drops (counted, ``torn``). The kernel keeps what was
written when the process dies; ``fsync`` every ``actors.journal_fsync_s`` bounds what a
crash of the machine itself loses.

What a group's records carry (the rollout writes them, actors/rollout/agent.py): the
group's stream position and end, the actor's stream position (``next``), the group
policy (pickled: which trajectories exist, their H_init, the branch budget, the
decisions so far) and, per trajectory, the tokens, loss mask, behaviour log-probs and
versions added since its last record, its ``LivePath`` fields, its phase and its sessions'
histories (``tools.python.state=session``). A record is written at every event that
changes the policy or a trajectory's next step, before any await, so the last policy and
each trajectory's last record always agree:

- ``round``: the trajectory runs its next round (a fresh root; after a tool result);
- ``calls``: its round ended in calls that had not all run (``text``, the round through
  its stop string, is parsed again on resume and the calls run: served by the tool cache
  when they had finished);
- ``done``: a leaf; ``acked`` once the policy was told (``GroupPolicy.finished``).

A round in progress when the actor died is lost and sampled again (it was never
recorded); everything before it is kept, versions included, so the staleness bound and
the importance weights treat resumed tokens as any others. ``{"k": "sent"}`` retires a
group once the learner's transport took it. Loading keeps the groups not sent and
rewrites the file with only them (compaction, also done while running past
``actors.journal_max_mb``).
"""

from __future__ import annotations

import logging
import os
import pickle
import struct
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgpack
import numpy as np

from actors.rollout.path import LivePath
from arpo_async.core.staleness import group_lag

log = logging.getLogger("actor")

HEADER = struct.Struct("<II")  # body length, crc32 of the body
MAX_RECORD = 256 << 20  # a length past this is a torn header, not a record
# LivePath's scalar fields, kept with each record of a trajectory
FIELDS = ("tool_calls", "branch_point", "decide", "snapshot", "rounds", "finish_reason",
          "overhang", "context_full", "needs_h_init")
ARRAYS = (("tokens", np.int32), ("mask", np.uint8), ("logprobs", np.float32),
          ("versions", np.int32))


def frame(rec: dict) -> bytes:
    """One record as written: its length, its CRC, its msgpack body."""
    body = msgpack.packb(rec, use_bin_type=True)
    return HEADER.pack(len(body), zlib.crc32(body)) + body


def journal_path(run_dir: str | Path, actor_id: int) -> Path:
    return Path(run_dir) / "journal" / f"actor{actor_id}.bin"


@dataclass
class PathRecord:
    """One trajectory as the journal last saw it."""

    tokens: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    fields: dict[str, Any] = field(default_factory=dict)
    phase: str = "round"  # round | calls | done
    text: str = ""  # phase calls: the round whose calls had not all run
    acked: bool = False  # phase done: the policy was told the leaf ended
    sessions: dict[str, list[str]] = field(default_factory=dict)

    def live(self, tid: int) -> LivePath:
        path = LivePath(tid, list(self.tokens), list(self.mask), list(self.logprobs),
                        list(self.versions), **self.fields)
        path.pending = self.text if self.phase == "calls" else ""
        return path


@dataclass
class TreeRecord:
    """A group in flight: its stream position and what is needed to finish it."""

    pos: int
    end: int
    policy: bytes = b""
    executed: int = 0
    paths: dict[int, PathRecord] = field(default_factory=dict)

    def model_tokens(self) -> int:
        """Sampled tokens it holds, each once (a fork's shared prefix is its parent's)."""
        return sum(sum(p.mask[p.fields.get("branch_point", 0):]) for p in self.paths.values())

    def versions(self) -> tuple[int, int]:
        """(oldest, newest) weights version of its sampled tokens; (-1, -1) with none."""
        seen = [v for p in self.paths.values() for v in p.versions if v >= 0]
        return (min(seen), max(seen)) if seen else (-1, -1)


def why_regenerate(tree: TreeRecord, learner_version: int, max_staleness: int) -> str:
    """Why a resumed tree is generated again from its prompt instead of finished ("" when
    it is finished): "rolled_back", it holds tokens of weights the learner no longer has
    (it resumed from an older checkpoint); "stale", its oldest token is already past the
    staleness bound, so the learner would drop the finished group (a version only grows:
    finishing it cannot help). Unknown learner version (-1): finished."""
    oldest, newest = tree.versions()
    if learner_version < 0 or oldest < 0:
        return ""
    if newest > learner_version:
        return "rolled_back"
    return "stale" if group_lag(learner_version, oldest) > max_staleness else ""


def _apply_path(tree: TreeRecord, item: dict) -> None:
    tid = int(item["t"])
    rec = tree.paths.get(tid)
    if rec is None:  # a new trajectory: a fork starts from its parent's first ``at`` tokens
        rec = tree.paths[tid] = PathRecord()
        src, at = int(item.get("from", -1)), int(item.get("at", 0))
        if src >= 0:
            parent = tree.paths[src]
            for name, _ in ARRAYS:
                getattr(rec, name).extend(getattr(parent, name)[:at])
    for name, dtype in ARRAYS:
        getattr(rec, name).extend(np.frombuffer(item[name], dtype).tolist())
    rec.fields, rec.phase, rec.text = dict(item["f"]), item["ph"], item.get("tx", "")
    rec.acked, rec.sessions = bool(item.get("ak", False)), dict(item.get("ss", {}))


def _item(tid: int, rec_from: int, at: int, path: LivePath, start: int, phase: str,
          acked: bool, sessions: dict[str, list[str]]) -> dict:
    item = {"t": tid, "f": {name: getattr(path, name) for name in FIELDS}, "ph": phase,
            "ak": acked, "ss": sessions}
    if rec_from >= 0:
        item["from"], item["at"] = rec_from, at
    if phase == "calls":
        item["tx"] = path.pending
    for name, dtype in ARRAYS:
        item[name] = np.asarray(getattr(path, name)[start:], dtype).tobytes()
    return item


class TreeJournal:
    """One actor's journal file (see the module docstring)."""

    def __init__(self, path: str | Path, fsync_s: float = 1.0, max_mb: float = 256.0):
        self.path = Path(path)
        self.fsync_s, self.max_bytes = fsync_s, int(max_mb * (1 << 20))
        self.live: dict[int, TreeRecord] = {}  # stream position -> tree not yet sent
        self.next = -1  # the stream position the actor had drawn up to (-1: unknown)
        self.counts = dict.fromkeys(("records", "bytes", "fsyncs", "torn", "orphans",
                                     "bad_records", "write_errors", "compactions",
                                     "trees_resumed", "tokens_resumed", "trees_rolled_back",
                                     "trees_stale"), 0)
        self.write_s = 0.0
        self._fd: int | None = None
        self._size = 0  # bytes in the file since it was last compacted
        self._stale = False  # a write failed: the file lags the trees in memory
        self._synced = time.monotonic()

    # ------------------------------------------------------------------ load
    def load(self) -> dict[int, TreeRecord]:
        """The trees an earlier incarnation left in flight, by stream position; the file is
        rewritten with only them. A torn last record is dropped and counted."""
        self.live, self.next = {}, -1
        if self.path.is_file():
            data = self.path.read_bytes()
            at = 0
            while at < len(data):
                if len(data) - at < HEADER.size:
                    self.counts["torn"] += 1
                    break
                size, crc = HEADER.unpack_from(data, at)
                body = data[at + HEADER.size: at + HEADER.size + size]
                if size > MAX_RECORD or len(body) < size or zlib.crc32(body) != crc:
                    self.counts["torn"] += 1
                    break
                rec = msgpack.unpackb(body, raw=False)
                try:
                    self._apply(rec)
                except (KeyError, TypeError, ValueError):  # whole but inconsistent: its tree
                    self.counts["bad_records"] += 1        # is not resumed (drawn again)
                    self.live.pop(int(rec.get("g", -1)), None)
                at += HEADER.size + size
        self.counts["trees_resumed"] = len(self.live)
        self.counts["tokens_resumed"] = sum(t.model_tokens() for t in self.live.values())
        try:
            self.compact()
        except OSError as exc:  # a full disk: the old file stays; rewritten at a later record
            log.warning("journal %s: could not be rewritten (%s)", self.path, exc)
            self.counts["write_errors"] += 1
            self._stale = True
        return dict(self.live)

    def _apply(self, rec: dict) -> None:
        kind, pos = rec.get("k"), int(rec.get("g", -1))
        if "n" in rec:
            self.next = max(self.next, int(rec["n"]))
        if kind == "sent":
            self.live.pop(pos, None)
            return
        if kind != "tree":
            return
        tree = self.live.get(pos)
        if tree is None:
            if "e" not in rec:  # the group was retired (compacted away) before this record
                self.counts["orphans"] += 1
                return
            tree = self.live[pos] = TreeRecord(pos, int(rec["e"]))
        tree.policy, tree.executed = rec["pol"], int(rec["x"])
        for item in rec["p"]:
            _apply_path(tree, item)

    # ------------------------------------------------------------------ write
    def _open(self) -> int:
        if self._fd is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        return self._fd

    def write(self, rec: dict) -> None:
        """Record ``rec``: applied to the trees in memory (the truth), then appended to
        the file. A write that fails (a full disk) never reaches the rollout: it is
        counted and logged, and the file, now behind, is rewritten whole from memory at
        the next record that can be written (until then a crash loses those trees)."""
        t0 = time.perf_counter()
        self._apply(rec)
        try:
            if self._stale:
                self.compact()
            else:
                self._append(frame(rec))
            if self.fsync_s >= 0 and time.monotonic() - self._synced >= self.fsync_s:
                os.fsync(self._open())
                self.counts["fsyncs"] += 1
                self._synced = time.monotonic()
            if self.max_bytes and self._size > self.max_bytes:
                self.compact()
        except OSError as exc:
            self.counts["write_errors"] += 1
            if not self._stale:
                log.warning("journal %s: a write failed (%s): the trees in flight are kept in "
                            "memory and the file is rewritten once it can be", self.path, exc)
            self._stale = True
            self.close()
        self.write_s += time.perf_counter() - t0

    def _append(self, data: bytes) -> None:
        if os.write(self._open(), data) != len(data):  # a short write leaves a torn record
            raise OSError(f"short write to {self.path}")
        self.counts["records"] += 1
        self.counts["bytes"] += len(data)
        self._size += len(data)

    def compact(self) -> None:
        """Rewrite the file with only the trees in flight, one record each (an OSError
        leaves the old file in place)."""
        tmp = self.path.with_suffix(".tmp")
        tmp.parent.mkdir(parents=True, exist_ok=True)
        try:
            with open(tmp, "wb") as f:
                for tree in self.live.values():
                    f.write(frame(self._whole(tree)))
                if not self.live and self.next >= 0:
                    f.write(frame({"k": "next", "n": self.next}))
                f.flush()
                os.fsync(f.fileno())
                size = f.tell()
        except OSError:
            tmp.unlink(missing_ok=True)
            raise
        self.close()
        os.replace(tmp, self.path)
        self._size, self._stale = size, False
        self.counts["compactions"] += 1

    def _whole(self, tree: TreeRecord) -> dict:
        items = []
        for tid, rec in tree.paths.items():
            item = {"t": tid, "f": rec.fields, "ph": rec.phase, "tx": rec.text,
                    "ak": rec.acked, "ss": rec.sessions}
            for name, dtype in ARRAYS:
                item[name] = np.asarray(getattr(rec, name), dtype).tobytes()
            items.append(item)
        return {"k": "tree", "g": tree.pos, "e": tree.end, "n": self.next, "pol": tree.policy,
                "x": tree.executed, "p": items}

    def group(self, pos: int, end: int, stream_next: int) -> GroupJournal:
        return GroupJournal(self, pos, end, stream_next, self.live.get(pos))

    def sent(self, pos: int) -> None:
        """The group at ``pos`` reached the learner's transport, or is not to be resumed
        (its tokens were sampled by weights the learner rolled back)."""
        if pos in self.live:
            self.write({"k": "sent", "g": pos})

    def stats(self) -> dict[str, float]:
        return {**{k: float(v) for k, v in self.counts.items()},
                "write_s": self.write_s, "in_flight": float(len(self.live))}

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


class GroupJournal:
    """One group's side of the journal, handed to ``Rollout.run``: ``resumed`` is the
    tree an earlier incarnation left (None: a new group), ``record`` writes an event."""

    def __init__(self, journal: TreeJournal, pos: int, end: int, stream_next: int,
                 resumed: TreeRecord | None):
        self.journal, self.pos, self.end, self.next = journal, pos, end, stream_next
        self.resumed = resumed
        self._written: dict[int, int] = ({tid: len(p.tokens) for tid, p in resumed.paths.items()}
                                         if resumed is not None else {})

    def record(self, policy, executed: int, paths: list[tuple[LivePath, int, dict]],
               acked: bool = False) -> None:
        """One event: the policy now and each of ``paths`` (a path, the trajectory it was
        forked from or -1, its sessions' histories)."""
        items = []
        for path, parent, sessions in paths:
            start = self._written.get(path.tid)
            new = start is None
            phase = "done" if path.finish_reason else "calls" if path.pending else "round"
            items.append(_item(path.tid, parent if new else -1, path.branch_point, path,
                               path.branch_point if new and parent >= 0 else start or 0,
                               phase, acked, sessions))
            self._written[path.tid] = len(path.tokens)
        rec = {"k": "tree", "g": self.pos, "n": self.next, "pol": pickle.dumps(policy),
               "x": executed, "p": items}
        if self.pos not in self.journal.live:
            rec["e"] = self.end
        self.journal.write(rec)
