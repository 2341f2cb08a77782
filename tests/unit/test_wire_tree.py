"""A trajectory group travels as a tree (arpo_async/core/protocol/wire.py): a fork sends
its own tokens only, the prefix it shares with its parent travels once, and ``decode``
gives every leaf back whole; a fork whose prefix differs from its parent's goes whole,
and a header that claims a prefix it cannot have is refused, never trusted."""

from __future__ import annotations

import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from arpo_async.core import protocol as P
from tests.unit.test_protocol import assert_rejects, assert_same, repack, wire


@st.composite
def trees(draw) -> P.TrajectoryGroup:
    """Groups as the rollout makes them: each fork copies its parent's first
    ``branch_point`` entries of all four arrays; leaves listed in any order."""
    n = draw(st.integers(1, 7))
    made: list[P.Trajectory] = []
    for i in range(n):
        length = draw(st.integers(0, 12))
        rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
        arrays = {"tokens": rng.integers(0, 50, length).astype(np.int32),
                  "loss_mask": rng.integers(0, 2, length).astype(np.uint8),
                  "logprobs": -rng.random(length).astype(np.float32),
                  "versions": rng.integers(0, 4, length).astype(np.int32)}
        parent = draw(st.integers(-1, i - 1)) if i else -1
        bp = 0
        if parent >= 0:
            bp = draw(st.integers(0, min(length, len(made[parent]))))
            for name in arrays:
                arrays[name][:bp] = getattr(made[parent], name)[:bp]
        made.append(P.Trajectory(**arrays, reward=float(i), parent=parent, branch_point=bp))
    order = draw(st.permutations(range(n)))  # parents need not come first on the wire
    where = {old: new for new, old in enumerate(order)}
    leaves = [P.Trajectory(**{a: getattr(made[o], a) for a in
                              ("tokens", "loss_mask", "logprobs", "versions")},
                           reward=made[o].reward, branch_point=made[o].branch_point,
                           parent=where[made[o].parent] if made[o].parent >= 0 else -1)
              for o in order]
    return P.TrajectoryGroup("g", 0, "p", np.arange(3, dtype=np.int32), leaves, mode="arpo")


def _own_tokens(frames) -> int:
    header = msgpack.unpackb(bytes(frames[0]), raw=False)
    return next(shape[0] for name, _, shape in header["arrays"] if name == "tokens")


@settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
@given(trees())
def test_a_tree_round_trips_and_sends_each_shared_token_once(group):
    frames = wire(group)
    assert_same(group, P.decode(frames))
    own = sum(len(leaf) - (leaf.branch_point if leaf.parent >= 0 else 0)
              for leaf in group.leaves)
    assert _own_tokens(frames) == own


def test_a_fork_whose_prefix_differs_goes_whole():
    root = P.Trajectory(np.arange(6, dtype=np.int32), np.ones(6, np.uint8),
                        -np.ones(6, np.float32), np.zeros(6, np.int32))
    fork = P.Trajectory(root.tokens.copy(), root.loss_mask.copy(), root.logprobs.copy(),
                        root.versions.copy(), parent=0, branch_point=4)
    fork.logprobs[1] = -0.5  # one behaviour log-prob differs inside the shared prefix
    group = P.TrajectoryGroup("g", 0, "p", np.zeros(2, np.int32), [root, fork])
    frames = wire(group)
    assert _own_tokens(frames) == 12 and msgpack.unpackb(frames[0])["body"]["leaves"][1][
        "shared"] == 0
    assert_same(group, P.decode(frames))


def _forked() -> list[bytes]:
    root = P.Trajectory(np.arange(6, dtype=np.int32), np.ones(6, np.uint8),
                        -np.ones(6, np.float32), np.zeros(6, np.int32))
    fork = P.Trajectory(np.r_[root.tokens[:4], [9, 9]].astype(np.int32), root.loss_mask.copy(),
                        root.logprobs.copy(), root.versions.copy(), parent=0, branch_point=4)
    return wire(P.TrajectoryGroup("g", 0, "p", np.zeros(2, np.int32), [root, fork]))


@pytest.mark.parametrize("mutate, reason", [
    (lambda h: h["body"]["leaves"][1].update(shared=3), "bad_field"),  # not the branch point
    (lambda h: h["body"]["leaves"][0].update(shared=2), "bad_field"),  # a root cannot share
    (lambda h: h["body"]["leaves"][1].update(shared=7, branch_point=7, len=9), "bad_field"),
    (lambda h: h["body"]["leaves"][0].update(parent=1, branch_point=2, shared=2, len=8),
     "bad_field"),  # parents in a cycle
    (lambda h: h["body"]["leaves"][1].pop("shared"), "missing_field"),
])
def test_a_header_that_claims_a_prefix_it_cannot_have_is_refused(mutate, reason):
    assert_same(P.decode(_forked()).leaves[1].tokens, np.array([0, 1, 2, 3, 9, 9], np.int32))
    assert_rejects(repack(_forked(), mutate), reason)


def test_a_fork_that_differs_only_in_the_bits_of_a_zero_goes_whole():
    root = P.Trajectory(np.arange(4, dtype=np.int32), np.ones(4, np.uint8),
                        np.zeros(4, np.float32), np.zeros(4, np.int32))
    fork = P.Trajectory(root.tokens.copy(), root.loss_mask.copy(),
                        np.array([-0.0, 0, 0, 0], np.float32), root.versions.copy(),
                        parent=0, branch_point=2)
    group = P.TrajectoryGroup("g", 0, "p", np.zeros(1, np.int32), [root, fork])
    frames = wire(group)
    assert _own_tokens(frames) == 8  # -0.0 is not 0.0 bitwise: sent whole, kept exact
    assert_same(group, P.decode(frames))


def test_a_few_header_bytes_cannot_make_the_decoder_allocate_more_than_a_message():
    """Forks that share their parent's whole length and send nothing of their own: each
    costs a header entry on the wire and the parent's length in memory."""
    n = 4096
    root = P.Trajectory(np.zeros(n, np.int32), np.zeros(n, np.uint8),
                        np.zeros(n, np.float32), np.zeros(n, np.int32))
    forks = [P.Trajectory(root.tokens, root.loss_mask, root.logprobs, root.versions,
                          parent=0, branch_point=n) for _ in range(40)]
    frames = wire(P.TrajectoryGroup("g", 0, "p", np.zeros(1, np.int32), [root, *forks]))
    assert _own_tokens(frames) == n  # 41 leaves of 4,096 entries, one of them on the wire
    assert len(P.decode(frames).leaves) == 41
    err = assert_rejects(frames, "too_large", max_bytes=40 * n * 13)
    assert "leaves whole" in str(err)


def test_a_long_chain_in_reverse_order_decodes_in_one_pass():
    leaves, n = [], 2000
    for i in range(n):  # leaf i forks leaf i+1 after its first token: parents come last
        leaves.append(P.Trajectory(np.zeros(i + 1, np.int32), np.zeros(i + 1, np.uint8),
                                   np.zeros(i + 1, np.float32), np.zeros(i + 1, np.int32),
                                   parent=i + 1 if i < n - 1 else -1,
                                   branch_point=1 if i < n - 1 else 0))
    group = P.TrajectoryGroup("g", 0, "p", np.zeros(1, np.int32), leaves)
    frames = wire(group)
    assert _own_tokens(frames) == sum(range(1, n + 1)) - (n - 1)
    assert_same(group, P.decode(frames))
