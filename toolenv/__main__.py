"""Command line for the tool environment.

    python -m toolenv serve-retriever --corpus FILE.jsonl --port P [--host H] [--delay-ms D]
        [--noise S --noise-seed N]
    python -m toolenv cache stats DIR
    python -m toolenv cache clear DIR
    python -m toolenv call python 'print(6*7)'
    python -m toolenv call python --session 'x = 41' 'x += 1; x' [--fork-after K
        [--child CODE ...] [--replay]]
    python -m toolenv call search 'query' [--retriever URL]

The modules that import aiohttp (the search tools; the retriever, which also loads
bm25s) are imported inside the command that needs them, so ``--help`` answers at once.
``call`` exits 1 when the tool reports an error.

``call python --session`` runs the codes one after another in one Python session
(``tools.python.state=session``): each sees what the ones before it left. With
``--fork-after K`` the session is forked after its K-th call; the remaining codes run in
the original (``root``) and the ``--child`` codes in the fork, which starts from the state
after call K and sees nothing the root does later. ``--replay`` copies the state by
re-executing the history instead of by checkpoint.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import sys

from toolenv.cache import cache_clear, cache_stats
from toolenv.python_tool import PythonTool

RETRIEVER_ENV = "ARPO_RETRIEVER_URL"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m toolenv", description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="command", required=True)

    s = sub.add_parser("serve-retriever",
                       help="BM25 retriever over a JSONL corpus (POST /retrieve)")
    s.add_argument("--corpus", required=True, help='JSONL: {"id","contents"} or {"title","text"}')
    s.add_argument("--port", type=int, default=8000, help="port (0: pick a free one)")
    s.add_argument("--host", default="127.0.0.1", help="address to bind")
    s.add_argument("--delay-ms", type=float, default=0.0, help="added latency per request, ms")
    s.add_argument("--noise", type=float, default=0.0,
                   help="share of query strings answered with a wrong entity's documents")
    s.add_argument("--noise-seed", type=int, default=0, help="seed of the noise draws")
    s.add_argument("--noise-note", default="",
                   help="text put before each document of a noisy reply ('': none)")
    s.add_argument("--ready-file", default="", help="write the URL here once serving")
    s.add_argument("--exit-with-parent", action="store_true",
                   help="stop when the starting process exits (used by RetrieverProcess)")

    c = sub.add_parser("cache", help="inspect or empty a tool-result cache")
    c.add_argument("action", choices=["stats", "clear"])
    c.add_argument("dir", help="cache folder")

    t = sub.add_parser("call", help="run one tool call and print its result")
    t.add_argument("tool", choices=["python", "search", "websearch"])
    t.add_argument("args", nargs="+",
                   help="code for python (several with --session), a query for search")
    t.add_argument("--session", action="store_true",
                   help="python: run the codes in one stateful session, in order")
    t.add_argument("--fork-after", type=int, default=0,
                   help="--session: fork the session after this many calls")
    t.add_argument("--child", nargs="*", default=[], help="--session: codes for the fork")
    t.add_argument("--replay", action="store_true",
                   help="--session: the fork replays the history instead of a checkpoint")
    t.add_argument("--retriever", default=os.environ.get(RETRIEVER_ENV, ""),
                   help=f"retriever URL for search (default: ${RETRIEVER_ENV})")
    t.add_argument("--topk", type=int, default=3, help="snippets per search")
    t.add_argument("--snippet-chars", type=int, default=200, help="characters per snippet")
    t.add_argument("--endpoint", default="", help="SERP endpoint for websearch")
    t.add_argument("--api-key-env", default="SERPER_API_KEY", help="env var holding the SERP key")
    t.add_argument("--unsandboxed", action="store_true",
                   help="run python without bubblewrap (unsafe; only where bwrap is missing)")
    return p


def _build_tool(a: argparse.Namespace):
    if a.tool == "python":
        return PythonTool(allow_unsandboxed=a.unsandboxed,
                          state="session" if a.session else "stateless")
    if a.tool == "search":
        if not a.retriever:
            raise SystemExit(f"call search: pass --retriever URL or set ${RETRIEVER_ENV}")
        from toolenv.search import SearchTool  # aiohttp: not for --help

        return SearchTool(a.retriever, topk=a.topk, snippet_chars=a.snippet_chars)
    from toolenv.websearch import SERPER_ENDPOINT, WebSearchTool  # aiohttp: not for --help

    return WebSearchTool(a.endpoint or SERPER_ENDPOINT, topk=a.topk,
                         snippet_chars=a.snippet_chars, api_key_env=a.api_key_env)


async def _session(tool, a: argparse.Namespace) -> int:
    """The codes in one session, forked after ``--fork-after`` calls (see the docstring)."""
    if a.replay:  # no checkpoint fits: the fork is made by replaying the history
        tool.sessions.checkpoint_bytes = 0
    root, child, failed = tool.open_session(), None, 0
    split = a.fork_after or len(a.args)
    plan = [("root", code) for code in a.args[:split]]
    plan += [("fork", "")] if a.fork_after else []
    plan += [("root", code) for code in a.args[split:]] + [("child", c) for c in a.child]
    calls = {"root": 0, "child": split}
    for who, code in plan:
        if who == "fork":
            child = await root.fork()
            print(f"-- forked after call {split}")
            continue
        res = await tool.call_in(root if who == "root" else child, code)
        failed += not res.ok
        calls[who] += 1
        print(f"[{who} {calls[who]}]{'' if res.ok else ' error: ' + res.error}")
        if res.text:
            print(res.text)
    stats = tool.stats()
    print("-- " + " ".join(f"{k}={stats.get('session_' + k, 0)}" for k in
                           ("forks", "replays", "fork_fallbacks", "replayed_calls")))
    return 1 if failed else 0


def _call(a: argparse.Namespace) -> int:
    if not a.session and (len(a.args) > 1 or a.fork_after or a.child or a.replay):
        print("error: several codes, --fork-after, --child and --replay need --session",
              file=sys.stderr)
        return 2
    if a.session and (a.tool != "python" or a.fork_after < 0 or a.fork_after > len(a.args)):
        print("error: --session is for python, with 0 <= --fork-after <= the codes given",
              file=sys.stderr)
        return 2
    try:
        # Built outside the loop: the Python tool probes its sandbox synchronously.
        tool = _build_tool(a)
    except (ValueError, RuntimeError) as exc:  # bad arguments, a missing key, no sandbox
        print(f"error: {exc}", file=sys.stderr)
        return 2

    async def run():
        try:
            return await (_session(tool, a) if a.session else tool.call(a.args[0]))
        finally:
            await tool.close()

    res = asyncio.run(run())
    if a.session:
        return res
    if not res.ok:
        print(res.text or res.error, file=sys.stderr)
        return 1
    print(res.text)
    return 0


def _cache(a: argparse.Namespace) -> int:
    try:
        if a.action == "stats":
            print(json.dumps(cache_stats(a.dir), indent=2, sort_keys=True))
        else:
            print(f"removed {cache_clear(a.dir)} entries from {a.dir}")
    except FileNotFoundError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


def main(argv: list[str] | None = None) -> int:
    a = _parser().parse_args(argv)
    if a.command == "serve-retriever":
        from toolenv.retriever_server import CorpusError, serve  # aiohttp: not for --help

        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
        try:
            serve(a.corpus, a.host, a.port, a.delay_ms, a.ready_file, a.exit_with_parent,
                  a.noise, a.noise_seed, a.noise_note)
        except CorpusError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        return 0
    if a.command == "cache":
        return _cache(a)
    return _call(a)


if __name__ == "__main__":
    sys.exit(main())
