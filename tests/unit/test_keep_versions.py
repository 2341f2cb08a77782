"""Keep mode's per-token versions (actors/engines/vllm_weights.py ``LiveRequest``): a request
frozen at weight updates is tagged, token by token, with the version that sampled each
token, from the counts the workers reported at each freeze."""

from __future__ import annotations

from actors.engines.vllm_weights import LiveRequest


def test_no_update_one_version():
    assert LiveRequest(3).versions(4) == [3, 3, 3, 3]


def test_each_update_switches_after_the_tokens_sampled_before_it():
    live = LiveRequest(0)
    live.switches += [(2, 1), (5, 2)]
    assert live.versions(7) == [0, 0, 1, 1, 1, 2, 2]


def test_a_request_that_had_not_sampled_yet_is_all_new():
    live = LiveRequest(0)
    live.switches.append((0, 1))
    assert live.versions(3) == [1, 1, 1]


def test_counts_past_the_end_or_behind_an_earlier_switch_are_clamped():
    live = LiveRequest(0)
    live.switches += [(4, 1), (2, 2)]  # a later count below an earlier one: never reorders
    assert live.versions(3) == [0, 0, 0]
    live = LiveRequest(0)
    live.switches += [(1, 1), (1, 2)]  # two updates with no token between them
    assert live.versions(3) == [0, 2, 2]
