"""Token entropy for ARPO's branching decisions, normalised to [0, 1].

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
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch

from arpo_async.core.logits import entropy_of_logits


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Exact entropy of softmax(logits) over the last dim, divided by log V.

    Returns a float32 tensor of shape ``logits.shape[:-1]`` with values in [0, 1].
    Tokens with logit -inf (masked out) contribute 0. Apply temperature before calling
    (``logits / T``) to get the entropy of the sampling distribution.
    """
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


def window_entropy(token_entropies: Sequence[float] | np.ndarray, k: int,
                   reduce: str = "sum") -> float:
    """A round's entropy from its first ``k`` tokens (fewer if the round is shorter):
    their normalised entropies summed (``reduce="sum"``, the scale of the code behind the
    ARPO paper's numbers, so H lies in [0, k]) or averaged (``"mean"``, in [0, 1]; dH is
    then about k times smaller, and with beta = 0.2 the branch probability barely leaves
    alpha).

    nan entries (tokens with no log-probs) are skipped, not counted as 0: a zero would
    look like certainty and lower the baseline. A round with no finite entry in its first
    k tokens (empty round) returns nan, which the branch planner treats as "unknown"
    (dH = 0). Entropy 0 is a real value and is counted normally.
    """
    if k < 1:
        raise ValueError(f"window_entropy: k={k}; need >= 1")
    if reduce not in ("sum", "mean"):
        raise ValueError(f"window_entropy: reduce={reduce!r}; expected sum or mean")
    head = np.asarray(token_entropies, dtype=np.float64).reshape(-1)[:k]
    head = head[np.isfinite(head)]
    if not head.size:
        return math.nan
    return float(head.sum() if reduce == "sum" else head.mean())
