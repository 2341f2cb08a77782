"""The packed learner paths (learner.packing = tree | flat) give the padded path's loss,
metrics and gradients to fp32 tolerance: random trees (hypothesis, derandomised: depth,
branching, lengths, tool tokens inside shared segments), soft and hard attribution,
bypass and recompute, truncate / mask / off IS modes, the dual clip, the AEPO switches,
chunked and unchunked log-probs, the dense / tiles attention backends, several
micro-batches and a two-rank split. A tiny Qwen3 built from its config (no files)."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from arpo_async.core.config import PPOLoss
from arpo_async.core.config.losses import CISPOLoss, GSPOLoss
from arpo_async.core.protocol import Trajectory, TrajectoryGroup
from learner import tree_attention as TA
from learner.batching import balanced_split, collate, samples_from_groups
from learner.logprobs import packed_forward, packed_step_loss
from learner.losses import LOSSES
from learner.packing import build_units, collate_packed, split_bins
from learner.strategies import padded_forward, padded_step_loss

VOCAB = 40
PAD = 0
_MODELS: dict[str, torch.nn.Module] = {}


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny matrices: one thread is 100x faster than a contended pool."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def tiny_model(attn: str = "sdpa") -> torch.nn.Module:
    if attn not in _MODELS:
        from transformers import Qwen3Config, Qwen3ForCausalLM

        torch.manual_seed(0)
        cfg = Qwen3Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=48,
                          num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                          head_dim=16, max_position_embeddings=256, tie_word_embeddings=False)
        model = Qwen3ForCausalLM._from_config(cfg, attn_implementation=attn,
                                              dtype=torch.float32)
        model.config.use_cache = False
        with torch.no_grad():  # peaked distributions: entropies and ratios spread out
            model.lm_head.weight.mul_(12.0)
        TA.enable(model)
        _MODELS[attn] = model
    return _MODELS[attn]


def old_model(model) -> torch.nn.Module:
    """A perturbed copy: the 'proximal' policy of recompute mode, so that r != 1."""
    key = id(model)
    if key not in _MODELS:
        old = copy.deepcopy(model)
        g = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for p in old.parameters():
                p.add_(torch.randn(p.shape, generator=g) * 0.05)
        _MODELS[key] = old
    return _MODELS[key]


# ----------------------------------------------------------------------------- random groups
@st.composite
def groups(draw, max_groups: int = 3):
    out = []
    for g in range(draw(st.integers(1, max_groups))):
        prompt = draw(st.lists(st.integers(1, VOCAB - 1), min_size=1, max_size=6))
        leaves: list[Trajectory] = []
        for i in range(draw(st.integers(1, 5))):
            parent = draw(st.integers(-1, i - 1))
            shared = 0
            if parent >= 0:
                shared = draw(st.integers(0, len(leaves[parent])))
            own = draw(st.integers(0 if shared else 1, 7))
            n = shared + own
            toks = np.array(draw(st.lists(st.integers(1, VOCAB - 1), min_size=own,
                                          max_size=own)), np.int32)
            mask = np.array(draw(st.lists(st.integers(0, 1), min_size=own, max_size=own)),
                            np.uint8)
            lp = np.array(draw(st.lists(st.floats(-5.5, -2.0, width=32), min_size=own,
                                        max_size=own)), np.float32) * mask
            ver = np.where(mask > 0, g, -1).astype(np.int32)
            if parent >= 0:
                p = leaves[parent]
                toks = np.concatenate([p.tokens[:shared], toks])
                mask = np.concatenate([p.loss_mask[:shared], mask])
                lp = np.concatenate([p.logprobs[:shared], lp]).astype(np.float32)
                ver = np.concatenate([p.versions[:shared], ver])
            assert len(toks) == n
            leaves.append(Trajectory(tokens=toks, loss_mask=mask, logprobs=lp, versions=ver,
                                     reward=float(draw(st.integers(0, 2))), parent=parent,
                                     branch_point=shared))
        out.append(TrajectoryGroup(group_id=f"g{g}", actor_id=0, prompt_id=str(g),
                                   prompt_tokens=np.array(prompt, np.int32), leaves=leaves))
    return out


SETTINGS = [
    ("soft", "bypass", PPOLoss()),
    ("hard", "bypass", PPOLoss()),
    ("soft", "recompute", PPOLoss(importance={"mode": "truncate", "cap": 1.5})),
    ("hard", "recompute", PPOLoss(importance={"mode": "mask", "low": 0.8, "high": 1.2})),
    ("soft", "recompute", PPOLoss(importance={"mode": "off"}, dual_clip=3.0)),
    ("soft", "bypass", PPOLoss(dual_clip=2.0, aepo_entropy_clip=True)),
    ("hard", "bypass", PPOLoss(aepo_entropy_adv_gamma=0.5, entropy_coef=0.01)),
    ("soft", "recompute", PPOLoss(aepo_entropy_clip=True, aepo_entropy_adv_gamma=-0.3,
                                       eps_low=0.1, eps_high=0.1)),
    ("hard", "recompute", GSPOLoss(eps_low=0.05, eps_high=0.05,
                                   importance={"mode": "truncate", "cap": 1.02},
                                   aepo_entropy_adv_gamma=0.3)),
    ("soft", "recompute", CISPOLoss(eps_low=0.05, eps_high=0.05, entropy_coef=0.01)),
    # tree credit: a token's advantage changes along a leaf, and by leaf in tree_grpo
    ("tree", "recompute", PPOLoss(dual_clip=3.0, aepo_entropy_adv_gamma=0.2)),
    ("tree_grpo", "bypass", PPOLoss()),
    ("tree", "bypass", GSPOLoss(eps_low=0.05, eps_high=0.05)),
]


# ----------------------------------------------------------------------------- the two paths
def reference(model, samples, s: PPOLoss, proximal: str, total: float):
    """learner.packing = padded: one micro-batch of right-padded rows."""
    batch = collate(samples, PAD)
    prox = None
    if proximal == "recompute":
        with torch.no_grad():
            prox = padded_forward(old_model(model), batch, 1.0, False)[0]
    return padded_step_loss(model, batch, s, 1.0, total, prox)


def packed(model, units, s: PPOLoss, proximal: str, total: float, backend: str,
           chunk: int):
    batch = collate_packed(units, PAD)
    base = "eager" if model.config._attn_implementation.endswith("eager") else "sdpa"
    mask = TA.attention_mask(batch, backend, "cpu", torch.float32, base)
    prox = None
    if proximal == "recompute":
        with torch.no_grad():
            old = old_model(model)
            prox = packed_forward(old, old.get_output_embeddings(), batch, mask, 1.0, chunk,
                                  False)[0]
    return packed_step_loss(model, model.get_output_embeddings(), batch, mask, s, 1.0, chunk,
                            total, prox)


def grads_of(model, loss) -> list[torch.Tensor]:
    model.zero_grad(set_to_none=False)
    loss.backward()
    return [p.grad.detach().clone() for p in model.parameters()]


def assert_same(ref, got, ref_grads, got_grads):
    (loss_r, met_r), (loss_g, met_g) = ref, got
    assert float(loss_g.detach()) == pytest.approx(float(loss_r.detach()), rel=1e-4, abs=1e-6)
    for k in met_r:
        assert met_g[k] == pytest.approx(met_r[k], rel=1e-4, abs=1e-5), k
    scale = max(float(g.abs().max()) for g in ref_grads) + 1e-12
    for a, b in zip(ref_grads, got_grads):
        assert float((a - b).abs().max()) <= 1e-4 * scale + 1e-7


def check(gs, mode, proximal, s, packing="tree", backend="tiles", chunk=3, attn="sdpa"):
    model = tiny_model(attn)
    samples, _ = samples_from_groups(gs, mode)
    total = max(sum(float(x.weight.sum()) for x in samples), 1.0)
    if LOSSES[s.type].unit == "sequence":
        total = max(float(sum(x.weight.sum() > 0 for x in samples)), 1.0)
    ref = reference(model, samples, s, proximal, total)
    ref_grads = grads_of(model, ref[0])
    got = packed(model, build_units(samples, packing), s, proximal, total, backend, chunk)
    assert_same(ref, got, ref_grads, grads_of(model, got[0]))


FAST = settings(max_examples=12, deadline=None, derandomize=True,
                phases=(Phase.explicit, Phase.reuse, Phase.generate),
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@pytest.mark.parametrize("case", range(len(SETTINGS)))
@FAST
@given(gs=groups())
def test_tree_equals_padded(case, gs):
    mode, proximal, s = SETTINGS[case]
    check(gs, mode, proximal, s)


@pytest.mark.parametrize("packing,backend,chunk,attn", [
    ("tree", "dense", 0, "sdpa"), ("tree", "dense", 2, "eager"), ("tree", "tiles", 0, "eager"),
    ("flat", "tiles", 4, "sdpa"), ("flat", "dense", 0, "sdpa")])
@FAST
@given(gs=groups())
def test_backends_equal_padded(packing, backend, chunk, attn, gs):
    check(gs, "soft", "recompute", PPOLoss(dual_clip=3.0), packing, backend, chunk, attn)


@settings(max_examples=8, deadline=None, derandomize=True,
          phases=(Phase.explicit, Phase.reuse, Phase.generate))
@given(gs=groups(), parts=st.integers(2, 3))
def test_microbatches_and_ranks_sum_to_the_whole(gs, parts):
    """Micro-batches (split_bins) and a two-rank split (balanced_split, whole groups per
    rank) each give parts whose losses and gradients add up to the one-batch result."""
    model = tiny_model()
    s = PPOLoss(dual_clip=3.0)
    samples, _ = samples_from_groups(gs, "hard")
    total = max(sum(float(x.weight.sum()) for x in samples), 1.0)
    ref = reference(model, samples, s, "bypass", total)
    ref_grads = grads_of(model, ref[0])
    units = build_units(samples, "tree")
    bins = split_bins([u.num_tokens for u in units], parts, cap=0)
    ranks = [build_units(part, "tree") for part in balanced_split(samples, 2)]
    for split in ([[units[i] for i in b] for b in bins], ranks):
        losses = [packed(model, part, s, "bypass", total, "tiles", 3)[0] for part in split]
        loss = sum(losses)
        assert float(loss) == pytest.approx(float(ref[0]), rel=1e-4, abs=1e-6)
        assert_same((ref[0], {}), (loss, {}), ref_grads, grads_of(model, loss))


def test_behaviour_disagreement_is_kept_apart():
    """A fork whose copy of the shared prefix carries another behaviour log-prob is not
    merged from that token on, and the loss still equals the padded one."""
    root = Trajectory(tokens=np.array([5, 6, 7, 8], np.int32),
                      loss_mask=np.array([1, 1, 1, 1], np.uint8),
                      logprobs=np.array([-3.0, -3.5, -4.0, -2.5], np.float32),
                      versions=np.zeros(4, np.int32), reward=1.0)
    lp = root.logprobs.copy()
    lp[2] = -3.9
    child = Trajectory(tokens=np.array([5, 6, 7, 9], np.int32), loss_mask=root.loss_mask,
                       logprobs=lp, versions=root.versions, reward=0.0, parent=0,
                       branch_point=3)
    g = TrajectoryGroup("g", 0, "p", np.array([1, 2], np.int32), [root, child])
    samples, _ = samples_from_groups([g], "soft")
    (unit,) = build_units(samples, "tree")
    assert unit.kept_apart == 1 and unit.num_tokens == 2 + 4 + 2
    check([g], "soft", "bypass", PPOLoss())


def test_layout_positions_and_mask():
    """Pre-order layout: a fork's tokens sit after its parent's, their position ids
    continue from the fork point, and the mask shows each token its own path only."""
    root = Trajectory(tokens=np.array([5, 6, 7], np.int32), loss_mask=np.ones(3, np.uint8),
                      logprobs=np.full(3, -3.0, np.float32), versions=np.zeros(3, np.int32))
    child = Trajectory(tokens=np.array([5, 9, 9, 9], np.int32), loss_mask=np.ones(4, np.uint8),
                       logprobs=np.full(4, -3.0, np.float32), versions=np.zeros(4, np.int32),
                       parent=0, branch_point=1)
    g = TrajectoryGroup("g", 0, "p", np.array([1, 2], np.int32), [root, child])
    samples, _ = samples_from_groups([g], "soft")
    batch = collate_packed(build_units(samples, "tree"), PAD)
    assert batch.input_ids[0].tolist() == [1, 2, 5, 6, 7, 9, 9, 9]
    assert batch.position_ids[0].tolist() == [0, 1, 2, 3, 4, 3, 4, 5]
    mask = TA.dense_mask(batch.end, "cpu")[0, 0]
    assert mask[5].tolist() == [True, True, True, False, False, True, False, False]
    assert mask[4].tolist() == [True] * 5 + [False] * 3
    # the shared token 5 is one target with both leaves' weight; 6 and 9 follow from it
    assert batch.ctx.tolist() == [1, 2, 3, 2, 5, 6]
    assert batch.count.tolist() == [2, 1, 1, 1, 1, 1]
    # the loss sees every trained copy: the shared token once per leaf, each its own leaf
    assert batch.ctx[batch.copy_target].tolist() == [1, 2, 3, 1, 2, 5, 6]
    assert batch.copy_seq.tolist() == [0, 0, 0, 1, 1, 1, 1]
