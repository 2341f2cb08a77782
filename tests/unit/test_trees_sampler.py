"""learner/trees.py: the tree of a group as segments (hand cases and random trees), the
advantages each segment was trained with, the decisions, and the sampler's one-in-N,
its size bounds and its refusal to fail the learner."""

from __future__ import annotations

import json

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from arpo_async.core.protocol import Trajectory, TrajectoryGroup
from learner.advantages import soft_advantages
from learner.trees import TreeSampler, prompt_ends, segments, tree_record


class CharTokenizer:
    """Token id k is the letter ``chr(97 + k % 26)``."""

    def decode(self, ids, skip_special_tokens=False) -> str:
        return "".join(chr(97 + int(i) % 26) for i in ids)

    def batch_decode(self, batch, skip_special_tokens=False) -> list[str]:
        return [self.decode(ids) for ids in batch]


def group_of(parents, branch_points, lengths, rewards, masks=None, seed=0) -> TrajectoryGroup:
    """Leaves that share exactly their parent's first ``branch_point`` tokens."""
    rng = np.random.default_rng(seed)
    leaves: list[Trajectory] = []
    for i, (p, bp, n) in enumerate(zip(parents, branch_points, lengths)):
        own = rng.integers(0, 50, n - bp).astype(np.int32)
        mask = (np.ones(n, np.uint8) if masks is None else np.asarray(masks[i], np.uint8))
        lp = -rng.exponential(1.0, n).astype(np.float32)
        if p >= 0:
            par = leaves[p]
            tokens = np.concatenate([par.tokens[:bp], own])
            mask[:bp], lp[:bp] = par.loss_mask[:bp], par.logprobs[:bp]
        else:
            tokens = own
        lp[mask == 0] = 0.0
        leaves.append(Trajectory(tokens=tokens, loss_mask=mask, logprobs=lp,
                                 versions=np.where(mask > 0, 1, -1).astype(np.int32),
                                 reward=float(rewards[i]), parent=p, branch_point=bp))
    return TrajectoryGroup(group_id="a0-test", actor_id=0, prompt_id="p0",
                           prompt_tokens=np.arange(3, dtype=np.int32), leaves=leaves)


def test_segments_hand_case():
    # leaf 1 forks from 0 after 3 tokens; leaf 3 from 2 after 2; leaf 4 from 1 after 2
    # (inside leaf 0's tokens, so leaf 0's first segment is cut at 2 as well)
    segs, paths = segments([-1, 0, -1, 2, 1], [0, 3, 0, 2, 2], [5, 4, 3, 2, 6])
    got = [(s["parent"], s["leaf"], s["start"], s["end"], s["leaves"], s["ends"]) for s in segs]
    assert got == [
        (-1, 0, 0, 2, [0, 1, 4], []),
        (0, 0, 2, 3, [0, 1], []),
        (1, 0, 3, 5, [0], [0]),
        (1, 1, 3, 4, [1], [1]),
        (0, 4, 2, 6, [4], [4]),
        (-1, 2, 0, 2, [2, 3], [3]),  # leaf 3 has no token of its own: it ends at the fork
        (5, 2, 2, 3, [2], [2]),
    ]
    assert paths[4][:2] == paths[0][:2] and paths[1][:3] == paths[0][:3]


def test_a_leaf_that_ends_where_its_fork_goes_on_and_an_empty_leaf():
    segs, _ = segments([-1, 0, -1], [0, 3, 0], [3, 5, 0])
    assert [(s["parent"], s["start"], s["end"], s["ends"]) for s in segs] == [
        (-1, 0, 3, [0]), (0, 3, 5, [1])]
    assert prompt_ends([3, 5, 0]) == [2]


@st.composite
def trees(draw):
    n = draw(st.integers(1, 7))
    parents, bps, lengths = [], [], []
    for i in range(n):
        p = draw(st.integers(-1, i - 1))
        bp = draw(st.integers(0, lengths[p])) if p >= 0 else 0
        parents.append(p)
        bps.append(bp)
        lengths.append(bp + draw(st.integers(0, 5)))
    return parents, bps, lengths


@settings(max_examples=200, deadline=None)
@given(trees())
def test_segments_rebuild_every_leaf(tree):
    parents, bps, lengths = tree
    segs, paths = segments(parents, bps, lengths)
    ends = {i: k for k, s in enumerate(segs) for i in s["ends"]}
    assert sorted(ends) == sorted(set(range(len(parents))) - set(prompt_ends(lengths)))
    for i, path in enumerate(paths):
        chain, k = [], ends.get(i, -1)  # the segments from the prompt to where i ends
        while k >= 0:
            chain.append(segs[k])
            k = segs[k]["parent"]
        nodes = [t for s in reversed(chain) for t in paths[s["leaf"]][s["start"]:s["end"]]]
        assert nodes == path
        assert all(i in s["leaves"] for s in chain)
    covered = [t for s in segs for t in paths[s["leaf"]][s["start"]:s["end"]]]
    assert sorted(covered) == sorted({t for p in paths for t in p})  # each token once
    assert all(s["end"] > s["start"] for s in segs)


def test_advantages_as_trained_soft_and_hard():
    group = group_of([-1, 0, -1], [0, 2, 0], [4, 3, 2], rewards=[1.0, 0.0, 0.0])
    a = soft_advantages([1.0, 0.0, 0.0])[0]
    hard = tree_record(group, CharTokenizer(), "hard", step=1)
    shared = hard["nodes"][0]
    assert shared["leaves"] == [0, 1]
    assert [c["trained"] for c in shared["copies"]] == [True, False]  # owned once
    assert shared["copies"][0]["advantage"] == round((a[0] + a[1]) / 2, 4)
    soft = tree_record(group, CharTokenizer(), "soft", step=1)
    assert [(c["advantage"], c["trained"]) for c in soft["nodes"][0]["copies"]] == [
        (round(a[0], 4), True), (round(a[1], 4), True)]
    assert [leaf["advantage"] for leaf in soft["leaves"]] == [round(x, 4) for x in a]


def test_parts_decisions_and_scores():
    masks = [[1, 1, 0, 0, 1, 1], [1, 1, 0, 0, 1]]
    group = group_of([-1, 0], [0, 4], [6, 5], rewards=[1.0, 0.0], masks=masks)
    rec = tree_record(group, CharTokenizer(), "soft", step=3)
    first = rec["nodes"][0]
    assert [(p["kind"], p["start"]) for p in first["parts"]] == [("model", 0), ("tool", 2)]
    assert first["parts"][0]["pieces"] == list(first["parts"][0]["text"])
    lp = group.leaves[0].logprobs
    assert first["parts"][0]["score"] == [round(-float(x), 3) for x in lp[:2]]
    assert rec["score"]["name"] == "-log p" and not rec["decisions_recorded"]
    # no recorded decisions: the fork the tree shows, at the end of the tool result
    assert first["decisions"] == [{"leaf": 0, "at": 4, "dh": None, "p": None, "forks": 1,
                                   "offset": 4, "forked": True}]
    group.decisions = [{"leaf": 0, "at": 4, "dh": 0.5, "p": 0.6, "forks": 1}]
    for leaf in group.leaves:
        leaf.entropies = np.full(len(leaf), 0.25)
    rec = tree_record(group, CharTokenizer(), "soft", step=3)
    assert rec["decisions_recorded"] and rec["nodes"][0]["decisions"][0]["dh"] == 0.5
    assert rec["score"]["name"] == "entropy"
    assert rec["nodes"][0]["parts"][0]["score"] == [0.25, 0.25]
    json.dumps(rec, allow_nan=False)  # strict JSON


def test_sampler_keeps_one_in_n_within_bounds(tmp_path):
    sampler = TreeSampler(tmp_path, every=3, advantage_mode="soft", tokenizer=CharTokenizer(),
                          keep_files=2)
    groups = [group_of([-1, 0], [0, 1], [3, 2], rewards=[1.0, 0.0], seed=k) for k in range(10)]
    for k, g in enumerate(groups):
        g.group_id = f"a0-g{k}/../x"  # a hostile id stays one file name
    assert sum(sampler.offer(groups[s:s + 2], step=s // 2 + 1) for s in range(0, 10, 2)) == 4
    files = sorted(p.name for p in (tmp_path / "trees").iterdir())
    assert files == ["00000004-000003-a0-g6_.._x.json", "00000005-000004-a0-g9_.._x.json"]
    assert json.loads((tmp_path / "trees" / files[-1]).read_text())["group_id"] == "a0-g9/../x"
    small = TreeSampler(tmp_path / "b", every=1, advantage_mode="soft",
                        tokenizer=CharTokenizer(), keep_bytes=1)
    small.offer(groups[:3], step=1)
    assert len(list((tmp_path / "b" / "trees").iterdir())) == 1  # the newest, whatever it weighs


def test_a_group_that_cannot_be_written_is_counted_not_raised(tmp_path):
    class Broken(CharTokenizer):
        def decode(self, ids, skip_special_tokens=False):
            raise RuntimeError("no tokenizer today")

    sampler = TreeSampler(tmp_path, every=1, advantage_mode="soft", tokenizer=Broken())
    assert sampler.offer([group_of([-1], [0], [2], rewards=[0.0])], step=1) == 0
    assert sampler.failed == 1
