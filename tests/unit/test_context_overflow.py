"""No length ends an actor: a trajectory whose context fills ``model.max_model_len``
ends as ``length`` and is counted (``rollout/context_full``), and the group goes on, through
the real rollout (actors/rollout/) with a scripted engine that refuses what vLLM
refuses (a context with no room for one token) and a fake tool with long results."""

from __future__ import annotations

import numpy as np
from transformers import AutoTokenizer

from actors.rollout import POLICIES, build_rollout
from actors.engines.base import ContextOverflow, GenResult
from arpo_async.core.config import config_from_dict
from toolenv.base import ToolResult
from toolenv.tasks.prompts import PromptSource

M = 4
CALL = "<python>print(1)</python>"
LONG = " ".join(["word"] * 60)  # a tool result of about 60 tokens


class RoomEngine:
    """Every round calls python; refuses, as vLLM and actors/engines/vllm_engine.py do, a
    context with no room under ``max_model_len``, and records what it was asked."""

    version = 0

    def __init__(self, tok, max_model_len: int, always_refuse: bool = False):
        self.tok, self.max_model_len, self.always_refuse = tok, max_model_len, always_refuse
        self.asked: list[tuple[int, int]] = []  # (context length, max_tokens)

    async def generate(self, req) -> GenResult:
        self.asked.append((len(req.prompt_tokens), req.max_tokens))
        if self.always_refuse or len(req.prompt_tokens) + 1 > self.max_model_len:
            raise ContextOverflow(f"context of {len(req.prompt_tokens)} tokens")
        ids = self.tok.encode(CALL, add_special_tokens=False)
        if len(ids) > req.max_tokens:
            ids = ids[:req.max_tokens]
            return GenResult(ids, [0.0] * len(ids), [[0.0]] * len(ids), "length")
        return GenResult(ids, [0.0] * len(ids), [[0.0]] * len(ids), "stop",
                         stop_reason="</python>")


class LongTool:
    def __init__(self):
        self.calls = 0

    async def call(self, name, args):
        self.calls += 1
        return ToolResult(LONG, ok=True)


def _setup(tok, max_model_len: int, **engine):
    cfg = config_from_dict({
        "model": {"max_model_len": max_model_len},
        "rollout": {"mode": "arpo", "group_size": M, "initial_samples": 2, "alpha": 1.0,
                    "beta": 0.0, "tool_call_limit": 5},
        "sampling": {"max_response_tokens": 2000, "on_overflow": "cap"},
        "tools": {"enabled": ["python"]}, "task": {"name": "arith"}})
    source = PromptSource(cfg, tok)
    prompt = source.next()
    return (cfg, source, prompt, RoomEngine(tok, max_model_len, **engine), LongTool())


def _lengths(tok) -> tuple[int, int]:
    call = len(tok.encode(CALL, add_special_tokens=False))
    from toolenv.tags import format_result

    return call, len(tok.encode(format_result(LONG), add_special_tokens=False))


async def test_a_prompt_that_fits_overflows_after_two_tool_results(tiny_model_dir):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    call, result = _lengths(tok)
    probe = PromptSource(_setup(tok, 4096)[0], tok).next()
    # room for the prompt, two calls with their results and half a third call
    limit = len(probe.tokens) + 2 * (call + result) + call // 2
    cfg, source, prompt, engine, tools = _setup(tok, limit)
    assert len(prompt.tokens) + cfg.sampling.max_response_tokens > limit  # fits only at start
    rollout = build_rollout(cfg, engine, source, tok, tools, np.random.default_rng(0),
                            POLICIES[cfg.rollout.mode])
    group = await rollout.run(prompt, actor_id=0)
    assert len(group.leaves) == M  # the group went on to its full budget
    for leaf in group.leaves:
        assert leaf.finish_reason == "length" and leaf.tool_calls >= 2
        assert len(prompt.tokens) + len(leaf.tokens) <= limit + result  # a result may overshoot
    assert group.stats["rollout/context_full"] == M
    # the engine was never asked for more than the room left under max_model_len
    assert all(n + k <= limit for n, k in engine.asked) and engine.asked


async def test_an_engine_refusal_ends_the_trajectory_as_length(tiny_model_dir):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    cfg, source, prompt, engine, tools = _setup(tok, 1024, always_refuse=True)
    rollout = build_rollout(cfg, engine, source, tok, tools, np.random.default_rng(0),
                            POLICIES[cfg.rollout.mode])
    group = await rollout.run(prompt, actor_id=0)
    assert len(group.leaves) == M and tools.calls == 0
    assert all(leaf.finish_reason == "length" and len(leaf.tokens) == 0
               for leaf in group.leaves)
    assert group.stats["rollout/context_full"] == M
