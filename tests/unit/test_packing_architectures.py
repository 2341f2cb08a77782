"""Packed trees for every decoder family the project claims: on small random models of
Llama (SmolLM2's architecture), Qwen3, Mistral and OLMo2, the packed paths (tree and flat,
tiles and dense attention) give the padded path's loss and gradients; Qwen3.5 (linear
attention layers) and a sliding-window Mistral are refused at start, naming the packing
that works, and train padded. The mask reaches each model through transformers' own
mask-function registry (learner/tree_attention.py), not through one family's forward."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given

from arpo_async.core.config import PPOLoss
from learner import tree_attention as TA
from learner.batching import collate, samples_from_groups
from learner.packing import build_units
from learner.strategies import padded_step_loss
from tests.unit.test_packing_exact import (FAST, PAD, VOCAB, _one_thread, assert_same,  # noqa: F401
                                           grads_of, groups, packed)

SMALL = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
             num_attention_heads=2, num_key_value_heads=1, head_dim=16,
             max_position_embeddings=256, tie_word_embeddings=True)


def _config(family: str):
    import transformers as T

    if family == "llama":
        return T.LlamaConfig(**SMALL)
    if family == "qwen3":
        return T.Qwen3Config(**SMALL)
    if family == "mistral":
        return T.MistralConfig(**SMALL, sliding_window=None)
    if family == "olmo2":
        return T.Olmo2Config(**{k: v for k, v in SMALL.items() if k != "head_dim"})
    if family == "mistral_window":
        return T.MistralConfig(**SMALL, sliding_window=64)
    if family == "qwen3_5":
        return T.Qwen3_5TextConfig(**SMALL, linear_num_value_heads=2, linear_num_key_heads=1,
                                   linear_key_head_dim=16, linear_value_head_dim=16,
                                   full_attention_interval=2)
    raise KeyError(family)


_MODELS: dict[str, torch.nn.Module] = {}


def model_of(family: str, packed_ok: bool = True) -> torch.nn.Module:
    if family not in _MODELS:
        from transformers import AutoModelForCausalLM

        torch.manual_seed(0)
        m = AutoModelForCausalLM.from_config(_config(family), attn_implementation="sdpa",
                                             dtype=torch.float32)
        m.config.use_cache = False
        with torch.no_grad():  # peaked distributions: ratios and clips spread out
            m.get_output_embeddings().weight.mul_(8.0)
        if packed_ok:
            TA.enable(m)
        _MODELS[family] = m
    return _MODELS[family]


FAMILIES = ["llama", "qwen3", "mistral", "olmo2"]


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("packing,backend", [("tree", "tiles"), ("tree", "dense"),
                                             ("flat", "tiles")])
@FAST
@given(gs=groups())
def test_packed_equals_padded(family, packing, backend, gs):
    model = model_of(family)
    assert model.config._attn_implementation == TA.PREFIX + "sdpa"
    s = PPOLoss(dual_clip=3.0)
    samples, _ = samples_from_groups(gs, "soft")
    total = max(sum(float(x.weight.sum()) for x in samples), 1.0)
    ref = padded_step_loss(model, collate(samples, PAD), s, 1.0, total)
    ref_grads = grads_of(model, ref[0])
    got = packed(model, build_units(samples, packing), s, "bypass", total, backend, 3)
    assert_same(ref, got, ref_grads, grads_of(model, got[0]))


@pytest.mark.parametrize("family,why", [("qwen3_5", "linear_attention"),
                                        ("mistral_window", "sliding window")])
def test_layers_a_tree_cannot_reach_are_refused(family, why):
    model = model_of(family, packed_ok=False)
    with pytest.raises(ValueError, match=f"{why}.*learner.packing=padded"):
        TA.enable(model)
    assert not model.config._attn_implementation.startswith(TA.PREFIX)


def test_preflight_refuses_before_anything_is_built(tmp_path):
    """The run's preflight reads the folder's config.json: a Qwen3.5 folder with packed
    trees stops in one line naming the key, before SFT; padded passes that check."""
    from arpo_async.core.config import ConfigError, config_from_dict
    from arpo_async.jobs.preflight import check_packing

    _config("qwen3_5").save_pretrained(tmp_path)
    cfg = config_from_dict({"model": {"path": str(tmp_path)}})
    with pytest.raises(ConfigError, match=r"^learner.packing: Qwen3_5TextConfig has "
                                          r"linear_attention layers.*learner.packing=padded"):
        check_packing(cfg)
    check_packing(config_from_dict({"model": {"path": str(tmp_path)},
                                    "learner": {"packing": "padded"}}))
    _config("llama").save_pretrained(tmp_path)
    check_packing(cfg)


@FAST
@given(gs=groups(max_groups=2))
def test_refused_family_trains_padded(gs):
    """What the refusal points at works: Qwen3.5's padded loss is finite and its gradient
    reaches every layer, the linear-attention ones included."""
    model = model_of("qwen3_5", packed_ok=False)
    samples, _ = samples_from_groups(gs, "soft")
    loss, _ = padded_step_loss(model, collate(samples, PAD), PPOLoss(), 1.0, 1.0)
    grads = grads_of(model, loss)
    assert torch.isfinite(loss)
    if any(float(x.weight.sum()) for x in samples) and any(float(abs(a).sum()) for a in
                                                           (x.advantages for x in samples)):
        layers = [g for (n, _), g in zip(model.named_parameters(), grads) if ".layers." in n]
        assert all(torch.isfinite(g).all() for g in layers)
