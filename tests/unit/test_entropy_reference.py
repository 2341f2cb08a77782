"""``rollout.entropy_estimator=reference`` against the ARPO authors' formula, written from
their code: RUC-NLPIR/ARPO at a95cd0894b53e97595845bd680ed7e85524a2244,
``ARPO/verl_arpo_entropy/verl/workers/rollout/vllm_rollout/vllm_rollout_with_tools.py``
(``self.logprobs = 10``, line 114; lines 172-177 and 284-303)::

    def _calc_entropy(self, logprobs):
            if not logprobs:
                return 0.0
            p_list = [math.exp(l) for l in logprobs]
            entropy = -sum(p * l for p, l in zip(p_list, logprobs))
            return entropy
    ...
    vocab_size = len(self.tokenizer.get_vocab())
    entropy_norm_factor = math.log(vocab_size)
    ...
        for j in range(min(20, len(tokens))):
            ...
            logprob_info = output.outputs[0].logprobs[j]
            token_list = list(logprob_info.values())
            token_logprobs = [token.logprob for token in token_list]
            logprobs.extend(token_logprobs)
        if logprobs:
            entropy = self._calc_entropy(logprobs) / entropy_norm_factor

``logprob_info`` is vLLM's per-token dict: the sampled token first, then the top 10 (one
entry when the sampled token is among them). The same dicts go through our vLLM engine's
``_top_k`` (what the rollout receives: the top k, best first, and the sampled token's own
log-prob) and ``round_entropy``; the two must agree to 1e-12 (they agree bit for bit)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import pytest

from actors.engines.vllm_round import top_k as _top_k
from arpo_async.core.entropy import (
    entropy_from_topk,
    reference_candidates,
    reference_round_entropy,
    round_entropy,
)

V = 151_665  # Qwen2.5's len(tokenizer.get_vocab())


@dataclass
class Logprob:  # the field of vLLM's Logprob the reference reads
    logprob: float


def authors_entropy(tokens: list[int], logprobs_out: list[dict], vocab_size: int) -> float:
    """Their loop and ``_calc_entropy`` for one output, as their code reads it."""
    logprobs = []
    for j in range(min(20, len(tokens))):
        token_list = list(logprobs_out[j].values())
        logprobs.extend([token.logprob for token in token_list])
    if not logprobs:
        return 0.0
    p_list = [math.exp(lp) for lp in logprobs]
    return -sum(p * lp for p, lp in zip(p_list, logprobs)) / math.log(vocab_size)


def vllm_round(rng: np.random.Generator, n_tokens: int, vocab: int, k: int = 10):
    """A round as vLLM returns it with ``logprobs=k``: per token the dict {sampled, top k}
    (float32 log-probs, as vLLM's tensors are), from random Zipf-ish distributions."""
    tokens, dicts = [], []
    for _ in range(n_tokens):
        logits = rng.standard_normal(vocab) * rng.uniform(0.5, 4.0)
        logp = (logits - np.logaddexp.reduce(logits)).astype(np.float32)
        tok = int(rng.choice(vocab, p=np.exp(logp.astype(np.float64)) / np.exp(
            logp.astype(np.float64)).sum())) if rng.random() < 0.7 else int(np.argmax(logp))
        top = np.argsort(-logp, kind="stable")[:k]
        entry = {tok: Logprob(float(logp[tok]))}
        for t in top:
            entry[int(t)] = Logprob(float(logp[t]))
        tokens.append(tok)
        dicts.append(entry)
    return tokens, dicts


def ours(tokens: list[int], dicts: list[dict], k: int = 10, window: int = 20) -> float:
    top = [_top_k(e, k) for e in dicts]
    sampled = [e[t].logprob for t, e in zip(tokens, dicts)]
    return round_entropy(top, sampled, [], estimator="reference", vocab_size=V, window=window)


@pytest.mark.parametrize("seed", range(6))
def test_reference_matches_the_authors_formula(seed):
    rng = np.random.default_rng(seed)
    vocab = 5000  # the draws; the normaliser is V, as for Qwen
    for n in (1, 3, 19, 20, 21, 64):  # shorter than, equal to and longer than the window
        tokens, dicts = vllm_round(rng, n, vocab)
        theirs = authors_entropy(tokens, dicts, V)
        mine = ours(tokens, dicts)
        assert abs(theirs - mine) <= 1e-12, (n, theirs, mine)
        assert theirs == mine  # the same operations in the same order: the same float
    outside = sum(len(d) == 11 for d in dicts)  # sampled tokens outside the top 10 occur
    assert 0 < outside < len(dicts)


def test_candidates_in_vllm_order():
    top = [-0.1, -1.0, -2.0]
    assert reference_candidates(top, -1.0) == [-1.0, -0.1, -2.0]  # sampled rank 2
    assert reference_candidates(top, -5.0) == [-5.0, -0.1, -1.0, -2.0]  # outside the top k
    assert reference_round_entropy([], V) == 0.0  # no log-probs: 0, as theirs
    assert math.isnan(round_entropy([[]], [-0.1], [], estimator="reference", vocab_size=V,
                                    window=20))  # nothing read: unknown for the planner


def test_zipf_figures_of_the_three_estimators():
    """The issue's Zipf law (s = 1.5, V = 151,665): per token the reference reads 0.122,
    the tail-corrected top-20 estimate 0.342, the exact entropy is 0.267."""
    rank = np.arange(1, V + 1, dtype=np.float64)
    p = rank ** -1.5
    p /= p.sum()
    logp = np.log(p)
    exact = float(-(p * logp).sum())
    one = round_entropy([list(logp[:10])], [float(logp[0])], [exact], estimator="reference",
                        vocab_size=V, window=20)
    tail = round_entropy([list(logp[:20])], [float(logp[0])], [exact],
                         estimator="tail_corrected", vocab_size=V, window=20)
    full = round_entropy([[]], [float(logp[0])], [exact], estimator="exact", vocab_size=V,
                         window=20)
    assert (round(one, 3), round(tail, 3), round(full, 3)) == (0.122, 0.342, 0.267)
    assert tail == pytest.approx(entropy_from_topk([logp[:20]], V)[0])


def test_short_rounds_scaled_to_the_window():
    per = [math.log(0.5)] * 2  # each token: two candidates of 1/2
    top, sampled = [per] * 5, [per[0]] * 5
    kw = {"vocab_size": 4, "window": 20}
    as_is = round_entropy(top, sampled, [], estimator="tail_corrected", **kw)
    assert as_is == pytest.approx(5 * 0.5)  # 5 tokens of ln2 / ln4
    scaled = round_entropy(top, sampled, [], estimator="tail_corrected", short_round="scale",
                           **kw)
    assert scaled == pytest.approx(20 * 0.5)
    ref = round_entropy(top, sampled, [], estimator="reference", short_round="scale", **kw)
    assert ref == pytest.approx(4 * round_entropy(top, sampled, [], estimator="reference",
                                                  **kw))
    exact = round_entropy(top, sampled, [math.log(2)] * 5 + [math.nan] * 3, estimator="exact",
                          short_round="skip", **kw)  # skip leaves the value as it is
    assert exact == pytest.approx(2.5)
    mean = round_entropy(top, sampled, [], estimator="tail_corrected", reduce="mean",
                         short_round="scale", **kw)
    assert mean == pytest.approx(0.5)  # a mean needs no rescaling
    with pytest.raises(ValueError, match="estimator"):
        round_entropy(top, sampled, [], estimator="renormalised", **kw)
