"""arpo_async/core/logits.py against the full-vocabulary formulas: log p(target), its
gradient through both chunked paths (the fused backward, and checkpointed chunks when
entropies are asked for), the entropy with one softmax copy, the greedy hits, the
temperature, -inf logits, and a causal LM that builds no logits of its own."""

from __future__ import annotations

import math

import pytest
import torch

from arpo_async.core.logits import causal_lm_logprobs, entropy_of_logits, target_stats

V, H, K = 700, 16, 90


def _setup(seed=0):
    torch.manual_seed(seed)
    head = torch.nn.Linear(H, V, bias=False)
    hidden = torch.randn(K, H, requires_grad=True)
    return head, hidden, torch.randint(0, V, (K,)), torch.randn(K)


def _reference(head, hidden, targets, temperature):
    logp = torch.log_softmax(head(hidden).float() / temperature, -1)
    p = logp.exp()
    ent = -(p * logp).sum(-1) / math.log(V)
    return logp.gather(-1, targets[:, None])[:, 0], ent, logp.argmax(-1) == targets


def _grads(head, hidden, value):
    hidden.grad, head.weight.grad = None, None
    value.backward()
    return hidden.grad.clone(), head.weight.grad.clone()


@pytest.mark.parametrize("temperature", [1.0, 0.6])
@pytest.mark.parametrize("chunk", [0, 7, 32, 1000])
@pytest.mark.parametrize("entropy", [False, True])
def test_values_and_gradients_equal_the_full_softmax(temperature, chunk, entropy):
    head, hidden, targets, g = _setup()
    s = target_stats(head, hidden, targets, temperature, chunk, entropy=entropy, hit=True)
    ref_lp, ref_ent, ref_hit = _reference(head, hidden, targets, temperature)
    torch.testing.assert_close(s.logp, ref_lp, atol=1e-5, rtol=0)
    assert torch.equal(s.hit, ref_hit)
    loss = (s.logp * g).sum() + (s.entropy.sum() if entropy else 0.0)
    ref_loss = (ref_lp * g).sum() + (ref_ent.sum() if entropy else 0.0)
    got, want = _grads(head, hidden, loss), _grads(head, hidden, ref_loss)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)
    if entropy:
        torch.testing.assert_close(s.entropy, ref_ent, atol=1e-5, rtol=0)


def test_entropy_with_masked_logits_and_its_range():
    z = torch.randn(4, 50) * 4
    z[:, :10] = -float("inf")
    logp = torch.log_softmax(z, -1)
    p = logp.exp()
    ref = -torch.where(p > 0, p * logp, torch.zeros_like(p)).sum(-1) / math.log(50)
    torch.testing.assert_close(entropy_of_logits(z), ref, atol=1e-5, rtol=0)
    assert float(entropy_of_logits(torch.zeros(1, 50))) == pytest.approx(1.0)
    with pytest.raises(ValueError, match="vocabulary of 1"):
        entropy_of_logits(torch.zeros(2, 1))


def test_no_targets_gives_an_empty_result_tied_to_the_graph():
    head, hidden, targets, _ = _setup()
    s = target_stats(head, hidden[:0], targets[:0], chunk=8, hit=True)
    assert s.logp.shape == (0,) and s.hit.shape == (0,)


def test_a_causal_lm_selects_targets_and_builds_no_logits(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    ids = torch.randint(0, model.config.vocab_size, (2, 20))
    select = torch.zeros(2, 19, dtype=torch.bool)
    select[0, 5:] = select[1, 12:] = True
    got = causal_lm_logprobs(model, ids, select, chunk=4).logp
    full = torch.log_softmax(model(input_ids=ids).logits[:, :-1].float(), -1)
    want = full.gather(-1, ids[:, 1:, None])[..., 0][select]
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    every = causal_lm_logprobs(model, ids, chunk=4).logp
    assert every.shape == (2, 19)
    torch.testing.assert_close(every[select], want, atol=1e-5, rtol=0)
