"""Advantage attribution for one prompt group (pure numpy).

ARPO (arXiv 2507.19849, Sec. 3.3 "advantage attribution estimation") scores the M leaves
of a group with GRPO's group-normalised reward, A_i = (R_i - mean(R)) / (std(R) + 1e-6),
and offers two ways to hand it to tokens (docs/design.md "Advantage attribution"):

* soft (the paper's default; plain GRPO when nothing branched): every model token of leaf
  i gets A_i. A shared prefix is trained once per leaf that contains it.
* hard: each tree segment is trained once. Tokens shared by the set S of leaves get
  mean_{j in S} A_j (the paper's shared-token advantage) and are *owned* by exactly one
  leaf: the owner mask is 1 there and 0 in the copies, so the learner multiplies it into
  the loss mask. A segment of a single leaf gets that leaf's A_i.

Two more modes credit the tree itself (beyond the ARPO paper; docs/design.md "Tree
advantages"), both trained like soft (every copy of a shared token, weight 1):

* tree (TreeRL, arXiv 2506.11902, Eqs. 2-4): a *node* is a maximal segment shared by the
  same set L(n) of leaves; V(n) = mean reward over L(n), V(root) = the group's mean. Every
  token of node n gets R(n) = [(V(n) - V(root)) + (V(n) - V(parent n))] / sqrt(|L(n)|): a
  global term and a local one, the choice made at the parent's state compared with the
  leaves that share that state, not only with the whole group. No std normalisation. A
  group without forks gets 2 (R_i - mean R) per leaf.
* tree_grpo (Tree-GRPO, arXiv 2509.21240; its code, ray_trainer_ts.py ``adv_estimator ==
  'tree'``): every token of leaf i gets A_i = z_group(R_i) + z_tree(R_i), two GRPO scores,
  over the group and over the leaves grown from the same global sample (its tree). A tree
  of one leaf gets an intra term of 0 (the authors' code would give R_i / (1 + 1e-6)).

std is the sample (unbiased, ddof=1) standard deviation, as GRPO/verl compute it with
torch.std. A group of one leaf, or one whose rewards are all equal, gets zero advantages
(in every mode).

The learner calls ``token_advantages(leaves, rewards, mode)``; each returned array covers a
leaf's response tokens (model and tool tokens alike); multiplying by the leaf's loss mask
(tool tokens 0) is the learner's job.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np

EPS = 1e-6


class LeafLike(Protocol):
    """What attribution needs of a leaf: protocol.Trajectory satisfies it."""

    parent: int  # index of the leaf it forked from, -1 for a global sample
    branch_point: int  # response tokens shared with the parent

    def __len__(self) -> int: ...


def soft_advantages(rewards: Sequence[float] | np.ndarray) -> tuple[np.ndarray, dict[str, float]]:
    """A_i = (R_i - mean R) / (std R + 1e-6), std with ddof=1; float64 array per leaf."""
    r = np.asarray(rewards, dtype=np.float64).reshape(-1)
    if r.size == 0:
        raise ValueError("soft_advantages: empty group")
    if not np.all(np.isfinite(r)):
        bad = int(np.flatnonzero(~np.isfinite(r))[0])
        raise ValueError(f"soft_advantages: reward of leaf {bad} is {r[bad]}")
    std = float(r.std(ddof=1)) if r.size > 1 else 0.0
    if std == 0.0:
        adv = np.zeros_like(r)  # nothing to prefer within the group
    else:
        adv = (r - r.mean()) / (std + EPS)
    return adv, {"reward_mean": float(r.mean()), "reward_std": std,
                 "adv_abs_mean": float(np.abs(adv).mean()),
                 "zero_std_group": float(std == 0.0)}


def _topo_order(parents: Sequence[int]) -> list[int]:
    n = len(parents)
    children: list[list[int]] = [[] for _ in range(n)]
    order = [i for i, p in enumerate(parents) if p == -1]
    for i, p in enumerate(parents):
        if not -1 <= p < n or p == i:
            raise ValueError(f"leaf {i}: parent {p} is not -1 or another leaf of the group")
        if p >= 0:
            children[p].append(i)
    k = 0
    while k < len(order):
        order.extend(children[order[k]])
        k += 1
    if len(order) != n:
        cyc = sorted(set(range(n)) - set(order))
        raise ValueError(f"leaves {cyc}: parent links form a cycle")
    return order


def check_tree(parents: Sequence[int], branch_points: Sequence[int],
               lengths: Sequence[int]) -> list[int]:
    """The leaves in an order where a parent comes before its children; ValueError for
    a group that is not a tree (a parent out of range or in a cycle, a branch point
    outside its leaf or its parent). What the learner checks of every group it receives
    (learner/service.py), whichever attribution it trains with."""
    n = len(parents)
    if not n == len(branch_points) == len(lengths):
        raise ValueError(f"{n} parents, {len(branch_points)} branch points, "
                         f"{len(lengths)} lengths")
    for i in range(n):
        bp, p = branch_points[i], parents[i]
        if lengths[i] < 0 or bp < 0 or bp > lengths[i]:
            raise ValueError(f"leaf {i}: branch_point {bp} outside [0, length {lengths[i]}]")
        if p == -1 and bp != 0:
            raise ValueError(f"leaf {i}: global sample (parent -1) with branch_point {bp}")
        if p >= 0 and 0 <= p < n and bp > lengths[p]:
            raise ValueError(f"leaf {i}: branch_point {bp} > parent {p}'s length {lengths[p]}")
    return _topo_order(parents)


def _token_nodes(parents: Sequence[int], branch_points: Sequence[int],
                 lengths: Sequence[int]) -> tuple[list[np.ndarray], np.ndarray, np.ndarray]:
    """Each leaf's token positions as ids of the tree's distinct tokens (a shared token has
    one id in every leaf that holds it), those ids flattened, and per id how many leaves
    hold it."""
    order = check_tree(parents, branch_points, lengths)
    node_ids: list[np.ndarray | None] = [None] * len(parents)
    next_node = 0
    for i in order:
        own = np.arange(next_node, next_node + lengths[i] - branch_points[i])
        next_node += own.size
        shared = node_ids[parents[i]][:branch_points[i]] if parents[i] >= 0 else own[:0]
        node_ids[i] = np.concatenate([shared, own])
    flat = np.concatenate(node_ids) if node_ids else np.zeros(0, dtype=np.int64)
    return node_ids, flat, np.bincount(flat, minlength=next_node)


def _leaf_mean(node_ids: list[np.ndarray], flat: np.ndarray, count: np.ndarray,
               per_leaf: np.ndarray) -> np.ndarray:
    """Per distinct token: the mean of ``per_leaf`` over the leaves that hold it."""
    weights = np.repeat(per_leaf, [len(ids) for ids in node_ids])
    return np.bincount(flat, weights=weights, minlength=count.size) / np.maximum(count, 1)


def treerl_advantages(parents: Sequence[int], branch_points: Sequence[int],
                      lengths: Sequence[int], rewards: Sequence[float] | np.ndarray
                      ) -> tuple[list[np.ndarray], dict[str, float]]:
    """TreeRL's node advantage (arXiv 2506.11902, Eqs. 2-4) for every token of every leaf:
    R(n) = [(V(n) - V(root)) + (V(n) - V(parent n))] / sqrt(|L(n)|).

    Along a leaf the sets of leaves holding its tokens only shrink, so a node ends where
    that count changes; the parent of a leaf's first node is the root (the prompt). The
    authors' code differs from the paper in ways listed in docs/design.md; this follows
    the paper."""
    r = np.asarray(rewards, dtype=np.float64).reshape(-1)
    node_ids, flat, count = _token_nodes(parents, branch_points, lengths)
    value = _leaf_mean(node_ids, flat, count, r)
    root = float(r.mean()) if r.size else 0.0
    advs, local = [], []
    for ids in node_ids:
        v, c = value[ids], count[ids]
        starts = np.flatnonzero(np.r_[True, c[1:] != c[:-1]]) if ids.size else ids
        parent_v = np.r_[root, v[:-1]][starts]  # the value just before each node starts
        seg = np.repeat(np.arange(starts.size), np.diff(np.r_[starts, ids.size]))
        lv = v - parent_v[seg] if ids.size else v
        advs.append(((v - root) + lv) / np.sqrt(c))
        local.append(lv)
    lv_all = np.concatenate(local) if local else np.zeros(0)
    return advs, {"tree_local_abs_mean": float(np.abs(lv_all).mean()) if lv_all.size else 0.0}


def _roots(parents: Sequence[int]) -> list[int]:
    """The global sample each leaf descends from (its tree, in Tree-GRPO's words)."""
    root = list(range(len(parents)))
    for i in _topo_order(parents):
        if parents[i] >= 0:
            root[i] = root[parents[i]]
    return root


def tree_grpo_advantages(parents: Sequence[int], rewards: Sequence[float] | np.ndarray
                         ) -> np.ndarray:
    """Tree-GRPO's leaf advantage: z over the group plus z over the leaf's own tree
    (arXiv 2509.21240; ray_trainer_ts.py, ``adv_estimator == 'tree'``)."""
    r = np.asarray(rewards, dtype=np.float64).reshape(-1)
    inter, _ = soft_advantages(r)
    roots = np.asarray(_roots(parents))
    intra = np.zeros_like(r)
    for t in np.unique(roots):
        members = np.flatnonzero(roots == t)
        intra[members] = soft_advantages(r[members])[0]
    return inter + intra


def hard_advantages(parents: Sequence[int], branch_points: Sequence[int],
                    lengths: Sequence[int], leaf_adv: Sequence[float] | np.ndarray
                    ) -> tuple[list[np.ndarray], list[np.ndarray], dict[str, float]]:
    """Per-leaf token advantages and owner masks for hard attribution.

    Leaf i shares its first ``branch_points[i]`` tokens with leaf ``parents[i]`` (which
    may share them further up). Each token position is a node of the tree; its leaf set S
    is every leaf that contains it, its advantage mean_{j in S} A_j, and it is owned by
    the leaf that created it (the one highest in the tree), mask 1 there, 0 in copies.
    """
    n = len(parents)
    adv = np.asarray(leaf_adv, dtype=np.float64).reshape(-1)
    if adv.size != n:
        raise ValueError(f"hard_advantages: {n} parents, {adv.size} advantages")
    node_ids, flat, count = _token_nodes(parents, branch_points, lengths)
    next_node = count.size
    node_adv = _leaf_mean(node_ids, flat, count, adv)
    token_adv = [node_adv[ids] for ids in node_ids]
    owner = [np.concatenate([np.zeros(branch_points[i], dtype=np.float32),
                             np.ones(lengths[i] - branch_points[i], dtype=np.float32)])
             for i in range(n)]
    total = int(flat.size)
    return token_adv, owner, {
        "tokens_total": float(total),
        "tokens_unique": float(next_node),
        "shared_token_frac": float((count[flat] > 1).mean()) if total else 0.0,
    }


MODES = ("soft", "hard", "tree", "tree_grpo")


def token_advantages(leaves: Sequence[LeafLike | Any], rewards: Sequence[float] | np.ndarray,
                     mode: str) -> tuple[list[np.ndarray], list[np.ndarray], dict[str, float]]:
    """(per-leaf float32 token advantages, per-leaf float32 weight masks, metrics) for
    ``mode`` in ``MODES``: weights are the owner masks in "hard", all 1 otherwise."""
    if mode not in MODES:
        raise ValueError(f"advantage mode {mode!r}: expected one of {', '.join(MODES)}")
    if len(leaves) != len(rewards):
        raise ValueError(f"token_advantages: {len(leaves)} leaves, {len(rewards)} rewards")
    leaf_adv, metrics = soft_advantages(rewards)
    lengths = [len(leaf) for leaf in leaves]
    parents = [leaf.parent for leaf in leaves]
    bps = [leaf.branch_point for leaf in leaves]
    if mode == "hard":
        advs, owner, hard_metrics = hard_advantages(parents, bps, lengths, leaf_adv)
        return [a.astype(np.float32) for a in advs], owner, metrics | hard_metrics
    weights = [np.ones(n, dtype=np.float32) for n in lengths]
    metrics |= {"tokens_total": float(sum(lengths))}
    if mode == "tree":
        advs, tree_metrics = treerl_advantages(parents, bps, lengths, rewards)
        return [a.astype(np.float32) for a in advs], weights, metrics | tree_metrics
    if mode == "tree_grpo":
        check_tree(parents, bps, lengths)
        leaf_adv = tree_grpo_advantages(parents, rewards)
    advs = [np.full(n, a, dtype=np.float32) for n, a in zip(lengths, leaf_adv)]
    return advs, weights, metrics
