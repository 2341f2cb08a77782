"""Search tool: an aiohttp client for a Search-R1 style retriever service.

Request: ``POST {url}`` with ``{"queries": [q], "topk": k, "return_scores": true}``.
Response: ``{"result": [[{"document": {"id", "contents"}, "score"}, ...]]}``, or with bare
documents when scores are off; ``contents`` is ``"Title\\ntext"``. Results are shown to
the model the way Search-R1 and the ARPO retriever setups did: one line per passage,
``Doc 1(Title: ...) text``, each text cut to ``snippet_chars``.

Errors come back as ``ToolResult(ok=False)``: HTTP 429, 5xx, timeouts and connection
failures are transient (the runner may retry), other 4xx and malformed replies are not.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import Iterable, Mapping
from pathlib import Path

import aiohttp

from toolenv.base import ToolResult

_WS_RE = re.compile(r"\s+")

NO_RESULTS = "No search results found."


def split_contents(contents: str) -> tuple[str, str]:
    """``"Title\\ntext"`` -> (title, text); wiki-18 quotes its titles, so quotes go."""
    title, _, text = contents.strip().partition("\n")
    return title.strip().strip('"').strip(), text.strip()


def format_passages(passages: Iterable[tuple[str, str]], snippet_chars: int) -> str:
    """Number (title, text) pairs as ``Doc i(Title: t) text``, one per line, each text
    cut to ``snippet_chars`` (with ``...``); duplicate texts are shown once."""
    lines, seen = [], set()
    for title, text in passages:
        text = " ".join(text.split())
        if not text and not title:
            continue
        key = text or title
        if key in seen:
            continue
        seen.add(key)
        if snippet_chars > 0 and len(text) > snippet_chars:
            text = text[:snippet_chars].rstrip() + "..."
        lines.append(f"Doc {len(lines) + 1}(Title: {title}) {text}".rstrip())
    return "\n".join(lines) if lines else NO_RESULTS


def passages_from_response(payload: object) -> list[tuple[str, str]]:
    """(title, text) of every document for the first query of a /retrieve response.
    Accepts ``[[{"document": doc, "score": s}]]`` and ``[[doc]]``; a doc has
    ``contents`` or ``title``/``text``. Raises TypeError on any other shape."""
    if not isinstance(payload, Mapping) or not isinstance(payload.get("result"), list):
        raise TypeError("response has no 'result' list")
    result = payload["result"]
    if not result:
        return []
    if not isinstance(result[0], list):
        raise TypeError("'result' must be a list of lists (one per query)")
    out = []
    for item in result[0]:
        doc = item.get("document", item) if isinstance(item, Mapping) else None
        if not isinstance(doc, Mapping):
            raise TypeError("each result must be a document object")
        if isinstance(doc.get("contents"), str):
            out.append(split_contents(doc["contents"]))
        elif isinstance(doc.get("text"), str):
            out.append((str(doc.get("title", "")).strip(), doc["text"].strip()))
        else:
            raise TypeError("document has neither 'contents' nor 'text'")
    return out


def http_error(status: int, what: str, latency: float) -> ToolResult:
    """ToolResult for an HTTP error status: 429 and 5xx are transient."""
    transient = status == 429 or status >= 500
    return ToolResult(f"Error: {what} returned HTTP {status}", False, latency,
                      error=f"http_{status}", transient=transient)


class SessionHolder:
    """One aiohttp session per tool, created lazily inside the running loop (a session
    is bound to the loop that made it; a new loop gets a new session)."""

    def __init__(self, timeout_s: float):
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._session: aiohttp.ClientSession | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def get(self) -> aiohttp.ClientSession:
        loop = asyncio.get_running_loop()
        if self._session is None or self._session.closed or self._loop is not loop:
            self._session = aiohttp.ClientSession(timeout=self._timeout)
            self._loop = loop
        return self._session

    async def close(self) -> None:
        # A session of another (finished) loop cannot be closed from this one.
        session, same_loop = self._session, self._loop is asyncio.get_running_loop()
        if session is not None and not session.closed and same_loop:
            await session.close()
        self._session, self._loop = None, None


class SearchTool:
    """``<search>query</search>`` against a retriever at ``url`` (POST /retrieve)."""

    name = "search"
    description = "Search the documents and return the best-matching snippets."
    parameters = {"type": "object", "required": ["query"], "properties": {
        "query": {"type": "string", "description": "what to look for"}}}

    @staticmethod
    def canonical(args: str) -> str:
        """The cache key's form of a query: whitespace runs collapsed to one space,
        stripped, lower-cased (retrievers and web search ignore case and spacing)."""
        return _WS_RE.sub(" ", args).strip().lower()

    @classmethod
    def from_config(cls, cfg, run_dir: str | Path, cache_dir: str | Path) -> SearchTool:
        """The tool of a ``tools`` section (its ``search`` section)."""
        s = cfg.search
        return cls(s.retriever_url, topk=s.topk, snippet_chars=s.snippet_chars)

    def __init__(
        self, url: str, topk: int = 3, snippet_chars: int = 200, session_timeout_s: float = 10
    ):
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"search: retriever url must be http(s)://..., got {url!r}")
        if topk < 1:
            raise ValueError(f"search: topk must be >= 1, got {topk}")
        self.url, self.topk, self.snippet_chars = url, topk, snippet_chars
        # The cache key includes the version: results depend on k, length and corpus.
        self.version = f"retriever-1:k={topk}:chars={snippet_chars}:{url}"
        self._sessions = SessionHolder(session_timeout_s)

    def __repr__(self) -> str:
        return f"SearchTool(url={self.url!r}, topk={self.topk}, snippet_chars={self.snippet_chars})"

    async def call(self, args: str) -> ToolResult:
        query = args.strip()
        if not query:
            return ToolResult("Error: empty search query", False, error="empty_query")
        body = {"queries": [query], "topk": self.topk, "return_scores": True}
        start = time.monotonic()
        try:
            async with self._sessions.get().post(self.url, json=body) as resp:
                if resp.status != 200:
                    return http_error(resp.status, "retriever", time.monotonic() - start)
                raw = await resp.read()
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
            msg = f"Error: retriever unreachable: {type(exc).__name__}: {exc}"
            return ToolResult(msg, False, time.monotonic() - start, error="connection",
                              transient=True)
        latency = time.monotonic() - start
        try:
            passages = passages_from_response(json.loads(raw))
        except (ValueError, TypeError) as exc:  # bad JSON, bad shape, bad UTF-8
            msg = f"Error: retriever sent a malformed reply: {exc}"
            return ToolResult(msg, False, latency, error="malformed_reply")
        return ToolResult(format_passages(passages[: self.topk], self.snippet_chars), True, latency)

    async def close(self) -> None:
        await self._sessions.close()
