"""``learner.loss.type = ppo``: the token-level clipped objective, ARPO's and AEPO's loss.

    r_t = exp(log r_t)
    o_t = min(r_t A_t, clip(r_t, 1 - eps_low, 1 + eps_high) A_t)      (PPO, arXiv 1707.06347)
    o_t = max(o_t, c A_t) where A_t < 0, if dual_clip c > 1          (Dual-clip PPO, 1912.09729)

With mu = prox (lockstep, or bypass mode) every IS weight is 1 and the loss is exactly the
PPO/GRPO clipped loss with DAPO's asymmetric clip (eps_high 0.28).

AEPO's entropy-balanced clipping (``aepo_entropy_clip``, arXiv 2510.14545 Sec. 3): the
upper clip bound becomes (1 + eps_high) / sg(r_t) * r_t, i.e. clip(r) = min(max(r,
1 - eps_low), (1 + eps_high) * r / sg(r)). The value is unchanged, but where plain PPO
clipping gives zero gradient (A > 0, r > 1 + eps_high) the gradient survives, scaled by
(1 + eps_high) / r. Only the upper bound is changed, as in the authors' code.
"""

from __future__ import annotations

import torch

from learner.losses.base import LossType, Terms, masked_mean


def objective(t: Terms, s) -> tuple[torch.Tensor, dict[str, float]]:
    r, adv = torch.exp(t.log_r), t.adv
    hi = 1.0 + s.eps_high
    if s.aepo_entropy_clip:
        upper = hi * r / r.detach()  # value hi, gradient hi / r (AEPO's sg trick)
        clipped = torch.minimum(torch.clamp(r, min=1.0 - s.eps_low), upper)
    else:
        clipped = torch.clamp(r, 1.0 - s.eps_low, hi)
    obj = torch.minimum(r * adv, clipped * adv)
    if s.dual_clip > 0:
        obj = torch.where(adv < 0, torch.maximum(obj, s.dual_clip * adv), obj)
    r = r.detach()
    count = float(t.m.sum())
    dual = ((adv < 0) & (r * adv < s.dual_clip * adv)).float() if s.dual_clip > 0 \
        else torch.zeros_like(r)
    return obj, {
        "clip_frac_high": masked_mean(((adv > 0) & (r > hi)).float(), t.m, count),
        "clip_frac_low": masked_mean(((adv < 0) & (r < 1.0 - s.eps_low)).float(), t.m, count),
        "dual_clip_frac": masked_mean(dual, t.m, count),
    }


LOSS = LossType(objective=objective, unit="token")
