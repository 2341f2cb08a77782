"""One round as vLLM requests (actors/engines/vllm_engine.py): the sampling parameters
of a segment, and the tokens, log-probs, top-k and entropies gathered over segments.
Imports vLLM only inside ``sampling_params``."""

from __future__ import annotations

from typing import Any

import numpy as np

from actors.engines.base import GenRequest


def nats(entry: dict) -> float:
    """Exact entropy (nats) of one token's distribution from its full log-prob dict
    (``logprobs=-1``); -inf entries (removed by top-p) contribute nothing."""
    lp = np.fromiter((v.logprob for v in entry.values()), np.float64, len(entry))
    lp = lp[np.isfinite(lp)]
    return float(-(np.exp(lp) * lp).sum())


def top_k(entry: dict, k: int) -> list[float]:
    """vLLM returns the top k plus the sampled token when it is not among them: keep the
    k best, finite values only (-inf marks tokens that top-p removed)."""
    values = sorted((lp.logprob for lp in entry.values()), reverse=True)[:k]
    return [v for v in values if v != float("-inf")]


def sampling_params(req: GenRequest, limit: int, k: int, full: bool, extra: dict[str, str],
              done: int) -> Any:
    """The sampling parameters of one segment: ``limit`` tokens, top-``k`` log-probs (or
    the whole vector when ``full``), the round's stops plus ``extra`` (stop strings that
    may straddle the boundary), the seed advanced by the ``done`` tokens so far."""
    from vllm import SamplingParams

    return SamplingParams(
        n=1, max_tokens=limit, temperature=req.temperature, top_p=req.top_p,
        stop_token_ids=list(req.stop_token_ids), stop=list(req.stop) + list(extra),
        include_stop_str_in_output=True, logprobs=-1 if full else k,
        ignore_eos=req.ignore_eos,
        seed=None if req.seed is None else (req.seed + done) % 2**31,
        # Text is only needed to match stop strings; decoding 20 candidates per token
        # otherwise costs more than the tiny model's forward pass.
        detokenize=bool(req.stop))


class Round:
    """A round's tokens and per-token figures, gathered over its segments."""

    def __init__(self):
        self.tokens: list[int] = []
        self.logprobs: list[float] = []
        self.top: list[list[float]] = []
        self.entropies: list[float] = []
        self.versions: list[int] = []

    def add(self, comp: Any, k: int, full: bool, entropy: bool, versions: list[int]) -> None:
        got, entries = list(comp.token_ids), comp.logprobs or []
        if len(entries) != len(got):
            raise RuntimeError(f"vLLM returned {len(entries)} log-prob entries for "
                               f"{len(got)} tokens")
        self.tokens += got
        self.logprobs += [float(e[t].logprob) for t, e in zip(got, entries)]
        self.top += [top_k(e, k) if k else [] for e in entries]
        if entropy:
            self.entropies += [nats(e) if full else float("nan") for e in entries]
        if len(versions) != len(got):
            raise RuntimeError(f"{len(versions)} versions for {len(got)} tokens")
        self.versions += versions
