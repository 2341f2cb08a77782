"""``learner.loss.type = gspo``: Group Sequence Policy Optimization (Zheng et al., arXiv
2507.18071), the sequence-level ratio and clip.

For sequence i with trained tokens t (weights m_t) and advantage A_i:

    s_i   = exp( sum_t m_t log r_t / sum_t m_t )          the length-normalised ratio
    J_i   = min(s_i A_i, clip(s_i, 1 - eps_low, 1 + eps_high) A_i)
    loss  = -(1/G) sum_i J_i                               G: trained sequences (Z)

computed in the paper's GSPO-token form (its Eq. 13): each token carries s_i,t =
sg(s_i) pi_t / sg(pi_t), whose value is s_i and whose gradient is s_i grad log pi_t; the
driver averages the tokens of a sequence (unit "sequence"), so the gradient is the
paper's s_i A_i (1/|y_i|) sum_t grad log pi_t, clipped as a whole sequence. With a
per-token IS weight w_t != 1 (recompute mode against stale actors) the token mean is of
w_t J_i, as verl applies its rollout weights per token.

A_i is the m-weighted mean of the sequence's token advantages: the paper has one
advantage per sequence, and so does ARPO's soft attribution (the leaf's own); hard
attribution gives a shared token the mean over the leaves that contain it and only the
owner trains it, so a leaf's trained tokens may differ, and A_i is their mean (as AReaL
does); AEPO's entropy-aware advantage varies per token too and is averaged the same way.

Checked against verl (volcengine/verl@b178a3c, verl/trainer/ppo/core_algos.py,
``compute_policy_loss_gspo``): the same token form and ``seq-mean-token-mean``
aggregation; verl takes the advantages per token as they come and clamps the log ratio
at 10, here the sequence mean of A and the driver's +-20 per token. AReaL (@4aef98d,
areal/utils/functional/functional.py, ``ppo_actor_loss_fn(importance_sampling_level=
"sequence")``) differentiates through the mean log ratio (the same gradient) but
aggregates by token mean over the whole batch, so a long sequence weighs more there.
tests/unit/test_loss_types.py holds both comparisons.
"""

from __future__ import annotations

import torch

from learner.losses.base import LossType, Terms, masked_mean


def objective(t: Terms, s) -> tuple[torch.Tensor, dict[str, float]]:
    seq = t.seq
    log_seq = seq.mean(t.log_r.detach(), t.m)  # [n] log s_i, no gradient (sg)
    adv = seq.spread(seq.mean(t.adv, t.m))  # A_i on every token of sequence i
    ratio = torch.exp(seq.spread(log_seq) + t.logpi - t.logpi.detach())  # s_i,t
    lo, hi = 1.0 - s.eps_low, 1.0 + s.eps_high
    obj = torch.minimum(ratio * adv, torch.clamp(ratio, lo, hi) * adv)
    r, count = ratio.detach(), float(t.m.sum())
    return obj, {
        "clip_frac_high": masked_mean(((adv > 0) & (r > hi)).float(), t.m, count),
        "clip_frac_low": masked_mean(((adv < 0) & (r < lo)).float(), t.m, count),
        "seq_ratio_mean": masked_mean(r, t.m, count),
    }


LOSS = LossType(objective=objective, unit="sequence")
