"""Packed training batches: each prompt group is one token tree, computed once.

``learner.packing = tree``: a group's leaves (``LeafSample``, learner/batching.py) become
one trie of tokens. The prompt is one chain; a leaf's response is a chain that starts at
the last prompt token, or, for a fork, at the last token it shares with its parent
(``branch_point``). The trie is laid out in depth-first pre-order, so

* a token's ancestors come before it and its subtree is the contiguous range
  ``[n, end[n])``: token q may attend to token k exactly when ``k <= q < end[k]``
  (learner/tree_attention.py builds dense masks, per-segment tiles or a FlexAttention
  block mask from that rule);
* the position id of a token is its depth (distance from the prompt's first token along
  its path), so every leaf sees the positions and context it was sampled with;
* the target token n is predicted from its parent node ``pred[n]``; a fork point
  predicts several targets (one per child).

Loss inputs (docs/design.md, "Packed tree batches"). The model runs once per node, and
the log-prob of a target node is computed once; the loss then sees every *copy* of a
trained token: one entry per (leaf, response token) with m > 0, pointing at its node,
with that leaf's weight, advantage and sequence id (``copy_target``, ``copy_seq``,
``copy_m``, ``copy_adv``). So the loss reads exactly what the padded path gives it, in
another order: token- and sequence-level losses alike (learner/losses/), no identity
about the loss's shape needed. A copy costs a gather and a few elementwise operations,
not a forward pass. ``count`` (copies per node) weights the entropy statistics.
Hard attribution needs nothing special: the copies of a shared token carry weight 0
except in the owner, and copies of weight 0 are left out.

Behaviour log-probs of a shared token: a fork copies its parent's tokens, log-probs and
versions (``LivePath.fork`` in actors/rollout/path.py), so they cannot differ. The builder
does not rely on it: a child shares a prefix token only while token id, behaviour
log-prob (bitwise) and version agree with the parent's; from the first disagreement on,
the child's tokens are kept apart (their own nodes, same context), and the batch counts
them in ``kept_apart``.

``learner.packing = flat``: every leaf is its own chain (prompt repeated), concatenated
without padding; ``padded`` is the row-per-leaf path of learner/batching.py.
Pure numpy/torch: no deepspeed, zmq or transformers here.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import torch

from learner.advantages import _topo_order
from learner.batching import LeafSample


@dataclass
class PackedTree:
    """One packing unit in pre-order: a group (tree) or a leaf (flat)."""

    ids: np.ndarray  # int64 token ids
    pred: np.ndarray  # int64 parent node (local index), -1 at the root
    depth: np.ndarray  # int64 position id
    end: np.ndarray  # int64 end of the node's subtree (local, exclusive)
    mu: np.ndarray  # float32 behaviour log-prob
    c_node: np.ndarray  # int64 per trained copy (leaf token with m > 0): its node
    c_seq: np.ndarray  # int64 its leaf (0..n_leaves-1, in leaf-index order)
    c_m: np.ndarray  # float32 its loss weight
    c_adv: np.ndarray  # float32 its advantage
    n_leaves: int
    leaf_tokens: int  # prompt + response tokens of its leaves (what padding-free rows cost)
    kept_apart: int = 0  # declared shared tokens that disagreed with the parent

    @property
    def num_tokens(self) -> int:
        return int(self.ids.shape[0])


def _same(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Bitwise equality (so -0.0 != 0.0 and nan == nan), elementwise."""
    a, b = np.ascontiguousarray(a), np.ascontiguousarray(b)
    if a.dtype.kind == "f":
        return a.view(np.uint32 if a.itemsize == 4 else np.uint64) == \
            b.astype(a.dtype).view(np.uint32 if a.itemsize == 4 else np.uint64)
    return a == b


def shared_length(child: LeafSample, parent: LeafSample) -> int:
    """Response tokens the child may share with its parent: its branch point, cut at the
    first token whose id, behaviour log-prob or version differs."""
    bp = min(child.branch_point, len(child.response), len(parent.response))
    ok = (_same(child.response[:bp], parent.response[:bp])
          & _same(child.behaviour[:bp], parent.behaviour[:bp])
          & _same(child.versions[:bp], parent.versions[:bp]))
    bad = np.flatnonzero(~ok)
    return int(bad[0]) if bad.size else bp


def _trie(leaves: list[LeafSample]) -> tuple[list[int], list[int], list[np.ndarray], int]:
    """(token ids, parent node, node of every response token per leaf, tokens kept
    apart), nodes numbered in creation order, the prompt first."""
    prompt = leaves[0].prompt
    if len(prompt) == 0:
        raise ValueError(f"group {leaves[0].group}: empty prompt (nothing predicts token 0)")
    for s in leaves[1:]:
        if not np.array_equal(s.prompt, prompt):
            raise ValueError(f"group {s.group}: leaf {s.index} has another prompt")
    ids = [int(t) for t in prompt]
    pred = [-1] + list(range(len(ids) - 1))
    local = {s.index: k for k, s in enumerate(leaves)}
    parents = [local.get(s.parent, -1) if s.parent >= 0 else -1 for s in leaves]
    nodes: list[np.ndarray | None] = [None] * len(leaves)
    kept_apart = 0
    for k in _topo_order(parents):
        s, p = leaves[k], parents[k]
        eff = shared_length(s, leaves[p]) if p >= 0 else 0
        kept_apart += (min(s.branch_point, len(s.response)) - eff) if p >= 0 else 0
        n_own = len(s.response) - eff
        own = np.arange(len(ids), len(ids) + n_own)
        nodes[k] = np.concatenate([nodes[p][:eff] if p >= 0 else own[:0], own])
        if n_own:
            pred.append(int(nodes[p][eff - 1]) if eff > 0 else len(prompt) - 1)
            pred.extend(own[:-1].tolist())
            ids.extend(int(t) for t in s.response[eff:])
    return ids, pred, nodes, kept_apart


def _preorder(pred: np.ndarray) -> np.ndarray:
    """Depth-first pre-order of the nodes (children in creation order)."""
    n = pred.shape[0]
    children: list[list[int]] = [[] for _ in range(n)]
    for x in range(1, n):
        children[pred[x]].append(x)
    order, stack = [], [0]
    while stack:
        x = stack.pop()
        order.append(x)
        stack.extend(reversed(children[x]))
    return np.asarray(order, dtype=np.int64)


def _subtree_end(pred: np.ndarray) -> np.ndarray:
    end = np.arange(1, pred.shape[0] + 1, dtype=np.int64)
    for x in range(pred.shape[0] - 1, 0, -1):
        p = pred[x]
        if end[x] > end[p]:
            end[p] = end[x]
    return end


def build_tree(leaves: list[LeafSample]) -> PackedTree:
    """The leaves of one group (any order, all with the same prompt) as one tree."""
    leaves = sorted(leaves, key=lambda s: s.index)
    ids, pred, nodes, kept_apart = _trie(leaves)
    n = len(ids)
    at = np.concatenate(nodes) if leaves else np.zeros(0, np.int64)
    m = np.concatenate([s.weight for s in leaves]).astype(np.float32)
    adv = np.concatenate([s.advantages for s in leaves]).astype(np.float32)
    leaf = np.repeat(np.arange(len(leaves)), [len(s.response) for s in leaves])
    mu = np.zeros(n, np.float32)
    mu[at] = np.concatenate([s.behaviour for s in leaves])
    order = _preorder(np.asarray(pred, np.int64))
    rank = np.empty(n, np.int64)
    rank[order] = np.arange(n)
    old_pred = np.asarray(pred, np.int64)[order]
    new_pred = np.where(old_pred >= 0, rank[np.maximum(old_pred, 0)], -1)
    depth = np.zeros(n, np.int64)
    for x in range(1, n):
        depth[x] = depth[new_pred[x]] + 1
    keep = m > 0
    return PackedTree(
        ids=np.asarray(ids, np.int64)[order], pred=new_pred, depth=depth,
        end=_subtree_end(new_pred), mu=mu[order],
        c_node=rank[at[keep]], c_seq=leaf[keep].astype(np.int64), c_m=m[keep],
        c_adv=adv[keep], n_leaves=len(leaves),
        leaf_tokens=sum(s.num_tokens for s in leaves), kept_apart=kept_apart)


def build_units(samples: list[LeafSample], mode: str) -> list[PackedTree]:
    """``tree``: one unit per group (a leaf without a group is its own); ``flat``: one
    per leaf."""
    if mode not in ("tree", "flat"):
        raise ValueError(f"packing {mode!r}: expected tree or flat")
    if mode == "flat":
        return [build_tree([_alone(s)]) for s in samples]
    groups: dict[tuple[int, int], list[LeafSample]] = {}
    for k, s in enumerate(samples):
        groups.setdefault((s.group, -1) if s.group >= 0 else (-1, k), []).append(s)
    return [build_tree(g) for g in groups.values()]


def _alone(s: LeafSample) -> LeafSample:
    """The leaf as a global sample (it shares nothing)."""
    return LeafSample(s.prompt, s.response, s.weight, s.behaviour, s.advantages, s.versions,
                      group=s.group, index=s.index, parent=-1, branch_point=0)


# ----------------------------------------------------------------------------- micro-batches


def bins_needed(sizes: list[int], cap: int) -> int:
    """Micro-batches first-fit decreasing needs to keep each under ``cap`` tokens (a unit
    larger than ``cap`` gets one of its own); 1 for no units or cap 0 (no limit)."""
    if cap <= 0 or not sizes:
        return 1
    loads: list[int] = []
    for size in sorted(sizes, reverse=True):
        for i, load in enumerate(loads):
            if load + size <= cap:
                loads[i] += size
                break
        else:
            loads.append(size)
    return max(len(loads), 1)


def split_bins(sizes: list[int], n: int, cap: int) -> list[list[int]]:
    """Unit indices in exactly ``n`` micro-batches: longest-first onto the least loaded;
    if that breaks the cap, first-fit decreasing (then some micro-batches stay empty)."""
    bins: list[list[int]] = [[] for _ in range(n)]
    loads = [0] * n
    for i in sorted(range(len(sizes)), key=lambda i: -sizes[i]):
        j = loads.index(min(loads))
        bins[j].append(i)
        loads[j] += sizes[i]
    if cap <= 0 or all(load <= cap or len(b) <= 1 for load, b in zip(loads, bins)):
        return bins
    bins, loads = [[] for _ in range(n)], [0] * n
    for i in sorted(range(len(sizes)), key=lambda i: -sizes[i]):
        j = next((j for j in range(n) if bins[j] and loads[j] + sizes[i] <= cap),
                 next((j for j in range(n) if not bins[j]), loads.index(min(loads))))
        bins[j].append(i)
        loads[j] += sizes[i]
    return bins


@dataclass
class PackedBatch:
    """Several units concatenated into one row (``[1, T]``), padded to ``align``."""

    input_ids: torch.Tensor  # [1, T] long
    position_ids: torch.Tensor  # [1, T] long (depth; alignment padding 0)
    pred: np.ndarray  # [T] int64 parent position, -1 at roots and padding
    end: np.ndarray  # [T] int64 subtree end; k is visible from q iff k <= q < end[k]
    ctx: torch.Tensor  # [K] long: position whose logits predict each target
    targets: torch.Tensor  # [K] long: the target token ids
    count: torch.Tensor  # [K] float trained copies of each target (from copy_target)
    behaviour: torch.Tensor  # [K] float32
    copy_target: torch.Tensor  # [E] long: the target of each trained copy
    copy_seq: torch.Tensor  # [E] long: its sequence (leaf), unique within the batch
    copy_m: torch.Tensor  # [E] float32 loss weight
    copy_adv: torch.Tensor  # [E] float32 advantage
    tokens: int  # real tokens (without alignment padding)
    leaf_tokens: int
    kept_apart: int

    @property
    def num_weighted(self) -> float:
        return float(self.copy_m.sum())

    @property
    def num_sequences(self) -> float:
        """Leaves with a trained token (what a sequence-level loss counts)."""
        return float(torch.unique(self.copy_seq).numel())


def collate_packed(units: list[PackedTree], pad_id: int, align: int = 1) -> PackedBatch:
    """Concatenate units (block structure: no token sees another unit) into one row; an
    empty list gives a one-token batch with no target (keeps ranks in step)."""
    ids, pos, pred, end, sel, local, copies = [], [], [], [], [], [], []
    offset = targets = leaves = 0
    for u in units:
        ids.append(u.ids)
        pos.append(u.depth)
        pred.append(np.where(u.pred >= 0, u.pred + offset, -1))
        end.append(u.end + offset)
        count = np.bincount(u.c_node, minlength=u.num_tokens)  # trained copies per node
        picked = np.flatnonzero((u.pred >= 0) & (count > 0))
        sel.append(picked + offset)
        local.append(picked)
        target_of = np.full(u.num_tokens, -1, np.int64)
        target_of[picked] = targets + np.arange(picked.shape[0])
        copies.append((target_of[u.c_node], u.c_seq + leaves, u.c_m, u.c_adv))
        offset += u.num_tokens
        targets += picked.shape[0]
        leaves += u.n_leaves
    tokens = offset
    total = max(-(-max(tokens, 1) // align) * align, 1)
    pad = total - tokens
    ids.append(np.full(pad, pad_id, np.int64))
    pos.append(np.zeros(pad, np.int64))
    pred.append(np.full(pad, -1, np.int64))
    end.append(np.arange(tokens + 1, total + 1, dtype=np.int64))  # padding sees itself only
    pred_all, all_ids = np.concatenate(pred), np.concatenate(ids)
    picked = np.concatenate(sel) if units else np.zeros(0, np.int64)

    def cat(k: int, dtype) -> torch.Tensor:  # the k-th copy array of every unit
        return torch.from_numpy(np.concatenate([c[k] for c in copies]).astype(dtype)
                                if units else np.zeros(0, dtype))

    copy_target = cat(0, np.int64)
    mu = np.concatenate([u.mu[p] for u, p in zip(units, local)]) if units else np.zeros(0)
    return PackedBatch(
        input_ids=torch.from_numpy(all_ids)[None], position_ids=torch.from_numpy(
            np.concatenate(pos))[None], pred=pred_all, end=np.concatenate(end),
        ctx=torch.from_numpy(pred_all[picked].astype(np.int64)),
        targets=torch.from_numpy(all_ids[picked].astype(np.int64)),
        count=torch.bincount(copy_target, minlength=int(picked.shape[0])).float(),
        behaviour=torch.from_numpy(mu.astype(np.float32)), copy_target=copy_target,
        copy_seq=cat(1, np.int64), copy_m=cat(2, np.float32), copy_adv=cat(3, np.float32),
        tokens=tokens, leaf_tokens=sum(u.leaf_tokens for u in units),
        kept_apart=sum(u.kept_apart for u in units))


def pad_targets(batch: PackedBatch, k: int) -> PackedBatch:
    """The batch with dummy targets (position 0, token 0, no copy) up to ``k``: under
    ZeRO-3 every rank must call the output layer as often (once per log-prob chunk), so
    the ranks agree on the target count of each micro-batch."""
    extra = k - batch.ctx.shape[0]
    if extra <= 0:
        return batch

    def grow(t: torch.Tensor) -> torch.Tensor:
        return torch.cat([t, t.new_zeros(extra)])

    names = ("ctx", "targets", "count", "behaviour")
    return replace(batch, **{n: grow(getattr(batch, n)) for n in names})
