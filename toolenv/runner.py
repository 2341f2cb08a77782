"""The runner every tool call goes through, and the factory that wires the tools.

``ToolRunner.call`` wraps a tool (toolenv/base.py), in this order: shared cache lookup ->
rate limit (asyncio-throttle) -> concurrency semaphore -> wall-clock timeout
(``asyncio.wait_for``, so it fires even when the tool hangs) -> retries with exponential
backoff for transient errors only -> the result cap (``tools.max_result_chars``: every
tool's text, error or not, is cut there with a marker and counted as ``truncated``) ->
cache store of successful results. Errors and timeouts are never cached, and a timeout is
never retried (a snippet that ran out of time once will do so again). A cached result is
capped again when read (an entry from a run with a larger cap).

``build_tools`` wires the tools listed in ``ToolsConfig.enabled``, the classes named in
``ToolsConfig.custom`` and the tools of the ``ToolsConfig.mcp`` servers (toolenv/
mcp_tools.py): a custom or MCP tool gets exactly this runner, its calls counted per tool
like the built-in ones. A call that cannot run (a Hermes call whose JSON does not parse,
names no known tool, or has arguments its schema rejects) is answered by ``reject``:
counted as a call and an error, never executed.

Stateful tools (``python`` with ``tools.python.state=session``; toolenv/base.py) keep a
session per trajectory: ``open_state`` gives a trajectory its ``ToolState`` (one session
per stateful tool), ``ToolState.fork`` copies it at a branch point and ``close`` ends it.
A call with a state is keyed in the cache by the session's digest as well (a result is
never served to a different state), and a hit moves the session on as if the call had run
(``advance``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from pathlib import Path
from typing import TYPE_CHECKING, Any

from asyncio_throttle import Throttler

from arpo_async.core.config import ConfigError
from toolenv.base import Tool, ToolResult, canonical, cap_text
from toolenv.cache import ToolCache
from toolenv.mcp_tools import mcp_tools
from toolenv.builtin import builtin_class
from toolenv.tool_classes import load_tool_class

if TYPE_CHECKING:
    from arpo_async.core.config import ToolsConfig
    from toolenv.cache import ToolCache

log = logging.getLogger(__name__)

_LATENCY_WINDOW = 10_000  # latencies kept for the percentiles (the mean is exact)
_PER_TOOL = ("calls", "cache_hits", "errors", "timeouts", "truncated")


def _throttler(rate_per_s: float) -> Throttler | None:
    """asyncio-throttle counts whole calls per period, so rates below 1/s widen the period."""
    if rate_per_s <= 0:
        return None  # 0 means no rate limit
    calls = max(1, round(rate_per_s))
    return Throttler(rate_limit=calls, period=calls / rate_per_s)


def _percentile(sorted_values: list[float], q: float) -> float:
    if not sorted_values:
        return 0.0
    index = min(len(sorted_values) - 1, int(q * len(sorted_values)))
    return sorted_values[index]


class ToolState:
    """One trajectory's sessions in the stateful tools, by tool name."""

    def __init__(self, sessions: dict[str, Any]):
        self.sessions = sessions

    def histories(self) -> dict[str, list[str]]:
        """Each session's history (the code of its kept calls, in order), where it keeps one."""
        return {name: list(s.history) for name, s in self.sessions.items()
                if isinstance(getattr(s, "history", None), list)}

    async def fork(self) -> ToolState:
        """A copy for a branch: each session's state now (the branch's own from here on)."""
        return ToolState({name: await s.fork() for name, s in self.sessions.items()})

    def close(self, reason: str = "finished") -> None:
        """The trajectory ended (``finished``) or was cancelled or failed (``dropped``)."""
        for session in self.sessions.values():
            session.close(reason)


class ToolRunner:
    """Every tool call goes through here (see the module docstring for the order)."""

    def __init__(self, tools: dict[str, Tool], cache: ToolCache | None, rate_per_s: float,
                 concurrency: int, timeout_s: float, retries: int, backoff_s: float = 0.1,
                 max_result_chars: int = 8192):
        if (concurrency < 1 or timeout_s <= 0 or retries < 0 or backoff_s < 0
                or max_result_chars < 1):
            raise ValueError(f"ToolRunner: need concurrency >= 1, timeout_s > 0, retries >= 0, "
                             f"backoff_s >= 0, max_result_chars >= 1; got {concurrency}, "
                             f"{timeout_s}, {retries}, {backoff_s}, {max_result_chars}")
        self.tools, self.cache = dict(tools), cache
        self.max_result_chars = max_result_chars
        self.timeout_s, self.retries, self.backoff_s = timeout_s, retries, backoff_s
        self._throttle = _throttler(rate_per_s)
        self._slots = asyncio.Semaphore(concurrency)
        self._counts = dict.fromkeys(
            ("calls", "executed", "cache_hits", "cache_misses", "errors", "timeouts", "retries",
             "invalid_calls", "cache_lookup_errors", "cache_store_errors", "truncated"), 0)
        self._latency_sum = 0.0
        self._latencies: deque[float] = deque(maxlen=_LATENCY_WINDOW)
        self._per_tool: dict[str, dict[str, float]] = {}

    def open_state(self) -> ToolState | None:
        """A new trajectory's sessions; None when no tool keeps state (the default)."""
        stateful = {name: tool for name, tool in self.tools.items()
                    if getattr(tool, "stateful", False)}
        if not stateful:
            return None
        return ToolState({name: tool.open_session() for name, tool in stateful.items()})

    def restore_state(self, histories: dict[str, list[str]]) -> ToolState | None:
        """A trajectory's sessions as an earlier incarnation of the actor left them
        (``ToolState.histories``): each stateful tool with ``restore_session`` rebuilds its
        history at the next call; one without it, or without a history, starts fresh."""
        stateful = {name: tool for name, tool in self.tools.items()
                    if getattr(tool, "stateful", False)}
        if not stateful:
            return None
        return ToolState({
            name: tool.restore_session(list(histories[name]))
            if name in histories and hasattr(tool, "restore_session") else tool.open_session()
            for name, tool in stateful.items()})

    async def call(self, name: str, args: str, state: ToolState | None = None) -> ToolResult:
        """Run one tool call (in the trajectory's ``state`` when the tool keeps one);
        failures come back as ``ok=False`` results, never raised."""
        start = time.perf_counter()
        tool = self.tools.get(name)
        session = state.sessions.get(name) if state is not None else None
        if tool is None:
            known = ", ".join(sorted(self.tools)) or "none"
            result = ToolResult(f"unknown tool {name!r} (available: {known})", ok=False,
                                error="unknown_tool")
        else:
            digest = session.digest if session is not None else ""
            result = self._lookup(tool, args, digest)
            if result is not None and session is not None:
                session.advance(args)
            if result is None:
                result = self._cap(await self._execute(tool, args, session))
                self._store(tool, args, result, digest)
        result.latency_s = time.perf_counter() - start
        self._count(name, result)
        return result

    def reject(self, name: str, message: str) -> ToolResult:
        """Answer a call that cannot run (its ``message`` is what the model reads): counted
        as a call, an error and an invalid call of ``name`` (of "invalid" when it names no
        known tool: the model's made-up names never become metric keys), never executed."""
        result = ToolResult(message, ok=False, error="invalid_call")
        self._counts["invalid_calls"] += 1
        self._count(name if name in self.tools else "invalid", result)
        return result

    def _lookup(self, tool: Tool, args: str, state: str) -> ToolResult | None:
        if self.cache is None:
            return None
        try:
            text = self.cache.get(tool.name, tool.version, canonical(tool, args), state)
        except Exception:  # a locked or damaged cache costs a lookup, not the call
            self._counts["cache_lookup_errors"] += 1
            log.exception("tool cache lookup failed for %s", tool.name)
            text = None
        if text is None:
            self._counts["cache_misses"] += 1
            return None
        self._counts["cache_hits"] += 1
        return ToolResult(cap_text(text, self.max_result_chars)[0], ok=True, cached=True)

    def _cap(self, result: ToolResult) -> ToolResult:
        """The result cut to ``max_result_chars`` (before it is cached or read)."""
        result.text, cut = cap_text(result.text, self.max_result_chars)
        result.truncated = result.truncated or cut
        return result

    async def _execute(self, tool: Tool, args: str, session: Any) -> ToolResult:
        self._counts["executed"] += 1
        attempt = 0
        while True:
            result = await self._attempt(tool, args, session)
            if result.ok or not result.transient or attempt >= self.retries:
                return result
            await asyncio.sleep(self.backoff_s * 2**attempt)
            attempt += 1
            self._counts["retries"] += 1

    async def _attempt(self, tool: Tool, args: str, session: Any) -> ToolResult:
        if self._throttle is not None:
            async with self._throttle:
                pass  # only the start of a call is rate limited, not its duration
        async with self._slots:
            try:
                call = tool.call(args) if session is None else tool.call_in(session, args)
                return await asyncio.wait_for(call, self.timeout_s)
            except asyncio.TimeoutError:
                return ToolResult(f"TimeoutError: {tool.name} call exceeded the "
                                  f"{self.timeout_s:g} s time limit", ok=False, error="timeout")
            except ConnectionError as exc:  # resets and refusals: worth another try
                return ToolResult(f"{type(exc).__name__}: {exc}", ok=False,
                                  error="connection", transient=True)
            except Exception as exc:  # a tool bug must not kill the rollout that called it
                log.exception("tool %s raised", tool.name)
                return ToolResult(f"{type(exc).__name__}: {exc}", ok=False,
                                  error=f"raised:{type(exc).__name__}")

    def _store(self, tool: Tool, args: str, result: ToolResult, state: str) -> None:
        if self.cache is None or not result.ok:
            return
        try:
            self.cache.set(tool.name, tool.version, canonical(tool, args), result.text,
                           state=state)
        except Exception:  # a full disk costs the cache entry, not the call
            self._counts["cache_store_errors"] += 1
            log.exception("tool cache store failed for %s", tool.name)

    def _count(self, name: str, result: ToolResult) -> None:
        per = self._per_tool.setdefault(name, {**dict.fromkeys(_PER_TOOL, 0), "latency_sum": 0.0})
        updates = {"calls": 1, "cache_hits": int(result.cached), "errors": int(not result.ok),
                   "timeouts": int(result.error == "timeout"),
                   "truncated": int(result.truncated and not result.cached)}
        for key, value in updates.items():
            per[key] += value
            if key != "cache_hits":  # counted at lookup time
                self._counts[key] += value
        per["latency_sum"] += result.latency_s
        self._latency_sum += result.latency_s
        self._latencies.append(result.latency_s)

    def stats(self) -> dict[str, float]:
        """Counters, overall and per tool as ``"<tool>.<counter>"``.

        calls: every call; executed: calls that ran the tool (cache hits did not; retries
        are counted apart in retries); cache_hits/cache_misses: lookups; errors: calls
        whose final result was not ok (timeouts, unknown tools and invalid calls
        included); invalid_calls: calls answered by ``reject``; timeouts; truncated:
        results cut at ``max_result_chars`` (or refused as too large by the tool itself);
        cache_lookup_errors/cache_store_errors: cache failures that cost only the cache.
        Latency is in seconds, end to end as the caller saw it (throttling and retries
        included); percentiles over the last 10,000 calls, the mean over all. A tool with
        a ``stats()`` method adds its own as ``"<tool>.<key>"`` (``PythonTool.stats``).
        """
        out: dict[str, float] = dict(self._counts)
        ordered = sorted(self._latencies)
        out["latency_mean_s"] = self._latency_sum / out["calls"] if out["calls"] else 0.0
        out["latency_p50_s"] = _percentile(ordered, 0.5)
        out["latency_p99_s"] = _percentile(ordered, 0.99)
        for name, per in self._per_tool.items():
            for key in _PER_TOOL:
                out[f"{name}.{key}"] = per[key]
            out[f"{name}.latency_mean_s"] = per["latency_sum"] / per["calls"]
        for name, tool in self.tools.items():  # a tool's own figures (python: its pool)
            if callable(getattr(tool, "stats", None)):
                out |= {f"{name}.{key}": value for key, value in tool.stats().items()}
        return out

    async def close(self) -> None:
        for tool in self.tools.values():
            if callable(getattr(tool, "close", None)):  # optional for custom tools
                await tool.close()
        if self.cache is not None:
            self.cache.close()


def build_tools(cfg: ToolsConfig, run_dir: str | Path) -> ToolRunner:
    """The runner for ``cfg.enabled`` (each built-in tool from its ``from_config``:
    toolenv/builtin.py) and ``cfg.custom`` with the shared cache and the configured
    limits. A custom class is constructed without arguments; one that fails raises
    ConfigError naming the key and the path."""
    cache_dir = Path(cfg.cache_dir) if cfg.cache_dir else Path(run_dir) / "tool_cache"
    classes = [builtin_class(name) for name in cfg.enabled]  # an unknown name: nothing made
    cache = ToolCache(cache_dir, ttl_s=cfg.cache_ttl_s)
    tools: dict[str, Tool] = {cls.name: cls.from_config(cfg, run_dir, cache_dir)
                              for cls in classes}
    try:
        tools |= custom_tools(cfg)
        if cfg.mcp:
            tools |= mcp_tools(cfg, taken=set(tools))
    except ConfigError:
        cache.close()
        raise
    return ToolRunner(tools, cache, rate_per_s=cfg.rate_per_s, concurrency=cfg.concurrency,
                      timeout_s=cfg.timeout_s, retries=cfg.retries,
                      max_result_chars=cfg.max_result_chars)


def custom_tools(cfg: ToolsConfig) -> dict[str, Tool]:
    """Instances of the ``tools.custom`` classes by name (the config checked the classes)."""
    out: dict[str, Tool] = {}
    for i, path in enumerate(cfg.custom):
        cls = load_tool_class(path)
        try:
            out[cls.name] = cls()
        except Exception as exc:  # the user's constructor: one line, not a traceback
            raise ConfigError(f"tools.custom[{i}]={path}: constructing {cls.__name__}() failed "
                              f"({type(exc).__name__}: {exc})") from None
    return out
