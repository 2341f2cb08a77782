"""A local BM25 retriever speaking the Search-R1 ``POST /retrieve`` API.

``python -m toolenv serve-retriever --corpus FILE.jsonl --port P`` indexes a JSONL corpus
(``{"id", "contents": "Title\\ntext"}`` or ``{"title", "text"}`` per line) with bm25s at
start-up and serves:

- ``POST /retrieve`` ``{"queries": [...], "topk": k, "return_scores": bool}`` ->
  ``{"result": [[{"document": {"id", "contents"}, "score": s}, ...], ...]}`` (bare
  documents when ``return_scores`` is false); documents with no matching term are left out.
- ``GET /health`` -> ``{"status": "ok", "docs": N}``.
- ``GET /stats`` -> requests served, requests in flight and the most ever in flight (the
  integration tests check client-side concurrency limits with it).

``--delay-ms`` adds latency to every request, to benchmark clients against a slow
service. ``--noise S --noise-seed N`` makes it an unreliable search engine on purpose (the
noisy synthetic suite, ``pipeline.suite_noise``): for a share S of query strings, drawn
from a hash of (N, the query lower-cased with its whitespace collapsed, as the tool cache
keys it), the reply names a wrong entity: the best documents whose title differs from the
best match's. The same query always gets the same reply; another phrasing is another draw.
``--noise-note TEXT`` puts TEXT before the text of each document of a noisy reply (a
search engine's "no exact match": the wrong reply can then be told from a right one).
``start_retriever`` runs it inside the current loop; ``RetrieverProcess`` runs it as a
child process and waits until it answers.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from aiohttp import web

from arpo_async.core.files import iter_jsonl

log = logging.getLogger(__name__)

MAX_TOPK = 100
MAX_QUERIES = 256
DEFAULT_TOPK = 3


class CorpusError(ValueError):
    """A corpus file or row that cannot be indexed; names the file and the row."""


def load_corpus(path: str | Path) -> list[dict]:
    """Read ``{"id", "contents"}`` documents; ``{"title", "text"}`` rows are joined into
    ``contents`` as ``"title\\ntext"``. Rows are numbered from 1 (the line number)."""
    path = Path(path)
    if not path.is_file():
        raise CorpusError(f"{path}: corpus file not found")
    docs = []
    for n, row in iter_jsonl(path, CorpusError):
        if isinstance(row.get("contents"), str) and row["contents"].strip():
            contents = row["contents"]
        elif isinstance(row.get("text"), str) and row["text"].strip():
            contents = f"{row.get('title') or ''}\n{row['text']}"
        else:
            raise CorpusError(f"{path}: row {n}: no text (expected 'contents' or 'text')")
        docs.append({"id": str(row.get("id", n - 1)), "contents": contents})
    if not docs:
        raise CorpusError(f"{path}: corpus is empty")
    return docs


NOISE_POOL = 50  # candidates searched for a wrong entity's documents in a noisy reply


def noisy_query(query: str, share: float, seed: int) -> bool:
    """Whether ``query`` gets a wrong-entity reply: a uniform draw from a hash of the seed
    and the query as the tool cache normalises it, below ``share``."""
    if share <= 0.0:
        return False
    norm = " ".join(query.split()).lower()
    digest = hashlib.blake2b(f"{seed}\0{norm}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2**64 < share


class BM25Index:
    """bm25s over the documents' full contents (title included), English stopwords;
    ``noise``/``noise_seed``: the unreliable engine of the module docstring."""

    def __init__(self, docs: list[dict], noise: float = 0.0, noise_seed: int = 0,
                 noise_note: str = ""):
        import bm25s  # lazy: --help and the client never need it

        if not 0.0 <= noise <= 1.0:
            raise ValueError(f"retriever noise {noise}: must be in [0, 1]")
        self._bm25s = bm25s
        self.noise, self.noise_seed, self.noise_note = noise, noise_seed, noise_note
        self.noisy_replies = 0
        start = time.monotonic()
        self.docs = docs
        tokens = bm25s.tokenize([d["contents"] for d in docs], stopwords="en", show_progress=False)
        self._retriever = bm25s.BM25()
        self._retriever.index(tokens, show_progress=False)
        self.vocab_size = len(tokens.vocab)
        self.build_s = time.monotonic() - start

    def search(self, query: str, k: int) -> list[tuple[dict, float]]:
        """Top ``k`` (document, score) pairs with a positive score, best first (ties by
        corpus order); for a noisy query, the top ``k`` of those whose title is not the
        best match's (the clean reply when there are none)."""
        if not noisy_query(query, self.noise, self.noise_seed):
            return self._ranked(query, k)
        hits = self._ranked(query, max(k, NOISE_POOL))
        if not hits:
            return hits
        title = _title(hits[0][0])
        wrong = [h for h in hits if _title(h[0]) != title][:k]
        if not wrong:
            return hits[:k]
        self.noisy_replies += 1
        if self.noise_note:
            return [(_noted(doc, self.noise_note), score) for doc, score in wrong]
        return wrong

    def _ranked(self, query: str, k: int) -> list[tuple[dict, float]]:
        words = self._bm25s.tokenize(
            [query], stopwords="en", return_ids=False, show_progress=False
        )[0]
        # get_scores plus our own top-k: bm25s.retrieve's selection costs ~1 ms a query
        # on a 5k-doc corpus (mostly zero scores), 10x the scoring itself.
        scores = self._retriever.get_scores(words) if words else np.zeros(0)
        hits = np.flatnonzero(scores > 0)
        if len(hits) > k:
            hits = hits[np.argpartition(-scores[hits], k - 1)[:k]]
        hits = hits[np.lexsort((hits, -scores[hits]))]
        return [(self.docs[int(i)], float(scores[i])) for i in hits]


def _title(doc: dict) -> str:
    return doc["contents"].partition("\n")[0].strip()


def _noted(doc: dict, note: str) -> dict:
    """``doc`` with ``note`` before its text (its title kept first)."""
    title, _, text = doc["contents"].partition("\n")
    return {**doc, "contents": f"{title}\n{note} {text}"}


@dataclass
class _Stats:
    requests: int = 0
    inflight: int = 0
    max_inflight: int = 0
    bad_requests: int = 0


class BadRequest(ValueError):
    pass


def parse_request(raw: bytes) -> tuple[list[str], int, bool]:
    """Validate a /retrieve body; raises BadRequest with the reason."""
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise BadRequest(f"body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise BadRequest("body must be a JSON object")
    unknown = set(body) - {"queries", "topk", "return_scores"}
    if unknown:
        raise BadRequest(f"unknown keys: {sorted(unknown)}")
    queries = body.get("queries")
    if not isinstance(queries, list) or not queries:
        raise BadRequest("'queries' must be a non-empty list of strings")
    if len(queries) > MAX_QUERIES or not all(isinstance(q, str) for q in queries):
        raise BadRequest(f"'queries' must be at most {MAX_QUERIES} strings")
    topk = body.get("topk")
    if topk is None or (type(topk) is int and topk == 0):  # Search-R1: 0/null = default
        topk = DEFAULT_TOPK
    if type(topk) is not int or not 1 <= topk <= MAX_TOPK:  # type(): bools are not ints
        raise BadRequest(f"'topk' must be an integer in [1, {MAX_TOPK}]")
    scores = body.get("return_scores", False)
    if not isinstance(scores, bool):
        raise BadRequest("'return_scores' must be true or false")
    return queries, topk, scores


def build_app(index: BM25Index, delay_ms: float = 0.0) -> web.Application:
    stats = _Stats()

    async def retrieve(request: web.Request) -> web.Response:
        stats.requests += 1
        stats.inflight += 1
        stats.max_inflight = max(stats.max_inflight, stats.inflight)
        try:
            if delay_ms > 0:
                await asyncio.sleep(delay_ms / 1000)
            try:
                queries, topk, with_scores = parse_request(await request.read())
            except BadRequest as exc:
                stats.bad_requests += 1
                return web.json_response({"error": str(exc)}, status=400)
            result = []
            for q in queries:
                hits = index.search(q, topk)
                if with_scores:
                    result.append([{"document": d, "score": s} for d, s in hits])
                else:
                    result.append([d for d, _ in hits])
            return web.json_response({"result": result})
        finally:
            stats.inflight -= 1

    async def health(_: web.Request) -> web.Response:
        return web.json_response({"status": "ok", "docs": len(index.docs)})

    async def get_stats(_: web.Request) -> web.Response:
        return web.json_response(vars(stats) | {"noisy_replies": index.noisy_replies})

    app = web.Application()
    app.router.add_post("/retrieve", retrieve)
    app.router.add_get("/health", health)
    app.router.add_get("/stats", get_stats)
    return app


async def start_retriever(
    corpus_path: str | Path, host: str = "127.0.0.1", port: int = 0, delay_ms: float = 0.0,
    noise: float = 0.0, noise_seed: int = 0, noise_note: str = "",
) -> tuple[web.AppRunner, str]:
    """Index the corpus and serve it in the running loop. Returns (runner, url of
    /retrieve); stop with ``await runner.cleanup()``."""
    loop = asyncio.get_running_loop()
    docs = await loop.run_in_executor(None, load_corpus, corpus_path)
    index = await loop.run_in_executor(None, BM25Index, docs, noise, noise_seed, noise_note)
    log.info("indexed %d docs (%d terms) from %s in %.2fs",
             len(docs), index.vocab_size, corpus_path, index.build_s)
    runner = web.AppRunner(build_app(index, delay_ms), access_log=None)
    await runner.setup()
    await web.TCPSite(runner, host, port).start()
    bound_host, bound_port = runner.addresses[0][:2]
    if ":" in bound_host:  # IPv6 literal
        bound_host = f"[{bound_host}]"
    return runner, f"http://{bound_host}:{bound_port}/retrieve"


async def _watch_parent(stop: asyncio.Event) -> None:
    """Stop when the process that started us is gone (we get re-parented)."""
    parent = os.getppid()
    while not stop.is_set():
        if os.getppid() != parent:
            log.warning("parent process %d exited; stopping", parent)
            stop.set()
        await asyncio.sleep(1.0)


def serve(corpus: str, host: str, port: int, delay_ms: float, ready_file: str = "",
          exit_with_parent: bool = False, noise: float = 0.0, noise_seed: int = 0,
          noise_note: str = "") -> None:
    """Blocking entry point of ``serve-retriever``; stops on SIGINT/SIGTERM."""

    async def main() -> None:
        runner, url = await start_retriever(corpus, host, port, delay_ms, noise, noise_seed,
                                            noise_note)
        stop = asyncio.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            asyncio.get_running_loop().add_signal_handler(sig, stop.set)
        watcher = asyncio.create_task(_watch_parent(stop)) if exit_with_parent else None
        print(f"retriever listening on {url}", flush=True)
        if ready_file:  # written atomically so a supervisor never reads half a URL
            tmp = f"{ready_file}.tmp"
            Path(tmp).write_text(url)
            os.replace(tmp, ready_file)
        await stop.wait()
        if watcher is not None:
            watcher.cancel()
        await runner.cleanup()

    asyncio.run(main())


class RetrieverProcess:
    """The retriever as a child process: ``with RetrieverProcess(corpus) as r: r.url``.
    ``port=0`` lets the server pick a free port and report it back."""

    def __init__(self, corpus: str | Path, port: int = 0, host: str = "127.0.0.1",
                 delay_ms: float = 0.0, startup_timeout_s: float = 60.0, noise: float = 0.0,
                 noise_seed: int = 0, noise_note: str = ""):
        self.corpus, self.port, self.host = Path(corpus), port, host
        self.delay_ms, self.startup_timeout_s = delay_ms, startup_timeout_s
        self.noise, self.noise_seed, self.noise_note = noise, noise_seed, noise_note
        self.url = ""
        self.proc: subprocess.Popen | None = None
        self._tmp: tempfile.TemporaryDirectory | None = None

    @property
    def base_url(self) -> str:
        return self.url.rsplit("/", 1)[0]

    def start(self) -> RetrieverProcess:
        self._tmp = tempfile.TemporaryDirectory(prefix="retriever-")
        ready, logf = Path(self._tmp.name, "url"), Path(self._tmp.name, "log")
        cmd = [sys.executable, "-m", "toolenv", "serve-retriever", "--corpus", str(self.corpus),
               "--host", self.host, "--port", str(self.port), "--delay-ms", str(self.delay_ms),
               "--noise", repr(self.noise), "--noise-seed", str(self.noise_seed),
               "--noise-note", self.noise_note,
               "--ready-file", str(ready), "--exit-with-parent"]
        with logf.open("wb") as out:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + self.startup_timeout_s
        while not ready.exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                tail = logf.read_text(errors="replace")[-2000:]
                self.close()
                raise RuntimeError(f"retriever over {self.corpus} did not start:\n{tail}")
            time.sleep(0.05)
        self.url = ready.read_text().strip()
        try:
            with urllib.request.urlopen(f"{self.base_url}/health", timeout=10) as resp:
                resp.read()
        except OSError as exc:  # URLError and HTTPError are OSErrors
            self.close()
            raise RuntimeError(f"retriever at {self.url}: /health failed: {exc}") from None
        return self

    def stats(self) -> dict:
        with urllib.request.urlopen(f"{self.base_url}/stats", timeout=10) as resp:
            return json.loads(resp.read())

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    def __enter__(self) -> RetrieverProcess:  # noqa: PYI034 (py3.10 has no typing.Self)
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()
