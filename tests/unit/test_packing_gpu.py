"""The GPU attention backends of packed batches (learner/tree_attention.py) give the
padded path's loss and gradients: FlexAttention block masks for tree and flat packing
(no T x T mask), and flash-attention varlen for flat packing (bf16, when flash-attn is
installed). Marked ``gpu``: skipped without CUDA (tests/conftest.py). Written against
torch 2.13 and transformers 5.19; passed on one H200 (torch 2.11, CUDA 13.0) on 2026-12-04,
flash-attn not installed there."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from arpo_async.core.config import PPOLoss
from learner import tree_attention as TA
from learner.batching import collate, samples_from_groups
from learner.device import to_device
from learner.logprobs import packed_step_loss
from learner.packing import build_units, collate_packed
from learner.strategies import padded_step_loss

pytestmark = [pytest.mark.gpu]


def _groups():
    import numpy as np
    from hypothesis import HealthCheck, Phase, given, settings

    from tests.unit.test_packing_exact import groups

    found = []

    @settings(max_examples=6, deadline=None, derandomize=True,
              phases=(Phase.explicit, Phase.generate),
              suppress_health_check=list(HealthCheck))
    @given(gs=groups())
    def collect(gs):
        found.append(gs)

    collect()
    assert np.all([len(g) for g in found])
    return found


def _model(attn: str, dtype):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=40, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                      max_position_embeddings=512, tie_word_embeddings=False)
    model = Qwen3ForCausalLM._from_config(cfg, attn_implementation=attn, dtype=dtype).cuda()
    model.config.use_cache = False
    TA.enable(model)
    return model


def _grads(model, loss):
    model.zero_grad(set_to_none=False)
    loss.backward()
    return [p.grad.detach().float().clone() for p in model.parameters()]


def _compare(model, packing: str, backend: str, base: str, align: int, tol: float):
    s = PPOLoss(dual_clip=3.0)
    for gs in _groups():
        samples, _ = samples_from_groups(gs, "soft")
        total = max(sum(float(x.weight.sum()) for x in samples), 1.0)
        padded = to_device(collate(samples, 0), torch.device("cuda"))
        ref, _ = padded_step_loss(model, padded, s, 1.0, total)
        ref_g = _grads(model, ref)
        batch = collate_packed(build_units(samples, packing), 0, align)
        batch = to_device(batch, torch.device("cuda"))
        mask = TA.attention_mask(batch, backend, "cuda", next(model.parameters()).dtype, base)
        got, _ = packed_step_loss(model, model.get_output_embeddings(), batch, mask, s, 1.0, 4,
                                  total)
        assert float(got) == pytest.approx(float(ref), rel=tol, abs=tol)
        scale = max(float(g.abs().max()) for g in ref_g)
        for a, b in zip(ref_g, _grads(model, got)):
            assert float((a - b).abs().max()) <= tol * scale + 1e-6


@pytest.mark.parametrize("packing", ["tree", "flat"])
def test_flex_block_mask_equals_padded(packing):
    _compare(_model("sdpa", torch.float32), packing, "flex", "sdpa", 128, 1e-4)


@pytest.mark.skipif(importlib.util.find_spec("flash_attn") is None, reason="needs flash-attn")
def test_flat_varlen_equals_padded():
    model = _model("flash_attention_2", torch.bfloat16)
    _compare(model, "flat", "varlen", "flash_attention_2", 1, 3e-2)


def test_flex_mask_is_linear_in_length():
    """The block mask of 8k tokens holds O(T) indices, not a T x T tensor."""
    import numpy as np

    end = np.arange(1, 8193)
    bm = TA.flex_block_mask(end, "cuda")
    held = sum(t.numel() for t in (bm.kv_num_blocks, bm.kv_indices) if t is not None)
    assert held < 8192 * 8192 // 100
