"""A generation engine without a model, for throughput experiments (``actors.engine=simulated``).

``SimulatedEngine`` implements the ``GenerationEngine`` protocol: it paces tokens with
``asyncio.sleep`` at ``tokens_per_s`` per sequence (its settings are the keys of
``actors.engine`` with ``type: simulated``; optionally capped for the whole engine), draws
them from a seeded generator, and returns plausible behaviour log-probs and top-k log-probs
whose tail-corrected entropy (the estimate the rollout uses) follows a configured profile:
``entropy`` for a first round, ``entropy_after_tool`` for a round that follows a tool
result. A round is free text (ordinary vocabulary tokens, never
a tag, brace or backslash) ending in a tool call of an enabled tool (``<python>print(3+4)
</python>``, ``<search>...</search>``, with the tokenizer's own tag ids), an answer
(``<answer>\\boxed{N}</answer>``) or end-of-sequence, so the real AgentRollout, tools,
scoring, transport and learner all run; the learner trains the real model on these ids
(all < vocabulary size). The log-probs are not the model's: importance ratios measured
against a simulated actor mean nothing, only their cost does.

Token distribution: token ranks follow p_i proportional to exp(-s i) over the V ranks (a
truncated geometric law), s chosen per token so that the normalised entropy is the target;
the top-k log-probs are the k best ranks and the sampled rank is drawn by inverse CDF.

``python -m actors.main --config RUN_DIR/config.yaml --actor-ids 0-63`` runs many
simulated actors in one process, each an asyncio task with its own engine, sockets and
actor id (the launcher does this when ``actors.engine.actors_per_process`` > 1): 64 processes that
each import torch would not fit a small machine.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import math
import re
import threading
import time
from dataclasses import dataclass

import numpy as np

from actors.engines.base import (
    GenRequest,
    GenResult,
    WeightGate,
    check_weight_names,
    checkpoint_shapes,
)

log = logging.getLogger("actor.sim")

_PLAIN = re.compile(r"[A-Za-z0-9 .,;:!?'()+*=-]+")  # free text that cannot form a tag or \boxed
_LEVELS = 401  # entropy table resolution


@dataclass(frozen=True)
class Vocab:
    """What the engine needs from the tokenizer, computed once per model folder."""

    size: int  # len(tokenizer): every id drawn is below it
    filler: np.ndarray  # ids of plain-text tokens
    eos: int | None
    tags: dict[str, tuple[int, ...]]  # "<python>" -> ids (one id for the tiny tokenizer)
    tool_result_end: tuple[int, ...]  # ids of "</result>"
    encode: object  # str -> list[int] (cached)
    tokenizer: object = None  # the model folder's tokenizer: the actor's too


_VOCAB_LOCK = threading.Lock()


def load_vocab(model_path: str) -> Vocab:
    """The model folder's ``Vocab``, made once per process: the simulated actors of one
    process (``actors_per_process``) start together, each in a worker thread, and must
    neither load the tokenizer 64 times nor import transformers from 64 threads at once
    (its lazy module then raises ImportError in some of them)."""
    with _VOCAB_LOCK:
        return _load_vocab(model_path)


@functools.lru_cache(maxsize=8)
def _load_vocab(model_path: str) -> Vocab:
    from transformers import AutoTokenizer  # transformers: heavy, not for --help

    tok = AutoTokenizer.from_pretrained(model_path)
    size = len(tok)
    reserved = set(tok.all_special_ids) | set(getattr(tok, "added_tokens_decoder", {}) or {})
    ids = [i for i in range(size) if i not in reserved]
    texts = tok.batch_decode([[i] for i in ids], skip_special_tokens=False)
    filler = np.array([i for i, t in zip(ids, texts) if _PLAIN.fullmatch(t)], dtype=np.int64)
    if filler.size < 16:
        raise ValueError(f"{model_path}: only {filler.size} plain-text tokens in the "
                         "vocabulary; the simulated engine needs at least 16")
    enc = functools.lru_cache(maxsize=4096)(
        lambda s: tuple(tok.encode(s, add_special_tokens=False)))
    tags = {t: enc(t) for t in ("<python>", "</python>", "<search>", "</search>",
                                "<answer>", "</answer>")}
    return Vocab(size, filler, tok.eos_token_id, tags, enc("</result>"), enc, tok)


class EntropyTable:
    """Rank law p_i ~ exp(-s min(i, k-1)) over V ranks: geometric over the top k, then a
    flat tail. Its tail is uniform, so the rollout's tail-corrected top-k estimate
    (``arpo_async.core.entropy``) recovers its entropy exactly. Tabulated over s and inverted."""

    def __init__(self, vocab_size: int, k: int):
        self.v, self.k = vocab_size, max(1, min(k, vocab_size))
        self.tail = self.v - self.k + 1  # ranks sharing the last level
        # s from 0 (uniform, H = 1) to 60 (all mass on rank 0); log-spaced in between.
        self.s = np.concatenate([[0.0], np.geomspace(1e-4, 60.0, _LEVELS - 1)])
        head = np.arange(self.k - 1, dtype=np.float64)
        w_head = np.exp(-self.s[:, None] * head[None, :])  # [levels, k-1]
        w_tail = self.tail * np.exp(-self.s * (self.k - 1))
        self.log_z = np.log(w_head.sum(1) + w_tail)
        logp_head = -self.s[:, None] * head[None, :] - self.log_z[:, None]
        logp_tail = -self.s * (self.k - 1) - self.log_z
        h = -(np.exp(logp_head) * logp_head).sum(1) - self.tail * np.exp(logp_tail) * logp_tail
        self.h = np.clip(h / math.log(self.v), 0.0, 1.0)  # decreasing in s

    def slope(self, h: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(s, log Z) per target entropy (np.interp needs increasing x: table reversed)."""
        h = np.clip(h, self.h[-1], self.h[0])
        s = np.interp(h, self.h[::-1], self.s[::-1])
        head = np.exp(-s[:, None] * np.arange(self.k - 1)[None, :]).sum(1)
        return s, np.log(head + self.tail * np.exp(-s * (self.k - 1)))

    def sample_ranks(self, s: np.ndarray, log_z: np.ndarray, rng: np.random.Generator
                     ) -> np.ndarray:
        """One rank per token: inverse CDF over the head, uniform inside the tail."""
        head = np.exp(-s[:, None] * np.arange(self.k - 1)[None, :] - log_z[:, None])
        u = rng.random(s.size)
        rank = (np.cumsum(head, axis=1) < u[:, None]).sum(1)  # k-1 means "in the tail"
        in_tail = rank == self.k - 1
        rank[in_tail] += rng.integers(0, self.tail, int(in_tail.sum()))
        return rank

    def logprobs(self, s: np.ndarray, log_z: np.ndarray, ranks: np.ndarray) -> np.ndarray:
        return -s * np.minimum(ranks, self.k - 1) - log_z

    def nats(self, s: np.ndarray, log_z: np.ndarray) -> np.ndarray:
        """Exact entropy (nats) of the law with slope ``s`` (the exact-entropy requests)."""
        logp_head = -s[:, None] * np.arange(self.k - 1)[None, :] - log_z[:, None]
        logp_tail = -s * (self.k - 1) - log_z
        return (-(np.exp(logp_head) * logp_head).sum(1)
                - self.tail * np.exp(logp_tail) * logp_tail)


class SimulatedEngine:
    """``GenerationEngine`` with no model; build it with ``await create(cfg, ...)``."""

    def __init__(self, sim, vocab: Vocab, tools: list[str], seed: int, version: int,
                 max_model_len: int, expected: dict[str, tuple] | None,
                 update_mode: str = "drain"):
        self.sim, self.vocab, self.tools = sim, vocab, list(tools)
        self.tokenizer = vocab.tokenizer
        self.seed, self.version, self.max_model_len = seed, version, max_model_len
        self._rng = np.random.default_rng([seed, 7])
        self._gate = WeightGate(update_mode, ("drain", "interrupt"))  # keep: vLLM only
        self._expected = expected
        self.tokens_generated = 0
        self.calls = 0
        self.interrupted_calls = 0
        self.last_update: dict[str, float] = {}

    @classmethod
    async def create(cls, cfg, model_path: str, seed: int, version: int = 0) -> SimulatedEngine:
        vocab = await asyncio.to_thread(load_vocab, str(model_path))
        return cls(cfg.actors.engine, vocab, cfg.tools.enabled, seed, version,
                   cfg.model.max_model_len, checkpoint_shapes(str(model_path)),
                   cfg.actors.weight_update_mode())

    # ------------------------------------------------------------------ generation
    async def generate(self, req: GenRequest) -> GenResult:
        """The round is drawn at once, then paced; in ``interrupt`` mode a weight update
        stops the pacing at a chunk boundary and the rest of the round carries the new
        version (a real engine recomputes the context; here nothing depends on it)."""
        self._check_prompt(req.prompt_tokens)
        rng = (np.random.default_rng([self.seed, req.seed]) if req.seed is not None
               else self._rng)
        limit = max(0, min(req.max_tokens, self.max_model_len - len(req.prompt_tokens)))
        tokens, reason = self._round(req, rng)
        finish = "stop" if len(tokens) <= limit else "length"
        tokens = tokens[:limit]
        if finish == "length":
            reason = None
        versions: list[int] = []
        interruptions = 0
        while True:  # ends when the round is paced whole (a stop only pauses it)
            stopped = []
            async with self._gate.call(stop=lambda flag=stopped: flag.append(True)):
                version = self.version
                done = await self._pace(len(tokens) - len(versions), stopped)
            versions += [version] * done
            if not stopped or len(versions) == len(tokens):
                break
            interruptions += 1
        after_tool = self._after_tool(req.prompt_tokens)
        logprobs, top, nats = self._logprobs(len(tokens), after_tool, req.logprobs_topk, rng)
        if 0 < req.topk_window < len(top):
            top = top[:req.topk_window] + [[] for _ in top[req.topk_window:]]
            nats = nats[:req.topk_window] + [math.nan] * (len(nats) - req.topk_window)
        self.tokens_generated += len(tokens)
        self.calls += 1
        self.interrupted_calls += bool(interruptions)
        return GenResult(tokens=tokens, logprobs=logprobs, top_logprobs=top,
                         finish_reason=finish, stop_reason=reason, version=version,
                         versions=versions, interruptions=interruptions,
                         entropies=nats if req.entropy else [])

    def _check_prompt(self, tokens: list[int]) -> None:
        if not tokens:
            raise ValueError("prompt_tokens is empty")
        if len(tokens) + 1 > self.max_model_len:
            raise ValueError(f"prompt of {len(tokens)} tokens (+1) exceeds "
                             f"model.max_model_len={self.max_model_len}")
        lo, hi = min(tokens), max(tokens)
        if lo < 0 or hi >= self.vocab.size:
            raise ValueError(f"prompt token id {hi if hi >= self.vocab.size else lo} is "
                             f"outside the vocabulary of {self.vocab.size}")

    def _round(self, req: GenRequest, rng: np.random.Generator) -> tuple[list[int], object]:
        """Free text, then how the round ends: (tokens, stop_reason)."""
        s = self.sim
        n = int(rng.integers(s.round_tokens_min, s.round_tokens_max + 1))
        text = self.vocab.filler[rng.integers(0, self.vocab.filler.size, n)].tolist()
        callable_tools = [t for t in self.tools if self._stops_at(req, f"</{t}>")]
        draw = rng.random()
        p_tool = s.tool_call_prob if callable_tools else 0.0
        if draw < p_tool:
            name = callable_tools[int(rng.integers(len(callable_tools)))]
            return text + self._tool_call(name, rng), self._reason(req, f"</{name}>")
        if draw < p_tool + s.eos_prob or not self._stops_at(req, "</answer>"):
            return text + ([self.vocab.eos] if self.vocab.eos is not None else []), None
        answer = self.vocab.encode(f"\\boxed{{{int(rng.integers(0, 20))}}}")
        tags = self.vocab.tags
        return (text + [*tags["<answer>"], *answer, *tags["</answer>"]],
                self._reason(req, "</answer>"))

    def _stops_at(self, req: GenRequest, tag: str) -> bool:
        ids = self.vocab.tags.get(tag, ())
        return (len(ids) == 1 and ids[0] in req.stop_token_ids) or tag in req.stop

    def _reason(self, req: GenRequest, tag: str) -> object:
        ids = self.vocab.tags[tag]
        return ids[0] if len(ids) == 1 and ids[0] in req.stop_token_ids else tag

    def _tool_call(self, name: str, rng: np.random.Generator) -> list[int]:
        if name == "python":
            code = self.sim.python_code
            body = list(self.vocab.encode(
                code or f"print({int(rng.integers(100))}+{int(rng.integers(100))})"))
        else:  # a query of a few plain words
            body = self.vocab.filler[rng.integers(0, self.vocab.filler.size, 3)].tolist()
        tags = self.vocab.tags
        return [*tags[f"<{name}>"], *body, *tags[f"</{name}>"]]

    def _after_tool(self, prompt: list[int]) -> bool:
        end = self.vocab.tool_result_end
        tail = prompt[-(len(end) + 2):]
        return any(tuple(tail[i:i + len(end)]) == end for i in range(len(tail) - len(end) + 1))

    def _logprobs(self, n: int, after_tool: bool, k: int, rng: np.random.Generator
                  ) -> tuple[list[float], list[list[float]], list[float]]:
        """Per token: the sampled log-prob, the top-k log-probs, the law's exact entropy."""
        if n == 0:
            return [], [], []
        target = self.sim.entropy_after_tool if after_tool else self.sim.entropy
        h = np.clip(target + self.sim.entropy_noise * rng.standard_normal(n), 0.0, 1.0)
        k = max(0, min(k, self.vocab.size))
        table = _entropy_table(self.vocab.size, k or 20)  # k = 0: shape only, nothing returned
        s, log_z = table.slope(h)
        logprobs = table.logprobs(s, log_z, table.sample_ranks(s, log_z, rng)).tolist()
        nats = table.nats(s, log_z).tolist()
        if not k:
            return logprobs, [[] for _ in range(n)], nats
        ranks = np.arange(k)[None, :]
        return logprobs, table.logprobs(s[:, None], log_z[:, None], ranks).tolist(), nats

    async def _pace(self, n: int, stopped: list) -> int:
        """Sleep as long as ``n`` tokens take; returns the tokens paced before ``stopped``
        (set by an interrupting weight update) was seen."""
        s = self.sim
        if s.request_latency_s:
            await asyncio.sleep(s.request_latency_s)
        done = 0
        while done < n and not stopped:
            step = min(s.chunk_tokens, n - done)
            rate = s.tokens_per_s
            if s.engine_tokens_per_s:
                rate = min(rate, s.engine_tokens_per_s / max(1, self._gate.in_flight))
            await asyncio.sleep(step / rate)
            done += step
        return done

    async def sequence_logprobs(self, prompt_tokens: list[int], tokens: list[int]) -> list[float]:
        """Deterministic per (version, tokens), but not any model's log-probs."""
        if not tokens:
            return []
        self._check_prompt(list(prompt_tokens) + list(tokens))
        async with self._gate.call():
            rng = np.random.default_rng([self.seed, self.version, len(tokens), *tokens[:32]])
            return (-rng.exponential(math.log(self.vocab.size) / 2, len(tokens))).tolist()

    # ------------------------------------------------------------------ weights
    async def update_weights(self, tensors: dict, version: int) -> float:
        """Checks names and shapes against the checkpoint, then holds new calls for
        ``actors.engine.update_s`` at a safe point, as a real load would; returns seconds paused."""
        shapes = {k: tuple(getattr(v, "shape", ())) for k, v in tensors.items()}
        optional = ["lm_head.weight"] if self._expected and "lm_head.weight" not in \
            self._expected else []
        shapes = {k: v for k, v in shapes.items() if k not in optional}
        check_weight_names(shapes, self._expected)
        async with self._gate.exclusive() as drain_s:
            t0 = time.perf_counter()
            if self.sim.update_s:
                await asyncio.sleep(self.sim.update_s)
            self.version = version
            load_s = time.perf_counter() - t0
        self.last_update = {"drain_s": drain_s, "load_s": load_s, "paused_s": drain_s + load_s,
                            "tensors": float(len(tensors))}
        return drain_s + load_s

    async def close(self) -> None:
        return None


@functools.lru_cache(maxsize=32)
def _entropy_table(vocab_size: int, k: int) -> EntropyTable:
    return EntropyTable(vocab_size, k)
