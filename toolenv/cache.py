"""The tool-result cache shared by every actor process on a host.

Entries live in a diskcache ``Cache`` (SQLite in WAL mode plus files): safe across
processes, about 10 us a get and 100 us a set. ``FanoutCache`` is deliberately not used:
it gives up on a write after 10 ms and returns False silently, which loses entries under
load.

Key = sha256 of ``json.dumps([tool, version, args])``, ``args`` in the tool's canonical
form (the runner passes ``toolenv.base.canonical(tool, args)``: each tool says which
calls must share a result); a call in a stateful session (``tools.python.state=session``)
adds the session's state, the digest of its history (toolenv/session.py), so a result is
only ever served to the same state: ``[tool, version, args, state]``.

Only successful results are stored: the runner never offers errors or timeouts, and
``set(..., ok=False)`` raises.

Locks. The calls are synchronous and the runner makes them on the actor's event loop,
so no operation waits more than ``LOCK_WAIT_S`` for another process's write lock: it
raises ``diskcache.Timeout`` (the runner counts a lookup or store error and the call goes
on) and a counter update is skipped (``counter_skips``). diskcache's default (60 s busy
timeout, retried for ever with ``retry=True``) would freeze every other actor's loop while
one actor holding the lock is stopped. Hit/miss/set counters are kept twice: in this process
(with get/set latency) and persistently, across processes, in a small counter cache next
to the entries, updated with diskcache's atomic ``incr``.
"""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path

import diskcache

_COUNTERS_SUBDIR = "counters"
_COUNTER_NAMES = ("hits", "misses", "sets")
LOCK_WAIT_S = 2.0  # the longest one cache operation waits for another process's lock


class ToolCache:
    """Disk-backed cache of tool results; one instance per process, many per directory."""

    def __init__(self, directory: str | Path, ttl_s: float = 0.0):
        if ttl_s < 0:
            raise ValueError(f"tool cache ttl_s must be >= 0, got {ttl_s}")
        self.directory = Path(directory)
        self.ttl_s = float(ttl_s)
        self._cache = diskcache.Cache(str(self.directory), timeout=LOCK_WAIT_S)
        # Counters never get evicted: the entry cache may cull under its size limit.
        self._counters = diskcache.Cache(
            str(self.directory / _COUNTERS_SUBDIR), eviction_policy="none", timeout=LOCK_WAIT_S
        )
        self.hits = 0
        self.misses = 0
        self.sets = 0
        self.counter_skips = 0  # persistent counter updates skipped (lock held too long)
        self._get_s = 0.0
        self._set_s = 0.0

    @staticmethod
    def key(tool: str, version: str, args: str, state: str = "") -> str:
        parts = [tool, version, args] + ([state] if state else [])
        payload = json.dumps(parts, ensure_ascii=False)
        return hashlib.sha256(payload.encode("utf-8")).hexdigest()

    def get(self, tool: str, version: str, args: str, state: str = "") -> str | None:
        """The cached text, or None on a miss (or an expired entry)."""
        start = time.perf_counter()
        value = self._cache.get(self.key(tool, version, args, state), default=None,
                                retry=False)
        hit = value is not None
        self._incr("hits" if hit else "misses")
        self._get_s += time.perf_counter() - start
        if hit:
            self.hits += 1
        else:
            self.misses += 1
        return value

    def set(self, tool: str, version: str, args: str, text: str, ok: bool = True,
            state: str = "") -> None:
        """Store a successful result. ``ok=False`` raises: errors are never cached."""
        if not ok:
            raise ValueError(f"refusing to cache a failed {tool} result (errors are never cached)")
        if not isinstance(text, str):
            raise TypeError(f"tool cache values are str, got {type(text).__name__}")
        start = time.perf_counter()
        expire = self.ttl_s if self.ttl_s > 0 else None
        self._cache.set(self.key(tool, version, args, state), text, expire=expire, retry=False)
        self._incr("sets")
        self._set_s += time.perf_counter() - start
        self.sets += 1

    def _incr(self, name: str) -> None:
        try:
            self._counters.incr(name, 1, default=0, retry=False)
        except diskcache.Timeout:
            self.counter_skips += 1

    def stats(self) -> dict[str, float]:
        """This process's counters and mean get/set latency."""
        lookups = self.hits + self.misses
        return {
            "hits": self.hits,
            "misses": self.misses,
            "sets": self.sets,
            "counter_skips": self.counter_skips,
            "hit_rate": self.hits / lookups if lookups else 0.0,
            "get_latency_mean_s": self._get_s / lookups if lookups else 0.0,
            "set_latency_mean_s": self._set_s / self.sets if self.sets else 0.0,
        }

    def disk_stats(self) -> dict[str, float]:
        """What is on disk: entries, bytes, and the counters summed over all processes."""
        totals = {name: int(self._counters.get(name, default=0, retry=True)) for name in
                  _COUNTER_NAMES}
        lookups = totals["hits"] + totals["misses"]
        return {
            "entries": len(self._cache),
            "size_bytes": self._cache.volume() + self._counters.volume(),
            "hits_total": totals["hits"],
            "misses_total": totals["misses"],
            "sets_total": totals["sets"],
            "hit_rate_total": totals["hits"] / lookups if lookups else 0.0,
        }

    def check(self, fix: bool = False) -> list:
        """diskcache's consistency check of the entries (warnings; empty when sound)."""
        return list(self._cache.check(fix=fix, retry=True))

    def clear(self) -> int:
        """Remove every entry and reset the persistent counters; returns entries removed."""
        removed = self._cache.clear(retry=True)
        self._counters.clear(retry=True)
        return removed

    def close(self) -> None:
        self._cache.close()
        self._counters.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _existing(directory: str | Path) -> Path:
    path = Path(directory)
    if not (path / "cache.db").is_file():
        raise FileNotFoundError(f"no tool cache at {path} (expected {path / 'cache.db'})")
    return path


def cache_stats(directory: str | Path) -> dict[str, float]:
    """Disk statistics of an existing cache folder (for the CLI)."""
    with ToolCache(_existing(directory)) as cache:
        return cache.disk_stats()


def cache_clear(directory: str | Path) -> int:
    """Empty an existing cache folder (for the CLI); returns entries removed."""
    with ToolCache(_existing(directory)) as cache:
        return cache.clear()
