"""The loss types of learner/losses/ beyond PPO, against their papers' formulas and the
peers' implementations, and every type exact on trees: the tree-packed layout gives the
loss the padded layout's loss and gradients to 1e-12 in float64 (random trees with
forks, tool tokens, groups of different policy versions, soft and hard attribution,
bypass and recompute with an IS weight, micro-batch and rank splits)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from arpo_async.core.config import LOSS_TYPES, config_from_dict
from learner.batching import balanced_split, collate, samples_from_groups
from learner.logprobs import packed_loss_inputs
from learner.losses import LOSSES, LossInputs, policy_loss
from learner.packing import build_units, collate_packed, split_bins
from tests.unit.test_packing_exact import groups

PAD = 0


def loss(kind: str, **keys):
    """The validated ``learner.loss`` section of ``type=kind``."""
    return config_from_dict({"learner": {"loss": {"type": kind, **keys}}}).learner.loss


class TableLM:
    """A language model that is a lookup table: log p(target | prefix) is one float64
    parameter per (prefix, target), its value fixed by the key, the same whichever layout
    asks. The tree and the padded layout each find their own keys (the padded rows'
    prefixes, the packed targets' paths), so the comparison checks the packing, not a
    shared mapping; no Qwen3 here, whose RMSNorm computes in fp32 (a float64 gradient
    through it agrees to ~1e-7 only: test_packing_exact.py checks the model path to fp32
    tolerance)."""

    def __init__(self):
        self.index: dict[tuple[int, ...], int] = {}

    def key_index(self, keys: list[tuple[int, ...]]) -> torch.Tensor:
        return torch.tensor([self.index.setdefault(k, len(self.index)) for k in keys],
                            dtype=torch.long)

    def params(self, shift: float = 0.0) -> torch.Tensor:
        values = [-0.5 - 3.0 * ((hash(k) % 10007) / 10007.0) + shift * ((hash(k) % 7) - 3)
                  for k in sorted(self.index, key=self.index.get)]
        return torch.tensor(values, dtype=torch.float64, requires_grad=True)


def padded_keys(batch) -> tuple[list[tuple[int, ...]], torch.Tensor]:
    ids, where = batch.input_ids, (batch.weight > 0).nonzero().tolist()
    return [tuple(ids[i, :p + 2].tolist()) for i, p in where], batch.weight > 0


def packed_keys(batch) -> list[tuple[int, ...]]:
    ids, pred = batch.input_ids[0].tolist(), batch.pred
    keys = []
    for ctx, target in zip(batch.ctx.tolist(), batch.targets.tolist()):
        path, node = [], ctx
        while node >= 0:
            path.append(ids[node])
            node = int(pred[node])
        keys.append(tuple(reversed(path)) + (target,))
    return keys


def _z(samples, kind: str) -> float:
    if LOSSES[kind].unit == "token":
        return max(sum(float(x.weight.sum()) for x in samples), 1.0)
    return max(float(sum(x.weight.sum() > 0 for x in samples)), 1.0)


def padded(table: TableLM, samples, s, recompute: bool, z: float):
    """(loss, metrics, d loss / d table) of the padded layout."""
    batch = collate(samples, PAD)
    keys, sel = padded_keys(batch)
    idx = table.key_index(keys)
    theta, old = table.params(), table.params(0.05)

    def place(values):
        out = torch.zeros(batch.weight.shape, dtype=torch.float64)
        return out.index_put((sel.nonzero()[:, 0], sel.nonzero()[:, 1]), values)

    inputs = LossInputs(
        logprobs=place(theta[idx]), behaviour_logprobs=batch.behaviour.double(),
        proximal_logprobs=place(old[idx].detach()) if recompute else None,
        advantages=batch.advantages.double(), loss_mask=batch.weight.double(),
        seq_ids=batch.seq_ids)
    value, metrics = policy_loss(inputs, s, normaliser=z)
    value.backward()
    return float(value.detach()), metrics, theta.grad


def packed(table: TableLM, units, s, recompute: bool, z: float):
    batch = collate_packed(units, PAD)
    idx = table.key_index(packed_keys(batch))
    theta, old = table.params(), table.params(0.05)
    batch.behaviour, batch.copy_adv = batch.behaviour.double(), batch.copy_adv.double()
    batch.copy_m = batch.copy_m.double()
    inputs = packed_loss_inputs(batch, theta[idx], None,
                                old[idx].detach() if recompute else None)
    value, metrics = policy_loss(inputs, s, normaliser=z)
    value.backward()
    return float(value.detach()), metrics, theta.grad


def assert_exact(ref, got):
    assert abs(got[0] - ref[0]) <= 1e-12 * max(1.0, abs(ref[0])), (got[0], ref[0])
    for k, v in ref[1].items():
        assert got[1][k] == pytest.approx(v, rel=1e-9, abs=1e-12), k
    n = ref[2].shape[0]  # parameters the padded layout asked for (the tree asks no other)
    assert got[2].shape[0] == n
    torch.testing.assert_close(got[2], ref[2], rtol=1e-12, atol=1e-14)


CASES = [(kind, mode, proximal, keys)
         for kind, keys in [("ppo", {"dual_clip": 3.0}),
                            ("gspo", {"eps_low": 0.05, "eps_high": 0.05}),
                            ("cispo", {"eps_low": 0.02, "eps_high": 0.02})]
         for mode, proximal in [("soft", "bypass"), ("hard", "recompute")]]
EXACT = settings(max_examples=25, deadline=None, derandomize=True,
                 phases=(Phase.explicit, Phase.reuse, Phase.generate),
                 suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c[:3])))
@EXACT
@given(gs=groups())
def test_every_loss_type_is_exact_on_trees(case, gs):
    """Groups of different versions (each group's behaviour log-probs its own), forks,
    tool tokens inside shared segments; recompute with a truncated IS weight."""
    kind, mode, proximal, keys = case
    s = loss(kind, proximal=proximal, importance={"mode": "truncate", "cap": 1.02}, **keys)
    samples, _ = samples_from_groups(gs, mode)
    z, table = _z(samples, kind), TableLM()
    ref = padded(table, samples, s, proximal == "recompute", z)
    got = packed(table, build_units(samples, "tree"), s, proximal == "recompute", z)
    assert_exact(ref, got)


@settings(max_examples=10, deadline=None, derandomize=True,
          phases=(Phase.explicit, Phase.reuse, Phase.generate))
@given(gs=groups(), parts=st.integers(2, 3))
def test_sequence_level_parts_sum_to_the_whole(gs, parts):
    """GSPO's Z counts sequences: micro-batches and a two-rank split, each given the whole
    mini-batch's count, add up to the one-batch loss and gradient (a leaf is never
    split)."""
    s = loss("gspo", eps_low=0.05, eps_high=0.05)
    samples, _ = samples_from_groups(gs, "soft")
    z, table = _z(samples, "gspo"), TableLM()
    ref = padded(table, samples, s, False, z)
    units = build_units(samples, "tree")
    bins = split_bins([u.num_tokens for u in units], parts, cap=0)
    ranks = [build_units(part, "tree") for part in balanced_split(samples, 2)]
    # what the trainer all-reduces as Z: the parts' trained sequences add up to the whole
    assert collate(samples, PAD).num_sequences == z or z == 1.0
    assert sum(collate_packed(p, PAD).num_sequences for p in ranks) == \
        collate_packed(units, PAD).num_sequences == collate(samples, PAD).num_sequences
    for split in ([[units[i] for i in b] for b in bins], ranks):
        value, grad = 0.0, torch.zeros_like(ref[2])
        for part in split:
            v, _, g = packed(table, part, s, False, z)
            value, grad = value + v, grad + g
        assert_exact((ref[0], {}, ref[2]), (value, {}, grad))


# ----------------------------------------------------------------------------- GSPO
def _rows(seed: int, rows: int, length: int, equal: bool):
    """Padded float64 inputs: log-probs with grad, behaviour, per-row or per-token
    advantages, masks of equal or unequal lengths."""
    g = torch.Generator().manual_seed(seed)
    logpi = (torch.rand(rows, length, generator=g, dtype=torch.float64) * -3.0 - 0.5)
    mu = logpi + torch.randn(rows, length, generator=g, dtype=torch.float64) * 0.3
    adv = torch.randn(rows, 1, generator=g, dtype=torch.float64).expand(rows, length).clone()
    mask = torch.ones(rows, length, dtype=torch.float64)
    if not equal:
        for i in range(rows):
            mask[i, 1 + i % (length - 1):] = 0.0
    return logpi.requires_grad_(), mu, adv, mask


def _ours(logpi, mu, adv, mask, s):
    rows = torch.arange(logpi.shape[0])[:, None].expand_as(logpi)
    return policy_loss(LossInputs(logprobs=logpi, behaviour_logprobs=mu,
                                  proximal_logprobs=None, advantages=adv, loss_mask=mask,
                                  seq_ids=rows), s)[0]


def gspo_paper(logpi, mu, adv, mask, eps_low, eps_high):
    """arXiv 2507.18071 Eq. 5-7, one sequence at a time: s_i = (pi/pi_old)^(1/|y_i|),
    J = (1/G) sum_i min(s_i A_i, clip(s_i) A_i), differentiated through s_i itself."""
    total, count = 0.0, 0
    for i in range(logpi.shape[0]):
        m = mask[i]
        if m.sum() == 0:
            continue
        s_i = torch.exp((m * (logpi[i] - mu[i])).sum() / m.sum())
        a_i = (m * adv[i]).sum() / m.sum()
        total = total + torch.minimum(s_i * a_i, s_i.clamp(1 - eps_low, 1 + eps_high) * a_i)
        count += 1
    return -total / count


def gspo_verl(logpi, mu, adv, mask, eps_low, eps_high):
    """verl@b178a3c compute_policy_loss_gspo, restated: the token form with the
    sequence's mean log ratio, max of the two negated surrogates, seq-mean-token-mean."""
    lens = mask.sum(-1).clamp(min=1)
    seq = ((logpi - mu) * mask).sum(-1) / lens
    ratio = torch.exp((logpi - logpi.detach() + seq.detach()[:, None]).clamp(max=10.0))
    per = torch.maximum(-adv * ratio, -adv * ratio.clamp(1 - eps_low, 1 + eps_high))
    rows = (per * mask).sum(-1) / (mask.sum(-1) + 1e-8)
    kept = (mask.sum(-1) > 0).double()
    return (rows * kept).sum() / kept.sum()


def gspo_areal(logpi, mu, adv, mask, eps_low, eps_high):
    """AReaL@4aef98d ppo_actor_loss_fn(importance_sampling_level="sequence"), restated:
    the ratio is exp of the mean log ratio (gradient through it), token mean overall."""
    lens = mask.sum(-1, keepdim=True).clamp(min=1)
    ratio = torch.exp(((logpi - mu) * mask).sum(-1, keepdim=True) / lens).expand_as(logpi)
    a = (adv * mask).sum(-1, keepdim=True) / lens
    per = torch.maximum(-a * ratio, -a * ratio.clamp(1 - eps_low, 1 + eps_high))
    return (per * mask).sum() / mask.sum()


def _value_and_grad(fn, logpi, *args):
    logpi.grad = None
    value = fn(logpi, *args)
    value.backward()
    return float(value), logpi.grad.clone()


@pytest.mark.parametrize("eps", [(3e-4, 4e-4), (0.2, 0.2), (10.0, 10.0)])
def test_gspo_is_the_papers_sequence_objective(eps):
    """Value and gradient equal the paper's per-sequence formula, whether the sequence
    ratios are clipped (the paper's 3e-4 / 4e-4: nearly all are) or not."""
    s = loss("gspo", eps_low=min(eps[0], 0.99), eps_high=eps[1], importance={"mode": "off"})
    for equal in (True, False):
        x = _rows(3, 6, 7, equal)
        want = _value_and_grad(gspo_paper, *x, min(eps[0], 0.99), eps[1])
        got = _value_and_grad(lambda *a: _ours(*a, s), *x)
        assert got[0] == pytest.approx(want[0], rel=1e-12, abs=1e-15)
        torch.testing.assert_close(got[1], want[1], rtol=1e-10, atol=1e-14)


def test_gspo_against_verl_and_areal():
    """verl: equal up to its 1e-8 guard in the denominators (advantages constant per
    sequence, as GRPO's). AReaL: equal
    when every sequence has the same length, different otherwise (it weighs a sequence
    by its length: a token mean over the batch)."""
    s = loss("gspo", eps_low=0.1, eps_high=0.1, importance={"mode": "off"})
    for equal in (True, False):
        x = _rows(5, 5, 6, equal)
        ours = _value_and_grad(lambda *a: _ours(*a, s), *x)
        verl = _value_and_grad(gspo_verl, *x, 0.1, 0.1)
        areal = _value_and_grad(gspo_areal, *x, 0.1, 0.1)
        assert ours[0] == pytest.approx(verl[0], rel=1e-7)
        torch.testing.assert_close(ours[1], verl[1], rtol=1e-7, atol=1e-12)
        if equal:
            assert ours[0] == pytest.approx(areal[0], rel=1e-12)
        else:
            assert abs(ours[0] - areal[0]) > 1e-3


def test_gspo_hand_values():
    """Two sequences: log ratios (0.1, 0.3) and (-0.2); A = +1 and -1; eps 0.1 / 0.1."""
    logpi = torch.tensor([[0.1, 0.3], [-0.2, 0.0]], dtype=torch.float64, requires_grad=True)
    mu = torch.zeros(2, 2, dtype=torch.float64)
    adv = torch.tensor([[1.0, 1.0], [-1.0, -1.0]], dtype=torch.float64)
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]], dtype=torch.float64)
    s1, s2 = np.exp(0.2), np.exp(-0.2)  # 1.2214 > 1.1 (clipped: A > 0); 0.8187 < 0.9 (A < 0)
    want = -(min(s1, 1.1) * 1.0 + max(s2, 0.9) * -1.0) / 2  # min(s A, clip(s) A) per row
    value, metrics = policy_loss(LossInputs(
        logprobs=logpi, behaviour_logprobs=mu, proximal_logprobs=None, advantages=adv,
        loss_mask=mask, seq_ids=torch.tensor([[0, 0], [1, 1]])),
        loss("gspo", eps_low=0.1, eps_high=0.1, importance={"mode": "off"}))
    assert float(value) == pytest.approx(want, rel=1e-12)
    value.backward()
    assert float(logpi.grad.abs().sum()) == 0.0  # both sequences clipped: no gradient
    assert metrics["clip_frac_high"] == pytest.approx(2 / 3)
    assert metrics["clip_frac_low"] == pytest.approx(1 / 3)


def test_a_sequence_level_loss_needs_sequence_ids():
    x = _rows(1, 2, 3, True)
    with pytest.raises(ValueError, match="sequence-level: it needs LossInputs.seq_ids"):
        policy_loss(LossInputs(logprobs=x[0], behaviour_logprobs=x[1], proximal_logprobs=None,
                               advantages=x[2], loss_mask=x[3]), loss("gspo"))


def test_every_registered_type_runs_through_the_driver():
    x = _rows(2, 3, 4, False)
    for kind in LOSS_TYPES:
        rows = torch.arange(3)[:, None].expand(3, 4)
        value, metrics = policy_loss(LossInputs(
            logprobs=x[0], behaviour_logprobs=x[1], proximal_logprobs=None, advantages=x[2],
            loss_mask=x[3], seq_ids=rows), loss(kind))
        assert torch.isfinite(value) and metrics["tokens"] == float(x[3].sum()), kind
        assert {"clip_frac_high", "clip_frac_low", "is_weight_mean"} <= set(metrics), kind


# ----------------------------------------------------------------------------- CISPO
def cispo_paper(logpi, mu, adv, mask, eps_low, eps_high):
    """arXiv 2506.13585 Eq. 4-5: (1 / sum |o_i|) sum_i sum_t sg(clip(r)) A log pi."""
    r = torch.exp(logpi.detach() - mu).clamp(1 - eps_low, 1 + eps_high)
    return -(mask * r * adv * logpi).sum() / mask.sum()


def cispo_verl(logpi, mu, adv, mask, eps_low, eps_high):
    """verl@b178a3c compute_policy_loss_cispo, restated: log r clamped to +-20, the
    clipped ratio detached, -sg(clip(r)) A log pi, token mean."""
    ratio = torch.exp((logpi - mu).clamp(-20.0, 20.0))
    per = -ratio.clamp(1 - eps_low, 1 + eps_high).detach() * adv * logpi
    return (per * mask).sum() / mask.sum()


@pytest.mark.parametrize("eps", [(1.0, 0.28), (0.1, 0.1), (0.0, 0.0)])
def test_cispo_is_the_papers_objective_and_verls(eps):
    """Value and gradient equal the paper's formula and verl's implementation, with no
    lower bound (the paper's), a narrow one, and a zero-width clip (a weight of exactly 1:
    plain REINFORCE)."""
    s = loss("cispo", eps_low=eps[0], eps_high=eps[1], importance={"mode": "off"})
    for equal in (True, False):
        x = _rows(7, 5, 6, equal)
        ours = _value_and_grad(lambda *a: _ours(*a, s), *x)
        for ref in (cispo_paper, cispo_verl):
            want = _value_and_grad(ref, *x, *eps)
            assert ours[0] == pytest.approx(want[0], rel=1e-12)
            torch.testing.assert_close(ours[1], want[1], rtol=1e-12, atol=1e-15)


def test_cispo_keeps_the_gradient_ppo_clips():
    """One token with A > 0 and r = 1.5 > 1 + eps: PPO's gradient is 0 there, CISPO's is
    -(1 + eps_high) A (the clipped weight, not 0 and not r)."""
    logpi = torch.tensor([np.log(1.5)], dtype=torch.float64, requires_grad=True)
    inputs = dict(behaviour_logprobs=torch.zeros(1, dtype=torch.float64),
                  proximal_logprobs=None, advantages=torch.ones(1, dtype=torch.float64),
                  loss_mask=torch.ones(1, dtype=torch.float64), seq_ids=torch.zeros(1))
    grads = {}
    for kind in ("ppo", "cispo"):
        logpi.grad = None
        value, metrics = policy_loss(LossInputs(logprobs=logpi, **inputs),
                                     loss(kind, eps_low=0.2, eps_high=0.2,
                                          importance={"mode": "off"}))
        value.backward()
        grads[kind] = float(logpi.grad[0])
        assert metrics["clip_frac_high"] == 1.0, kind
    assert grads["ppo"] == 0.0
    assert grads["cispo"] == pytest.approx(-1.2, rel=1e-12)
