"""``pipeline.sft_dtype = bfloat16``: SFT's forward and backward under bf16 autocast, the
weights and AdamW state float32 (arpo_async/jobs/sft.py ``_train_step``). One step on a
tiny random Qwen3 (no files): the weights stay float32 and move, the loss is the float32
step's to bf16 precision."""

from __future__ import annotations

import copy

import pytest
import torch

from arpo_async.jobs.sft import _train_step


def _model():
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                      max_position_embeddings=64)
    return Qwen3ForCausalLM._from_config(cfg, dtype=torch.float32).train()


def test_bf16_autocast_keeps_float32_weights_and_learns():
    base = _model()
    ids = torch.randint(1, 64, (2, 12), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(2, 12)
    losses = {}
    for dtype in ("float32", "bfloat16"):
        model = copy.deepcopy(base)
        before = [p.detach().clone() for p in model.parameters()]
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        losses[dtype], _ = _train_step(model, opt, ids, mask, 0, dtype)
        assert all(p.dtype == torch.float32 for p in model.parameters())
        assert any(not torch.equal(a, p) for a, p in zip(before, model.parameters()))
    assert losses["bfloat16"] == pytest.approx(losses["float32"], rel=2e-2)
    assert losses["bfloat16"] != losses["float32"]  # it ran in bf16: rounded differently
