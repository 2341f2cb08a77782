"""arpo_async.core.entropy: hand values, agreement with the exact entropy, and the bounds that make
the tail-corrected estimate trustworthy."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from arpo_async.core.entropy import entropy_from_logits, entropy_from_topk, window_entropy

LN2 = math.log(2)


def test_logits_hand_values():
    logits = torch.tensor([
        [0.0, 0.0, 0.0, 0.0],                       # uniform: 1
        [0.0, -math.inf, -math.inf, -math.inf],     # one token: 0
        [0.0, 0.0, -math.inf, -math.inf],           # two of four: ln2 / ln4
    ])
    h = entropy_from_logits(logits)
    assert h.shape == (3,)
    np.testing.assert_allclose(h.numpy(), [1.0, 0.0, 0.5], atol=1e-6)
    assert not torch.isnan(h).any()


def test_logits_batch_shape_and_vocab_check():
    assert entropy_from_logits(torch.zeros(2, 5, 7)).shape == (2, 5)
    with pytest.raises(ValueError, match="vocabulary"):
        entropy_from_logits(torch.zeros(3, 1))


def test_topk_hand_values():
    half, quarter = math.log(0.5), math.log(0.25)
    # Renormalised: q = (2/3, 1/3), H / ln 2.
    renorm = entropy_from_topk([[half, quarter]])
    expected = -(2 / 3 * math.log(2 / 3) + 1 / 3 * math.log(1 / 3)) / LN2
    assert renorm[0] == pytest.approx(expected)
    # Tail-corrected with V=4: known 0.5 ln2 + 0.25 ln4 = ln2, tail 0.25 over 2 tokens
    # = 0.25 ln 8 = 0.75 ln2; total 1.75 ln2 / ln4 = 0.875 (exact for p=.5,.25,.125,.125).
    assert entropy_from_topk([[half, quarter]], vocab_size=4)[0] == pytest.approx(0.875)
    # No missing mass: the tail term vanishes.
    assert entropy_from_topk([[half, half]], vocab_size=4)[0] == pytest.approx(0.5)
    assert entropy_from_topk([[half, half]])[0] == pytest.approx(1.0)


def test_topk_ragged_single_and_empty():
    out = entropy_from_topk([[0.0], [math.log(0.5), math.log(0.5)], []])
    assert out[0] == 0.0 and out[1] == pytest.approx(1.0) and math.isnan(out[2])
    out_tail = entropy_from_topk([[math.log(0.5)]], vocab_size=3)
    # 0.5 known, 0.5 over 2 tokens: ln2/2 + 0.5 ln4 = 1.5 ln2 ; / ln3
    assert out_tail[0] == pytest.approx(1.5 * LN2 / math.log(3))


def test_topk_rejects_bad_input():
    with pytest.raises(ValueError, match="token 1"):
        entropy_from_topk([[-1.0], [0.5]])
    with pytest.raises(ValueError, match="token 0"):
        entropy_from_topk([[float("nan")]])
    with pytest.raises(ValueError, match="candidates"):
        entropy_from_topk([[-1.0, -2.0, -3.0]], vocab_size=2)
    with pytest.raises(ValueError, match="vocab_size"):
        entropy_from_topk([[-1.0]], vocab_size=1)


def test_full_candidate_list_equals_exact():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 50, generator=gen) * 3
    exact = entropy_from_logits(logits).numpy()
    logp = torch.log_softmax(logits, -1).numpy()
    np.testing.assert_allclose(entropy_from_topk(list(logp)), exact, atol=1e-5)
    np.testing.assert_allclose(entropy_from_topk(list(logp), vocab_size=50), exact, atol=1e-5)


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), scale=st.floats(0.1, 8.0), vocab=st.integers(8, 200))
def test_tail_estimate_is_upper_bound_and_monotone(seed, scale, vocab):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(4, vocab, generator=gen, dtype=torch.float64) * scale
    logp = torch.log_softmax(logits, -1)
    # the reference in float64 (entropy_from_logits works in float32: near-certain
    # positions there are off by ~1e-5, more than this comparison allows)
    exact = (-(logp.exp() * logp).sum(-1) / math.log(vocab)).numpy()
    np.testing.assert_allclose(entropy_from_logits(logits).numpy(), exact, atol=1e-4)
    previous = None
    for k in (1, 2, 4, vocab // 2, vocab):
        top = logp.topk(k, -1).values.numpy()
        est = entropy_from_topk(list(top), vocab_size=vocab)
        assert np.all(est >= exact - 1e-9)  # uniform tail = the max-entropy completion
        assert np.all((est >= 0) & (est <= 1))
        if previous is not None:
            assert np.all(est <= previous + 1e-9)
        previous = est
    np.testing.assert_allclose(previous, exact, atol=1e-9)


def test_window_entropy_rules():
    vals = [0.2, 0.4, math.nan, 0.6, 0.9]
    # the default sums the first k tokens (the ARPO authors' scale); nan is skipped
    assert window_entropy(vals, 3) == pytest.approx(0.6)
    assert window_entropy(vals, 4) == pytest.approx(1.2)
    assert window_entropy(vals, 100) == pytest.approx(2.1)
    assert window_entropy(vals, 3, "mean") == pytest.approx(0.3)  # not counted as 0
    assert window_entropy(vals, 4, "mean") == pytest.approx(0.4)
    assert window_entropy(vals, 100, "mean") == pytest.approx(np.mean([0.2, 0.4, 0.6, 0.9]))
    assert window_entropy(vals, 3, "max") == pytest.approx(0.4)  # nan skipped
    assert window_entropy(vals, 100, "max") == pytest.approx(0.9)
    for reduce in ("sum", "mean", "max"):
        assert window_entropy([0.0, 0.0], 5, reduce) == 0.0
        assert math.isnan(window_entropy([], 5, reduce))
        assert math.isnan(window_entropy([math.nan, math.nan], 5, reduce))
        assert window_entropy(np.array([0.5, 0.1]), 1, reduce) == pytest.approx(0.5)
    with pytest.raises(ValueError, match="k=0"):
        window_entropy([0.1], 0)
    with pytest.raises(ValueError, match="reduce='median'"):
        window_entropy([0.1], 1, "median")
