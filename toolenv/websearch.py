"""Optional web-search backend for the search tool: a Serper-style SERP API.

``POST {endpoint}`` with header ``X-API-KEY`` and ``{"q": query, "num": k}`` returns
``{"organic": [{"title", "link", "snippet"}, ...]}``. The ARPO authors searched Bing
through a paid SERP API; this speaks the most common such shape. Results are shown
exactly like the local retriever's (``Doc i(Title: ...) snippet``), so a policy trained
on one reads the other.

The API key comes from an environment variable named at construction and is never
written to logs, reprs, error texts or results: any text that leaves this module is
scrubbed of it.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import Mapping

import aiohttp

from toolenv.base import ToolResult
from toolenv.search import SessionHolder, format_passages, http_error

SERPER_ENDPOINT = "https://google.serper.dev/search"


def organic_passages(payload: object) -> list[tuple[str, str]]:
    """(title, snippet) pairs of a SERP reply; TypeError on any other shape."""
    if not isinstance(payload, Mapping):
        raise TypeError("reply is not a JSON object")
    organic = payload.get("organic", [])
    if not isinstance(organic, list):
        raise TypeError("'organic' is not a list")
    out = []
    for item in organic:
        if not isinstance(item, Mapping):
            raise TypeError("an 'organic' entry is not an object")
        out.append((str(item.get("title", "")).strip(), str(item.get("snippet", "")).strip()))
    return out


class WebSearchTool:
    """``<search>query</search>`` against a SERP API; same name as the retriever tool,
    so the configuration chooses one or the other."""

    name = "search"

    def __init__(
        self,
        endpoint: str = SERPER_ENDPOINT,
        topk: int = 3,
        snippet_chars: int = 200,
        api_key_env: str = "SERPER_API_KEY",
        session_timeout_s: float = 10,
    ):
        key = os.environ.get(api_key_env, "").strip()
        if not key:
            raise ValueError(f"web search: environment variable {api_key_env} is not set")
        if topk < 1:
            raise ValueError(f"web search: topk must be >= 1, got {topk}")
        self._key = key
        self.endpoint, self.topk, self.snippet_chars = endpoint, topk, snippet_chars
        self.api_key_env = api_key_env
        # Web results change over time; the cache TTL (tools.cache_ttl_s) bounds staleness.
        self.version = f"serp-1:k={topk}:chars={snippet_chars}:{endpoint}"
        self._sessions = SessionHolder(session_timeout_s)

    def __repr__(self) -> str:
        return (f"WebSearchTool(endpoint={self.endpoint!r}, topk={self.topk}, "
                f"api_key_env={self.api_key_env!r})")

    def _scrub(self, text: str) -> str:
        return text.replace(self._key, "***")

    def _fail(self, msg: str, kind: str, latency: float, transient: bool) -> ToolResult:
        return ToolResult(f"Error: {self._scrub(msg)}", False, latency, error=kind,
                          transient=transient)

    async def call(self, args: str) -> ToolResult:
        query = args.strip()
        if not query:
            return ToolResult("Error: empty search query", False, error="empty_query")
        headers = {"X-API-KEY": self._key, "Content-Type": "application/json"}
        start = time.monotonic()
        try:
            session = self._sessions.get()
            async with session.post(self.endpoint, json={"q": query, "num": self.topk},
                                    headers=headers) as resp:
                if resp.status != 200:  # report the status only: bodies may echo the key
                    return http_error(resp.status, "web search", time.monotonic() - start)
                raw = await resp.read()
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
            return self._fail(f"web search unreachable: {type(exc).__name__}: {exc}",
                              "connection", time.monotonic() - start, transient=True)
        latency = time.monotonic() - start
        try:
            passages = organic_passages(json.loads(raw))
        except (ValueError, TypeError) as exc:  # bad JSON, bad shape, bad UTF-8
            return self._fail(f"web search sent a malformed reply: {exc}", "malformed_reply",
                              latency, transient=False)
        text = format_passages(passages[: self.topk], self.snippet_chars)
        return ToolResult(self._scrub(text), True, latency)

    async def close(self) -> None:
        await self._sessions.close()
