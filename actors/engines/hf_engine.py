"""A generation engine on plain transformers, for machines without vLLM.

A manual sampling loop over the model's KV cache, so each token's behaviour log-prob and
its top-k log-probs come from exactly the distribution it was drawn from: log_softmax of
logits / temperature after top-p filtering (the same rule and the same top-p cut as
vLLM's sampler, and the same convention for greedy decoding, temperature 0: the
temperature-1 distribution). Requests run one at a time in a worker thread
(``asyncio.to_thread``) under a lock, so the event loop stays free; concurrent requests
queue. Slow next to vLLM, but exact and dependency-free: the reference the vLLM engine
is tested against. In ``interrupt`` mode a weight update stops a request between two
decode steps; it resumes from prompt + its tokens under the new weights.
"""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from actors.engines.base import (
    GenRequest,
    GenResult,
    WeightGate,
    check_weight_names,
    torch_state_dict,
)
from arpo_async.core.logits import causal_lm_logprobs

GREEDY_EPS = 1e-5  # temperatures below this decode greedily (vLLM's _SAMPLING_EPS)


def sampling_logprobs(logits: Any, temperature: float, top_p: float) -> Any:
    """Log-probs of the distribution a token is drawn from: ``logits`` [..., V] scaled by
    temperature, then top-p filtered (-inf outside the nucleus), as vLLM's sampler does."""
    logits = logits.float()
    if temperature < GREEDY_EPS:
        return torch.log_softmax(logits, dim=-1)
    z = logits / temperature
    if top_p < 1.0:
        # vLLM's apply_top_k_top_p: drop the low tail whose cumulative mass <= 1 - p,
        # always keeping the most likely token.
        z_sorted, idx = z.sort(dim=-1, descending=False)
        cum = z_sorted.softmax(dim=-1).cumsum(dim=-1)
        drop = cum <= 1 - top_p
        drop[..., -1] = False
        z = z.scatter(-1, idx, z_sorted.masked_fill(drop, float("-inf")))
    return torch.log_softmax(z, dim=-1)


def nats(logprobs: Any) -> float:
    """Exact entropy (nats) of one distribution given as log-probs (-inf entries, tokens
    that top-p removed, contribute nothing)."""
    p = logprobs.exp()
    return float(-torch.where(p > 0, p * logprobs, torch.zeros_like(p)).sum())


class HFEngine:
    """``GenerationEngine`` over a transformers causal LM; build it with ``await create``."""

    def __init__(self, model: Any, tokenizer: Any, seed: int, version: int, max_model_len: int,
                 update_mode: str = "drain"):
        self._model = model
        self.tokenizer = tokenizer  # the actor's too
        self._generator = torch.Generator().manual_seed(seed)
        self.version = version
        self.max_model_len = max_model_len
        eos = model.generation_config.eos_token_id
        if eos is None:
            eos = model.config.eos_token_id
        self._eos = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        self._gate = WeightGate(update_mode, ("drain", "interrupt"))  # keep: vLLM only
        self._compute = asyncio.Lock()  # one request on the model at a time
        self.interrupted_calls = 0
        self.last_update: dict[str, float] = {}

    @classmethod
    async def create(cls, model_path: str | Path, dtype: str = "float32", seed: int = 0,
                     threads: int = 1, version: int = 0, max_model_len: int = 2048,
                     update_mode: str = "drain") -> HFEngine:
        torch.set_num_threads(threads)

        def load():
            model = AutoModelForCausalLM.from_pretrained(str(model_path),
                                                         dtype=getattr(torch, dtype))
            return model.eval(), AutoTokenizer.from_pretrained(str(model_path))

        model, tokenizer = await asyncio.to_thread(load)
        return cls(model, tokenizer, seed, version, max_model_len, update_mode)

    # ------------------------------------------------------------------ generation
    def _stopped(self, req: GenRequest, tokens: list[int]) -> tuple[bool, str | int | None]:
        """Whether the newest of the round's ``tokens`` ends it (checked after every token,
        so a stop string found in the tail is one the newest token completed)."""
        tok = tokens[-1]
        if tok in req.stop_token_ids:
            return True, tok
        if tok in self._eos and not req.ignore_eos:
            return True, None
        if req.stop:
            # Decode a short tail only: a stop string is a few tokens at most. The round's
            # tokens before an interruption count too.
            tail = self.tokenizer.decode(tokens[-16:], skip_special_tokens=False)
            for s in req.stop:
                if s in tail:
                    return True, s
        return False, None

    def _generate_sync(self, req: GenRequest, done: list[int], stop: threading.Event
                       ) -> GenResult:
        """Tokens after ``req.prompt_tokens + done`` until the round ends, the token
        budget is spent or ``stop`` is set (finish_reason "abort")."""
        gen = (torch.Generator().manual_seed(req.seed + len(done)) if req.seed is not None
               else self._generator)
        prompt = list(req.prompt_tokens) + done
        limit = min(req.max_tokens - len(done), self.max_model_len - len(prompt))
        tokens, logprobs, tops, ents = [], [], [], []
        finish, reason = "length", None
        with torch.inference_mode():
            # the prefill's logits of the last position only: [1, 1, V], not [1, L, V]
            out = self._model(torch.tensor([prompt]), use_cache=True, logits_to_keep=1)
            for _ in range(max(0, limit)):
                if stop.is_set():
                    finish = "abort"
                    break
                lp = sampling_logprobs(out.logits[0, -1], req.temperature, req.top_p)
                if req.temperature < GREEDY_EPS:
                    tok = int(lp.argmax())
                else:
                    tok = int(torch.multinomial(lp.exp(), 1, generator=gen))
                tokens.append(tok)
                logprobs.append(float(lp[tok]))
                in_window = req.topk_window <= 0 or len(done) + len(tokens) <= req.topk_window
                k = min(max(req.logprobs_topk, 0), lp.shape[-1]) if in_window else 0
                top = lp.topk(k).values.tolist() if k else []
                tops.append([v for v in top if v != float("-inf")])
                if req.entropy:
                    ents.append(nats(lp) if in_window else float("nan"))
                ended, reason = self._stopped(req, done + tokens)
                if ended:
                    finish = "stop"
                    break
                out = self._model(torch.tensor([[tok]]), past_key_values=out.past_key_values,
                                  use_cache=True)
        return GenResult(tokens=tokens, logprobs=logprobs, top_logprobs=tops,
                         finish_reason=finish, stop_reason=reason, version=self.version,
                         entropies=ents)

    async def generate(self, req: GenRequest) -> GenResult:
        if not req.prompt_tokens:
            raise ValueError("prompt_tokens is empty")
        if len(req.prompt_tokens) >= self.max_model_len:
            raise ValueError(f"prompt of {len(req.prompt_tokens)} tokens leaves no room under "
                             f"model.max_model_len={self.max_model_len}")
        tokens, logprobs, tops, versions, ents, interruptions = [], [], [], [], [], 0
        while True:
            stop = threading.Event()
            async with self._gate.call(stop=stop.set), self._compute:
                version = self.version
                part = await asyncio.to_thread(self._generate_sync, req, tokens, stop)
            tokens += part.tokens
            logprobs += part.logprobs
            tops += part.top_logprobs
            ents += part.entropies
            versions += [version] * len(part.tokens)
            if part.finish_reason != "abort":
                break
            interruptions += 1  # a weight update stopped it: resume under the new weights
        self.interrupted_calls += bool(interruptions)
        return GenResult(tokens=tokens, logprobs=logprobs, top_logprobs=tops,
                         finish_reason=part.finish_reason, stop_reason=part.stop_reason,
                         version=version, versions=versions, interruptions=interruptions,
                         entropies=ents)

    def _sequence_sync(self, prompt_tokens: list[int], tokens: list[int]) -> list[float]:
        ids = torch.tensor([list(prompt_tokens) + list(tokens)])
        select = torch.zeros(1, ids.shape[1] - 1, dtype=torch.bool)
        select[0, len(prompt_tokens) - 1:] = True  # the positions that predict ``tokens``
        with torch.inference_mode():
            return causal_lm_logprobs(self._model, ids, select).logp.tolist()

    async def sequence_logprobs(self, prompt_tokens: list[int], tokens: list[int]) -> list[float]:
        if not prompt_tokens:
            raise ValueError("prompt_tokens is empty: the first token has no log-prob")
        if not tokens:
            return []
        async with self._gate.call(), self._compute:
            return await asyncio.to_thread(self._sequence_sync, prompt_tokens, tokens)

    # ------------------------------------------------------------------ weights
    def _load_sync(self, state: dict) -> None:
        self._model.load_state_dict(state, strict=False)

    async def update_weights(self, tensors: dict[str, Any], version: int) -> float:
        """Full weights in place at a safe point; returns seconds new calls were held."""
        t0 = time.perf_counter()
        state = torch_state_dict(tensors, self._model.dtype)
        expected = {k: tuple(v.shape) for k, v in self._model.state_dict().items()}
        tied = ["lm_head.weight"] if self._model.config.tie_word_embeddings else []
        check_weight_names({k: v.shape for k, v in state.items()}, expected, optional=tied)
        convert_s = time.perf_counter() - t0
        async with self._gate.exclusive() as drain_s:
            t1 = time.perf_counter()
            async with self._compute:
                await asyncio.to_thread(self._load_sync, state)
            self.version = version
            load_s = time.perf_counter() - t1
        self.last_update = {"convert_s": convert_s, "drain_s": drain_s, "load_s": load_s,
                            "paused_s": drain_s + load_s, "tensors": float(len(state))}
        return drain_s + load_s

    async def close(self) -> None:
        self._model = None
