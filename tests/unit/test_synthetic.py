"""The synthetic tool-use suite: determinism by seed, disjoint splits, answers recomputed
independently from the corpus text, rows the data loader reads, and (integration-marked,
they start the sandbox and a retriever) traces whose every tool output equals what the
real tools return, in the ARPO format, scoring 1.0 (+ the two-tool bonus)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import re
from pathlib import Path

import pytest

from arpo_async.core.files import read_jsonl
from arpo_async.jobs import synthetic as syn
from toolenv.tags import format_result, validate_format
from toolenv.tasks import suite as gen

SMALL = gen.SuiteSpec(seed=3, entities=240, sft=12, rl=9, heldout=9)


def _facts_from_corpus(entities: list[gen.Entity]) -> dict[str, dict[str, int]]:
    """Facts read back from the documents' text (not from the generator's dicts)."""
    patterns = {"population": r"population is (\d+)", "founded": r"founding year is (\d+)",
                "elevation": r"elevation in metres is (\d+)", "born": r"birth year .* is (\d+)",
                "books": r"number of books .* is (\d+)"}
    out: dict[str, dict[str, int]] = {}
    for row in gen.corpus_rows(entities):
        title, text = row["contents"].split("\n", 1)
        facts = {a: int(m.group(1)) for a, p in patterns.items() if (m := re.search(p, text))}
        assert len(facts) == 1, text  # one fact per document
        out.setdefault(title, {}).update(facts)
    return out


def _expected_answer(question: str, facts: dict[str, dict[str, int]]) -> str:
    """The answer, worked out from the question's words and the corpus text alone."""
    m = re.fullmatch(r"What is (\d+) ([*+]) (\d+)\?", question)
    if m:
        a, op, b = int(m.group(1)), m.group(2), int(m.group(3))
        return str(a * b if op == "*" else a + b)
    phrases = {"the population of": "population", "the founding year of": "founded",
               "the elevation of": "elevation", "the birth year of": "born",
               "the number of books by": "books"}
    alt = "|".join(re.escape(p) for p in phrases)
    parts = re.findall(rf"({alt}) ([A-Z][a-z]+ [A-Z][a-z]+)", question)
    values = [facts[name][phrases[p]] for p, name in parts]
    if len(values) == 1:
        return str(values[0])
    assert len(values) == 2, question
    return str(values[0] + values[1] if " plus " in question else values[0] - values[1])


def test_entities_are_deterministic_unique_and_split():
    a, b = gen.make_entities(SMALL), gen.make_entities(SMALL)
    assert a == b
    assert a != gen.make_entities(dataclasses.replace(SMALL, seed=4))
    names = [e.name.lower() for e in a]
    assert len(set(names)) == len(names) == SMALL.entities
    per_split = {s: sum(e.split == s for e in a) for s in gen.SPLITS}
    assert per_split["sft"] > per_split["rl"] > 0 and per_split["heldout"] > 0


def test_tasks_are_deterministic_and_independent_of_other_split_sizes():
    for split in gen.SPLITS:
        assert gen.make_tasks(SMALL, split) == gen.make_tasks(SMALL, split)
    bigger_sft = dataclasses.replace(SMALL, sft=50)
    assert gen.make_tasks(bigger_sft, "heldout") == gen.make_tasks(SMALL, "heldout")
    assert gen.make_tasks(dataclasses.replace(SMALL, seed=9), "rl") != gen.make_tasks(SMALL, "rl")
    kinds = [t.kind for t in gen.make_tasks(SMALL, "rl")]
    assert kinds == list(gen.KINDS) * 3  # round-robin: every prefix is balanced


def test_splits_share_no_entity_and_no_operand_pair():
    spec = dataclasses.replace(SMALL, sft=120, rl=60, heldout=60)
    tasks = {s: gen.make_tasks(spec, s) for s in gen.SPLITS}
    ents = {s: {name for t in ts for name, _ in t.found} for s, ts in tasks.items()}
    pairs = {s: {t.question for t in ts if t.kind == "arith"} for s, ts in tasks.items()}
    for s1, s2 in (("sft", "rl"), ("sft", "heldout"), ("rl", "heldout")):
        assert not ents[s1] & ents[s2], (s1, s2)
        assert not pairs[s1] & pairs[s2], (s1, s2)
    for split, ts in tasks.items():
        for t in ts:
            if t.kind == "arith":
                a, op, b = re.fullmatch(r"What is (\d+) ([*+]) (\d+)\?", t.question).groups()
                assert gen.pair_split(op, int(a), int(b)) == split


def test_answers_match_the_corpus_text():
    spec = dataclasses.replace(SMALL, sft=60, rl=30, heldout=30)
    facts = _facts_from_corpus(gen.make_entities(spec))
    for split in gen.SPLITS:
        for t in gen.make_tasks(spec, split):
            assert t.answer == _expected_answer(t.question, facts), t
            if t.kind != "arith":  # the search queries copy a span of the question
                for tool, args in t.calls:
                    assert tool != "search" or args in t.question


def test_rows_load_as_examples_and_match_the_prompt_source(tmp_path):
    from arpo_async.core.config import config_from_dict
    from toolenv.tasks.data import load_examples
    from toolenv.tasks.prompts import PromptSource

    tasks = gen.make_tasks(SMALL, "rl")
    path = tmp_path / "rl.jsonl"
    path.write_text("".join(json.dumps(t.row()) + "\n" for t in tasks))
    examples = load_examples(path)
    assert [e.question for e in examples] == [t.question for t in tasks]
    assert [e.answers for e in examples] == [[t.answer] for t in tasks]
    assert {e.kind for e in examples} == {"math"}
    assert {e.system_prompt for e in examples} == {gen.SYSTEM_PROMPT}

    # task.name=synthetic_tools gives rl.jsonl of the default-size suite with that seed.
    cfg = config_from_dict({"task": {"name": "synthetic_tools", "seed": 3, "num_prompts": 9}})
    source = PromptSource(cfg, tokenizer=None)
    default_rl = gen.make_tasks(gen.SuiteSpec(seed=3, rl=9), "rl")
    assert [(p.id, p.question, p.answers, p.system_prompt) for p in source.items] == \
        [(t.id, t.question, [t.answer], gen.SYSTEM_PROMPT) for t in default_rl]


def test_corpus_rows_are_retriever_documents(tmp_path):
    from toolenv.retriever_server import load_corpus

    path = tmp_path / "corpus.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in gen.corpus_rows(
        gen.make_entities(SMALL))))
    docs = load_corpus(path)
    n_city = 2 * SMALL.entities // 3
    assert len(docs) == 3 * n_city + 2 * (SMALL.entities - n_city)  # one per fact
    assert len({d["id"] for d in docs}) == len(docs)
    assert all(d["contents"].split("\n")[0] in d["contents"].split("\n")[1] for d in docs)


# ------------------------------------------------------------------ real tools


@pytest.fixture(scope="module")
def suite(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("suite")
    syn.write_suite(out, SMALL)
    return out


@pytest.mark.integration
def test_write_suite_is_byte_identical_for_the_same_seed(suite, tmp_path):
    syn.write_suite(tmp_path, SMALL)
    for name in ("corpus.jsonl", "sft.jsonl", "rl.jsonl", "heldout.jsonl"):
        assert (suite / name).read_bytes() == (tmp_path / name).read_bytes(), name
    meta = json.loads((suite / "meta.json").read_text())
    assert meta["tools"] == {"search": {"topk": SMALL.topk, "snippet_chars": SMALL.snippet_chars}}


@pytest.mark.integration
def test_traces_are_well_formed_and_score_full_marks(suite):
    from toolenv.tasks.data import Example
    from toolenv.tasks.rewards import TWO_TOOL_BONUS, score_response

    traces = read_jsonl(suite / "sft.jsonl")
    assert {t["kind"] for t in traces} == set(gen.KINDS)
    for t in traces:
        assert t["response"] == "".join(s["text"] for s in t["segments"])
        assert validate_format(t["response"]) == (True, "ok"), t["id"]
        score = score_response(t["response"], Example(t["id"], t["question"], t["answers"], "math"))
        bonus = TWO_TOOL_BONUS if t["kind"] == "combo" else 0.0
        assert score.reward == pytest.approx(1.0 + bonus), (t["id"], score)
        roles = [s["role"] for s in t["segments"]]
        assert roles[0] == roles[-1] == "model" and roles[1::2] == ["tool"] * (len(roles) // 2)


@pytest.mark.integration
def test_every_tool_output_equals_the_live_tools(suite):
    """Re-run each call through the real client stack: the sandboxed PythonTool and the
    SearchTool against the retriever server over HTTP; compare byte for byte."""
    from toolenv.python_tool import PythonTool
    from toolenv.retriever_server import start_retriever
    from toolenv.search import SearchTool
    from toolenv.tags import find_tool_call

    traces = read_jsonl(suite / "sft.jsonl")

    async def check() -> int:
        runner, url = await start_retriever(suite / "corpus.jsonl")
        search = SearchTool(url, topk=SMALL.topk, snippet_chars=SMALL.snippet_chars)
        python, checked = PythonTool(), 0
        try:
            for t in traces:
                segs = t["segments"]
                for call_seg, tool_seg in zip(segs[0::2], segs[1::2]):
                    call = find_tool_call(call_seg["text"])
                    tool = python if call.name == "python" else search
                    live = await tool.call(call.args)
                    assert live.ok, live
                    assert tool_seg["text"] == format_result(live.text), (t["id"], call)
                    checked += 1
        finally:
            await search.close()
            await runner.cleanup()
        return checked

    assert asyncio.run(check()) == sum(len(t["segments"]) // 2 for t in traces)


def test_direct_traces_answer_from_memory_without_a_tool():
    """``SuiteSpec.direct``: the demonstrator skips the tools; such a trace is well formed
    and right (on its own entity), with no tool segment and so no two-tool bonus."""
    from toolenv.tasks.data import Example
    from toolenv.tasks.rewards import score_response

    for task in gen.make_tasks(SMALL, "sft", 3):  # one of each kind
        t = asyncio.run(syn.build_trace(task, tools=None, direct=True))
        assert [s["role"] for s in t["segments"]] == ["model"] and t["direct"]
        assert t["response"].startswith(f"<think>{gen.THINK_DIRECT}</think>")
        assert validate_format(t["response"]) == (True, "ok"), t["id"]
        score = score_response(t["response"], Example(t["id"], t["question"], t["answers"], "math"))
        assert score.reward == pytest.approx(1.0), (t["id"], score)
