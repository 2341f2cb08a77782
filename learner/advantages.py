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

std is the sample (unbiased, ddof=1) standard deviation, as GRPO/verl compute it with
torch.std. A group of one leaf, or one whose rewards are all equal, gets zero advantages.

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
    order = check_tree(parents, branch_points, lengths)
    node_ids: list[np.ndarray | None] = [None] * n
    next_node = 0
    for i in order:
        own = np.arange(next_node, next_node + lengths[i] - branch_points[i])
        next_node += own.size
        shared = node_ids[parents[i]][:branch_points[i]] if parents[i] >= 0 else own[:0]
        node_ids[i] = np.concatenate([shared, own])
    flat = np.concatenate(node_ids) if n else np.zeros(0, dtype=np.int64)
    weights = np.repeat(adv, [len(ids) for ids in node_ids])
    count = np.bincount(flat, minlength=next_node)
    node_adv = np.bincount(flat, weights=weights, minlength=next_node) / np.maximum(count, 1)
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


def token_advantages(leaves: Sequence[LeafLike | Any], rewards: Sequence[float] | np.ndarray,
                     mode: str) -> tuple[list[np.ndarray], list[np.ndarray], dict[str, float]]:
    """(per-leaf float32 token advantages, per-leaf float32 weight masks, metrics) for
    ``mode`` "soft" (weights all 1) or "hard" (weights = owner masks)."""
    if mode not in ("soft", "hard"):
        raise ValueError(f"advantage mode {mode!r}: expected 'soft' or 'hard'")
    if len(leaves) != len(rewards):
        raise ValueError(f"token_advantages: {len(leaves)} leaves, {len(rewards)} rewards")
    leaf_adv, metrics = soft_advantages(rewards)
    lengths = [len(leaf) for leaf in leaves]
    if mode == "soft":
        advs = [np.full(n, a, dtype=np.float32) for n, a in zip(lengths, leaf_adv)]
        weights = [np.ones(n, dtype=np.float32) for n in lengths]
        return advs, weights, metrics | {"tokens_total": float(sum(lengths))}
    advs, owner, hard_metrics = hard_advantages(
        [leaf.parent for leaf in leaves], [leaf.branch_point for leaf in leaves], lengths,
        leaf_adv)
    return [a.astype(np.float32) for a in advs], owner, metrics | hard_metrics
