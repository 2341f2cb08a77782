"""How far the top-k entropy estimates (what vLLM's logprobs allow) are from the exact
full-vocabulary entropy, on a real (randomly initialised, then briefly trained)
Qwen3ForCausalLM. Prints the error table quoted in arpo_async/core/entropy.py's docstring."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from arpo_async.core.entropy import entropy_from_logits, entropy_from_topk, window_entropy

transformers = pytest.importorskip("transformers")

VOCAB = 2048
KS = (5, 10, 20)
SUB_VOCAB = 256
WINDOW = 20


def _build_model() -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = transformers.Qwen3Config(
        vocab_size=VOCAB, hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, intermediate_size=256,
        max_position_embeddings=512)
    return transformers.Qwen3ForCausalLM(cfg).eval()


def _chain_batch(gen: torch.Generator, batch: int, length: int, noise: float) -> torch.Tensor:
    # Token sequences over a 256-token sub-vocabulary that follow a fixed successor map,
    # with a fraction ``noise`` of random successors: a model trained on them is
    # confident (noise 0) or moderately uncertain (noise 0.3).
    perm = torch.randperm(SUB_VOCAB, generator=torch.Generator().manual_seed(5))
    x = torch.randint(0, SUB_VOCAB, (batch,), generator=gen)
    cols = [x]
    for _ in range(length - 1):
        flip = torch.rand(batch, generator=gen) < noise
        x = torch.where(flip, torch.randint(0, SUB_VOCAB, (batch,), generator=gen), perm[x])
        cols.append(x)
    return torch.stack(cols, dim=1)


def _trained(noise: float, steps: int) -> torch.nn.Module:
    model = _build_model()
    gen = torch.Generator().manual_seed(1)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    model.train()
    for _ in range(steps):
        ids = _chain_batch(gen, 16, 64, noise)
        loss = model(input_ids=ids, labels=ids).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model.eval()


def _logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids).logits.float()  # [B, T, V]


def _errors(logits: torch.Tensor) -> dict[tuple[str, int], tuple[float, float]]:
    """(estimator, k) -> (per-token MAE, per-window MAE) against the exact entropy."""
    exact = entropy_from_logits(logits).numpy()  # [B, T]
    logp = torch.log_softmax(logits, dim=-1)
    out = {}
    for k in KS:
        top = logp.topk(k, dim=-1).values.numpy()  # [B, T, k]
        for name, vocab in (("renorm", None), ("tail", VOCAB)):
            est = np.stack([entropy_from_topk(list(row), vocab) for row in top])
            tok = float(np.abs(est - exact).mean())
            win = float(np.mean([
                abs(window_entropy(est[b, s:], WINDOW, "mean")
                    - window_entropy(exact[b, s:], WINDOW, "mean"))
                for b in range(est.shape[0]) for s in range(0, est.shape[1], WINDOW)]))
            out[(name, k)] = (tok, win)
    return out


def _table(settings: dict[str, torch.Tensor]) -> tuple[list[str], dict]:
    header = (f"{'setting (mean exact H)':34s} {'k':>3s}  {'renormalised':>15s}  "
              f"{'tail-corrected':>15s}")
    lines = [header]
    all_errs = {}
    for label, logits in settings.items():
        exact_mean = float(entropy_from_logits(logits).mean())
        errs = all_errs[label] = _errors(logits)
        for k in KS:
            r, t = errs[("renorm", k)], errs[("tail", k)]
            head = f"{label} ({exact_mean:.3f})" if k == KS[0] else ""
            lines.append(f"{head:34s} {k:3d}  {r[0]:.4f} / {r[1]:.4f}  {t[0]:.4f} / {t[1]:.4f}")
    return lines, all_errs


@pytest.mark.integration
def test_topk_entropy_error_table():
    gen = torch.Generator().manual_seed(2)
    random_logits = _logits(_build_model(), torch.randint(0, VOCAB, (4, 80), generator=gen))
    settings = {
        "random model, T=1.0": random_logits,
        "random model, T=0.3": random_logits / 0.3,
        "trained, noisy text, T=1.0": _logits(_trained(0.3, 40), _chain_batch(gen, 4, 80, 0.3)),
        "trained, clean text, T=1.0": _logits(_trained(0.0, 80), _chain_batch(gen, 4, 80, 0.0)),
    }
    lines, all_errs = _table(settings)
    print("\nMAE vs exact normalised entropy, per token / per 20-token window\n"
          + "\n".join(lines))

    for label, errs in all_errs.items():
        assert np.all(np.isfinite(np.array(list(errs.values())))), f"{label}: non-finite"
        tail_tok = [errs[("tail", k)][0] for k in KS]
        # The uniform tail is the max-entropy completion, so more known candidates can
        # only bring the estimate down towards the truth.
        assert all(b <= a + 1e-9 for a, b in itertools.pairwise(tail_tok)), (label, tail_tok)
    # The estimator the rollout uses must be the better one over the whole range.
    for k in KS:
        pooled = {name: np.mean([errs[(name, k)][0] for errs in all_errs.values()])
                  for name in ("renorm", "tail")}
        assert pooled["tail"] < pooled["renorm"], (k, pooled)
    # The settings must really span high and low entropy.
    means = [float(entropy_from_logits(v).mean()) for v in settings.values()]
    assert max(means) > 0.9 and min(means) < 0.3, means
