"""Search end to end: the real BM25 retriever server (a child process on loopback), the
aiohttp client through the ToolRunner, HTTP error handling, and the web-search backend
against a local server of the SERP API's shape."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest
from aiohttp import web

from toolenv.retriever_server import CorpusError, RetrieverProcess, load_corpus, start_retriever
from toolenv.runner import ToolRunner
from toolenv.search import NO_RESULTS, SearchTool
from toolenv.websearch import WebSearchTool

pytestmark = pytest.mark.integration

DOCS = {
    "Marie Curie": "Marie Curie was a Polish and naturalised-French physicist and chemist who "
                   "conducted pioneering research on radioactivity and won two Nobel Prizes.",
    "Ada Lovelace": "Ada Lovelace was an English mathematician and writer, chiefly known for her "
                    "work on Charles Babbage's proposed mechanical general-purpose computer, the "
                    "Analytical Engine.",
    "Mount Kilimanjaro": "Mount Kilimanjaro is a dormant volcano in Tanzania and the highest "
                         "mountain in Africa, about 5,895 metres above sea level.",
    "Danube": "The Danube is the second-longest river in Europe; it flows through ten countries "
              "including Germany, Austria, Hungary and Romania into the Black Sea.",
    "Alan Turing": "Alan Turing was an English mathematician, computer scientist and "
                   "cryptanalyst who formalised the concepts of algorithm and computation with "
                   "the Turing machine.",
    "Great Barrier Reef": "The Great Barrier Reef is the world's largest coral reef system, "
                          "off the coast of Queensland, Australia.",
    "Frank Lowy": "Frank Lowy is an Australian-Israeli businessman, co-founder of Westfield, "
                  "who chaired Football Federation Australia and presented its 2022 FIFA World "
                  "Cup bid.",
    "Photosynthesis": "Photosynthesis is the process by which plants and other organisms "
                      "convert light energy into chemical energy stored in sugars.",
}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    path = tmp_path_factory.mktemp("corpus") / "wiki.jsonl"
    rows = [{"id": str(i), "contents": f'"{t}"\n{x}'} for i, (t, x) in enumerate(DOCS.items())]
    rows.append({"title": "Analytical Engine", "text": "The Analytical Engine was a proposed "
                 "mechanical general-purpose computer designed by Charles Babbage."})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def retriever(corpus):
    with RetrieverProcess(corpus) as proc:
        yield proc


@pytest.mark.parametrize("title", ["Marie Curie", "Mount Kilimanjaro", "Alan Turing", "Danube"])
async def test_entity_query_returns_its_doc_first(retriever, title):
    tool = SearchTool(retriever.url, topk=3, snippet_chars=60)
    try:
        res = await tool.call(f"Tell me about {title}")
    finally:
        await tool.close()
    assert res.ok and res.latency_s > 0
    lines = res.text.splitlines()
    assert lines[0].startswith(f"Doc 1(Title: {title}) ")
    assert 1 <= len(lines) <= 3
    assert all(len(line.split(") ", 1)[1]) <= 63 for line in lines)  # 60 chars + "..."


async def test_title_text_rows_and_no_match(retriever):
    tool = SearchTool(retriever.url, topk=2, snippet_chars=500)
    try:
        res = await tool.call("Babbage analytical engine")
        assert res.ok
        assert {line.split(")")[0] for line in res.text.splitlines()} == {
            "Doc 1(Title: Analytical Engine", "Doc 2(Title: Ada Lovelace"}
        none = await tool.call("zyzzyva quokka")
        assert none.ok and none.text == NO_RESULTS
        empty = await tool.call("   ")
        assert not empty.ok and not empty.transient
    finally:
        await tool.close()


async def test_concurrency_limit_holds_at_the_server(corpus):
    # A fresh server with latency so that requests overlap if the client lets them.
    with RetrieverProcess(corpus, delay_ms=20) as slow:
        runner = ToolRunner({"search": SearchTool(slow.url)}, cache=None, rate_per_s=0,
                            concurrency=8, timeout_s=30, retries=0)
        titles = list(DOCS)
        queries = [f"{titles[i % len(titles)]} fact {i}" for i in range(200)]
        results = await asyncio.gather(*(runner.call("search", q) for q in queries))
        await runner.close()
        stats = slow.stats()
    assert all(r.ok for r in results), [r.text for r in results if not r.ok][:3]
    assert all(r.text.startswith("Doc 1(Title: ") for r in results)
    assert stats["requests"] == 200
    assert 2 <= stats["max_inflight"] <= 8, stats  # >= 2: the requests did overlap


async def test_bad_requests_get_400(retriever):
    bodies = [b"not json", b"[]", b'{"queries": "one string"}', b'{"queries": []}',
              b'{"queries": ["a"], "topk": -1}', b'{"queries": ["a"], "topk": 1.5}',
              b'{"queries": ["a"], "topk": false}', b'{"queries": ["a"], "topk": 101}',
              b'{"queries": ["a"], "return_scores": "yes"}', b'{"queries": ["a"], "k": 3}']
    async with aiohttp.ClientSession() as session:
        for body in bodies:
            async with session.post(retriever.url, data=body) as resp:
                assert resp.status == 400, body
                assert (await resp.json())["error"], body
        # Without scores the Search-R1 server returns bare documents.
        async with session.post(retriever.url, json={"queries": ["Turing"], "topk": 1}) as resp:
            docs = (await resp.json())["result"][0]
    assert docs == [{"id": "4", "contents": f'"Alan Turing"\n{DOCS["Alan Turing"]}'}]


async def test_start_retriever_in_process(corpus):
    runner, url = await start_retriever(corpus, port=0)
    tool = SearchTool(url, topk=1)
    try:
        res = await tool.call("coral reef Queensland")
    finally:
        await tool.close()
        await runner.cleanup()
    assert res.ok and res.text.startswith("Doc 1(Title: Great Barrier Reef)")


def test_bad_corpus_names_file_and_row(tmp_path):
    path = tmp_path / "broken.jsonl"
    path.write_text('{"id": "0", "contents": "T\\ntext"}\n{"id": "1", "title": "No text"}\n')
    with pytest.raises(CorpusError, match=r"broken\.jsonl: row 2: no text"):
        load_corpus(path)
    with pytest.raises(RuntimeError, match=r"broken\.jsonl: row 2: no text"):
        RetrieverProcess(path, startup_timeout_s=30).start()


async def _serve(handler, path="/retrieve"):
    app = web.Application()
    app.router.add_post(path, handler)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    host, port = runner.addresses[0][:2]
    return runner, f"http://{host}:{port}{path}"


@pytest.mark.parametrize(("status", "transient"), [(503, True), (500, True), (429, True),
                                                   (404, False), (422, False)])
async def test_http_errors_are_classified(status, transient):
    async def handler(_):
        return web.Response(status=status, text="nope")

    runner, url = await _serve(handler)
    tool = SearchTool(url)
    try:
        res = await tool.call("anything")
    finally:
        await tool.close()
        await runner.cleanup()
    assert not res.ok and res.transient is transient and res.error == f"http_{status}"


async def test_malformed_reply_and_unreachable_server():
    async def handler(_):
        return web.json_response({"result": "not a list of lists"})

    runner, url = await _serve(handler)
    tool = SearchTool(url)
    try:
        bad = await tool.call("anything")
    finally:
        await tool.close()
        await runner.cleanup()
    assert not bad.ok and not bad.transient and bad.error == "malformed_reply"
    gone = SearchTool(url)  # the server is down now: connection refused
    try:
        res = await gone.call("anything")
    finally:
        await gone.close()
    assert not res.ok and res.transient and res.error == "connection"


async def test_runner_retries_transient_errors():
    calls = {"n": 0}

    async def handler(request):
        calls["n"] += 1
        if calls["n"] < 3:
            return web.Response(status=503)
        body = await request.json()
        assert body == {"queries": ["flaky"], "topk": 3, "return_scores": True}
        doc = {"id": "0", "contents": "Flaky\nIt worked on the third try."}
        return web.json_response({"result": [[{"document": doc, "score": 1.0}]]})

    server, url = await _serve(handler)
    runner = ToolRunner({"search": SearchTool(url)}, cache=None, rate_per_s=0, concurrency=2,
                        timeout_s=10, retries=2, backoff_s=0.01)
    try:
        res = await runner.call("search", "flaky")
    finally:
        await runner.close()
        await server.cleanup()
    assert res.ok and res.text == "Doc 1(Title: Flaky) It worked on the third try."
    assert calls["n"] == 3


SECRET = "sk-test-0123456789abcdef"


async def test_web_search_against_a_serp_shaped_server(monkeypatch):
    seen = []

    async def handler(request):
        seen.append(await request.json())
        if request.headers.get("X-API-KEY") != SECRET:
            # A careless API echoes the key it got; the client must not pass it on.
            return web.Response(status=401, text=f"bad key {request.headers.get('X-API-KEY')}")
        organic = [{"title": "Danube - Wikipedia", "link": "https://en.wikipedia.org/wiki/Danube",
                    "snippet": "The Danube is the second-longest river in Europe."},
                   {"title": "Danube (mirror)", "link": "https://example.org",
                    "snippet": "The Danube is the second-longest river in Europe."},
                   {"title": "Black Sea", "link": "https://example.org/bs",
                    "snippet": f"The Danube flows into the Black Sea. {SECRET}"}]
        return web.json_response({"organic": organic})

    server, url = await _serve(handler, "/search")
    monkeypatch.setenv("TEST_SERP_KEY", SECRET)
    tool = WebSearchTool(url, topk=3, api_key_env="TEST_SERP_KEY")
    monkeypatch.setenv("TEST_SERP_KEY", "sk-wrong-key-000000000")
    wrong = WebSearchTool(url, api_key_env="TEST_SERP_KEY")
    try:
        res = await tool.call("  Danube river ")
        denied = await wrong.call("Danube")
    finally:
        await tool.close()
        await wrong.close()
        await server.cleanup()
    assert seen[0] == {"q": "Danube river", "num": 3}
    assert res.ok
    assert res.text.splitlines() == [
        "Doc 1(Title: Danube - Wikipedia) The Danube is the second-longest river in Europe.",
        "Doc 2(Title: Black Sea) The Danube flows into the Black Sea. ***",
    ]
    assert not denied.ok and not denied.transient and denied.error == "http_401"
    assert "wrong" not in denied.text + denied.error
    assert SECRET not in repr(tool) + res.text + res.error


def test_web_search_needs_its_key(monkeypatch):
    monkeypatch.delenv("TEST_MISSING_KEY", raising=False)
    with pytest.raises(ValueError, match="environment variable TEST_MISSING_KEY is not set"):
        WebSearchTool("http://127.0.0.1:9/search", api_key_env="TEST_MISSING_KEY")
