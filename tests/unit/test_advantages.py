"""learner.advantages: hand-computed trees, a slow reference that materialises every
token of every leaf and groups equal prefixes, and hypothesis properties."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from arpo_async.core.protocol import Trajectory
from learner.advantages import (hard_advantages, soft_advantages, token_advantages,
                                 tree_grpo_advantages, treerl_advantages)


def test_soft_hand_values():
    adv, m = soft_advantages([1.0, 0.0, 0.0, 1.0])
    # mean 0.5, sample std sqrt(1/3): A = +-0.5 / 0.57735 = +-0.8660
    np.testing.assert_allclose(adv, [0.866025, -0.866025, -0.866025, 0.866025], atol=1e-5)
    assert m["reward_std"] == pytest.approx(math.sqrt(1 / 3))
    assert m["zero_std_group"] == 0.0
    assert np.all(soft_advantages([0.7])[0] == 0)  # a group of one: nothing to compare
    adv, m = soft_advantages([0.3, 0.3, 0.3])
    assert np.all(adv == 0) and m["zero_std_group"] == 1.0
    with pytest.raises(ValueError, match="leaf 1"):
        soft_advantages([0.0, math.nan])
    with pytest.raises(ValueError, match="empty"):
        soft_advantages([])


def test_hard_hand_tree():
    # leaf0: root, 6 tokens; leaf1 forks leaf0 at 4 (7 tokens); leaf2 forks leaf1 at 2
    # (5 tokens); leaf3: root, 3 tokens.
    a = np.array([1.0, 2.0, 4.0, 8.0])
    advs, owner, m = hard_advantages([-1, 0, 1, -1], [0, 4, 2, 0], [6, 7, 5, 3], a)
    s012, s01 = (1 + 2 + 4) / 3, (1 + 2) / 2
    np.testing.assert_allclose(advs[0], [s012, s012, s01, s01, 1, 1])
    np.testing.assert_allclose(advs[1], [s012, s012, s01, s01, 2, 2, 2])
    np.testing.assert_allclose(advs[2], [s012, s012, 4, 4, 4])
    np.testing.assert_allclose(advs[3], [8, 8, 8])
    assert owner[0].tolist() == [1] * 6
    assert owner[1].tolist() == [0] * 4 + [1] * 3
    assert owner[2].tolist() == [0] * 2 + [1] * 3
    assert owner[3].tolist() == [1] * 3
    assert m["tokens_total"] == 21 and m["tokens_unique"] == 6 + 3 + 3 + 3
    assert m["shared_token_frac"] == pytest.approx((2 * 3 + 2 * 2) / 21)


def test_hard_rejects_bad_trees():
    with pytest.raises(ValueError, match="leaf 1: branch_point 5 outside"):
        hard_advantages([-1, 0], [0, 5], [4, 4], [0, 0])
    with pytest.raises(ValueError, match="leaf 1: branch_point 4 > parent 0's length 3"):
        hard_advantages([-1, 0], [0, 4], [3, 6], [0, 0])
    with pytest.raises(ValueError, match="leaf 0: global sample"):
        hard_advantages([-1], [2], [4], [0])
    with pytest.raises(ValueError, match="leaf 1: parent 5"):
        hard_advantages([-1, 5], [0, 0], [1, 1], [0, 0])
    with pytest.raises(ValueError, match="cycle"):
        hard_advantages([1, 0], [1, 1], [2, 2], [0, 0])
    with pytest.raises(ValueError, match="2 parents, 1 advantages"):
        hard_advantages([-1, -1], [0, 0], [1, 1], [0])
    with pytest.raises(ValueError, match="2 parents, 1 branch points, 2 lengths"):
        hard_advantages([-1, -1], [0], [1, 1], [0, 0])


def _leaves(parents, bps, lengths, seed=0):
    """Real token sequences for a tree: a fork copies its parent's first bp tokens and
    samples the rest (from a huge id space, so only shared tokens coincide)."""
    rng = np.random.default_rng(seed)
    seqs: dict[int, list[int]] = {}
    pending = list(range(len(parents)))
    while pending:
        for i in list(pending):
            if parents[i] == -1 or parents[i] in seqs:
                head = seqs[parents[i]][:bps[i]] if parents[i] >= 0 else []
                seqs[i] = head + rng.integers(0, 2**62, lengths[i] - bps[i]).tolist()
                pending.remove(i)
    return [seqs[i] for i in range(len(parents))]


def _reference(seqs, leaf_adv):
    """Straight from the definition: token p of leaf i is shared by every leaf whose
    first p+1 tokens are identical; it gets their mean advantage and is counted once."""
    advs, owned = [], set()
    owner = []
    for s in seqs:
        row, own = [], []
        for p in range(len(s)):
            group = [j for j, t in enumerate(seqs) if len(t) > p and t[:p + 1] == s[:p + 1]]
            row.append(np.mean([leaf_adv[j] for j in group]))
            key = tuple(s[:p + 1])
            own.append(0.0 if key in owned else 1.0)
            owned.add(key)
        advs.append(np.array(row))
        owner.append(np.array(own))
    return advs, owner


@st.composite
def trees(draw):
    n = draw(st.integers(1, 7))
    parents, bps, lengths = [], [], []
    for i in range(n):
        length = draw(st.integers(0, 9))
        parent = draw(st.integers(-1, i - 1))
        bp = draw(st.integers(0, min(length, lengths[parent]))) if parent >= 0 else 0
        parents.append(parent)
        bps.append(bp)
        lengths.append(length)
    rewards = draw(st.lists(st.floats(-1, 1.1), min_size=n, max_size=n))
    return parents, bps, lengths, rewards


@settings(max_examples=150, deadline=None)
@given(tree=trees(), seed=st.integers(0, 1000))
def test_hard_matches_slow_reference(tree, seed):
    parents, bps, lengths, rewards = tree
    leaf_adv, _ = soft_advantages(rewards)
    advs, owner, m = hard_advantages(parents, bps, lengths, leaf_adv)
    ref_adv, ref_owner = _reference(_leaves(parents, bps, lengths, seed), leaf_adv)
    for i in range(len(parents)):
        np.testing.assert_allclose(advs[i], ref_adv[i], atol=1e-12)
        # parents precede children here, so "first seen" is the creator, as in the module
        np.testing.assert_array_equal(owner[i], ref_owner[i])
    # every distinct prefix (tree node) is owned exactly once
    assert sum(float(o.sum()) for o in owner) == m["tokens_unique"]


@settings(max_examples=150, deadline=None)
@given(tree=trees())
def test_hard_counts_each_shared_token_once_consistently(tree):
    parents, bps, lengths, rewards = tree
    leaf_adv, _ = soft_advantages(rewards)
    advs, owner, _ = hard_advantages(parents, bps, lengths, leaf_adv)
    # Sum over owned tokens of mean_S A equals sum_i A_i * sum over leaf i's tokens of
    # 1/|S|: each leaf's advantage is spread over the tree exactly once per token it has.
    seqs = _leaves(parents, bps, lengths)
    share = [np.array([sum(1 for t in seqs if len(t) > p and t[:p + 1] == s[:p + 1])
                       for p in range(len(s))]) for s in seqs]
    lhs = sum(float((a * o).sum()) for a, o in zip(advs, owner))
    rhs = sum(leaf_adv[i] * float((1.0 / share[i]).sum()) for i in range(len(seqs)) if len(seqs[i]))
    assert lhs == pytest.approx(rhs, abs=1e-9)
    # all copies of a token carry the same advantage as its owner
    for i, p in enumerate(parents):
        if p >= 0:
            np.testing.assert_allclose(advs[i][:bps[i]], advs[p][:bps[i]])


@settings(max_examples=100, deadline=None)
@given(rewards=st.lists(st.floats(-1, 1.1), min_size=2, max_size=16))
def test_soft_group_sums_to_zero(rewards):
    adv, m = soft_advantages(rewards)
    if m["reward_std"] > 0:
        assert abs(adv.sum()) < 1e-6 * len(rewards) * max(1.0, np.abs(adv).max())
    else:
        assert np.all(adv == 0)


@settings(max_examples=60, deadline=None)
@given(lengths=st.lists(st.integers(0, 12), min_size=1, max_size=8),
       data=st.data())
def test_grpo_without_branching_hard_equals_soft(lengths, data):
    rewards = data.draw(st.lists(st.floats(-1, 1.1), min_size=len(lengths),
                                 max_size=len(lengths)))
    leaves = [_leaf(n) for n in lengths]
    soft_a, soft_w, _ = token_advantages(leaves, rewards, "soft")
    hard_a, hard_w, _ = token_advantages(leaves, rewards, "hard")
    for sa, sw, ha, hw in zip(soft_a, soft_w, hard_a, hard_w):
        np.testing.assert_allclose(sa, ha, atol=1e-7)
        np.testing.assert_array_equal(sw, hw)


def _leaf(n, parent=-1, bp=0):
    return Trajectory(tokens=np.zeros(n, np.int32), loss_mask=np.ones(n, np.uint8),
                      logprobs=np.zeros(n, np.float32), versions=np.zeros(n, np.int32),
                      parent=parent, branch_point=bp)


def test_token_advantages_on_protocol_leaves():
    leaves = [_leaf(4), _leaf(5, parent=0, bp=3)]
    advs, weights, m = token_advantages(leaves, [1.0, 0.0], "soft")
    a = 0.5 / (math.sqrt(0.5) + 1e-6)
    np.testing.assert_allclose(advs[0], [a] * 4, rtol=1e-6)
    np.testing.assert_allclose(advs[1], [-a] * 5, rtol=1e-6)
    assert all(w.dtype == np.float32 and np.all(w == 1) for w in weights)
    advs, weights, m = token_advantages(leaves, [1.0, 0.0], "hard")
    np.testing.assert_allclose(advs[0], [0, 0, 0, a], atol=1e-6)
    np.testing.assert_allclose(advs[1], [0, 0, 0, -a, -a], atol=1e-6)
    assert weights[1].tolist() == [0, 0, 0, 1, 1] and advs[0].dtype == np.float32
    assert m["tokens_unique"] == 6
    with pytest.raises(ValueError, match="soft, hard, tree, tree_grpo"):
        token_advantages(leaves, [1.0, 0.0], "trees")
    with pytest.raises(ValueError, match="2 leaves, 1 rewards"):
        token_advantages(leaves, [1.0], "soft")



# ---------------------------------------------------------------- tree credit
# Two trees of two leaves: leaf1 forks leaf0 after 3 tokens, leaf3 forks leaf2 after 5;
# rewards [1, 0, 0, 0]. Nodes: a0 = leaf0[:3] (leaves {0, 1}), a1 = leaf0[3:], a2 =
# leaf1[3:]; b0 = leaf2[:5] ({2, 3}), b1 = leaf2[5:], b2 = leaf3[5:]. V(root) = 0.25.
HAND = ([-1, 0, -1, 2], [0, 3, 0, 5], [6, 8, 7, 9], [1.0, 0.0, 0.0, 0.0])


def test_treerl_hand_tree():
    advs, m = treerl_advantages(*HAND)
    r2 = math.sqrt(2)
    a0 = ((0.5 - 0.25) + (0.5 - 0.25)) / r2  # 0.353553: V(a0) = 0.5 against the root
    a1 = (1 - 0.25) + (1 - 0.5)  # 1.25: the right choice at a0's state
    a2 = (0 - 0.25) + (0 - 0.5)  # -0.75
    b0 = ((0 - 0.25) + (0 - 0.25)) / r2  # -0.353553
    b12 = (0 - 0.25) + (0 - 0)  # -0.25: no local term below b0, both children failed
    np.testing.assert_allclose(advs[0], [a0] * 3 + [a1] * 3)
    np.testing.assert_allclose(advs[1], [a0] * 3 + [a2] * 5)
    np.testing.assert_allclose(advs[2], [b0] * 5 + [b12] * 2)
    np.testing.assert_allclose(advs[3], [b0] * 5 + [b12] * 4)
    assert (a0, a1, a2, b0) == pytest.approx((0.353553, 1.25, -0.75, -0.353553), abs=1e-6)
    assert m["tree_local_abs_mean"] > 0


def test_tree_grpo_hand_tree():
    a = tree_grpo_advantages(HAND[0], HAND[3])
    # inter: z over [1, 0, 0, 0] = [1.5, -0.5, -0.5, -0.5]; intra: z over {1, 0} =
    # +-0.707107 in the first tree, 0 in the second (equal rewards)
    np.testing.assert_allclose(a, [2.207107, -1.207107, -0.5, -0.5], atol=1e-5)
    # a tree of one leaf has no intra term (the authors' verl code would give R / (1 + eps))
    np.testing.assert_allclose(tree_grpo_advantages([-1, -1, -1], [1.0, 0.0, 0.0]),
                               soft_advantages([1.0, 0.0, 0.0])[0])


def _treerl_reference(seqs, rewards):
    """From the paper's definition on materialised prefixes: the node of token p of a leaf
    is its run of prefixes held by the same leaves; V is the mean reward of those leaves,
    the parent's V the one of the prefix just before the run (the root's before p = 0)."""
    def holders(s, p):
        return [j for j, t in enumerate(seqs) if len(t) > p and t[:p + 1] == s[:p + 1]]

    root = float(np.mean(rewards))
    out = []
    for s in seqs:
        row = []
        for p in range(len(s)):
            here = holders(s, p)
            start = p
            while start > 0 and holders(s, start - 1) == here:
                start -= 1
            v = float(np.mean([rewards[j] for j in here]))
            v_parent = float(np.mean([rewards[j] for j in holders(s, start - 1)])) \
                if start > 0 else root
            row.append(((v - root) + (v - v_parent)) / math.sqrt(len(here)))
        out.append(np.array(row))
    return out


@settings(max_examples=150, deadline=None)
@given(tree=trees(), seed=st.integers(0, 1000))
def test_treerl_matches_slow_reference(tree, seed):
    parents, bps, lengths, rewards = tree
    advs, _ = treerl_advantages(parents, bps, lengths, rewards)
    ref = _treerl_reference(_leaves(parents, bps, lengths, seed), rewards)
    for i in range(len(parents)):
        np.testing.assert_allclose(advs[i], ref[i], atol=1e-12)


@settings(max_examples=100, deadline=None)
@given(tree=trees())
def test_tree_credit_properties(tree):
    parents, bps, lengths, rewards = tree
    advs, _ = treerl_advantages(parents, bps, lengths, rewards)
    # every copy of a shared token carries the same advantage (packing trains it once)
    for i, p in enumerate(parents):
        if p >= 0:
            np.testing.assert_allclose(advs[i][:bps[i]], advs[p][:bps[i]])
    # one reward everywhere: nothing to prefer, in both tree modes
    flat, _ = treerl_advantages(parents, bps, lengths, [0.3] * len(parents))
    assert all(np.all(a == 0) for a in flat)
    assert np.all(tree_grpo_advantages(parents, [0.3] * len(parents)) == 0)


@settings(max_examples=60, deadline=None)
@given(lengths=st.lists(st.integers(1, 12), min_size=1, max_size=8), data=st.data())
def test_tree_credit_without_forks(lengths, data):
    """No fork: TreeRL gives each leaf 2 (R_i - mean R) (its node is the leaf, its parent
    the root); Tree-GRPO gives GRPO's score (each tree is one leaf)."""
    rewards = data.draw(st.lists(st.floats(-1, 1.1), min_size=len(lengths),
                                 max_size=len(lengths)))
    leaves = [_leaf(n) for n in lengths]
    r = np.asarray(rewards)
    tree_a, tree_w, _ = token_advantages(leaves, rewards, "tree")
    grpo_a, _, _ = token_advantages(leaves, rewards, "tree_grpo")
    soft_a, _, _ = token_advantages(leaves, rewards, "soft")
    for i, n in enumerate(lengths):
        np.testing.assert_allclose(tree_a[i], [2 * (r[i] - r.mean())] * n, atol=1e-6)
        np.testing.assert_allclose(grpo_a[i], soft_a[i], atol=1e-6)
        assert tree_w[i].dtype == np.float32 and np.all(tree_w[i] == 1)
