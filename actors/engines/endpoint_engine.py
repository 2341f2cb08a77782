"""A generation engine over an OpenAI-compatible completions endpoint (``vllm serve``,
SGLang, ...), so a model served elsewhere is evaluated through the same rollout code.

Token in, token out where the server allows it: the prompt goes as token ids, and the
vLLM extensions ``return_tokens_as_token_ids``, ``stop_token_ids``,
``include_stop_str_in_output`` and ``skip_special_tokens=false`` are requested, so the
reply's ``logprobs.tokens`` are ``"token_id:N"`` strings and the ids come back exact.
A server that ignores them returns token *text*; the ids are then recovered by encoding
the completion text with the local tokenizer (inexact: ``exact_tokens`` turns False and
a warning is logged once), with log-probs kept only when the counts agree.

The endpoint serves fixed weights: ``update_weights`` refuses.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

import aiohttp

from actors.engines.base import GenRequest, GenResult

log = logging.getLogger(__name__)

_ID_PREFIX = "token_id:"


class EndpointError(RuntimeError):
    """The endpoint answered with an error status or a reply of the wrong shape."""


def _ids_from_tokens(tokens: list[Any]) -> list[int] | None:
    """Ids from vLLM's ``token_id:N`` strings; None when the reply holds plain text."""
    out = []
    for tok in tokens:
        if not isinstance(tok, str) or not tok.startswith(_ID_PREFIX):
            return None
        out.append(int(tok[len(_ID_PREFIX):]))
    return out


def _top(entry: Any, k: int) -> list[float]:
    if not isinstance(entry, dict):
        return []
    values = sorted((float(v) for v in entry.values()), reverse=True)[:k]
    return [v for v in values if v != float("-inf")]


class EndpointEngine:
    """``GenerationEngine`` over ``POST {base_url}/v1/completions``; build it with
    ``await EndpointEngine.create(url, tokenizer)``."""

    def __init__(self, base_url: str, model: str, tokenizer: Any, timeout_s: float = 600.0,
                 version: int = 0):
        self.base_url = base_url.rstrip("/")
        self.model = model
        self.tokenizer = tokenizer
        self.version = version
        self.exact_tokens = True
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._session: aiohttp.ClientSession | None = None

    @classmethod
    async def create(cls, base_url: str, tokenizer: Any, model: str | None = None,
                     timeout_s: float = 600.0) -> EndpointEngine:
        """Connect; without ``model`` the first id that ``GET /v1/models`` lists is used."""
        engine = cls(base_url, model or "", tokenizer, timeout_s)
        if not model:
            reply = await engine._request("GET", "/v1/models")
            try:
                engine.model = str(reply["data"][0]["id"])
            except (KeyError, IndexError, TypeError):
                await engine.close()
                raise EndpointError(f"{engine.base_url}/v1/models: no model listed") from None
        return engine

    async def _request(self, method: str, path: str, body: dict | None = None) -> dict:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(timeout=self._timeout)
        url = f"{self.base_url}{path}"
        try:
            async with self._session.request(method, url, json=body) as resp:
                text = await resp.text()
                if resp.status != 200:
                    raise EndpointError(f"{url}: HTTP {resp.status}: {text[:300]}")
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            raise EndpointError(f"{url}: {type(exc).__name__}: {exc}") from None
        try:
            return json.loads(text)
        except ValueError:
            raise EndpointError(f"{url}: reply is not JSON: {text[:300]!r}") from None

    def _body(self, req: GenRequest) -> dict:
        body = {
            "model": self.model, "prompt": list(req.prompt_tokens), "max_tokens": req.max_tokens,
            "temperature": req.temperature, "top_p": req.top_p,
            "logprobs": max(0, req.logprobs_topk),
            "stop_token_ids": list(req.stop_token_ids), "include_stop_str_in_output": True,
            "skip_special_tokens": False, "return_tokens_as_token_ids": True,
        }
        if req.stop:
            body["stop"] = list(req.stop)
        if req.seed is not None:
            body["seed"] = int(req.seed)
        return body

    async def generate(self, req: GenRequest) -> GenResult:
        if not req.prompt_tokens:
            raise ValueError("prompt_tokens is empty")
        reply = await self._request("POST", "/v1/completions", self._body(req))
        try:
            choice = reply["choices"][0]
            lp = choice.get("logprobs") or {}
            text = choice.get("text") or ""
            tokens = list(lp.get("tokens") or [])
            logprobs = [float(x) if x is not None else 0.0 for x in lp.get("token_logprobs") or []]
            tops = [_top(e, req.logprobs_topk) for e in lp.get("top_logprobs") or []]
        except (KeyError, IndexError, TypeError, ValueError, AttributeError) as exc:
            raise EndpointError(f"{self.base_url}: completion reply of the wrong shape: "
                                f"{type(exc).__name__}: {exc}") from None
        ids = _ids_from_tokens(tokens) if tokens else None
        if ids is None:
            ids = self._recover_ids(text)
            if len(ids) != len(logprobs):
                logprobs, tops = [0.0] * len(ids), [[] for _ in ids]
        if len(logprobs) != len(ids) or len(tops) not in (0, len(ids)):
            raise EndpointError(f"{self.base_url}: {len(ids)} tokens but {len(logprobs)} "
                                f"log-probs and {len(tops)} top-k entries")
        return GenResult(tokens=ids, logprobs=logprobs, top_logprobs=tops or [[] for _ in ids],
                         finish_reason=choice.get("finish_reason") or "abort",
                         stop_reason=choice.get("stop_reason"), version=self.version)

    def _recover_ids(self, text: str) -> list[int]:
        if self.exact_tokens:
            log.warning("%s does not return token ids (return_tokens_as_token_ids): "
                        "re-encoding completion text, token boundaries may differ",
                        self.base_url)
            self.exact_tokens = False
        return self.tokenizer.encode(text, add_special_tokens=False)

    async def sequence_logprobs(self, prompt_tokens: list[int], tokens: list[int]) -> list[float]:
        """Prompt log-probs by echo: ``echo=true`` returns one log-prob per prompt token."""
        if not tokens:
            return []
        body = {"model": self.model, "prompt": list(prompt_tokens) + list(tokens),
                "max_tokens": 1, "temperature": 0.0, "logprobs": 0, "echo": True,
                "return_tokens_as_token_ids": True}
        reply = await self._request("POST", "/v1/completions", body)
        try:
            values = reply["choices"][0]["logprobs"]["token_logprobs"]
        except (KeyError, IndexError, TypeError) as exc:
            raise EndpointError(f"{self.base_url}: echo reply without logprobs: {exc}") from None
        start = len(prompt_tokens)
        return [float(v) for v in values[start:start + len(tokens)]]

    async def update_weights(self, tensors: dict, version: int) -> float:
        raise NotImplementedError("an endpoint serves fixed weights; update them on the server")

    async def close(self) -> None:
        if self._session is not None and not self._session.closed:
            await self._session.close()
        self._session = None
