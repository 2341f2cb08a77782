"""learner.losses: hand-computed tokens, a per-token reference written from the formula,
and properties (PPO/GRPO reduction, bypass == recompute, AEPO clipping, IS masking,
micro-batching)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from arpo_async.core.config import PPOLoss, config_from_dict
from learner.losses import LossInputs, policy_loss


def _inputs(logpi, mu, adv, mask=None, prox=None, ref=None, ent=None):
    def t(x):
        return None if x is None else torch.tensor(x, dtype=torch.float64)

    lp = t(logpi).requires_grad_(True)
    return LossInputs(logprobs=lp, behaviour_logprobs=t(mu), proximal_logprobs=t(prox),
                      advantages=t(adv), loss_mask=t(mask if mask is not None
                                                    else [1.0] * len(logpi)),
                      ref_logprobs=t(ref), entropy=t(ent))


def _v(loss):
    return float(loss.detach())


def _grad(loss, inp):
    (g,) = torch.autograd.grad(loss, inp.logprobs)
    return g.numpy()


# ----------------------------------------------------------------------------- hand values

R = [1.0, 1.5, 0.5, 1.1]
A = [1.0, 1.0, -1.0, -1.0]


def test_ppo_hand_values():
    inp = _inputs([math.log(r) for r in R], [0.0] * 4, A)
    loss, m = policy_loss(inp, PPOLoss(eps_low=0.2, eps_high=0.28))
    # objectives: 1, min(1.5, 1.28) = 1.28, min(-0.5, -0.8) = -0.8, -1.1
    assert _v(loss) == pytest.approx(-(1 + 1.28 - 0.8 - 1.1) / 4)
    np.testing.assert_allclose(_grad(loss, inp), [-0.25, 0, 0, 1.1 / 4], atol=1e-12)
    assert m["clip_frac_high"] == 0.25 and m["clip_frac_low"] == 0.25
    assert m["ratio_max"] == pytest.approx(1.5) and m["is_weight_mean"] == 1.0
    assert m["tokens"] == 4 and m["pg_loss"] == pytest.approx(m["loss"])


def test_aepo_entropy_balanced_clip_hand_values():
    inp = _inputs([math.log(r) for r in R], [0.0] * 4, A)
    loss, _ = policy_loss(inp, PPOLoss(eps_high=0.28, aepo_entropy_clip=True))
    assert _v(loss) == pytest.approx(-(1 + 1.28 - 0.8 - 1.1) / 4)  # value unchanged
    # token 1 (A > 0, r = 1.5 > 1.28) now passes gradient (1.28 / sg(r)) * r -> 1.28
    np.testing.assert_allclose(_grad(loss, inp), [-0.25, -1.28 / 4, 0, 1.1 / 4], atol=1e-12)


def test_dual_clip_hand_values():
    inp = _inputs([math.log(4.0), math.log(2.0)], [0.0, 0.0], [-1.0, -1.0])
    loss, m = policy_loss(inp, PPOLoss(eps_high=0.28, dual_clip=3.0))
    # token 0: min(-4, -1.28) = -4 -> max(-4, -3) = -3 (no grad); token 1: -2 (r A)
    assert _v(loss) == pytest.approx(-(-3 - 2) / 2)
    np.testing.assert_allclose(_grad(loss, inp), [0.0, 2.0 / 2], atol=1e-12)
    assert m["dual_clip_frac"] == 0.5


def test_truncated_and_masked_importance_weights_hand_values():
    # prox - mu = log 3 on token 0 (w = min(3, 2) = 2), log 1.5 on token 1.
    prox = [0.0, 0.0]
    mu = [-math.log(3.0), -math.log(1.5)]
    inp = _inputs([0.0, 0.0], mu, [1.0, 1.0], prox=prox)
    loss, m = policy_loss(inp, PPOLoss(importance={"mode": "truncate", "cap": 2.0}))
    assert _v(loss) == pytest.approx(-(2.0 + 1.5) / 2)
    assert m["is_weight_max"] == pytest.approx(2.0) and m["is_truncated_frac"] == 0.5
    assert m["is_raw_weight_max"] == pytest.approx(3.0)
    loss, m = policy_loss(inp, PPOLoss(importance={"mode": "mask", "low": 0.5, "high": 2.0}))
    assert _v(loss) == pytest.approx(-(0.0 + 1.0) / 2)  # masked token stays in Z
    assert m["is_masked_frac"] == 0.5
    loss, _ = policy_loss(inp, PPOLoss(importance={"mode": "off"}))
    assert _v(loss) == pytest.approx(-1.0)


def test_kl_and_entropy_terms_hand_values():
    ent = torch.tensor([0.5, 1.5], dtype=torch.float64, requires_grad=True)
    inp = _inputs([0.0, 0.0], [0.0, 0.0], [0.0, 0.0], ref=[math.log(2.0), 0.0])
    inp.entropy = ent
    loss, m = policy_loss(inp, PPOLoss(kl_coef=0.1, entropy_coef=0.01))
    k3 = 2.0 - math.log(2.0) - 1.0
    assert m["kl"] == pytest.approx(k3 / 2) and m["entropy"] == pytest.approx(1.0)
    assert _v(loss) == pytest.approx(0.1 * k3 / 2 - 0.01 * 1.0)
    loss.backward()
    np.testing.assert_allclose(ent.grad.numpy(), [-0.005, -0.005])


def test_entropy_aware_advantage_hand_values():
    # H = (0, 1, 2): mean 1, sample std 1, z = (-1, 0, 1); gamma 0.2 -> A * (0.8, 1, 1.2)
    inp = _inputs([0.0] * 3, [0.0] * 3, [1.0, 1.0, -1.0], ent=[0.0, 1.0, 2.0])
    loss, _ = policy_loss(inp, PPOLoss(aepo_entropy_adv_gamma=0.2))
    assert _v(loss) == pytest.approx(-(0.8 + 1.0 - 1.2) / 3)
    loss, _ = policy_loss(inp, PPOLoss(aepo_entropy_adv_gamma=0.2),
                          entropy_stats=(0.0, 2.0))  # z = (0, .5, 1)
    assert _v(loss) == pytest.approx(-(1.0 + 1.1 - 1.2) / 3)


def test_errors_name_the_field():
    inp = _inputs([0.0, 0.0], [0.0], [1.0, 1.0])
    with pytest.raises(ValueError, match="behaviour_logprobs: shape"):
        policy_loss(inp, PPOLoss())
    inp = _inputs([0.0], [0.0], [1.0])
    with pytest.raises(ValueError, match="ref_logprobs"):
        policy_loss(inp, PPOLoss(kl_coef=0.1))
    with pytest.raises(ValueError, match="entropy"):
        policy_loss(inp, PPOLoss(aepo_entropy_adv_gamma=0.2))
    inp.entropy = torch.zeros(1, dtype=torch.float64)
    with pytest.raises(ValueError, match="no gradient"):
        policy_loss(inp, PPOLoss(entropy_coef=0.1))
    with pytest.raises(ValueError, match="normaliser"):
        policy_loss(inp, PPOLoss(), normaliser=0)
    with pytest.raises(ValueError, match="dual_clip"):
        PPOLoss(dual_clip=0.5)
    with pytest.raises(ValueError, match="importance.mode"):
        PPOLoss(importance={"mode": "clip"})


def test_from_config_and_empty_mask():
    s = config_from_dict({"learner": {"loss": {"dual_clip": 3.0, "aepo_entropy_clip": True}}}
                         ).learner.loss
    assert s.type == "ppo" and s.dual_clip == 3.0 and s.aepo_entropy_clip and s.eps_high == 0.28
    inp = _inputs([0.3, -0.2], [0.0, 0.0], [1.0, -1.0], mask=[0.0, 0.0])
    loss, m = policy_loss(inp, s)
    assert _v(loss) == 0.0 and m["tokens"] == 0.0
    np.testing.assert_array_equal(_grad(loss, inp), [0.0, 0.0])


def test_garbage_at_masked_positions_stays_out_of_loss_and_gradient():
    # Tool/padding positions: behaviour log-prob 0 by protocol, anything in ref/advantage.
    inp = _inputs([-1.0, -3.0, -2.0], [-1.1, 0.0, -2.2], [0.5, 1e6, -0.3],
                  mask=[1.0, 0.0, 1.0], prox=[-1.0, 500.0, -2.0], ref=[-1.0, 1e4, -2.0])
    s = PPOLoss(kl_coef=0.1, dual_clip=3.0)
    loss, m = policy_loss(inp, s)
    clean = _inputs([-1.0, -2.0], [-1.1, -2.2], [0.5, -0.3], prox=[-1.0, -2.0],
                    ref=[-1.0, -2.0])
    want, _ = policy_loss(clean, s)
    assert _v(loss) == pytest.approx(_v(want)) and all(np.isfinite(list(m.values())))
    g = _grad(loss, inp)
    assert g[1] == 0.0 and np.allclose(g[[0, 2]], _grad(want, clean))


# ----------------------------------------------------------------------------- reference

def _reference(logpi, mu, prox, adv, mask, ref, ent, s: PPOLoss, norm=None):
    """Per-token loop straight from the formula, on 0-d tensors so autograd follows."""
    prox = mu if prox is None else prox
    sel = [float(ent[t].detach()) for t in range(len(mask)) if mask[t] > 0]
    mean_h = sum(sel) / len(sel) if sel else 0.0
    std_h = (sum((h - mean_h) ** 2 for h in sel) / (len(sel) - 1)) ** 0.5 if len(sel) > 1 else 0
    std_h = std_h if std_h > 0 else 1.0
    z = float(sum(mask)) if norm is None else norm
    total = 0.0
    for t in range(len(mask)):
        if mask[t] == 0:
            continue
        a = adv[t] * (1 + s.aepo_entropy_adv_gamma * (float(ent[t].detach()) - mean_h) / std_h) \
            if s.aepo_entropy_adv_gamma else adv[t]
        raw = math.exp(prox[t] - mu[t])
        imp = s.importance
        if imp.mode == "truncate":
            w = min(raw, imp.cap)
        else:
            w = 1.0 if imp.mode == "off" or imp.low <= raw <= imp.high else 0.0
        r = torch.exp(logpi[t] - prox[t])
        hi = 1 + s.eps_high
        if s.aepo_entropy_clip and float(r.detach()) > hi:
            clipped = hi * r / r.detach()
        else:
            clipped = torch.clamp(r, 1 - s.eps_low, hi)
        o = torch.minimum(r * a, clipped * a)
        if s.dual_clip and a < 0:
            o = torch.maximum(o, torch.tensor(s.dual_clip * a, dtype=o.dtype))
        total = total - mask[t] * w * o / z
        if s.kl_coef:
            d = ref[t] - logpi[t]
            total = total + s.kl_coef * mask[t] * (torch.exp(d) - d - 1) / z
        if s.entropy_coef:
            total = total - s.entropy_coef * mask[t] * ent[t] / z
    return total


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), n=st.integers(1, 12),
       is_mode=st.sampled_from(["truncate", "mask", "off"]), aepo_clip=st.booleans(),
       dual=st.sampled_from([0.0, 3.0]), gamma=st.sampled_from([0.0, 0.2]),
       kl=st.sampled_from([0.0, 0.05]), bypass=st.booleans())
def test_matches_per_token_reference(seed, n, is_mode, aepo_clip, dual, gamma, kl, bypass):
    g = np.random.default_rng(seed)
    mu = g.normal(-1.5, 0.5, n)
    prox = None if bypass else mu + g.normal(0, 0.6, n)
    logpi = (mu if bypass else prox) + g.normal(0, 0.5, n)
    adv, mask = g.normal(0, 1, n), (g.random(n) < 0.8).astype(float)
    ref, ent = mu + g.normal(0, 0.3, n), g.random(n) * 3
    s = PPOLoss(importance={"mode": is_mode}, aepo_entropy_clip=aepo_clip, dual_clip=dual,
                     aepo_entropy_adv_gamma=gamma, kl_coef=kl, entropy_coef=0.01)
    inp = _inputs(logpi.tolist(), mu.tolist(), adv.tolist(), mask.tolist(),
                  None if prox is None else prox.tolist(), ref.tolist(), None)
    inp.entropy = torch.tensor(ent, requires_grad=True)
    loss, _ = policy_loss(inp, s, normaliser=float(n))
    lp_ref = torch.tensor(logpi, requires_grad=True)
    ent_ref = torch.tensor(ent, requires_grad=True)
    expected = _reference(lp_ref, mu.tolist(), None if prox is None else prox.tolist(),
                          adv.tolist(), mask.tolist(), torch.tensor(ref), ent_ref, s, norm=n)
    if not torch.is_tensor(expected):  # every token masked
        assert _v(loss) == 0.0
        return
    assert _v(loss) == pytest.approx(_v(expected), abs=1e-10)
    got = torch.autograd.grad(loss, [inp.logprobs, inp.entropy])
    want = torch.autograd.grad(expected, [lp_ref, ent_ref], allow_unused=True)
    for a, b in zip(got, want):
        np.testing.assert_allclose(a.numpy(), np.zeros(n) if b is None else b.numpy(),
                                   atol=1e-10)


# ----------------------------------------------------------------------------- properties

def _ppo_numpy(logpi, old, adv, mask, eps_low, eps_high):
    """Textbook PPO clipped surrogate (token mean) and its gradient w.r.t. logpi."""
    r = np.exp(logpi - old)
    surr = np.minimum(r * adv, np.clip(r, 1 - eps_low, 1 + eps_high) * adv)
    n = mask.sum()
    unclipped = (r * adv <= np.clip(r, 1 - eps_low, 1 + eps_high) * adv) | \
        ((r >= 1 - eps_low) & (r <= 1 + eps_high))
    return -(mask * surr).sum() / n, -(mask * adv * r * unclipped) / n


@settings(max_examples=80, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), n=st.integers(1, 16), start=st.booleans(),
       is_mode=st.sampled_from(["truncate", "mask", "off"]))
def test_lockstep_reduces_to_ppo_grpo(seed, n, start, is_mode):
    g = np.random.default_rng(seed)
    old = g.normal(-2, 1, n)
    logpi = old.copy() if start else old + g.normal(0, 0.4, n)
    adv, mask = g.normal(0, 1, n), np.ones(n)
    inp = _inputs(logpi.tolist(), old.tolist(), adv.tolist(), mask.tolist(), prox=old.tolist())
    loss, m = policy_loss(inp, PPOLoss(eps_low=0.2, eps_high=0.28, importance={"mode": is_mode}))
    want_loss, want_grad = _ppo_numpy(logpi, old, adv, mask, 0.2, 0.28)
    assert _v(loss) == pytest.approx(want_loss, abs=1e-10)
    np.testing.assert_allclose(_grad(loss, inp), want_grad, atol=1e-10)
    assert m["is_weight_mean"] == 1.0
    if start:  # first step of an update: the loss is minus the mean advantage
        assert _v(loss) == pytest.approx(-adv.mean(), abs=1e-10)


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), n=st.integers(1, 16))
def test_bypass_equals_recompute_when_prox_is_mu(seed, n):
    g = np.random.default_rng(seed)
    mu, adv = g.normal(-2, 1, n), g.normal(0, 1, n)
    logpi = mu + g.normal(0, 0.5, n)
    s = PPOLoss(dual_clip=3.0)
    a = _inputs(logpi.tolist(), mu.tolist(), adv.tolist())
    b = _inputs(logpi.tolist(), mu.tolist(), adv.tolist(), prox=mu.tolist())
    (la, ma), (lb, mb) = policy_loss(a, s), policy_loss(b, s)
    assert _v(la) == _v(lb) and ma == mb
    np.testing.assert_array_equal(_grad(la, a), _grad(lb, b))


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), n=st.integers(2, 16))
def test_entropy_clip_keeps_value_and_revives_clipped_gradients(seed, n):
    g = np.random.default_rng(seed)
    old, adv = g.normal(-2, 1, n), np.abs(g.normal(0, 1, n)) + 0.1
    logpi = old + g.uniform(0.0, 0.8, n)
    logpi[0] = old[0] + 0.5  # at least one A > 0 token with r = 1.65 > 1.28
    plain, aepo = PPOLoss(eps_high=0.28), PPOLoss(eps_high=0.28, aepo_entropy_clip=True)
    a = _inputs(logpi.tolist(), old.tolist(), adv.tolist())
    b = _inputs(logpi.tolist(), old.tolist(), adv.tolist())
    (la, _), (lb, _) = policy_loss(a, plain), policy_loss(b, aepo)
    assert _v(la) == pytest.approx(_v(lb), abs=1e-12)
    ga, gb = _grad(la, a), _grad(lb, b)
    clipped = np.exp(logpi - old) > 1.28
    assert np.all(ga[clipped] == 0) and np.all(gb[clipped] < 0)
    np.testing.assert_allclose(gb[clipped], -1.28 * adv[clipped] / n)
    np.testing.assert_allclose(ga[~clipped], gb[~clipped])


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), n=st.integers(1, 16))
def test_mask_mode_masks_exactly_the_out_of_range_tokens(seed, n):
    g = np.random.default_rng(seed)
    mu, adv = g.normal(-2, 1, n), g.normal(0, 1, n)
    prox = mu + g.normal(0, 1.0, n)
    logpi = prox + g.normal(0, 0.1, n)
    raw = np.exp(prox - mu)
    out = (raw < 0.5) | (raw > 2.0)
    inp = _inputs(logpi.tolist(), mu.tolist(), adv.tolist(), prox=prox.tolist())
    loss, m = policy_loss(inp, PPOLoss(importance={"mode": "mask", "low": 0.5, "high": 2.0}))
    off = _inputs(logpi.tolist(), mu.tolist(), adv.tolist(), prox=prox.tolist())
    loss_off, _ = policy_loss(off, PPOLoss(importance={"mode": "off"}))
    g_mask, g_off = _grad(loss, inp), _grad(loss_off, off)
    assert np.all(g_mask[out] == 0)
    np.testing.assert_allclose(g_mask[~out], g_off[~out])
    assert m["is_masked_frac"] == pytest.approx(out.mean())


def test_micro_batches_add_up_to_the_batch():
    g = np.random.default_rng(3)
    n = 40
    mu, adv = g.normal(-2, 1, n), g.normal(0, 1, n)
    prox = mu + g.normal(0, 0.2, n)
    logpi = prox + g.normal(0, 0.3, n)
    mask, ent = (g.random(n) < 0.7).astype(float), g.random(n)
    s = PPOLoss(aepo_entropy_adv_gamma=0.2, aepo_entropy_clip=True, dual_clip=3.0)
    full = _inputs(logpi.tolist(), mu.tolist(), adv.tolist(), mask.tolist(), prox.tolist(),
                   ent=ent.tolist())
    loss_full, _ = policy_loss(full, s)
    sel = ent[mask > 0]
    stats = (float(sel.mean()), float(sel.std(ddof=1)))
    total, grads = 0.0, []
    for lo, hi in ((0, 13), (13, 40)):
        part = _inputs(logpi[lo:hi].tolist(), mu[lo:hi].tolist(), adv[lo:hi].tolist(),
                       mask[lo:hi].tolist(), prox[lo:hi].tolist(), ent=ent[lo:hi].tolist())
        loss, _ = policy_loss(part, s, normaliser=float(mask.sum()), entropy_stats=stats)
        total += _v(loss)
        grads.append(_grad(loss, part))
    assert total == pytest.approx(_v(loss_full), abs=1e-12)
    np.testing.assert_allclose(np.concatenate(grads), _grad(loss_full, full), atol=1e-12)
