"""The tool protocol: what a tool is and what one call returns.

A tool is anything with a ``name``, a ``version`` and an async ``call(args)`` returning a
``ToolResult``. Every call goes through ``toolenv.runner.ToolRunner`` (cache, rate limit,
concurrency limit, timeout, retries, metrics); ``toolenv.runner.build_tools`` wires the
tools listed in ``tools.enabled``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


@dataclass
class ToolResult:
    text: str  # what goes between <result>...</result>
    ok: bool  # False on error/timeout
    latency_s: float = 0.0
    cached: bool = False
    error: str = ""  # short error kind: "timeout", "http_503", "sandbox", ...
    transient: bool = False  # worth retrying (HTTP 5xx/429, connection reset); never timeouts


class Tool(Protocol):
    name: str  # "python", "search"
    version: str  # bump when results would change; part of the cache key

    async def call(self, args: str) -> ToolResult: ...

    async def close(self) -> None: ...
