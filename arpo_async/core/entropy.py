"""Token and round entropy for ARPO's branching decisions.

ARPO (arXiv 2507.19849, Sec. 3.2 "entropy variation monitoring") measures the entropy of
the first k tokens a round generates, H = -sum_j p_j log p_j with p = softmax(z / T), and
compares it with the trajectory's initial entropy. docs/design.md ("Round entropy")
normalises it to [0, 1]: divide by log V for the full distribution, or by log of the
number of candidates when it is estimated from top-k log-probs.

Three estimators:

* ``entropy_from_logits``: exact, from the full logits (the transformers engine and the
  learner).
* ``entropy_from_topk(top, vocab_size=None)``: the *renormalised* top-k estimate, the
  entropy of p restricted to the k returned candidates and renormalised, divided by
  log k. It ignores the missing mass entirely.
* ``entropy_from_topk(top, vocab_size=V)``: the *tail-corrected* estimate. The k known
  terms are kept as they are and the missing mass r = 1 - sum(p) is spread uniformly over
  the V - k other tokens, then divided by log V. A uniform tail is the most entropic
  tail with that mass, so this is an upper bound on the true entropy, and it never grows
  as k grows (each extra known candidate replaces part of the uniform guess).

**The vLLM rollout path uses the tail-corrected estimate** (pass ``vocab_size``): it is
on the same scale as the exact normalised entropy and had the lower error over the range
measured (pooled over settings, for every k). Measured by
tests/integration/test_entropy_estimate.py on a Qwen3ForCausalLM (vocab 2048, hidden 128,
2 layers), mean absolute error against the exact normalised entropy, per token / per
20-token window (entropies lie in [0, 1]; 320 tokens per setting):

    setting (mean exact H)               k   renormalised     tail-corrected
    random model, T=1.0 (0.997)          5   0.0024 / 0.0023  0.0032 / 0.0032
                                        10   0.0024 / 0.0024  0.0032 / 0.0032
                                        20   0.0025 / 0.0025  0.0030 / 0.0030
    random model, T=0.3 (0.963)          5   0.0266 / 0.0244  0.0342 / 0.0342
                                        10   0.0262 / 0.0257  0.0324 / 0.0324
                                        20   0.0263 / 0.0263  0.0299 / 0.0299
    trained, noisy text, T=1.0 (0.665)   5   0.3243 / 0.3243  0.2984 / 0.2984
                                        10   0.3250 / 0.3250  0.2741 / 0.2741
                                        20   0.3248 / 0.3248  0.2357 / 0.2357
    trained, clean text, T=1.0 (0.077)   5   0.2295 / 0.2295  0.0118 / 0.0118
                                        10   0.1705 / 0.1705  0.0013 / 0.0013
                                        20   0.1177 / 0.1177  0.0001 / 0.0001

("trained": 40 or 80 Adam steps on token chains with 30% / 0% random successors.) On a
near-uniform distribution both are close (the renormalised one reads ~1 only because
log k rescales it); on a confident model the renormalised estimate is far off; in the
middle (mass spread thinly over many unlisted tokens) both are poor: the uniform tail
overestimates by 0.24 at k=20, the renormalised estimate is off by 0.32. Only the
difference dH = H_t - H_init drives branching, and both terms use the same estimator,
which cancels part of this bias.

vLLM returns the top-k log-probs *plus* the sampled token when it is not among them;
pass each distinct candidate once (the estimators accept lists of any length >= 1).

**A round's entropy** (``round_entropy``, ``rollout.entropy_estimator``), from the first
``window`` tokens of a round:

* ``reference``: the ARPO authors' number (RUC-NLPIR/ARPO, ``vllm_rollout_with_tools.py``
  ``_calc_entropy`` and its caller): every log-prob vLLM returned for those tokens (the
  top k, the authors' 10, and the sampled token when it is not among them, in vLLM's
  order: the sampled token first) flattened into one list, ``-sum(exp(l) * l)`` over it,
  divided by ``ln V`` once. No tail term, so it is a lower bound of the summed normalised
  entropy; ``reference_round_entropy`` reproduces it operation for operation, so the same
  log-probs give the same float.
* ``tail_corrected``: ``entropy_from_topk(top, V)`` per token, then ``window_entropy``.
* ``exact``: the engine's exact entropy of each token's sampling distribution (nats,
  ``GenResult.entropies``) over ``ln V``, then ``window_entropy``: the yardstick.

``short_round`` for a round shorter than the window: ``as_is`` (a sum over fewer tokens,
so a short round reads as an entropy fall), ``scale`` (the sum rescaled to the window's
length), ``skip`` (the value as is; the branch planner makes no decision on it).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import torch


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Exact entropy of softmax(logits) over the last dim, divided by log V.

    Returns a float32 tensor of shape ``logits.shape[:-1]`` with values in [0, 1].
    Tokens with logit -inf (masked out) contribute 0. Apply temperature before calling
    (``logits / T``) to get the entropy of the sampling distribution.
    """
    # torch only here: the rest of this module (the rollout's round entropy) is numpy
    from arpo_async.core.logits import entropy_of_logits

    return entropy_of_logits(logits.float())  # one softmax copy (arpo_async/core/logits.py)


def _token_entropy(logps: np.ndarray, vocab_size: int | None) -> float:
    k = logps.size
    if k == 0:
        return math.nan
    p = np.exp(logps)
    if vocab_size is None:
        if k == 1:
            return 0.0  # one candidate: no spread to measure on the log k scale
        q = p / p.sum()
        h = -float(np.sum(np.where(q > 0, q * np.log(np.maximum(q, 1e-300)), 0.0)))
        return min(max(h / math.log(k), 0.0), 1.0)
    known = -float(np.sum(np.where(p > 0, p * logps, 0.0)))
    tail_mass = max(0.0, 1.0 - float(p.sum()))
    tail_size = vocab_size - k
    tail = 0.0
    if tail_mass > 0.0 and tail_size > 0:
        # Missing mass spread uniformly over the unseen tokens: the maximum-entropy tail.
        tail = -tail_mass * math.log(tail_mass / tail_size)
    return min(max((known + tail) / math.log(vocab_size), 0.0), 1.0)


def entropy_from_topk(top_logprobs: Sequence[Sequence[float]],
                      vocab_size: int | None = None) -> np.ndarray:
    """Per-token normalised entropy from per-token top-k log-probs.

    ``top_logprobs[t]`` holds the log-probs of the distinct candidates returned for token
    t (any order, lengths may differ). Without ``vocab_size``: the renormalised top-k
    estimate / log k (one candidate gives 0). With ``vocab_size``: the tail-corrected
    estimate / log V. A token with no candidates gives nan (unknown, see
    ``window_entropy``). Returns float64 array of length len(top_logprobs).
    """
    if vocab_size is not None and vocab_size < 2:
        raise ValueError(f"entropy_from_topk: vocab_size={vocab_size}; need >= 2")
    out = np.empty(len(top_logprobs), dtype=np.float64)
    for t, cands in enumerate(top_logprobs):
        logps = np.asarray(cands, dtype=np.float64).reshape(-1)
        if np.any(np.isnan(logps)) or np.any(logps > 1e-6):
            raise ValueError(f"entropy_from_topk: token {t} has invalid log-probs {cands!r}")
        if vocab_size is not None and logps.size > vocab_size:
            raise ValueError(f"entropy_from_topk: token {t} has {logps.size} candidates "
                             f"> vocab_size {vocab_size}")
        out[t] = _token_entropy(np.minimum(logps, 0.0), vocab_size)
    return out


ESTIMATORS = ("reference", "tail_corrected", "exact")
SHORT_ROUNDS = ("as_is", "scale", "skip")


def reference_candidates(top: Sequence[float], sampled: float) -> list[float]:
    """One token's log-probs in the order vLLM's logprob dict lists them, as the reference
    code reads them: the sampled token first, then the top k without it (by value: a
    sampled token tied with the k-th best but outside the top k counts as inside)."""
    rest = list(top)
    with_sampled = next((i for i, v in enumerate(rest) if v == sampled), None)
    if with_sampled is not None:
        del rest[with_sampled]
    return [float(sampled), *rest]


def reference_round_entropy(candidates: Sequence[Sequence[float]], vocab_size: int,
                            window: int = 20) -> float:
    """The ARPO authors' round entropy: the log-probs of the first min(window, len) tokens
    flattened, ``-sum(p * l)`` with ``p = exp(l)``, divided by ``ln V``; 0.0 for a round
    with none (as theirs). The same operations in the same order as their code."""
    logprobs = [float(lp) for cands in candidates[:window] for lp in cands]
    if not logprobs:
        return 0.0
    p_list = [math.exp(lp) for lp in logprobs]
    return -sum(p * lp for p, lp in zip(p_list, logprobs)) / math.log(vocab_size)


def round_entropy(top_logprobs: Sequence[Sequence[float]], sampled: Sequence[float],
                  entropies: Sequence[float], *, estimator: str, vocab_size: int,
                  window: int, reduce: str = "sum", short_round: str = "as_is") -> float:
    """A round's entropy H from its first ``window`` tokens with ``estimator`` (module
    docstring): ``top_logprobs`` and ``sampled`` (the sampled tokens' log-probs) per token,
    ``entropies`` the exact per-token entropies in nats (``exact`` only). nan: unknown (no
    token of the window has what the estimator needs). ``short_round="scale"`` rescales a
    summed H of a round shorter than the window to the window's length."""
    if estimator not in ESTIMATORS:
        raise ValueError(f"round_entropy: estimator={estimator!r}; expected {ESTIMATORS}")
    if short_round not in SHORT_ROUNDS:
        raise ValueError(f"round_entropy: short_round={short_round!r}; expected {SHORT_ROUNDS}")
    if estimator == "reference":
        head = [(t, s) for t, s in zip(top_logprobs[:window], sampled[:window]) if len(t)]
        if not head:
            return math.nan
        h = reference_round_entropy([reference_candidates(t, s) for t, s in head], vocab_size,
                                    window)
        n = len(head)
    else:
        if estimator == "exact":
            per_token = np.asarray(entropies[:window], dtype=np.float64) / math.log(vocab_size)
        else:
            top = top_logprobs[:window]
            per_token = entropy_from_topk(top, vocab_size) if len(top) else np.zeros(0)
        h = window_entropy(per_token, window, reduce) if per_token.size else math.nan
        n = int(np.isfinite(per_token[:window]).sum())
        if reduce != "sum":
            return h
    if short_round == "scale" and 0 < n < window:
        h *= window / n
    return h


def window_entropy(token_entropies: Sequence[float] | np.ndarray, k: int,
                   reduce: str = "sum") -> float:
    """A round's entropy from its first ``k`` tokens (fewer if the round is shorter):
    their normalised entropies summed (``reduce="sum"``, the scale of the code behind the
    ARPO paper's numbers, so H lies in [0, k]) or averaged (``"mean"``, in [0, 1]; dH is
    then about k times smaller, and with beta = 0.2 the branch probability barely leaves
    alpha), or their maximum (``"max"``, in [0, 1]: the one most uncertain token, a
    decision made in a single token, which a sum over k tokens normalised by ln V
    dilutes; its scale needs a beta of its own).

    nan entries (tokens with no log-probs) are skipped, not counted as 0: a zero would
    look like certainty and lower the baseline. A round with no finite entry in its first
    k tokens (empty round) returns nan, which the branch planner treats as "unknown"
    (dH = 0). Entropy 0 is a real value and is counted normally.
    """
    if k < 1:
        raise ValueError(f"window_entropy: k={k}; need >= 1")
    if reduce not in ("sum", "mean", "max"):
        raise ValueError(f"window_entropy: reduce={reduce!r}; expected sum, mean or max")
    head = np.asarray(token_entropies, dtype=np.float64).reshape(-1)[:k]
    head = head[np.isfinite(head)]
    if not head.size:
        return math.nan
    return float(head.sum() if reduce == "sum" else head.mean() if reduce == "mean"
                 else head.max())
