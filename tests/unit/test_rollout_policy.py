"""The rollout's group-policy contract (actors/rollout/policy.py): every ``rollout.mode``
has a policy, and a policy sees the events the contract names, in order, through the
real rollout (``build_rollout``: the path stepper, a scripted engine, a fake tool)."""

from __future__ import annotations


import numpy as np
from transformers import AutoTokenizer

from actors.engines.base import GenResult
from actors.rollout import POLICIES, build_rollout
from actors.rollout.agent import AgentRollout
from actors.rollout.plain import PlainRollout
from actors.rollout.policy import GroupPolicy, Spawn
from arpo_async.core.config import ROLLOUT, config_from_dict
from toolenv.base import ToolResult
from toolenv.tasks.prompts import PromptSource

CALL, ANSWER = "<python>print(3+4)</python>", "<answer>\\boxed{7}</answer>"


class ScriptedEngine:
    """Calls python until the context holds ``calls`` tool results, then answers."""

    version = 0

    def __init__(self, tokenizer, calls: int = 2):
        self.tok, self.calls = tokenizer, calls

    async def generate(self, req) -> GenResult:
        text = self.tok.decode(req.prompt_tokens, skip_special_tokens=False)
        reply = ANSWER if text.count("</result>") >= self.calls else CALL
        ids = self.tok.encode(reply, add_special_tokens=False)
        top = [[0.0] for _ in ids]
        return GenResult(ids, [0.0] * len(ids), top, "stop", version=self.version)


class FakeTools:
    async def call(self, name, args):
        return ToolResult("7", ok=True)


def scripted_run(tiny_model_dir, policy, group_size: int = 4, calls: int = 2):
    """A group of ``policy`` through the real rollout; returns (group, tokenizer)."""
    import asyncio

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    cfg = config_from_dict({
        "rollout": {"mode": "arpo", "group_size": group_size, "initial_samples": 1},
        "sampling": {"round_max_tokens": 32, "max_response_tokens": 200},
        "tools": {"enabled": ["python"]}, "task": {"name": "arith"}})
    source = PromptSource(cfg, tok)
    rollout = build_rollout(cfg, ScriptedEngine(tok, calls), source, tok, FakeTools(),
                            np.random.default_rng(0), policy)
    return asyncio.run(rollout.run(source.next(), actor_id=0)), tok


def test_every_mode_has_a_policy_and_plain_sampling_needs_no_tools():
    modes = set(ROLLOUT.members)
    assert modes == set(POLICIES)
    assert all(issubclass(p, GroupPolicy) for p in POLICIES.values())
    cfg = config_from_dict({"rollout": {"mode": "grpo"}, "tools": {"enabled": []}})
    tok = object.__new__(type("Tok", (), {"eos_token_id": None, "encode": lambda *a, **k: [1]}))
    assert isinstance(build_rollout(cfg, None, None, tok, None, None), PlainRollout)
    assert not isinstance(build_rollout(cfg, None, None, tok, None, None), AgentRollout)


class Recording(GroupPolicy):
    """Two roots; a fork of root 0 at its first tool round; every event logged."""

    def __init__(self, cfg, rng):
        super().__init__()
        self.parents, self.events = [-1, -1], []

    def start(self):
        return [0, 1]

    def parent_of(self, tid):
        return self.parents[tid]

    def reads_first_round(self, tid):
        return tid == 0

    def first_round(self, tid, h, short):
        self.events.append(("first", tid))

    def tool_round(self, tid, at, h, short):
        self.events.append(("tool_round", tid, at))
        if tid == 0 and len(self.parents) == 2:
            self.parents.append(0)
            return Spawn(forks=[2])
        return Spawn()

    def observe_tool(self, tid, at, call, result):
        self.events.append(("tool", tid, at, call.name, result.text))

    def finished(self, tid):
        self.events.append(("finished", tid))
        return []


def test_a_policy_sees_its_events_in_order_and_forks_start_at_the_result(tiny_model_dir):
    policies = []

    def policy(cfg, rng):
        policies.append(Recording(cfg, rng))
        return policies[-1]

    group, tok = scripted_run(tiny_model_dir, policy, calls=2)
    events = policies[0].events
    leaves = group.leaves
    assert [leaf.parent for leaf in leaves] == [-1, -1, 0]
    # first rounds: only the trajectory whose first round the policy reads
    assert [e for e in events if e[0] == "first"] == [("first", 0)]
    # each tool result is observed at the length after it, and the next round of the same
    # trajectory is its tool round at that same length
    for tid in (0, 1, 2):
        tools = [e[2] for e in events if e[0] == "tool" and e[1] == tid]
        rounds = [e[2] for e in events if e[0] == "tool_round" and e[1] == tid]
        assert rounds == tools[:len(rounds)]
        assert all(e[3:] == ("python", "7") for e in events if e[0] == "tool" and e[1] == tid)
    # the fork starts at the end of root 0's first tool result and shares its tokens
    first_result = next(e[2] for e in events if e[0] == "tool" and e[1] == 0)
    fork = leaves[2]
    assert fork.branch_point == first_result
    assert list(fork.tokens[:first_result]) == list(leaves[0].tokens[:first_result])
    # the fork does not run that tool again: 2 calls for each root, 1 for the fork
    assert group.tool_calls_executed == 5
    assert sorted(e[1] for e in events if e[0] == "finished") == [0, 1, 2]
    assert events.index(("finished", 2)) > events.index(("tool_round", 0, first_result))
