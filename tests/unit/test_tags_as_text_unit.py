"""A tokenizer like a real one (``--tags-as-text``): no ARPO tag is a token and tags merge
with their neighbours; the rollout's rule for a stop string that ends inside a token
(docs/design.md "Tags as text"), through the real ``AgentRollout`` with a scripted
engine; SFT masks that follow the segments exactly."""

from __future__ import annotations

import numpy as np
import pytest

from actors.rollout import POLICIES, build_rollout
from actors.rollout.path import after_overhang, split_at_stop
from actors.engines.base import GenResult
from arpo_async.core.config import config_from_dict
from arpo_async.jobs.sft import encode_trace
from arpo_async.jobs.tiny_model import ARPO_TAGS, SPECIAL_TOKENS
from toolenv.base import ToolResult
from toolenv.tags import format_result
from toolenv.tasks.prompts import Prompt, PromptSource

CALL = "<python>print(3+4)</python>"
ANSWER = "<answer>\\boxed{7}</answer>"


@pytest.fixture(scope="module")
def tok(tags_as_text_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tags_as_text_model_dir)


def pieces(tok, text: str) -> list[str]:
    return [tok.decode([i]) for i in tok.encode(text, add_special_tokens=False)]


def test_no_tag_is_a_token_and_tags_merge_with_their_neighbours(tok):
    assert len(tok) == 2048
    for t in SPECIAL_TOKENS:
        assert len(tok.encode(t, add_special_tokens=False)) == 1, t
    for t in ARPO_TAGS:
        assert len(tok.encode(t, add_special_tokens=False)) > 1, t
    text = ("<think>I need python.</think>\n<python>print(12*34)</python>\n<result>\n408\n"
            "</result>\n<answer>The answer is \\boxed{408}</answer>")
    assert tok.decode(tok.encode(text, add_special_tokens=False)) == text  # lossless
    p = pieces(tok, text)
    # as in Qwen's BPE: the tag's edges are merged with what touches them
    assert p[:2] == ["<think", ">"] and ".</" in p and ")</" in p and "}</" in p
    assert p[p.index("<python") + 1] == ">print"
    assert p[p.index(")</") + 1:p.index(")</") + 3] == ["python", ">\n"]  # </python> ends inside
    assert pieces(tok, "</python></think>\n\n")[-2:] == ["think", ">\n\n"]


def test_chat_template_is_qwen3_shaped(tok):
    msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": "Q?"}]
    text = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    assert text == "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nQ?<|im_end|>\n" \
                   "<|im_start|>assistant\n"
    off = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False,
                                  enable_thinking=False)
    assert off == text + "<think>\n\n</think>\n\n"
    turn = msgs + [{"role": "assistant", "content": "A", "reasoning_content": "\nR\n"}]
    done = tok.apply_chat_template(turn, tokenize=False)
    assert done.endswith("<|im_start|>assistant\n<think>\nR\n</think>\n\nA<|im_end|>\n")


def test_split_at_stop_and_after_overhang_by_hand():
    assert split_at_stop("x</python>\n", "</python>") == ("x</python>", "\n")
    assert split_at_stop("a</python>b</python>", "</python>") == ("a</python>", "b</python>")
    assert split_at_stop("x</python>\n", 17) == ("x</python>\n", "")  # a stop token id
    assert split_at_stop("no stop", None) == ("no stop", "")
    res = format_result("7")
    assert after_overhang("\n", res) == res[1:]  # the model already wrote the newline
    assert after_overhang("", res) == res
    assert after_overhang(".", res) == res and after_overhang("\n\n", res) == res


class ScriptedEngine:
    """Round 1 calls python and its last token runs ``tail`` past ``</python>``; round 2
    answers. Stop strings, as a real tokenizer's multi-token tags need."""

    version = 0

    def __init__(self, tok, tail: str):
        self.tok, self.tail, self.requests = tok, tail, []

    async def generate(self, req) -> GenResult:
        self.requests.append(req)
        after = "</result>" in self.tok.decode(req.prompt_tokens)
        text, stop = (ANSWER, "</answer>") if after else (CALL + self.tail, "</python>")
        ids = self.tok.encode(text, add_special_tokens=False)
        return GenResult(ids, [-0.5] * len(ids), [[-0.5]] * len(ids), "stop", stop_reason=stop,
                         version=0)


class FakeTools:
    def __init__(self):
        self.calls = []

    async def call(self, name, args):
        self.calls.append((name, args))
        return ToolResult("7", ok=True)


@pytest.mark.parametrize("tail", ["", "\n", ".", "\n\n"])
async def test_a_call_ending_inside_a_token_runs_once_and_its_result_follows(tok, tail):
    cfg = config_from_dict({
        "rollout": {"mode": "grpo", "group_size": 2, "initial_samples": 2},
        "sampling": {"max_response_tokens": 200},
        "tools": {"enabled": ["python"]}, "task": {"name": "arith"}})
    engine, tools = ScriptedEngine(tok, tail), FakeTools()
    source = PromptSource(cfg, tok)
    rollout = build_rollout(cfg, engine, source, tok, tools, np.random.default_rng(0),
                            POLICIES[cfg.rollout.mode])
    round_ids = tok.encode(CALL + tail, add_special_tokens=False)
    if tail:  # the stop string really ends inside the round's last token
        assert tok.decode(round_ids[-1:]) == ">" + tail
    prompt = source.encode(Prompt("p", "What is 3 + 4?", ["7"], "math"))
    group = await rollout.run(prompt, actor_id=0)
    assert all("</python>" in r.stop and "</answer>" in r.stop for r in engine.requests)
    assert tools.calls == [("python", "print(3+4)")] * 2  # once per leaf, never twice
    result = format_result("7")
    inserted = result[len(tail):] if result.startswith(tail) else result
    for leaf in group.leaves:
        assert leaf.tool_calls == 1 and leaf.finish_reason == "stop"
        # every sampled id is kept; the result's ids follow them; nothing re-tokenised
        np.testing.assert_array_equal(leaf.tokens[:len(round_ids)], round_ids)
        assert tok.decode(leaf.tokens) == CALL + tail + inserted + ANSWER
        tool = leaf.loss_mask == 0
        assert tok.decode(leaf.tokens[tool]) == inserted
        assert np.all(leaf.logprobs[tool] == 0) and np.all(leaf.logprobs[~tool] == -0.5)
        # the reward parser reads the decoded text: text other than whitespace between
        # the call and its result is malformed
        assert (leaf.reward, leaf.score) == ((-1.0, 0.0) if tail.strip() else (1.0, 1.0))


def test_sft_masks_are_the_segments_exactly(tok):
    segments = [{"role": "model", "text": "<think>Add.</think>\n" + CALL},
                {"role": "tool", "text": format_result("7")},
                {"role": "model", "text": ANSWER}]
    row = {"question": "What is 3+4?", "system": "S", "segments": segments}
    ids, mask = encode_trace(tok, row)
    prompt = tok.apply_chat_template([{"role": "system", "content": "S"},
                                      {"role": "user", "content": "What is 3+4?"}],
                                     add_generation_prompt=True, tokenize=True, return_dict=False)
    assert ids[:len(prompt)] == list(prompt) and not any(mask[:len(prompt)])
    ids, mask = np.array(ids[len(prompt):]), np.array(mask[len(prompt):])
    # each segment is encoded alone: no token crosses a segment, so a tag that merges
    # does so inside its segment (")</", ">print") and takes that segment's mask
    runs = np.flatnonzero(np.diff(mask)) + 1
    texts = [tok.decode(part) for part in np.split(ids, runs)]
    assert texts == [segments[0]["text"], segments[1]["text"], ANSWER + "<|im_end|>"]
    assert [int(m[0]) for m in np.split(mask, runs)] == [1, 0, 1]
