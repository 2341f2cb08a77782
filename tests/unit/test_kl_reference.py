"""The KL term's k3 estimator as verl's ``low_var_kl`` computes it (learner/losses/base.py
``kl_k3``): hand values, the two clamps (log-ratio to [-20, 20] before exp, k3 to
[-10, 10]) and what they do to the gradient, and the term inside the policy loss."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from arpo_async.core.config import PPOLoss
from learner.losses import KL_LIMIT, LOG_RATIO_LIMIT, LossInputs, kl_k3, policy_loss


def _t(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64)


def test_k3_hand_values():
    ref, logpi = _t([-1.0, -1.0, -2.0, -1.0]), _t([-1.0, -1.0 - math.log(2), -1.0, -3.0])
    # d = ref - logpi = (0, ln 2, -1, 2): k3 = e^d - d - 1
    want = [0.0, 2 - math.log(2) - 1, math.exp(-1) + 1 - 1, math.exp(2) - 3]
    np.testing.assert_allclose(kl_k3(ref, logpi).numpy(), want, rtol=1e-12)


def test_k3_is_nonnegative_and_zero_only_at_equal_logprobs():
    g = torch.Generator().manual_seed(0)
    ref, logpi = -5 * torch.rand(1000, generator=g), -5 * torch.rand(1000, generator=g)
    k = kl_k3(ref, logpi)
    assert bool((k > 0).all()) and float(kl_k3(ref, ref).abs().max()) == 0.0


def test_clamps_as_verl():
    assert LOG_RATIO_LIMIT == 20.0 and KL_LIMIT == 10.0
    logpi = _t([-40.0, -3.0, -30.0]).requires_grad_()
    ref = _t([-5.0, -3.0 + 2.5, -1.0])
    k = kl_k3(ref, logpi)
    # d = 35 -> 20 -> e^20 - 21, clamped to 10; d = 2.5 -> e^2.5 - 3.5 = 8.68 (kept);
    # d = 29 -> clamped twice
    np.testing.assert_allclose(k.detach().numpy(), [10.0, math.exp(2.5) - 3.5, 10.0])
    k.sum().backward()
    # no gradient from a clamped token; d/dlogpi of e^d - d - 1 is -(e^d - 1) elsewhere
    np.testing.assert_allclose(logpi.grad.numpy(), [0.0, -(math.exp(2.5) - 1), 0.0])


def test_kl_term_in_the_loss_is_finite_where_masked():
    # masked positions may hold garbage (-inf, huge): neither the loss nor its gradient
    # may turn nan, and they contribute nothing
    logpi = _t([-1.0, -float("inf"), -2.0]).requires_grad_()
    inp = LossInputs(logprobs=logpi, behaviour_logprobs=_t([-1.0, 0.0, -2.0]),
                     proximal_logprobs=None, advantages=_t([0.0, 0.0, 0.0]),
                     loss_mask=_t([1.0, 0.0, 1.0]), ref_logprobs=_t([-1.5, 1e30, -2.0]))
    loss, m = policy_loss(inp, PPOLoss(kl_coef=0.1))
    k3 = math.exp(-0.5) + 0.5 - 1  # first token; the third has ref == logpi
    assert float(loss.detach()) == pytest.approx(0.1 * k3 / 2)
    assert m["kl"] == pytest.approx(k3 / 2)
    loss.backward()
    assert bool(torch.isfinite(logpi.grad).all()) and float(logpi.grad[1]) == 0.0
