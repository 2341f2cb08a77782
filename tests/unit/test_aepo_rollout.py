"""AEPO's dynamic budget split through the real rollout (actors/rollout/) with a
scripted engine and a fake tool: the probe only measures, then exactly m global samples
exist (the probe included) and the other M - m leaves come from branching, refilled with
global samples only where branching left budget unused."""

from __future__ import annotations

import math

import numpy as np
import pytest
from transformers import AutoTokenizer

from actors.rollout import POLICIES, build_rollout
from actors.branching import aepo_global_samples
from actors.engines.base import GenResult
from arpo_async.core.config import config_from_dict
from arpo_async.core.entropy import entropy_from_topk, window_entropy
from toolenv.base import ToolResult
from toolenv.tasks.prompts import PromptSource

M = 8
CONFIDENT = [0.0]  # one candidate with all the mass: entropy 0
SPREAD = [math.log(1 / 20)] * 20  # twenty equally likely candidates


class ScriptedEngine:
    """A round before any tool result calls python (confident tokens); a round after a
    result answers (spread tokens): the post-tool entropy rises."""

    version = 0

    def __init__(self, tokenizer):
        self.tok = tokenizer
        self.calls = 0

    async def generate(self, req) -> GenResult:
        self.calls += 1
        text = self.tok.decode(req.prompt_tokens, skip_special_tokens=False)
        after_tool = "</result>" in text
        reply = "<answer>\\boxed{7}</answer>" if after_tool else "<python>print(3+4)</python>"
        ids = self.tok.encode(reply, add_special_tokens=False)
        top = [SPREAD if after_tool else CONFIDENT for _ in ids]
        return GenResult(ids, [t[0] for t in top], top, "stop", version=self.version)


class FakeTools:
    def __init__(self):
        self.calls = 0

    async def call(self, name, args):
        self.calls += 1
        return ToolResult("7", ok=True)


def _cfg(**rollout):
    aepo = {"aepo_branch_penalty": 0.0} if rollout.get("mode", "aepo") == "aepo" else {}
    return config_from_dict({
        "rollout": {"mode": "aepo", "group_size": M, "initial_samples": 4, "alpha": 1.0,
                    "beta": 0.0, **aepo, **rollout},
        "sampling": {"max_response_tokens": 200},
        "tools": {"enabled": ["python"]}, "task": {"name": "arith"}})


async def _group(tiny_model_dir, **rollout):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    cfg = _cfg(**rollout)
    engine, tools = ScriptedEngine(tok), FakeTools()
    source = PromptSource(cfg, tok)
    rollout = build_rollout(cfg, engine, source, tok, tools, np.random.default_rng(0),
                            POLICIES[cfg.rollout.mode])
    return await rollout.run(source.next(), actor_id=0), tok, tools


def _expected_m(tok) -> int:
    answer = tok.encode("<answer>\\boxed{7}</answer>", add_special_tokens=False)
    h_tool = window_entropy(entropy_from_topk([SPREAD] * len(answer), len(tok)), 20)
    call = tok.encode("<python>print(3+4)</python>", add_special_tokens=False)
    h_root = window_entropy(entropy_from_topk([CONFIDENT] * len(call), len(tok)), 20)
    return aepo_global_samples(h_root, [h_tool], M, 0.5)


async def test_exactly_m_global_samples_then_branching(tiny_model_dir):
    group, tok, tools = await _group(tiny_model_dir)
    m = _expected_m(tok)
    assert 1 < m < M // 2  # the entropy rise after the tool shrinks the global share
    s = group.stats
    assert s["branch/aepo_m"] == m
    roots = [i for i, leaf in enumerate(group.leaves) if leaf.parent == -1]
    forks = [i for i, leaf in enumerate(group.leaves) if leaf.parent >= 0]
    assert len(group.leaves) == M
    # the probe (0) never branched: it only measured; its m - 1 companions each forked
    # once (P = 1), and the fill took what branching left
    assert all(group.leaves[i].parent != 0 for i in forks)
    assert s["branch/global_samples"] - s["branch/fills"] == m
    assert s["branch/forks"] == len(forks) == min(m - 1, M - m)
    assert len(roots) == m + s["branch/fills"]
    assert s["branch/tool_rounds"] == m - 1 + s["branch/fills"]  # the probe's is no decision
    # a fork reuses its parent's tool result: calls run = global samples, not leaves
    assert tools.calls == group.tool_calls_executed == len(roots)
    # every decision is on the group for the trees page: one row per decision, placed at
    # the fork's branch point, its forks those the tree shows
    assert len(group.decisions) == s["branch/tool_rounds"]
    placed = {(int(d[0]), int(d[1])): int(d[4]) for d in group.decisions if d[4] > 0}
    shown: dict[tuple[int, int], int] = {}
    for i in forks:
        key = (group.leaves[i].parent, group.leaves[i].branch_point)
        shown[key] = shown.get(key, 0) + 1
    assert placed == shown


async def test_a_flat_probe_splits_the_budget_in_half(tiny_model_dir, monkeypatch):
    monkeypatch.setattr(ScriptedEngine, "generate", _flat)
    group, _, _ = await _group(tiny_model_dir)
    assert group.stats["branch/aepo_m"] == M // 2  # no entropy gap: sigmoid(0) = 1/2


async def _flat(self, req) -> GenResult:
    """Every round answers at once, confidently: the probe sees no tool result at all."""
    ids = self.tok.encode("<answer>\\boxed{7}</answer>", add_special_tokens=False)
    return GenResult(ids, [0.0] * len(ids), [CONFIDENT] * len(ids), "stop", version=0)


@pytest.mark.parametrize("mode", ["arpo", "grpo"])
async def test_other_modes_have_no_probe(tiny_model_dir, mode):
    group, _, _ = await _group(tiny_model_dir, mode=mode)
    assert "branch/aepo_m" not in group.stats and len(group.leaves) == M
