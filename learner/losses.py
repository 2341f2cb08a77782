"""The importance-corrected ARPO/AEPO policy loss over one (micro-)batch of tokens (pure).

Three policies, named as in AReaL's decoupled PPO loss:

* ``logprobs``: pi_theta, the policy being updated (carries the gradient);
* ``proximal_logprobs``: the learner's policy at the start of this update (no grad), or
  None in "bypass" mode, where the behaviour log-probs stand in for it;
* ``behaviour_logprobs``: mu, what the actor sampled with (older weights, and an
  inference engine whose numerics differ from the trainer's).

Per model token t (docs/design.md, "The importance-corrected loss"):

    r_t = exp(logpi_t - prox_t)
    w_t = min(exp(prox_t - mu_t), C)                       is_mode "truncate"
        = 1[lo <= exp(prox_t - mu_t) <= hi]                is_mode "mask"
        = 1                                                is_mode "off"
    o_t = min(r_t A_t, clip(r_t, 1 - eps_low, 1 + eps_high) A_t)      (PPO, arXiv 1707.06347)
    o_t = max(o_t, c A_t) where A_t < 0, if dual_clip c > 1          (Dual-clip PPO, 1912.09729)
    L   = -sum_t m_t w_t o_t / Z + kl_coef sum_t m_t k3_t / Z - entropy_coef sum_t m_t H_t / Z
    k3_t = exp(d_t) - d_t - 1, d_t = ref_t - logpi_t      (Schulman's k3 KL estimator)

log r_t and prox_t - mu_t are clamped to [-20, 20] before exp, as verl does, so one
wild token cannot overflow. k3 is computed as verl's ``kl_penalty(..., "low_var_kl")``
(verl/trainer/ppo/core_algos.py): d_t clamped to [-20, 20] before exp, and k3_t clamped
to [-10, 10] (no gradient from a token past either bound). ``ref_logprobs`` come from
the frozen copy of the initial weights (learner/reference.py).

Z is the ``normaliser``: by default this call's sum_t m_t (token mean); when the learner
splits a mini-batch into micro-batches it passes the mini-batch's masked-token count over
all ranks, so the micro-batch losses add up to its token-mean loss (and so do the
gradients), one optimizer step per mini-batch as verl's ``token-mean``. Masked IS tokens
(mask mode) keep their place in Z, as in the formula. With mu = prox (lockstep, or
bypass mode) every w_t = 1 and L is exactly the PPO/GRPO clipped loss.

AEPO switches (arXiv 2510.14545, Sec. 3 "entropy-balanced policy optimization"):

* entropy-balanced clipping (``aepo_entropy_clip``): the upper clip bound becomes
  (1 + eps_high) / sg(r_t) * r_t, i.e. clip(r) = min(max(r, 1 - eps_low),
  (1 + eps_high) * r / sg(r)). The value is unchanged, but where plain PPO clipping gives
  zero gradient (A > 0, r > 1 + eps_high) the gradient survives, scaled by
  (1 + eps_high) / r. Only the upper bound is changed, as in the authors' code.
* entropy-aware advantage (``aepo_entropy_adv_gamma`` = gamma): A_t <- A_t (1 + gamma z_t),
  z_t = (H_t - mean H) / std H over the batch's model tokens (sample std; std 0 counts as
  1), H_t the current policy's token entropy, detached. Pass ``entropy_stats=(mean, std)``
  of the whole batch when micro-batching, else this call's tokens are used: the trainer
  sums ``entropy_moments`` over every micro-batch and rank before the loss and passes
  ``stats_from_moments`` of the total (learner/trainer.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from arpo_async.core.loss_settings import LossSettings

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


def _f(x: torch.Tensor) -> torch.Tensor:
    """At least float32 (bf16/fp16 log-probs are upcast; float64 stays float64)."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def _masked_mean(x: torch.Tensor, m: torch.Tensor, count: float) -> float:
    return float((x * m).sum() / count) if count > 0 else 0.0


def _masked_max(x: torch.Tensor, m: torch.Tensor) -> float:
    sel = x[m > 0]
    return float(sel.max()) if sel.numel() else 0.0


def _masked_min(x: torch.Tensor, m: torch.Tensor) -> float:
    sel = x[m > 0]
    return float(sel.min()) if sel.numel() else 0.0


def _check(inp: LossInputs, settings: LossSettings) -> None:
    shape = inp.logprobs.shape
    named = {"behaviour_logprobs": inp.behaviour_logprobs, "advantages": inp.advantages,
             "loss_mask": inp.loss_mask, "proximal_logprobs": inp.proximal_logprobs,
             "ref_logprobs": inp.ref_logprobs, "entropy": inp.entropy}
    for name, t in named.items():
        if t is not None and t.shape != shape:
            raise ValueError(f"LossInputs.{name}: shape {tuple(t.shape)} != logprobs "
                             f"{tuple(shape)}")
    if settings.kl_coef != 0.0 and inp.ref_logprobs is None:
        raise ValueError("kl_coef != 0 needs LossInputs.ref_logprobs")
    if (settings.entropy_coef != 0.0 or settings.aepo_entropy_adv_gamma != 0.0) \
            and inp.entropy is None:
        raise ValueError("entropy_coef / aepo_entropy_adv_gamma != 0 needs LossInputs.entropy")
    if settings.entropy_coef != 0.0 and inp.logprobs.requires_grad \
            and not inp.entropy.requires_grad:
        raise ValueError("entropy_coef != 0 but LossInputs.entropy carries no gradient")


def kl_k3(ref: torch.Tensor, logpi: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimate of KL(pi_theta || pi_ref) on tokens sampled from pi_theta,
    clamped as verl's ``low_var_kl``: d = clamp(ref - logpi, +-20), k3 = clamp(exp(d) - d
    - 1, +-10). Differentiable in ``logpi``; >= 0, and 0 exactly where ref == logpi."""
    d = (ref - logpi).clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)
    return (torch.exp(d) - d - 1.0).clamp(-KL_LIMIT, KL_LIMIT)


def _importance_weight(prox: torch.Tensor, mu: torch.Tensor, s: LossSettings
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """(w_t, raw exp(prox - mu)); both without gradient."""
    raw = torch.exp((prox - mu).clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT))
    if s.is_mode == "truncate":
        return raw.clamp(max=s.is_cap), raw
    if s.is_mode == "mask":
        return ((raw >= s.is_mask_low) & (raw <= s.is_mask_high)).to(raw.dtype), raw
    return torch.ones_like(raw), raw


def entropy_moments(entropy: torch.Tensor, copies: torch.Tensor) -> torch.Tensor:
    """float64 [sum c H, sum c H^2, sum c] over tokens with ``copies`` c (the number of
    loss-weighted copies a position stands for: 1/0 on padded rows, the packed count);
    moments of several micro-batches and ranks add up to those of the whole batch."""
    h, c = entropy.detach().double().reshape(-1), copies.detach().double().reshape(-1)
    return torch.stack([(c * h).sum(), (c * h * h).sum(), c.sum()])


def stats_from_moments(mom: torch.Tensor) -> tuple[float, float]:
    """(mean, sample std) from summed ``entropy_moments``, as ``_entropy_aware`` computes
    them over one call's tokens."""
    s1, s2, n = (float(x) for x in mom)
    if n <= 0:
        return 0.0, 0.0
    mean = s1 / n
    var = max(s2 - n * mean * mean, 0.0) / (n - 1) if n > 1 else 0.0
    return mean, var ** 0.5


def _entropy_aware(adv: torch.Tensor, ent: torch.Tensor, m: torch.Tensor, gamma: float,
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


def _clipped_objective(r: torch.Tensor, adv: torch.Tensor, s: LossSettings) -> torch.Tensor:
    hi = 1.0 + s.eps_high
    if s.aepo_entropy_clip:
        upper = hi * r / r.detach()  # value hi, gradient hi / r (AEPO's sg trick)
        clipped = torch.minimum(torch.clamp(r, min=1.0 - s.eps_low), upper)
    else:
        clipped = torch.clamp(r, 1.0 - s.eps_low, hi)
    obj = torch.minimum(r * adv, clipped * adv)
    if s.dual_clip > 0:
        obj = torch.where(adv < 0, torch.maximum(obj, s.dual_clip * adv), obj)
    return obj


def policy_loss(inp: LossInputs, settings: LossSettings, normaliser: float | None = None,
                entropy_stats: tuple[float, float] | None = None
                ) -> tuple[torch.Tensor, dict[str, float]]:
    """Scalar loss to minimise, and metrics (masked means over this call's tokens)."""
    s = settings
    _check(inp, s)
    logpi = _f(inp.logprobs)
    m = _f(inp.loss_mask.detach())
    count = float(m.sum())
    if normaliser is not None and normaliser <= 0:
        raise ValueError(f"normaliser must be > 0, got {normaliser}")
    # No masked token: every sum is 0, so any Z > 0 gives a zero loss that backpropagates.
    norm = float(normaliser) if normaliser is not None else max(count, 1.0)
    mu = _f(inp.behaviour_logprobs.detach())
    prox = mu if inp.proximal_logprobs is None else _f(inp.proximal_logprobs.detach())
    adv = _f(inp.advantages.detach())
    if s.aepo_entropy_adv_gamma != 0.0:
        adv = _entropy_aware(adv, inp.entropy, m, s.aepo_entropy_adv_gamma, entropy_stats)

    w, raw_w = _importance_weight(prox, mu, s)
    # As verl does, bound the log-ratio so one wild token cannot overflow exp.
    log_r = (logpi - prox).clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)
    r = torch.exp(log_r)
    obj = _clipped_objective(r, adv, s)
    pg_loss = -(m * w * obj).sum() / norm
    loss = pg_loss
    metrics: dict[str, float] = {"kl": 0.0}
    if inp.ref_logprobs is not None:
        # Padding/tool positions may hold anything: a finite stand-in there, and the
        # clamps keep exp() finite, so 0 * inf never turns the sum (or its gradient) nan.
        ref = torch.where(m > 0, _f(inp.ref_logprobs.detach()), 0.0)
        kl = (m * kl_k3(ref, logpi)).sum() / norm
        loss = loss + s.kl_coef * kl
        metrics["kl"] = float(kl.detach()) * norm / count if count else 0.0
    if inp.entropy is not None:
        ent = _f(inp.entropy)
        if s.entropy_coef != 0.0:
            loss = loss - s.entropy_coef * (m * ent).sum() / norm
        metrics["entropy"] = _masked_mean(ent.detach(), m, count)
    metrics |= _metrics(r.detach(), log_r.detach(), adv, w, raw_w, m, count, s)
    metrics |= {"loss": float(loss.detach()), "pg_loss": float(pg_loss.detach()),
                "tokens": count}
    return loss, metrics


def _metrics(r: torch.Tensor, log_r: torch.Tensor, adv: torch.Tensor, w: torch.Tensor,
             raw_w: torch.Tensor, m: torch.Tensor, count: float, s: LossSettings
             ) -> dict[str, float]:
    high = ((adv > 0) & (r > 1.0 + s.eps_high)).float()
    low = ((adv < 0) & (r < 1.0 - s.eps_low)).float()
    dual = ((adv < 0) & (r * adv < s.dual_clip * adv)).float() if s.dual_clip > 0 \
        else torch.zeros_like(r)
    dropped = (w == 0).float() if s.is_mode == "mask" else torch.zeros_like(r)
    truncated = (raw_w > s.is_cap).float() if s.is_mode == "truncate" else torch.zeros_like(r)
    return {
        "clip_frac_high": _masked_mean(high, m, count),
        "clip_frac_low": _masked_mean(low, m, count),
        "dual_clip_frac": _masked_mean(dual, m, count),
        "is_weight_mean": _masked_mean(w, m, count),
        "is_weight_max": _masked_max(w, m),
        "is_raw_weight_max": _masked_max(raw_w, m),
        "is_raw_weight_min": _masked_min(raw_w, m),
        "is_masked_frac": _masked_mean(dropped, m, count),
        "is_truncated_frac": _masked_mean(truncated, m, count),
        "ratio_mean": _masked_mean(r, m, count),
        "ratio_max": _masked_max(r, m),
        # k3 estimate of KL(prox || theta) on tokens sampled near prox: r - 1 - log r >= 0
        "approx_kl": _masked_mean(r - 1.0 - log_r, m, count),
    }
