"""AEPO's entropy-aware advantage standardises H over the whole step's batch: moments
(sum, sum of squares, count) of any split of the tokens (micro-batches, ranks) add up to
the batch's, and the loss of the parts with those statistics adds up to the one-batch
loss; per-part statistics would not (learner/losses/, learner/trainer.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from arpo_async.core.config import PPOLoss
from learner.losses import LossInputs, entropy_moments, policy_loss, stats_from_moments


def _batch(seed: int, n: int = 60):
    g = np.random.default_rng(seed)
    mu = g.normal(-2, 1, n)
    return dict(mu=mu, prox=mu + g.normal(0, 0.2, n), adv=g.normal(0, 1, n),
                mask=(g.random(n) < 0.7).astype(float), ent=g.random(n) ** 2,
                logpi=mu + g.normal(0, 0.3, n))


def _inputs(b, lo, hi) -> LossInputs:
    t = {k: torch.tensor(v[lo:hi], dtype=torch.float64) for k, v in b.items()}
    return LossInputs(logprobs=t["logpi"].requires_grad_(), behaviour_logprobs=t["mu"],
                      proximal_logprobs=t["prox"], advantages=t["adv"], loss_mask=t["mask"],
                      entropy=t["ent"])


SPLITS = [(0, 7), (7, 30), (30, 31), (31, 60)]  # two ranks x two micro-batches


def test_moments_of_parts_add_up_to_the_batch():
    b = _batch(0)
    total = sum(entropy_moments(torch.tensor(b["ent"][lo:hi]),
                                torch.tensor(b["mask"][lo:hi] > 0)) for lo, hi in SPLITS)
    sel = b["ent"][b["mask"] > 0]
    assert stats_from_moments(total) == pytest.approx((sel.mean(), sel.std(ddof=1)),
                                                      rel=1e-12)
    # packed copies: a token standing for c copies counts c times
    ent, copies = torch.tensor([0.1, 0.5, 0.9]), torch.tensor([2.0, 0.0, 1.0])
    assert stats_from_moments(entropy_moments(ent, copies)) == pytest.approx(
        (np.mean([0.1, 0.1, 0.9]), np.std([0.1, 0.1, 0.9], ddof=1)))
    assert stats_from_moments(torch.zeros(3, dtype=torch.float64)) == (0.0, 0.0)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_split_loss_with_batch_statistics_equals_one_batch(seed):
    b = _batch(seed)
    s = PPOLoss(aepo_entropy_adv_gamma=0.2, aepo_entropy_clip=True, dual_clip=3.0)
    full = policy_loss(_inputs(b, 0, 60), s)[0].detach()
    moments = sum(entropy_moments(torch.tensor(b["ent"][lo:hi]),
                                  torch.tensor(b["mask"][lo:hi] > 0)) for lo, hi in SPLITS)
    stats, norm = stats_from_moments(moments), float(b["mask"].sum())
    batch_wide = sum(float(policy_loss(_inputs(b, lo, hi), s, normaliser=norm,
                                       entropy_stats=stats)[0].detach()) for lo, hi in SPLITS)
    per_part = sum(float(policy_loss(_inputs(b, lo, hi), s, normaliser=norm)[0].detach())
                   for lo, hi in SPLITS)
    assert batch_wide == pytest.approx(float(full), abs=1e-12)
    assert abs(per_part - float(full)) > 1e-4  # what per-micro-batch z gave
