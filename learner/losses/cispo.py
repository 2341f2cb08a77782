"""``learner.loss.type = cispo``: Clipped IS-weight Policy Optimization (MiniMax-M1,
arXiv 2506.13585, Eq. 4-5), REINFORCE with the importance weight clipped and detached.

    r_t  = exp(log r_t)                      pi_theta / the proximal (old) policy
    o_t  = sg(clip(r_t, 1 - eps_low, 1 + eps_high)) A_t log pi_theta_t
    loss = -(1 / sum_t m_t) sum_t m_t w_t o_t            token mean (unit "token")

Unlike PPO's clip, which zeroes the gradient of a token whose ratio left the trust
region (in the direction that would move it further), CISPO keeps every token's
gradient, sg(clip(r)) A grad log pi, and only bounds its weight. The paper leaves the
lower bound off (``eps_low = 1``: the weight's lower clip is 0, and a ratio is never
below it) and tunes the upper one; it gives no value we could check, so ``eps_high``
defaults to this project's PPO upper clip, 0.28. The loss's value is the paper's (a
weighted log-likelihood, not a surrogate near 0), as verl reports it.

Checked against verl (volcengine/verl@b178a3c, verl/trainer/ppo/core_algos.py,
``compute_policy_loss_cispo``): the same objective and token-mean aggregation; verl
clamps log r to +-20 before exp, as the driver here does. tests/unit/test_loss_types.py
compares both, value and gradient.
"""

from __future__ import annotations

import torch

from learner.losses.base import LossType, Terms, masked_mean


def objective(t: Terms, s) -> tuple[torch.Tensor, dict[str, float]]:
    r = torch.exp(t.log_r.detach())
    lo, hi = 1.0 - s.eps_low, 1.0 + s.eps_high
    weight = torch.clamp(r, lo, hi)  # no gradient: sg(clip(r))
    count = float(t.m.sum())
    return weight * t.adv * t.logpi, {
        "clip_frac_high": masked_mean((r > hi).float(), t.m, count),
        "clip_frac_low": masked_mean((r < lo).float(), t.m, count),
    }


LOSS = LossType(objective=objective, unit="token")
