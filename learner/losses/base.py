"""What every policy loss shares (pure): its inputs, the contract of a loss type, and the
terms around the objective (importance weight, AEPO's entropy-aware advantage, KL,
entropy, aggregation).

Three policies, named as in AReaL's decoupled PPO loss:

* ``logprobs``: pi_theta, the policy being updated (carries the gradient);
* ``proximal_logprobs``: the learner's policy at the start of this update (no grad), or
  None in "bypass" mode, where the behaviour log-probs stand in for it;
* ``behaviour_logprobs``: mu, what the actor sampled with (older weights, and an
  inference engine whose numerics differ from the trainer's).

Per token copy t of sequence i (docs/design.md, "The importance-corrected loss"):

    log r_t = clamp(logpi_t - prox_t, -20, 20)
    w_t = min(exp(prox_t - mu_t), C)                       importance.mode "truncate"
        = 1[lo <= exp(prox_t - mu_t) <= hi]                importance.mode "mask"
        = 1                                                importance.mode "off"
    o_t = the loss type's objective (to maximise): ppo.py, gspo.py, ...
    L   = -agg(m w o) + kl_coef agg(m k3) - entropy_coef agg(m H)
    agg(x) = sum_t x_t / Z                                   unit "token"
           = sum_i (sum_{t in i} x_t / sum_{t in i} m_t) / Z  unit "sequence"
    k3_t = exp(d_t) - d_t - 1, d_t = ref_t - logpi_t      (Schulman's k3 KL estimator)

log r_t and prox_t - mu_t are clamped to [-20, 20] before exp, as verl does, so one
wild token cannot overflow. k3 is computed as verl's ``kl_penalty(..., "low_var_kl")``
(verl/trainer/ppo/core_algos.py): d_t clamped to [-20, 20] before exp, and k3_t clamped
to [-10, 10] (no gradient from a token past either bound). ``ref_logprobs`` come from
the frozen copy of the initial weights (learner/reference.py).

Z is the ``normaliser``: by default this call's trained tokens (unit "token": sum_t m_t)
or sequences (unit "sequence": those with sum_t m_t > 0); when the learner splits a
mini-batch into micro-batches it passes the mini-batch's count over all ranks, so the
micro-batch losses add up to the mini-batch's mean loss (and so do the gradients), one
optimizer step per mini-batch, as verl's ``token-mean`` and ``seq-mean-token-mean``.
Masked IS tokens (mask mode) keep their place in Z, as in the formula.

The inputs are per token copy, in any shape (a padded [B, L-1] batch, or the flat copies
of a packed batch, learner/packing.py); ``seq_ids`` says which sequence (leaf) each copy
belongs to, so a sequence-level loss reads the same structure in both layouts.

AEPO's entropy-aware advantage (``aepo_entropy_adv_gamma`` = gamma, arXiv 2510.14545
Sec. 3): A_t <- A_t (1 + gamma z_t), z_t = (H_t - mean H) / std H over the batch's model
tokens (sample std; std 0 counts as 1), H_t the current policy's token entropy,
detached. Pass ``entropy_stats=(mean, std)`` of the whole batch when micro-batching,
else this call's tokens are used: the trainer sums ``entropy_moments`` over every
micro-batch and rank before the loss and passes ``stats_from_moments`` of the total
(learner/trainer.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from collections.abc import Callable
from typing import Any, Literal

import torch

LOG_RATIO_LIMIT = 20.0  # |logpi - prox| beyond this is clamped (no gradient past it)
KL_LIMIT = 10.0  # k3 per token is clamped to [-KL_LIMIT, KL_LIMIT], as verl's low_var_kl


@dataclass
class LossInputs:
    logprobs: torch.Tensor  # [T] current policy (requires grad)
    behaviour_logprobs: torch.Tensor  # [T] mu_t recorded by the actor
    proximal_logprobs: torch.Tensor | None  # [T] learner at update start; None = bypass
    advantages: torch.Tensor  # [T]
    loss_mask: torch.Tensor  # [T] float 0/1 (model tokens; and hard-mode owner mask)
    ref_logprobs: torch.Tensor | None = None  # [T] reference policy, for the KL term
    entropy: torch.Tensor | None = None  # [T] current policy's token entropy
    seq_ids: torch.Tensor | None = None  # [T] int64 sequence (leaf) of each token copy


@dataclass
class Terms:
    """What the driver hands a loss type's objective, every tensor per token copy."""

    logpi: torch.Tensor  # current log-probs, at least float32, with gradient
    log_r: torch.Tensor  # clamp(logpi - prox, +-20), with gradient
    adv: torch.Tensor  # advantages (after AEPO's entropy-aware shaping), no gradient
    m: torch.Tensor  # loss weights, no gradient
    seq: "Sequences | None"  # sequence structure (None for a token-level loss)


@dataclass(frozen=True)
class LossType:
    """A loss type (one module under learner/losses/, registered in __init__.py).

    ``objective(terms, settings) -> (o, metrics)``: the per-token-copy objective o_t to
    maximise (same shape as ``terms.m``; the driver applies the IS weight, the mask and
    the aggregation) and metrics (masked means over this call's tokens). ``unit``: what
    Z counts, "token" or "sequence". ``settings`` is the validated ``learner.loss``
    section (arpo_async/core/config/losses.py); the objective reads its own keys."""

    objective: Callable[[Terms, Any], tuple[torch.Tensor, dict[str, float]]]
    unit: Literal["token", "sequence"] = "token"


class Sequences:
    """The sequence of every token copy as dense indices 0..n-1, and per-sequence sums."""

    def __init__(self, seq_ids: torch.Tensor, m: torch.Tensor):
        flat = seq_ids.reshape(-1).to(torch.long)
        self.shape = seq_ids.shape
        _, self.index = torch.unique(flat, return_inverse=True)
        self.n = int(self.index.max()) + 1 if self.index.numel() else 0
        self.weight = self.sum(m)  # sum of m per sequence
        self.trained = int((self.weight > 0).sum())

    def sum(self, x: torch.Tensor) -> torch.Tensor:
        """[n] per-sequence sums of ``x`` (same shape as the copies)."""
        flat = x.reshape(-1)
        return torch.zeros(self.n, dtype=flat.dtype, device=flat.device).index_add(
            0, self.index.to(flat.device), flat)

    def mean(self, x: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
        """[n] m-weighted mean of ``x`` per sequence (0 for a sequence with no weight)."""
        w = self.weight.to(x.dtype)
        return self.sum(m * x) / torch.where(w > 0, w, torch.ones_like(w))

    def spread(self, per_seq: torch.Tensor) -> torch.Tensor:
        """A per-sequence value back on every token copy (the copies' shape)."""
        return per_seq.index_select(0, self.index.to(per_seq.device)).reshape(self.shape)


def _f(x: torch.Tensor) -> torch.Tensor:
    """At least float32 (bf16/fp16 log-probs are upcast; float64 stays float64)."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def masked_mean(x: torch.Tensor, m: torch.Tensor, count: float) -> float:
    return float((x * m).sum() / count) if count > 0 else 0.0


def masked_max(x: torch.Tensor, m: torch.Tensor) -> float:
    sel = x[m > 0]
    return float(sel.max()) if sel.numel() else 0.0


def masked_min(x: torch.Tensor, m: torch.Tensor) -> float:
    sel = x[m > 0]
    return float(sel.min()) if sel.numel() else 0.0


def check_inputs(inp: LossInputs, settings, unit: str) -> None:
    shape = inp.logprobs.shape
    named = {"behaviour_logprobs": inp.behaviour_logprobs, "advantages": inp.advantages,
             "loss_mask": inp.loss_mask, "proximal_logprobs": inp.proximal_logprobs,
             "ref_logprobs": inp.ref_logprobs, "entropy": inp.entropy, "seq_ids": inp.seq_ids}
    for name, t in named.items():
        if t is not None and t.shape != shape:
            raise ValueError(f"LossInputs.{name}: shape {tuple(t.shape)} != logprobs "
                             f"{tuple(shape)}")
    if unit == "sequence" and inp.seq_ids is None:
        raise ValueError(f"loss type {settings.type!r} is sequence-level: it needs "
                         "LossInputs.seq_ids")
    needs = settings.needs
    if needs.reference and inp.ref_logprobs is None:
        raise ValueError("kl_coef != 0 needs LossInputs.ref_logprobs")
    if needs.entropy and inp.entropy is None:
        raise ValueError("entropy_coef / aepo_entropy_adv_gamma != 0 needs LossInputs.entropy")
    if needs.entropy_grad and inp.logprobs.requires_grad \
            and not inp.entropy.requires_grad:
        raise ValueError("entropy_coef != 0 but LossInputs.entropy carries no gradient")


def kl_k3(ref: torch.Tensor, logpi: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimate of KL(pi_theta || pi_ref) on tokens sampled from pi_theta,
    clamped as verl's ``low_var_kl``: d = clamp(ref - logpi, +-20), k3 = clamp(exp(d) - d
    - 1, +-10). Differentiable in ``logpi``; >= 0, and 0 exactly where ref == logpi."""
    d = (ref - logpi).clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)
    return (torch.exp(d) - d - 1.0).clamp(-KL_LIMIT, KL_LIMIT)


def importance_weight(prox: torch.Tensor, mu: torch.Tensor, s
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """(w_t, raw exp(prox - mu)); both without gradient."""
    raw = torch.exp((prox - mu).clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT))
    imp = s.importance  # learner.loss.importance: its mode's keys
    if imp.mode == "truncate":
        return raw.clamp(max=imp.cap), raw
    if imp.mode == "mask":
        return ((raw >= imp.low) & (raw <= imp.high)).to(raw.dtype), raw
    return torch.ones_like(raw), raw


def entropy_moments(entropy: torch.Tensor, copies: torch.Tensor) -> torch.Tensor:
    """float64 [sum c H, sum c H^2, sum c] over tokens with ``copies`` c (the number of
    loss-weighted copies a position stands for: 1/0 on padded rows, the packed count);
    moments of several micro-batches and ranks add up to those of the whole batch."""
    h, c = entropy.detach().double().reshape(-1), copies.detach().double().reshape(-1)
    return torch.stack([(c * h).sum(), (c * h * h).sum(), c.sum()])


def stats_from_moments(mom: torch.Tensor) -> tuple[float, float]:
    """(mean, sample std) from summed ``entropy_moments``, as ``entropy_aware`` computes
    them over one call's tokens."""
    s1, s2, n = (float(x) for x in mom)
    if n <= 0:
        return 0.0, 0.0
    mean = s1 / n
    var = max(s2 - n * mean * mean, 0.0) / (n - 1) if n > 1 else 0.0
    return mean, var ** 0.5


def entropy_aware(adv: torch.Tensor, ent: torch.Tensor, m: torch.Tensor, gamma: float,
                  stats: tuple[float, float] | None) -> torch.Tensor:
    ent = _f(ent.detach())
    if stats is None:
        sel = ent[m > 0]
        mean = float(sel.mean()) if sel.numel() else 0.0
        std = float(sel.std()) if sel.numel() > 1 else 0.0
    else:
        mean, std = float(stats[0]), float(stats[1])
    std = std if std > 0 else 1.0  # all-equal entropies: z = 0, not nan
    return adv * (1.0 + gamma * (ent - mean) / std)


def aggregate(x: torch.Tensor, m: torch.Tensor, seq: Sequences | None, unit: str
              ) -> torch.Tensor:
    """sum_t m_t x_t (unit "token"), or the sum over sequences of the m-weighted token
    mean of x within each (unit "sequence"); the caller divides by Z."""
    if unit == "token":
        return (m * x).sum()
    return seq.mean(x, m).sum()


def ratio_metrics(r: torch.Tensor, log_r: torch.Tensor, w: torch.Tensor,
                  raw_w: torch.Tensor, m: torch.Tensor, count: float, s) -> dict[str, float]:
    """The token ratio's and the IS weight's metrics, the same for every loss type."""
    imp = s.importance
    dropped = (w == 0).float() if imp.mode == "mask" else torch.zeros_like(r)
    truncated = (raw_w > imp.cap).float() if imp.mode == "truncate" else torch.zeros_like(r)
    return {
        "is_weight_mean": masked_mean(w, m, count),
        "is_weight_max": masked_max(w, m),
        "is_raw_weight_max": masked_max(raw_w, m),
        "is_raw_weight_min": masked_min(raw_w, m),
        "is_masked_frac": masked_mean(dropped, m, count),
        "is_truncated_frac": masked_mean(truncated, m, count),
        "ratio_mean": masked_mean(r, m, count),
        "ratio_max": masked_max(r, m),
        # k3 estimate of KL(prox || theta) on tokens sampled near prox: r - 1 - log r >= 0
        "approx_kl": masked_mean(r - 1.0 - log_r, m, count),
    }
