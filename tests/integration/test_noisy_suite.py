"""The noisy suite (``pipeline.suite_noise``, ``suite_slips``, ``suite_recover``): the
retriever's wrong-entity replies are a fixed share of query strings, the same for the
same query whoever asks (the index, the HTTP server the RL stage uses, a second index),
and the SFT traces built on them are well formed, check some wrong results and answer
with others, and hold exactly what the live tools return (the sandbox, the noisy server
as the pipeline starts it from the suite's meta.json)."""

from __future__ import annotations

import asyncio
import json

import pytest

from arpo_async.core.files import read_jsonl
from arpo_async.jobs import synthetic as syn
from toolenv.retriever_server import BM25Index, RetrieverProcess, noisy_query
from toolenv.tags import find_tool_call, format_result, validate_format
from toolenv.tasks import suite as gen

pytestmark = [pytest.mark.integration]

NOISY = gen.SuiteSpec(seed=5, entities=240, sft=36, rl=9, heldout=9, search_noise=0.5,
                      python_slips=0.5, recover=0.5)


def _title(hits) -> str:
    return hits[0][0]["contents"].partition("\n")[0]


def test_wrong_entity_replies_are_a_fixed_share_of_queries():
    docs = gen.corpus_rows(gen.make_entities(NOISY))
    clean, noisy = BM25Index(docs), BM25Index(docs, noise=0.3, noise_seed=5)
    tasks = [t for t in gen.make_tasks(NOISY, "rl", 300) if t.kind == "lookup"]
    queries = [t.calls[0][1] for t in tasks]
    wrong = [q for q in queries if noisy_query(q, 0.3, 5)]
    assert 0.2 < len(wrong) / len(queries) < 0.4  # a hash: the same share on every run
    for task, q in zip(tasks, queries):
        got, want = noisy.search(q, 1), clean.search(q, 1)
        assert _title(want) == task.found[0][0]  # the clean reply names the asked entity
        assert (_title(got) != _title(want)) == (q in wrong), q
        assert noisy.search(f"  {q.upper()} ", 1) == got  # the cache's normalisation
    assert noisy.noisy_replies == 2 * len(wrong)
    assert not noisy_query(queries[0], 0.0, 5) and noisy_query(queries[0], 1.0, 5)


def test_a_noted_wrong_reply_says_so_and_a_right_one_is_untouched():
    docs = gen.corpus_rows(gen.make_entities(NOISY))
    plain = BM25Index(docs, noise=0.3, noise_seed=5)
    noted = BM25Index(docs, noise=0.3, noise_seed=5, noise_note="No exact match.")
    queries = [t.calls[0][1] for t in gen.make_tasks(NOISY, "rl", 60) if t.kind == "lookup"]
    assert any(noisy_query(q, 0.3, 5) for q in queries)
    assert any(not noisy_query(q, 0.3, 5) for q in queries)
    for q in queries:
        (doc, score), = plain.search(q, 1)
        (got, got_score), = noted.search(q, 1)
        title, _, text = doc["contents"].partition("\n")
        want = f"{title}\nNo exact match. {text}" if noisy_query(q, 0.3, 5) else doc["contents"]
        assert (got["contents"], got["id"], got_score) == (want, doc["id"], score), q
        assert "No exact match" not in doc["contents"]  # the corpus itself is left alone


@pytest.fixture(scope="module")
def suite(tmp_path_factory):
    out = tmp_path_factory.mktemp("noisy")
    meta = syn.write_suite(out, NOISY)
    return out, meta


def test_traces_check_some_wrong_results_and_use_others(suite):
    from toolenv.tasks.data import Example
    from toolenv.tasks.rewards import score_response

    out, meta = suite
    traces = read_jsonl(out / "sft.jsonl")
    counts = meta["counts"]
    assert counts["sft_wrong_results"] > counts["sft_checks"] > 0
    assert counts["sft_correct"] == sum(t["correct"] for t in traces) < len(traces)
    assert gen.suite_noise(out / "corpus.jsonl") == {"noise": 0.5, "noise_seed": 5,
                                                     "noise_note": ""}
    for t in traces:
        assert validate_format(t["response"]) == (True, "ok"), t["id"]
        score = score_response(t["response"], Example(t["id"], t["question"], t["answers"], "math"))
        assert (score.correct == 1.0) == t["correct"], t["id"]
        calls = t["response"].count("<result>")
        assert calls == {"arith": 1, "lookup": 1, "combo": 3}[t["kind"]] + t["checks"]


def test_every_tool_output_equals_the_live_noisy_tools(suite):
    from toolenv.python_tool import PythonTool
    from toolenv.search import SearchTool

    out, _ = suite
    traces = read_jsonl(out / "sft.jsonl")
    corpus = out / "corpus.jsonl"

    async def check(url: str) -> int:
        search = SearchTool(url, topk=NOISY.topk, snippet_chars=NOISY.snippet_chars)
        python, checked = PythonTool(), 0
        try:
            for t in traces:
                segs = t["segments"]
                for call_seg, tool_seg in zip(segs[0::2], segs[1::2]):
                    call = find_tool_call(call_seg["text"])
                    live = await (python if call.name == "python" else search).call(call.args)
                    assert live.ok and tool_seg["text"] == format_result(live.text), t["id"]
                    checked += 1
        finally:
            await search.close()
        return checked

    with RetrieverProcess(corpus, **gen.suite_noise(corpus)) as server:
        checked = asyncio.run(check(server.url))
        assert server.stats()["noisy_replies"] > 0
    assert checked == sum(len(t["segments"]) // 2 for t in traces)
    assert json.loads((out / "meta.json").read_text())["spec"]["search_noise"] == 0.5
