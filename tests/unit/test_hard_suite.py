"""The harder synthetic suite (toolenv/tasks/hard.py): the default suite unchanged (digests
of its entities and tasks taken before the harder suite existed), each new kind's answer
equal to what its demonstrator computes from BM25's real replies over the corpus (the
trace builder run with the in-process BM25 index and a fake Python that evaluates the
snippet's arithmetic), splits that share no entity or word problem, near-namesakes that
BM25 ranks first, kinds in the mix's proportions, the dials validated in the config and
in the pipeline, and the kinds carried into the evaluation's per-kind figures. One test,
integration-marked, builds a small suite with the real sandbox and retriever server."""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import hashlib
import json
import re

import numpy as np
import pytest

from arpo_async.jobs import synthetic as syn
from toolenv.search import format_passages, split_contents
from toolenv.tags import validate_format
from toolenv.tasks import hard
from toolenv.tasks import suite as gen

HARD = gen.SuiteSpec(seed=3, entities=240, sft=120, rl=60, heldout=60, topk=2, hard=True)


@pytest.fixture(scope="module")
def entities() -> list[gen.Entity]:
    return hard.make_entities(HARD)


@pytest.fixture(scope="module")
def tasks() -> dict[str, list[gen.Task]]:
    return {s: hard.make_tasks(HARD, s) for s in gen.SPLITS}


@pytest.fixture(scope="module")
def index(entities):
    from toolenv.retriever_server import BM25Index

    return BM25Index(gen.corpus_rows(entities))


# ------------------------------------------------------------------ the default suite


def _digest(spec: gen.SuiteSpec) -> str:
    h = hashlib.sha256()
    for row in gen.corpus_rows(gen.make_entities(spec)):
        h.update(json.dumps(row, sort_keys=True).encode())
    for split in gen.SPLITS:
        for t in gen.make_tasks(spec, split):
            h.update(json.dumps([t.row(), t.calls, t.found, t.rephrase], sort_keys=True).encode())
    return h.hexdigest()


@pytest.mark.parametrize("spec, digest", [
    (gen.SuiteSpec(seed=3, entities=240, sft=60, rl=30, heldout=30),
     "b8ce2a9af9d21a092cdb424ff1ca60b5d12c37e89f668da5ea088f444bebea11"),
    (gen.SuiteSpec(seed=0, sft=300, rl=200, heldout=100),
     "6c878f6ac0a0ee073cb0f8178c1a53fe96128187dea112a1fc40360dbd919249"),
])
def test_the_default_suite_is_unchanged(spec, digest):
    """Digests of corpus and tasks computed before toolenv/tasks/hard.py existed; the
    harder suite's dials do not reach the default suite."""
    assert _digest(spec) == digest
    assert _digest(dataclasses.replace(spec, namesakes=0.9, mix={"word": 1.0})) == digest


def test_each_builder_refuses_the_other_suite():
    with pytest.raises(ValueError, match="toolenv.tasks.hard.make_tasks"):
        gen.make_tasks(HARD, "rl")
    with pytest.raises(ValueError, match="toolenv.tasks.hard.make_entities"):
        gen.make_entities(HARD)
    with pytest.raises(ValueError, match="spec.hard is off"):
        hard.make_tasks(gen.SuiteSpec(), "rl")


# ------------------------------------------------------------------ entities


def test_entities_extend_the_default_ones(entities):
    base = {e.name: e for e in gen.make_entities(dataclasses.replace(HARD, hard=False))}
    assert hard.make_entities(HARD) == entities  # deterministic
    by_name = {e.name: e for e in entities}
    assert len(by_name) == len(entities)
    for name, e in base.items():  # the default suite's facts, plus relations for writers
        assert {k: v for k, v in by_name[name].facts.items() if k in e.facts} == e.facts
    for w in (e for e in entities if e.type == "person"):
        place, teacher = by_name[w.facts["birthplace"]], by_name[w.facts["teacher"]]
        assert place.type == "city" and teacher.type == "person" and teacher is not w
        assert place.split == teacher.split == w.split  # relations stay in their split


def test_namesakes_share_the_bm25_tokens_and_nothing_else(entities):
    import bm25s

    pairs = hard.namesake_pairs(entities)
    by_name = {e.name: e for e in entities}
    twins = [n for n in pairs if re.search(r" [A-Z]\. ", n)]
    assert len(twins) == len(pairs) // 2
    share = len(twins) / (len(entities) - len(twins))  # of the default suite's entities
    assert 0.2 < share < 0.4, share  # namesakes = 0.3
    for twin in twins:
        a, b = by_name[twin], by_name[pairs[twin]]
        assert (a.type, a.split) == (b.type, b.split)
        assert all(a.facts[k] != b.facts[k] for k in gen.ATTRS if k in a.facts)
        words = bm25s.tokenize([a.name, b.name], stopwords="en", return_ids=False,
                               show_progress=False)
        assert words[0] == words[1]  # BM25 cannot tell them apart
    none = hard.make_entities(dataclasses.replace(HARD, namesakes=0.0))
    assert not hard.namesake_pairs(none)


def test_bm25_ranks_a_namesake_first_for_some_queries(tasks, index):
    """Over every search of the SFT split: the asked entity is always among the top 2 (so
    the suite is solvable at topk 2) and BM25's first result is another entity for a
    measured share of them; without namesakes, never."""
    def first_wrong(ts, idx) -> tuple[int, int]:
        wrong = n = 0
        for t in ts:
            for (_, query), (name, _) in zip([c for c in t.calls if c[0] == "search"], t.found):
                titles = [d["contents"].split("\n")[0] for d, _ in idx.search(query, 2)]
                assert name in titles, (t.id, query, titles)
                wrong += titles[0] != name
                n += 1
        return wrong, n

    wrong, n = first_wrong(tasks["sft"], index)
    assert 0.15 < wrong / n < 0.45, (wrong, n)  # measured 0.28 at namesakes 0.3
    from toolenv.retriever_server import BM25Index

    plain = dataclasses.replace(HARD, namesakes=0.0)
    idx = BM25Index(gen.corpus_rows(hard.make_entities(plain)))
    assert first_wrong(hard.make_tasks(plain, "sft"), idx)[0] == 0


# ------------------------------------------------------------------ tasks


def test_kinds_follow_the_mix_in_every_prefix():
    mix = {"chain": 2.0, "word": 1.0, "check": 1.0, "arith": 0.0}
    seq = hard.kind_sequence(mix, 400)
    assert set(seq) == {"chain", "word", "check"}
    for n in range(1, 401):
        counts = collections.Counter(seq[:n])
        for kind, w in mix.items():
            assert abs(counts[kind] - n * w / 4) <= 1, (n, kind)


def test_tasks_are_deterministic_and_independent_of_other_split_sizes(tasks):
    assert hard.make_tasks(HARD, "rl") == tasks["rl"]
    assert hard.make_tasks(dataclasses.replace(HARD, sft=500), "heldout") == tasks["heldout"]
    assert {t.kind for t in tasks["sft"]} == {k for k, w in HARD.mix.items() if w > 0}


def test_splits_share_no_entity_and_no_word_problem(tasks, entities):
    split_of = {e.name: e.split for e in entities}
    words = {}
    for split, ts in tasks.items():
        for t in ts:
            assert all(split_of[name] == split for name, _ in t.found), t  # hops included
            if t.kind == "word":
                numbers = [int(x.replace(",", "")) for x in re.findall(r"\d[\d,]*", t.question)]
                words.setdefault(split, set()).add(t.question)
                assert any(hard.word_split(i, numbers) == split for i in range(len(hard.WORD)))
    assert not words["sft"] & words["rl"] and not words["sft"] & words["heldout"]
    assert not words["rl"] & words["heldout"]


def test_word_problems_carry_the_questions_numbers(tasks):
    for t in (t for ts in tasks.values() for t in ts if t.kind == "word"):
        (tool, code), = t.calls
        asked = [x.replace(",", "") for x in re.findall(r"\d[\d,]*\d|\d", t.question)]
        assert tool == "python" and re.findall(r"\d+", code) == asked, t
        assert int(t.answer) > 0 and str(eval(code[6:-1])) == t.answer  # noqa: S307


def test_chain_questions_name_the_writer_and_their_relations(tasks, entities):
    by_name = {e.name: e for e in entities}
    for t in (t for ts in tasks.values() for t in ts if t.kind in ("chain", "chain3")):
        writer = re.search(r"the writer (.+) was born", t.question).group(1)
        steps = ["teacher", "birthplace"] if t.kind == "chain3" else ["birthplace"]
        assert len(t.calls) == len(steps) + 1 and [n for n, _ in t.found][0] == writer
        ent = by_name[writer]
        for (name, value), rel in zip(t.found, steps):
            assert name == ent.name and value == ent.facts[rel]
            ent = by_name[value]
        attr = next(a for a, v in gen.ATTRS.items() if t.question.startswith(
            f"What is {v[1].format('')}"))
        assert t.answer == str(ent.facts[attr])


# ------------------------------------------------------------------ the demonstrator


class _Tools:
    """The trace builder's tools: BM25 in process (``RealTools.search``) and a fake Python
    that evaluates a ``print(arithmetic)`` snippet."""

    search = syn.RealTools.search

    def __init__(self, index, topk: int):
        self.index, self.topk, self.snippet_chars = index, topk, HARD.snippet_chars

    async def run(self, tool: str, args: str) -> str:
        if tool == "search":
            return self.search(args)
        expr = re.fullmatch(r"print\(([\d+\-*/() abs]+)\)", args).group(1)
        return f"{eval(expr, {'abs': abs})}\n"  # noqa: S307


def _traces(tasks, tools, demos=None) -> list[dict]:
    return asyncio.run(syn.build_traces(tasks, tools, demos=demos))


def test_traces_compute_the_answers_from_the_corpus(tasks, index):
    """Every kind's trace, built from BM25's replies: it reads each fact from the document
    titled with the entity asked (not always the first), copies a chain's next entity
    from a reply, and ends at the task's answer, well formed and scoring full marks."""
    from toolenv.tasks.data import Example
    from toolenv.tasks.rewards import TWO_TOOL_BONUS, score_response

    ts = tasks["sft"]
    traces = _traces(ts, _Tools(index, HARD.topk))
    assert {t["kind"] for t in traces} == {t.kind for t in ts}
    second = 0
    for task, tr in zip(ts, traces):
        assert tr["correct"] and validate_format(tr["response"]) == (True, "ok"), tr["id"]
        score = score_response(tr["response"], Example(tr["id"], tr["question"],
                                                       tr["answers"], "math"))
        bonus = TWO_TOOL_BONUS if task.kind in ("combo", "check") else 0.0
        assert score.reward == pytest.approx(1.0 + bonus), (tr["id"], score)
        calls = re.findall(r"<(search|python)>(.*?)</\1>", tr["response"])
        assert [c[0] for c in calls] == [c[0] for c in task.calls]
        searches = [a for tool, a in task.calls if tool == "search"]
        assert [a for tool, a in calls if tool == "search"] == searches
        for (_, query), (name, value) in zip([c for c in task.calls if c[0] == "search"],
                                             task.found):
            shown = format_passages([split_contents(d["contents"])
                                     for d, _ in index.search(query, HARD.topk)], 160)
            line = syn._titled(shown, name)
            assert line.endswith(f" {value}.") and shown in tr["response"]
            second += not line.startswith("Doc 1(")
    assert second > 0  # some facts came from a second document


def test_a_noisy_harder_suite_builds_traces_that_check_or_follow_a_wrong_hop(entities):
    """With search_noise the demonstrator meets wrong entities (a chain then follows the
    entity the wrong reply named, unless it checks); every trace stays well formed and
    is marked correct exactly when its answer is the task's."""
    from toolenv.retriever_server import BM25Index

    spec = dataclasses.replace(HARD, search_noise=0.4)
    ts = hard.make_tasks(spec, "sft", 60)
    idx = BM25Index(gen.corpus_rows(entities), 0.4, spec.seed)
    demos = [syn.Demonstrator(np.random.default_rng([3, i]), 0.0, 0.5)
             for i in range(len(ts))]
    traces = _traces(ts, _Tools(idx, spec.topk), demos)
    assert sum(t["wrong_results"] for t in traces) > 0 and sum(t["checks"] for t in traces) > 0
    followed = 0
    for task, tr in zip(ts, traces):
        assert validate_format(tr["response"]) == (True, "ok"), tr["id"]
        boxed = re.search(r"\\boxed\{(.*?)\}", tr["response"]).group(1)
        assert tr["correct"] == (boxed == tr["answers"][0])
        planned = {a for tool, a in task.calls if tool == "search"}
        planned |= {q for qs in task.rephrase for q in qs}
        followed += not set(re.findall(r"<search>(.*?)</search>", tr["response"])) <= planned
    assert any(not t["correct"] for t in traces)
    assert followed > 0  # a chain searched the city a wrong reply named


# ------------------------------------------------------------------ config, CLI, evaluation


def test_the_config_owns_the_same_kinds_and_mix_and_validates_them():
    from arpo_async.core.config import ConfigError, config_from_dict
    from arpo_async.core.config.run import HARD_MIX, SUITE_KINDS

    assert SUITE_KINDS == gen.ALL_KINDS and HARD_MIX == gen.HARD_MIX
    h = config_from_dict({}).pipeline.suite_hard
    assert not h.enabled and h.mix == gen.SuiteSpec().mix
    assert h.namesakes == gen.SuiteSpec().namesakes
    one = config_from_dict({"pipeline": {"suite_hard": {"mix": {"chain": 5}}}})
    assert one.pipeline.suite_hard.mix == {**gen.HARD_MIX, "chain": 5.0}  # the others kept
    for bad, where in (({"mix": {"chian": 1}}, "unknown task kind"),
                       ({"mix": {"word": -1}}, "weights must be >= 0"),
                       ({"mix": {k: 0 for k in gen.ALL_KINDS}}, "not all 0"),
                       ({"namesakes": 1.5}, "namesakes"), ({"hops": 3}, "hops")):
        with pytest.raises(ConfigError, match=f"pipeline.suite_hard.*{where}"):
            config_from_dict({"pipeline": {"suite_hard": bad}})


def test_the_spec_refuses_namesakes_at_topk_1_and_the_pipeline_says_which_keys(tmp_path):
    from arpo_async.core.config import ConfigError, config_from_dict
    from arpo_async.jobs.pipeline import build_data

    with pytest.raises(ValueError, match="topk >= 2"):
        dataclasses.replace(HARD, topk=1)
    dataclasses.replace(HARD, topk=1, namesakes=0.0)  # no namesake, no tie
    with pytest.raises(ValueError, match="unknown"):
        dataclasses.replace(HARD, mix={"lookups": 1.0})
    cfg = config_from_dict({"pipeline": {"data_dir": str(tmp_path / "d"),
                                         "suite_hard": {"enabled": True}},
                            "tools": {"search": {"topk": 1}}})
    with pytest.raises(ConfigError, match=r"pipeline.suite_hard with tools.search.topk=1"):
        build_data(cfg)
    assert not (tmp_path / "d").exists()


def test_the_cli_reads_the_dials():
    assert syn.parse_mix("chain=3, word=0") == {"chain": 3.0, "word": 0.0}
    with pytest.raises(SystemExit):
        syn.main(["/nonexistent/out", "--hard", "--topk", "1"])  # namesakes need topk 2


def test_new_kinds_reach_the_evaluations_per_kind_figures(tasks, tmp_path):
    from arpo_async.jobs.evaluate import _row_kinds, _summarise

    path = tmp_path / "heldout.jsonl"
    path.write_text("".join(json.dumps(t.row()) + "\n" for t in tasks["heldout"]))
    kinds = _row_kinds(path)
    assert set(kinds.values()) == {t.kind for t in tasks["heldout"]}
    items = [{"kind": k, "scores": [1.0, 0.0], "rewards": [1.0, 0.0], "tool_calls": [2, 1]}
             for k in kinds.values()]
    assert set(_summarise(items, 2)["per_kind"]) >= set(gen.HARD_KINDS)


@pytest.mark.integration
def test_a_small_harder_suite_with_the_real_tools(tmp_path):
    """write_suite with the sandboxed Python and the BM25 index; every search output is
    what the retriever server returns over HTTP to the SearchTool."""
    from arpo_async.core.files import read_jsonl
    from toolenv.retriever_server import start_retriever
    from toolenv.search import SearchTool
    from toolenv.tags import find_tool_call, format_result

    spec = dataclasses.replace(HARD, sft=14, rl=7, heldout=7)
    meta = syn.write_suite(tmp_path, spec, concurrency=2)
    assert meta["counts"]["sft_correct"] == 14 and meta["spec"]["hard"]
    traces = read_jsonl(tmp_path / "sft.jsonl")

    async def check() -> int:
        runner, url = await start_retriever(tmp_path / "corpus.jsonl")
        search, checked = SearchTool(url, topk=spec.topk, snippet_chars=spec.snippet_chars), 0
        try:
            for t in traces:
                segs = t["segments"]
                for call_seg, tool_seg in zip(segs[0::2], segs[1::2]):
                    call = find_tool_call(call_seg["text"])
                    if call.name == "search":
                        live = await search.call(call.args)
                        assert tool_seg["text"] == format_result(live.text), (t["id"], call)
                        checked += 1
        finally:
            await search.close()
            await runner.cleanup()
        return checked

    assert asyncio.run(check()) > 14
