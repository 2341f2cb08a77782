"""The decision layer (actors/branching.py) against the authors' rollout, step by step on
scripted, seeded rounds: the branch rule, H_init, the fill rule, AEPO's rule and counter,
and when the decision is taken.

Their code, transcribed below in a few lines per rule (nothing of it is imported or kept):

* ARPO: RUC-NLPIR/ARPO at a95cd0894b53e97595845bd680ed7e85524a2244,
  ``ARPO/verl_arpo_entropy/verl/workers/rollout/vllm_rollout/vllm_rollout_with_tools.py``
  (``ARPO_FILE`` below, cited as A:<line>);
* AEPO: the authors' AEPO upload and fix, 30efc15cbe057dec0ab6d68fb6b41874f26940b7 (read
  through the fork wangevan6/ARPO, which carries the authors' commits),
  ``AEPO/verl_aepo_entropy/verl/workers/rollout/vllm_rollout/vllm_rollout_with_tools.py``
  (cited as E:<line>).

Their loop runs every live trajectory of a batch one round in lockstep (A:264), reads each
round's window entropy (A:287-305), and after the round's tool results decides on forks
for each trajectory whose round ended in a call (A:458-487) from *that* round's entropy;
a prompt with nothing live gets one fresh sample (A:490-508). For one prompt, tokens and
tools are replaced by a script: trajectory k (ids in creation order on both sides) runs
the rounds ``script[k]``, each an (entropy, ends in a tool call) pair. Their
``random.random()`` (A:473) becomes the same seeded numpy stream the planner draws from.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from actors.branching import BranchPlanner, BranchSettings

ARPO_FILE = "ARPO/verl_arpo_entropy/verl/workers/rollout/vllm_rollout/vllm_rollout_with_tools.py"


def _scripts(seed: int, count: int = 64, max_calls: int = 3) -> list[list[tuple[float, bool]]]:
    """Rounds of each trajectory (by creation index): up to ``max_calls`` rounds ending in a
    call, then one answering round; entropies in [0, 4], the summed window's scale."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(count):
        calls = int(rng.integers(0, max_calls + 1))
        hs = rng.uniform(0.0, 4.0, size=calls + 1)
        out.append([(float(h), i < calls) for i, h in enumerate(hs)])
    return out


def authors_loop(scripts, n, initial, alpha, beta, rng, aepo_penalty=None) -> tuple[list, list]:
    """Their generate_sequences for ONE prompt with beam_size 2 (one fork per draw, the
    scripts' BEAM_SIZE=2). ``aepo_penalty``: AEPO's loop (its constant, E:953). Returns
    the parents by index and the decisions (index, dH, branched, counter)."""
    parent, h_init = [-1] * initial, {}  # A:249-255; initial_entropy_dict, A:115
    step = [0] * initial
    active, created, counter, log = list(range(initial)), initial, 0, []  # A:258; E:680
    while active:  # A:264
        current = {}
        for i in active:  # A:287-305: H of the round; the first one is H_init
            current[i] = scripts[i][step[i]][0]
            h_init.setdefault(i, current[i])
        calls = [i for i in active if scripts[i][step[i]][1]]  # A:338-346; else ends, A:360
        for i in active:
            step[i] += 1
        new, remaining, made = [], n - created, 0  # A:459
        for src in calls if remaining > 0 else []:  # A:460-463
            if min(1, remaining - made) <= 0:  # A:464-466 (beam_size - 1 = 1)
                break
            u, dh = rng.random(), current[src] - h_init[src]  # A:470-473
            if aepo_penalty is None:
                branch = max(0.0, min(1.0, u - beta * dh)) <= alpha  # A:473-477
            else:  # E:947-968
                prob = (u + beta * dh) * max(0.0, 1.0 - aepo_penalty * counter)
                branch = not max(0.0, min(1.0, prob)) < alpha
            log.append((src, round(dh, 12), branch, counter))
            if branch:  # A:479-485
                new.append(src)
                made += 1
        if not calls and created + len(new) < n:  # A:490-508: one fresh sample per round
            new.append(-1)
        if new and aepo_penalty is not None:  # E:1006, E:1025-1036: fills count too
            counter += 1  # (a round that creates nothing leaves it, one prompt per batch)
        created += len(new)
        parent += new
        step += [0] * len(new)
        active = calls + list(range(len(parent) - len(new), len(parent)))  # A:512-526
    return parent, log


def planner_loop(scripts, settings: BranchSettings, rng) -> tuple[list, list, BranchPlanner]:
    """The same lockstep rounds driving the planner at the authors' timing: a round's own
    entropy decides on a fork after its tool result (actors/rollout/ decides on
    the round after the result instead: test_the_rollout_decides_one_round_earlier)."""
    pl = BranchPlanner(settings, rng)
    active, step, log = pl.start(), {}, []
    while active:
        current = {}
        for t in active:
            current[t] = scripts[t][step.setdefault(t, 0)][0]
            if step[t] == 0:
                pl.record_initial_entropy(t, current[t])  # global samples and forks (own)
        calls = [t for t in active if scripts[t][step[t]][1]]
        for t in active:
            step[t] += 1
            if t not in calls:
                pl.finish(t)
        new = []
        for t in calls:
            room, streak = pl.remaining_budget(), pl.streak_of(t)
            forks, m = pl.after_tool_round(t, current[t])
            if room > 0:  # their loop draws nothing once the prompt's budget is spent
                log.append((t, round(m["dh"], 12), bool(forks), streak))
            new += forks
        new += pl.fill()
        active = calls + new
    return pl.parents(), log, pl


def _settings(fill="one_per_round", **kw) -> BranchSettings:
    base = dict(group_size=8, initial_samples=3, alpha=0.5, beta=0.2, fork_h_init="own",
                fill=fill)
    return BranchSettings(**(base | kw))


@pytest.mark.parametrize("seed", range(40))
def test_arpo_tree_and_decisions_match_the_authors_loop(seed):
    """Same draws, same timing: every decision (who, dH against its own first round, fork
    or not) and the whole tree agree, fills included."""
    scripts = _scripts(1000 + seed)
    theirs = authors_loop(scripts, 8, 3, 0.5, 0.2, np.random.default_rng(seed))
    ours = planner_loop(scripts, _settings(), np.random.default_rng(seed))
    assert ours[0] == theirs[0]
    assert [d[:3] for d in ours[1]] == [d[:3] for d in theirs[1]]


def test_h_init_is_each_trajectorys_own_first_round():
    """Theirs: initial_entropy_dict keyed by the new index, set by its first round (A:304);
    ours with fork_h_init=own: the fork's first round, never its parent's."""
    scripts = _scripts(7)
    _, _, pl = planner_loop(scripts, _settings(), np.random.default_rng(3))
    assert pl.stats()["forks"] > 0
    for t in range(pl.created):
        assert pl.h_init_of(t) == scripts[t][0][0]


def test_filling_all_at_once_departs_and_forks_less():
    """fill=all starts every missing root at once; theirs one per round, and that root may
    fork before the next: over seeded groups, fewer forks with all."""
    forks = {"all": 0, "one_per_round": 0}
    differ = 0
    for seed in range(60):
        scripts = _scripts(5000 + seed)
        theirs = authors_loop(scripts, 8, 3, 0.5, 0.2, np.random.default_rng(seed))
        for fill in forks:
            parents, _, pl = planner_loop(scripts, _settings(fill), np.random.default_rng(seed))
            forks[fill] += pl.stats()["forks"]
            differ += fill == "all" and parents != theirs[0]
    assert differ > 0 and forks["all"] < forks["one_per_round"]


@pytest.mark.parametrize("seed", range(20))
def test_aepo_rule_matches_theirs_without_a_count(seed):
    """AEPO's (u + beta dH) f >= alpha (aepo_rule=authors), tree for tree, while the
    consecutive count is 0 on both sides (penalty 0)."""
    scripts = _scripts(2000 + seed)
    theirs = authors_loop(scripts, 8, 3, 0.5, 0.2, np.random.default_rng(seed), 0.0)
    s = _settings(aepo_rule="authors", aepo_penalty=0.0)
    ours = planner_loop(scripts, s, np.random.default_rng(seed))
    assert ours[0] == theirs[0]
    assert [d[:3] for d in ours[1]] == [d[:3] for d in theirs[1]]


def test_aepo_counter_is_per_prompt_and_counts_fills_there_per_lineage_here():
    """A remaining difference (docs/design.md): their count goes up once per round in
    which the prompt created anything, fills included (E:1025-1036); ours counts the
    branches on a lineage. Hand case: root 0 answers at once, the fill (1) calls."""
    scripts = [[(1.0, False)], [(1.0, True), (2.0, True), (1.0, False)]] + \
        [[(1.0, False)]] * 6
    _, theirs = authors_loop(scripts, 4, 1, 0.5, 0.2, np.random.default_rng(0), 0.05)
    s = _settings(group_size=4, initial_samples=1, aepo_rule="authors", aepo_penalty=0.05)
    _, ours, _ = planner_loop(scripts, s, np.random.default_rng(0))
    assert theirs[0][3] == 1 and ours[0][3] == 0  # the fill already counted there


LEVELS = ([0.0], [math.log(1 / 5)] * 5, [math.log(1 / 20)] * 20)  # round r after r results


class _Engine:
    """Round r (r tool results in the context) has entropy level r; rounds 0 and 1 call
    python, round 2 answers."""

    version = 0

    def __init__(self, tok):
        self.tok = tok

    async def generate(self, req):
        from actors.engines.base import GenResult

        r = self.tok.decode(req.prompt_tokens, skip_special_tokens=False).count("</result>")
        ids = self.tok.encode("<answer>\\boxed{7}</answer>" if r >= 2 else
                              "<python>print(3+4)</python>", add_special_tokens=False)
        top = [LEVELS[r]] * len(ids)
        return GenResult(ids, [t[0] for t in top], top, "stop", version=0)


class _Tools:
    async def call(self, name, args):
        from toolenv.base import ToolResult

        return ToolResult("7", ok=True)


def _round_h(tok, r: int) -> float:
    from arpo_async.core.entropy import round_entropy

    text = "<answer>\\boxed{7}</answer>" if r >= 2 else "<python>print(3+4)</python>"
    n = len(tok.encode(text, add_special_tokens=False))
    return round_entropy([LEVELS[r]] * n, [LEVELS[r][0]] * n, [], estimator="tail_corrected",
                         vocab_size=len(tok), window=20)


async def test_the_rollout_decides_one_round_earlier(tiny_model_dir, monkeypatch):
    """Timing, a kept difference: theirs reads the round that made call j and forks after
    result j (A:470-479), so a lineage's first decision has dH = 0 and the entropy after
    result j decides at result j + 1; actors/rollout/ reads the round after
    result j and forks at result j (the fork resamples the round that was read)."""
    from transformers import AutoTokenizer

    from actors.rollout import POLICIES, build_rollout
    from arpo_async.core.config import config_from_dict
    from toolenv.tasks.prompts import PromptSource

    seen = []
    decide = BranchPlanner.after_tool_round
    monkeypatch.setattr(BranchPlanner, "after_tool_round",
                        lambda self, t, h, short=False, p_given=None: (
                            seen.append((t, h, self.h_init_of(t))) or decide(self, t, h, short)))
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    cfg = config_from_dict({
        "rollout": {"mode": "arpo", "group_size": 2, "initial_samples": 2, "alpha": 0.0,
                    "beta": 0.0, "fork_h_init": "own", "fill": "one_per_round"},
        "sampling": {"max_response_tokens": 200},
        "tools": {"enabled": ["python"]}, "task": {"name": "arith"}})
    source = PromptSource(cfg, tok)
    rollout = build_rollout(cfg, _Engine(tok), source, tok, _Tools(), np.random.default_rng(0),
                            POLICIES[cfg.rollout.mode])
    await rollout.run(source.next(), actor_id=0)
    h = [_round_h(tok, r) for r in range(3)]
    assert len(set(h)) == 3
    ours = sorted((t, hh - h0) for t, hh, h0 in seen)  # decisions after results 1 and 2
    assert ours == sorted([(t, h[j] - h[0]) for t in (0, 1) for j in (1, 2)])
    theirs = [h[j] - h[0] for j in (0, 1)]  # A: at results 1 and 2, from rounds 0 and 1
    assert theirs[0] == 0.0 and [d for t, d in ours if t == 0] != theirs


def test_arpo_rule_is_ours_up_to_ties():
    """clip(u - beta dH, 0, 1) <= alpha (A:473-477) against u < clip(alpha + beta dH):
    the same event for u in [0, 1) except u - beta dH == alpha exactly."""
    from actors.branching import branch_probability

    rng = np.random.default_rng(0)
    for _ in range(20000):
        u, dh = rng.random(), rng.normal(0, 4)
        alpha, beta = rng.uniform(0, 1), rng.uniform(-1, 1)
        theirs = max(0.0, min(1.0, u - beta * dh)) <= alpha
        ours = u < branch_probability(dh, 0.0, alpha, beta)
        assert theirs == ours or math.isclose(u - beta * dh, alpha, abs_tol=1e-12)
