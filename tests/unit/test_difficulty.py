"""actors/difficulty.py: prompts the recent policy always solves or never does are passed
over by their kind's share of groups without reward variance, within hard bounds (no
prompt starved, every draw ends), and the run is reproducible from its seed."""

from __future__ import annotations

import itertools
from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from actors.difficulty import DifficultyBudget
from arpo_async.core.config.tools import DifficultyConfig


def _prompt(pid: str, kind: str):
    return SimpleNamespace(id=pid, kind=kind)


def _budget(seed: int = 0, **kw) -> DifficultyBudget:
    return DifficultyBudget(DifficultyConfig(enabled=True, **kw), np.random.default_rng(seed))


def test_estimate_by_hand():
    b = _budget(max_skip=0.5, min_groups=2, window=4)
    arith = _prompt("a0", "arith")
    b.observe(arith, [1, 1, 1, 1])  # solved by every leaf: no variance
    assert b.zero_share["arith"] == 1.0
    assert b.skip_probability(_prompt("a1", "arith")) == 0.0  # one group: below min_groups
    b.observe(_prompt("a2", "arith"), [0, 1, 0, 0])
    assert b.zero_share["arith"] == 0.5  # the mean of the first groups: (1 + 0) / 2
    assert b.skip_probability(_prompt("a3", "arith")) == pytest.approx(0.25)
    for pid in ("a4", "a5", "a6"):
        b.observe(_prompt(pid, "arith"), [0, 0])
    # the mean until `window` groups, then an average with rate 1/4: (1 + 0 + 1 + 1) / 4 = 0.75
    # after 4, then 0.75 * 0.75 + 0.25 = 0.8125
    assert b.zero_share["arith"] == pytest.approx(0.8125)
    # a prompt whose own last group had no variance: skipped at max_skip, whatever its kind
    assert b.skip_probability(_prompt("a0", "lookup")) == 0.5
    assert b.skip_probability(_prompt("new", "lookup")) == 0.0
    b.observe(_prompt("one", "combo"), [1.0])  # one leaf: nothing to compare
    assert b.flat["one"]


def test_refuses_an_unseeded_generator():
    with pytest.raises(TypeError, match="seeded"):
        DifficultyBudget(DifficultyConfig(), None)


def _stream(kinds: list[str]):
    """An endless stream of distinct prompts cycling through ``kinds``."""
    counter = itertools.count()

    def next_prompt():
        i = next(counter)
        return _prompt(f"p{i}", kinds[i % len(kinds)])
    return next_prompt, counter


def test_an_uninformative_kind_is_drawn_less_never_never():
    b = _budget(seed=3, max_skip=0.75, min_groups=1)
    b.observe(_prompt("x", "easy"), [1, 1, 1])  # z_easy = 1: skip 0.75
    b.observe(_prompt("y", "hard"), [0, 1, 1])  # z_hard = 0: never skipped
    next_prompt, _ = _stream(["easy", "hard"])
    taken = [b.draw(next_prompt)[0].kind for _ in range(4000)]
    easy = taken.count("easy") / len(taken)
    # offers alternate; an easy prompt is taken with probability 0.25: 1 easy per 4 hard
    assert easy == pytest.approx(0.25 / 1.25, abs=0.02)
    assert b.stats()["difficulty/skipped/easy"] > 0 and "difficulty/skipped/hard" not in b.stats()


def test_the_bounds_hold_even_when_every_prompt_looks_useless():
    b = _budget(seed=1, max_skip=0.999, min_groups=1, max_consecutive=5, max_prompt_skips=2)
    b.observe(_prompt("z", "k"), [0, 0])
    next_prompt, counter = _stream(["k"])
    prompt, passed = b.draw(next_prompt)
    assert passed == 5 and prompt.id == "p5"  # a draw passes over at most max_consecutive
    # the same prompt offered again and again: taken after max_prompt_skips passes
    same = _prompt("again", "k")
    offers = []

    def offer():
        offers.append(1)
        return same
    assert b.draw(offer) == (same, 2) and len(offers) == 3
    assert "again" not in b.streak  # taken: its streak starts again


@settings(max_examples=50, deadline=None)
@given(seed=st.integers(0, 2**16), flat=st.lists(st.booleans(), min_size=1, max_size=40),
       max_consecutive=st.integers(1, 6))
def test_a_draw_always_ends_and_the_same_seed_gives_the_same_draws(seed, flat, max_consecutive):
    runs = []
    for _ in range(2):
        b = _budget(seed=seed, min_groups=1, max_consecutive=max_consecutive)
        for i, f in enumerate(flat):
            b.observe(_prompt(f"o{i}", "k"), [1, 1] if f else [0, 1])
        next_prompt, _ = _stream(["k", "j"])
        draws = [b.draw(next_prompt) for _ in range(20)]
        assert all(passed <= max_consecutive for _, passed in draws)
        runs.append([(p.id, passed) for p, passed in draws])
    assert runs[0] == runs[1]


def test_the_actor_s_draw_covers_every_prompt_it_passed_over():
    """A group drawn after skips spans their stream positions ([data_pos, data_end)), and
    its prompt is the one at data_end - 1: the prompt record stays exact."""
    from actors.actor import Actor
    from arpo_async.core.config import load_config
    from toolenv.tasks.prompts import PromptSource

    cfg = load_config(None, ["task.name=arith", "task.num_prompts=50", "tools.enabled=[]"])
    src = PromptSource(cfg, _ShortTokenizer())
    b = _budget(seed=2, min_groups=1, max_skip=0.9)
    b.observe(_prompt("seen", "arith"), [1, 1])  # every arith prompt now looks solved
    actor = SimpleNamespace(_resume={}, _redo=[], source=src, difficulty=b)
    ends, passed_total = [], 0
    for _ in range(10):
        pos, end, prompt = Actor._draw(actor)
        assert prompt.id == src.prompt_at(end - 1).id
        assert pos == (ends[-1] if ends else 0)  # no position left out between groups
        ends.append(end)
    assert ends[-1] == 10 + sum(b.skipped.values()) and sum(b.skipped.values()) > 0


class _ShortTokenizer:
    """Enough of a tokenizer for PromptSource: a short prompt of fixed ids."""

    eos_token_id, pad_token_id = 0, 0

    def apply_chat_template(self, messages, **kw):
        return [1, 2, 3]

    def encode(self, text, **kw):
        return [1] * max(1, len(text) // 4)

    def convert_tokens_to_ids(self, token):
        return 5

    def get_vocab(self):
        return {}
