"""A sample of the trained groups, kept as trees for people to look at (rank 0).

One trained group in ``learner.trees_every`` (the first, then every N-th) is written as
one JSON file under ``RUN_DIR/trees/`` (``python -m arpo_async.jobs.analyze trees RUN_DIR``
draws them: arpo_async/jobs/trees_page.py). Only the kept groups are decoded; the others
cost one counter increment. A file that cannot be written is logged and counted, never
fatal: the page is a view of the run, not part of it.

A file (``FORMAT`` 1, compact JSON, written atomically) holds the group's tree as
*segments*: maximal runs of response tokens shared by the same set of leaves, so a fork,
and the end of a leaf, always starts a new segment (the trie learner/packing.py trains,
cut at its branch points). Each segment has its tokens split into model rounds and tool
results, per model token its id, its decoded piece and a score: the token's entropy when
the leaf carries one (``entropies``), else its surprisal -log p under the behaviour
policy, labelled as such (the protocol's leaves carry log-probs, not entropies). Each
segment has the advantage of each leaf copy as the learner attributed it
(learner/advantages.py, ``learner.loss.advantage``: soft trains every copy with its leaf's
A, hard trains the owner's copy once with the mean over its leaves), each leaf its
reward, and each branch decision its place, dH, P and forks: as recorded when the group
carries ``decisions`` (dicts with ``leaf``, ``at`` = the response index where the decided
round starts, ``dh``, ``p``, ``forks``), else the forks the tree itself shows, with dH
and P unknown.

Size: at most ``KEEP_FILES`` files and ``KEEP_BYTES`` bytes; past either bound the oldest
files (by name: step, then order) are removed, never the newest.
"""

from __future__ import annotations

import json
import logging
import math
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from arpo_async.core.files import atomic_write_text
from learner.advantages import soft_advantages, token_advantages

log = logging.getLogger("learner.trees")

FORMAT = 1
TREES_DIR = "trees"  # under RUN_DIR
KEEP_FILES = 200  # newest tree files kept
KEEP_BYTES = 64 * 2**20  # and at most this many bytes of them
_SAFE = re.compile(r"[^A-Za-z0-9_.-]")


def segments(parents: Sequence[int], branch_points: Sequence[int], lengths: Sequence[int]
             ) -> tuple[list[dict], list[list[int]]]:
    """The group's tree as segments, depth first: (segments, per leaf the token-node id of
    each response position). A segment is ``{"parent": segment index or -1 (the prompt),
    "leaf": the leaf that created it, "start", "end": its range in that leaf's response
    (and in every leaf through it), "leaves": the leaves through it, "ends": the leaves
    whose last token is its last}``. A leaf with no response token ends at the prompt
    (``prompt_ends``)."""
    n = len(parents)
    ids: list[list[int] | None] = [None] * n
    owner: list[tuple[int, int]] = []  # token node -> (leaf that created it, position)
    up: list[int] = []  # token node -> the node before it (-1: the prompt)
    pending = list(range(n))
    while pending:  # parents first (advantages.py has already refused cycles)
        rest = []
        for i in pending:
            p, bp = parents[i], branch_points[i]
            if p >= 0 and ids[p] is None:
                rest.append(i)
                continue
            shared = ids[p][:bp] if p >= 0 else []
            first = len(owner)
            own = list(range(first, first + lengths[i] - len(shared)))
            owner += [(i, len(shared) + k) for k in range(len(own))]
            up += [shared[-1] if shared else -1] * bool(own) + own[:-1]
            ids[i] = shared + own
        if len(rest) == len(pending):
            raise ValueError(f"leaves {rest}: parent links form a cycle")
        pending = rest
    children: list[list[int]] = [[] for _ in range(len(owner) + 1)]  # [-1]: the prompt's
    for t, u in enumerate(up):
        children[u].append(t)
    ends: dict[int, list[int]] = {}
    for i, path in enumerate(ids):
        ends.setdefault(path[-1] if path else -1, []).append(i)

    def head(t: int) -> bool:
        return up[t] == -1 or len(children[up[t]]) != 1 or up[t] in ends

    out: list[dict] = []
    by_last: dict[int, int] = {}  # a segment's last token node -> the segment
    stack = [(t, -1) for t in reversed(children[-1])]
    while stack:
        t, parent = stack.pop()
        last = t
        while len(children[last]) == 1 and not head(children[last][0]):
            last = children[last][0]
        leaf, start = owner[t]
        by_last[last] = len(out)
        out.append({"parent": parent, "leaf": leaf, "start": start,
                    "end": owner[last][1] + 1, "leaves": [], "ends": sorted(ends.get(last, []))})
        stack += [(c, len(out) - 1) for c in reversed(children[last])]
    for i, path in enumerate(ids):  # a leaf runs through its last segment and its ancestors
        k = by_last[path[-1]] if path else -1
        while k >= 0:
            out[k]["leaves"].append(i)
            k = out[k]["parent"]
    return out, [list(p) for p in ids]


def prompt_ends(lengths: Sequence[int]) -> list[int]:
    """Leaves with an empty response: they end at the prompt."""
    return [i for i, n in enumerate(lengths) if n == 0]


def _num(x: float, digits: int = 4) -> float | None:
    x = float(x)
    return round(x, digits) if math.isfinite(x) else None


def decisions_of(group) -> tuple[list[dict], bool]:
    """(decisions, recorded): the group's own ``decisions`` when it carries them, else
    one per fork point the tree shows (leaf = the parent, at = the branch point)."""
    recorded = getattr(group, "decisions", None)
    if recorded:
        rows = [d if isinstance(d, dict) else dict(zip(("leaf", "at", "dh", "p", "forks"), d))
                for d in recorded]  # the protocol's rows, or dicts
        return [{"leaf": int(d["leaf"]), "at": int(d["at"]), "dh": _num(d.get("dh", math.nan)),
                 "p": _num(d.get("p", math.nan)), "forks": int(d.get("forks", 0))}
                for d in rows], True
    forks: dict[tuple[int, int], int] = {}
    for leaf in group.leaves:
        if leaf.parent >= 0:
            key = (int(leaf.parent), int(leaf.branch_point))
            forks[key] = forks.get(key, 0) + 1
    return [{"leaf": p, "at": at, "dh": None, "p": None, "forks": k}
            for (p, at), k in sorted(forks.items())], False


def _parts(tokenizer, leaf, start: int, end: int, score: np.ndarray) -> list[dict]:
    """The segment's runs of model tokens (a round, or its piece) and tool results."""
    mask = np.asarray(leaf.loss_mask[start:end]) > 0
    cuts = [0, *(np.flatnonzero(mask[1:] != mask[:-1]) + 1).tolist(), len(mask)]
    out = []
    for a, b in zip(cuts, cuts[1:]):
        ids = [int(t) for t in leaf.tokens[start + a:start + b]]
        part = {"kind": "model" if mask[a] else "tool", "start": start + a,
                "text": tokenizer.decode(ids, skip_special_tokens=False)}
        if mask[a]:
            part["ids"] = ids
            part["pieces"] = _pieces(tokenizer, ids)
            part["score"] = [_num(s, 3) for s in score[start + a:start + b]]
            v = leaf.versions[start + a:start + b]
            part["versions"] = [int(v.min()), int(v.max())]
        out.append(part)
    return out


def _pieces(tokenizer, ids: list[int]) -> list[str]:
    """Each token decoded on its own (a character split over tokens shows as U+FFFD);
    through the fast tokenizer's Rust backend in one call when there is one."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        return backend.decode_batch([[t] for t in ids], skip_special_tokens=False)
    return tokenizer.batch_decode([[t] for t in ids], skip_special_tokens=False)


def _token_score(leaf) -> tuple[np.ndarray, bool]:
    """(per-token score, is it an entropy): ``entropies`` if the leaf has them, else -log p."""
    ent = getattr(leaf, "entropies", None)
    if ent is not None and len(ent) == len(leaf):
        return np.asarray(ent, dtype=np.float64), True
    return -np.asarray(leaf.logprobs, dtype=np.float64), False


def tree_record(group, tokenizer, advantage_mode: str, step: int) -> dict:
    """The JSON object of one trained group (module docstring)."""
    leaves = group.leaves
    rewards = np.array([leaf.reward for leaf in leaves], dtype=np.float64)
    advs, owners, _ = token_advantages(leaves, rewards, advantage_mode)
    leaf_adv, _ = soft_advantages(rewards)
    lengths = [len(leaf) for leaf in leaves]
    segs, paths = segments([leaf.parent for leaf in leaves],
                           [leaf.branch_point for leaf in leaves], lengths)
    scores = [_token_score(leaf) for leaf in leaves]
    decisions, recorded = decisions_of(group)
    node_of = {}  # token node -> segment index
    for k, s in enumerate(segs):
        for t in paths[s["leaf"]][s["start"]:s["end"]]:
            node_of[t] = k
    nodes = []
    for k, s in enumerate(segs):
        a = s["start"]
        nodes.append({
            "id": f"n{k}", "parent": f"n{s['parent']}" if s["parent"] >= 0 else None,
            "leaf": s["leaf"], "start": a, "end": s["end"], "leaves": s["leaves"],
            "ends": s["ends"],
            "copies": [{"leaf": j, "advantage": _num(advs[j][a]),
                        "trained": bool(owners[j][a] > 0)} for j in s["leaves"]],
            "parts": _parts(tokenizer, leaves[s["leaf"]], a, s["end"], scores[s["leaf"]][0]),
            "decisions": []})
    unplaced = 0
    for d in decisions:
        j, at = d["leaf"], d["at"]
        if not (0 <= j < len(leaves) and 0 < at <= lengths[j]):
            unplaced += 1  # outside its leaf: counted in the record, never a failure
            continue
        k = node_of[paths[j][at - 1]]
        nodes[k]["decisions"].append({**d, "offset": at - segs[k]["start"],
                                      "forked": d["forks"] > 0})
    return {
        "format": FORMAT, "step": step, "group_id": group.group_id,
        "prompt_id": group.prompt_id, "actor_id": group.actor_id, "mode": group.mode,
        "kind": str(getattr(group, "kind", "") or ""), "advantage_mode": advantage_mode,
        "score": ({"name": "entropy", "unit": "nats"} if all(e for _, e in scores) else
                  {"name": "-log p", "unit": "nats",
                   "note": "surprisal of the sampled token under the behaviour policy, a "
                           "proxy: the group carries no per-token entropy"}),
        "decisions_recorded": recorded, "decisions_unplaced": unplaced,
        "prompt": {"text": tokenizer.decode([int(t) for t in group.prompt_tokens],
                                            skip_special_tokens=False),
                   "tokens": int(group.prompt_tokens.size), "ends": prompt_ends(lengths)},
        "leaves": [{"index": i, "parent": int(leaf.parent), "branch_point": int(leaf.branch_point),
                    "length": lengths[i], "reward": _num(leaf.reward), "score": _num(leaf.score),
                    "advantage": _num(leaf_adv[i]), "tool_calls": int(leaf.tool_calls),
                    "finish_reason": leaf.finish_reason} for i, leaf in enumerate(leaves)],
        "nodes": nodes,
    }


class TreeSampler:
    """Keeps one trained group in ``every`` under ``run_dir/trees/`` (module docstring).
    ``tokenizer``: a tokenizer, or the model folder to load one from at the first keep."""

    def __init__(self, run_dir: str | Path, every: int, advantage_mode: str, tokenizer: Any,
                 keep_files: int = KEEP_FILES, keep_bytes: int = KEEP_BYTES):
        if every < 1:
            raise ValueError(f"TreeSampler: every={every}; need >= 1 (0 means no sampler)")
        self.dir = Path(run_dir) / TREES_DIR
        self.every, self.mode, self.tokenizer = every, advantage_mode, tokenizer
        self.keep_files, self.keep_bytes = keep_files, keep_bytes
        self.seen = self.written = self.failed = 0

    def offer(self, groups: list, step: int) -> int:
        """Count ``groups`` (trained at ``step``) and write the ones due; files written."""
        wrote = 0
        for group in groups:
            self.seen += 1
            if (self.seen - 1) % self.every:
                continue
            try:
                self.write(group, step)
                wrote += 1
            except Exception:  # noqa: BLE001 - a view of the run must never end it
                self.failed += 1
                log.warning("could not keep group %s as a tree", group.group_id, exc_info=True)
        return wrote

    def write(self, group, step: int) -> Path:
        if isinstance(self.tokenizer, (str, Path)):
            from transformers import AutoTokenizer  # once, at the first kept group

            self.tokenizer = AutoTokenizer.from_pretrained(str(self.tokenizer))
        record = tree_record(group, self.tokenizer, self.mode, step)
        self.written += 1
        name = _SAFE.sub("_", group.group_id)[:64]
        path = self.dir / f"{step:08d}-{self.written:06d}-{name}.json"
        atomic_write_text(path, json.dumps(record, separators=(",", ":"), ensure_ascii=False))
        self.prune()
        return path

    def prune(self) -> int:
        """Remove the oldest files past ``keep_files`` or ``keep_bytes``; files removed."""
        files = sorted(self.dir.glob("*.json"), reverse=True)  # newest first
        total, removed = 0, 0
        for k, path in enumerate(files):
            try:
                total += path.stat().st_size
                if k and (k >= self.keep_files or total > self.keep_bytes):
                    path.unlink()
                    removed += 1
            except FileNotFoundError:
                continue
        return removed
