"""``rollout.entropy_estimator=exact`` on the transformers and simulated engines: each
window token's entropy, equal to the entropy of the sampling distribution a plain
forward pass gives (the learner's numerics) or of the simulated law, and nothing past the
window; the top-k log-probs of the same request are still right. (vLLM's exact entropies
are checked in test_arpo_rollout.py, on the engine that test starts.)"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from actors.engines import build_engine
from actors.engines.base import GenRequest
from actors.engines.hf_engine import sampling_logprobs
from arpo_async.core.config import config_from_dict
from arpo_async.core.entropy import entropy_from_topk, round_entropy

pytestmark = [pytest.mark.integration]

WINDOW, TOL = 8, 1e-5


async def test_exact_entropy_from_transformers(tiny_model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    prompt = list(tok.apply_chat_template([{"role": "user", "content": "What is 12*34?"}],
                                          add_generation_prompt=True, tokenize=True,
                                          return_dict=False))
    cfg = config_from_dict({"model": {"path": str(tiny_model_dir), "max_model_len": 256},
                            "rollout": {"entropy_estimator": "exact"},
                            "actors": {"engine": "transformers"}})
    hf = await build_engine(cfg, str(tiny_model_dir))
    try:
        for temperature, top_p in ((1.0, 1.0), (0.7, 0.9)):
            res = await hf.generate(GenRequest(
                prompt, max_tokens=16, temperature=temperature, top_p=top_p, logprobs_topk=10,
                topk_window=WINDOW, entropy=True, seed=3, ignore_eos=True))
            with torch.no_grad():
                logits = model(torch.tensor([prompt + res.tokens])).logits[0, len(prompt) - 1:-1]
            lp = sampling_logprobs(logits, temperature, top_p)
            p = lp.exp()
            nats = (-torch.where(p > 0, p * lp, torch.zeros_like(p)).sum(-1)).numpy()
            assert len(res.entropies) == len(res.tokens) == 16
            np.testing.assert_allclose(res.entropies[:WINDOW], nats[:WINDOW], atol=TOL, rtol=0)
            assert all(math.isnan(e) for e in res.entropies[WINDOW:])
            for t, top in enumerate(res.top_logprobs[:WINDOW]):
                want = [v for v in lp[t].topk(10).values.tolist() if v != -math.inf]
                np.testing.assert_allclose(top, want, atol=TOL)
            h = round_entropy(res.top_logprobs, res.logprobs, res.entropies, estimator="exact",
                              vocab_size=lp.shape[-1], window=WINDOW)
            assert h == pytest.approx(float(nats[:WINDOW].sum()) / math.log(lp.shape[-1]))
        plain = await hf.generate(GenRequest(prompt, max_tokens=4, logprobs_topk=5, seed=1))
        assert plain.entropies == []
    finally:
        await hf.close()


async def test_exact_entropy_from_the_simulated_engine(tiny_model_dir):
    """The simulated law's tail is uniform, so its tail-corrected top-k estimate is its
    exact entropy: the two estimators agree on it."""
    cfg = config_from_dict({"model": {"path": str(tiny_model_dir)},
                            "actors": {"engine": {"type": "simulated", "tokens_per_s": 5000.0}},
                            "tools": {"enabled": ["python"]}})
    sim = await build_engine(cfg, str(tiny_model_dir))
    res = await sim.generate(GenRequest([1, 2, 3], max_tokens=40, logprobs_topk=20,
                                        topk_window=WINDOW, entropy=True, seed=2))
    n = min(WINDOW, len(res.tokens))
    vocab = 2 ** 11
    tail = entropy_from_topk(res.top_logprobs[:n], vocab)
    np.testing.assert_allclose(np.asarray(res.entropies[:n]) / math.log(vocab), tail, atol=1e-6)
    assert all(math.isnan(e) for e in res.entropies[n:])
    await sim.close()
