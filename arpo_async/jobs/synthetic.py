"""Write the synthetic tool-use suite (toolenv/tasks/suite.py) to files: the corpus, the
RL and held-out splits, and SFT traces built with the real tools.

SFT traces are built with the real tools: the sandboxed ``PythonTool`` runs every snippet,
and a search result is what ``toolenv.retriever_server.BM25Index`` returns for the query,
formatted by ``toolenv.search.format_passages`` exactly as ``SearchTool`` shows the live
server's reply. A trace is stored as segments (model text / tool text) so SFT can mask
the tool segments.

A search's fact is read from the result's document titled with the entity asked (with
``topk`` above 1 it may be another than the first: the harder suite's namesakes, which
BM25 ranks first for about half their queries); a chain's next query names the entity
the previous search found.

CLI: ``python -m arpo_async.jobs.synthetic OUT_DIR [--seed 0 --entities 600 --sft 3000
--rl 2000 --heldout 300 --topk 1 --snippet-chars 160 --direct 0]`` writes corpus.jsonl,
sft.jsonl, rl.jsonl, heldout.jsonl and meta.json (the tool settings evaluation and RL
must use); ``--hard [--mix chain=2,word=2,... --namesakes 0.3]`` writes the harder suite
(toolenv/tasks/hard.py).
"""


from __future__ import annotations

import argparse
import asyncio
import json
import re
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from arpo_async.core.files import atomic_write_json, write_jsonl
from toolenv.python_tool import PythonTool
from toolenv.retriever_server import BM25Index
from toolenv.search import format_passages, split_contents
from toolenv.tags import format_result
from toolenv.tasks import hard
from toolenv.tasks.suite import (
    SPLITS,
    SYSTEM_PROMPT,
    THINK,
    THINK_DIRECT,
    SuiteSpec,
    Task,
    corpus_rows,
    make_entities,
    make_tasks,
    slip,
    with_operands,
)

# ----------------------------------------------------------------------------- traces


class RealTools:
    """The tools a trace is built with: the sandboxed Python tool and the BM25 index
    (with the suite's retriever noise), formatted as the live ``SearchTool`` would show
    the retriever's reply."""

    def __init__(self, docs: list[dict], topk: int, snippet_chars: int, hide: list = (),
                 noise: float = 0.0, noise_seed: int = 0, noise_note: str = ""):
        self.index = BM25Index(docs, noise, noise_seed, noise_note)
        self.python = PythonTool(hide=list(hide))
        self.topk, self.snippet_chars = topk, snippet_chars

    def search(self, query: str) -> str:
        hits = self.index.search(query, self.topk)
        return format_passages([split_contents(d["contents"]) for d, _ in hits][: self.topk],
                               self.snippet_chars)

    async def run(self, tool: str, args: str) -> str:
        if tool == "search":
            return self.search(args)
        result = await self.python.call(args)
        if not result.ok:
            raise RuntimeError(f"python tool failed on {args!r}: {result.error}: {result.text}")
        return result.text


@dataclass
class Demonstrator:
    """How the SFT demonstrator meets wrong tool results (the noisy suite): ``slips`` the
    share of its snippets with a slipped operand, ``recover`` the chance it checks a wrong
    result (another phrasing, the snippet run again as meant) instead of using it; its
    draws come from ``rng`` (one generator per trace)."""

    rng: np.random.Generator
    slips: float = 0.0
    recover: float = 0.0

    def checks(self) -> bool:
        return bool(self.recover > 0 and self.rng.random() < self.recover)

    def slipped(self, code: str) -> str:
        return slip(code, self.rng) if self.slips > 0 and self.rng.random() < self.slips else code


async def build_trace(task: Task, tools: RealTools, direct: bool = False,
                      demo: Demonstrator | None = None) -> dict:
    """One SFT trace of ``task`` with real tool outputs. A clean trace is checked to carry
    the facts the answer needs, so it never teaches a wrong answer; in the noisy suite a
    trace that used a wrong result unchecked answers with it (``correct`` false), as an
    imperfect demonstrator would. ``direct``: the demonstrator answers from memory instead
    (``SuiteSpec.direct``)."""
    counts = {"wrong_results": 0, "checks": 0}
    if direct:
        segments = [{"text": f"<think>{THINK_DIRECT}</think>\n<answer>\\boxed{{{task.answer}}}"
                             "</answer>", "role": "model"}]
        final = task.answer
    else:
        segments, final = await _tool_segments(task, tools, demo, counts)
    return {"id": task.id, "kind": task.kind, "question": task.question,
            "answers": [task.answer], "system": SYSTEM_PROMPT, "segments": segments,
            "response": "".join(s["text"] for s in segments), "direct": direct,
            "correct": final == task.answer, **counts}


class _Trace:
    """Segments of one trace as it is built: model text, then each call's result."""

    def __init__(self, thought: str, tools: RealTools):
        self.segments = [{"text": f"<think>{thought}</think>\n", "role": "model"}]
        self.tools = tools

    async def call(self, tool: str, args: str) -> str:
        self.segments[-1]["text"] += f"<{tool}>{args}</{tool}>"
        output = await self.tools.run(tool, args)
        self.segments.append({"text": format_result(output), "role": "tool"})
        self.segments.append({"text": "", "role": "model"})
        return output


def _titled(output: str, name: str) -> str | None:
    """The line of a search result whose document is titled ``name`` (None: none is)."""
    return next((line for line in output.splitlines()
                 if re.match(rf"Doc \d+\(Title: {re.escape(name)}\)", line)), None)


def _fact(line: str, numeric: bool) -> int | str | None:
    """The fact a result line ends with: its last number, or (not ``numeric``) a relation's
    entity name ("... is Kos Havi.")."""
    if numeric:
        numbers = re.findall(r"\d+", line)
        return int(numbers[-1]) if numbers else None
    _, sep, tail = line.rpartition(" is ")
    return tail.rstrip(".") if sep and tail.rstrip(".") else None


async def _search(trace: _Trace, task: Task, i: int, demo: Demonstrator | None,
                  counts: dict, values: list) -> int | str:
    """The i-th search of ``task`` (and its checks); returns the fact it found."""
    name, expected = task.found[i]
    numeric, value = not isinstance(expected, str), expected
    queries = [[a for t, a in task.calls if t == "search"][i],
               *(task.rephrase[i] if task.rephrase else [])]
    if i and isinstance(task.found[i - 1][1], str) and values[-1] != task.found[i - 1][1]:
        # a chain after a wrong hop: search the entity that hop named, take what it says
        queries = [q.replace(task.found[i - 1][1], str(values[-1])) for q in queries]
        name, value = str(values[-1]), None
    for n, query in enumerate(queries):
        output = await trace.call("search", query)
        line = _titled(output, name)
        if line is not None:
            if value is not None and not line.endswith(f" {value}."):
                raise RuntimeError(f"{task.id}: search {query!r} did not return its fact first")
            return value if value is not None else _fact(line, numeric)
        if demo is None:  # the clean suite: every reply shows its entity
            raise RuntimeError(f"{task.id}: search {query!r} did not return its fact first")
        counts["wrong_results"] += 1
        if n == len(queries) - 1 or not demo.checks():
            break
        counts["checks"] += 1
    found = _fact((output.splitlines() or [""])[0], numeric)  # unchecked: the first document's
    return expected if found is None else found


async def _tool_segments(task: Task, tools: RealTools, demo: Demonstrator | None,
                         counts: dict) -> tuple[list[dict], str]:
    trace = _Trace(THINK[task.kind].format(task.question.removeprefix("What is ").rstrip("?")),
                   tools)
    values, output = [], ""
    for tool, args in task.calls:
        if tool == "search":
            values.append(await _search(trace, task, len(values), demo, counts, values))
            output = str(values[-1])
            continue
        code = with_operands(args, values) if values else args
        written = demo.slipped(code) if demo else code
        output = (await trace.call("python", written)).strip()
        if written != code:
            counts["wrong_results"] += 1
            if demo.checks():
                counts["checks"] += 1
                output = (await trace.call("python", code)).strip()
    final = output if task.calls[-1][0] == "python" else str(values[-1])
    if not counts["wrong_results"] and final != task.answer:
        raise RuntimeError(f"{task.id}: tools gave {output!r}, expected {task.answer!r}")
    trace.segments[-1]["text"] = f"<answer>\\boxed{{{final}}}</answer>"
    return trace.segments, final


async def build_traces(tasks: list[Task], tools: RealTools, concurrency: int = 8,
                       direct: list[bool] | None = None,
                       demos: list[Demonstrator | None] | None = None) -> list[dict]:
    slots = asyncio.Semaphore(concurrency)
    demos = [None] * len(tasks) if demos is None else demos

    async def one(task: Task, from_memory: bool, demo: Demonstrator | None) -> dict:
        async with slots:
            return await build_trace(task, tools, from_memory, demo)

    # Let every call finish before raising: cancelling sandboxed runs mid-flight is
    # avoided (it hung asyncio.run's clean-up when a trace check failed).
    direct = [False] * len(tasks) if direct is None else direct
    results = await asyncio.gather(*(one(t, d, m) for t, d, m in zip(tasks, direct, demos,
                                                                      strict=True)),
                                   return_exceptions=True)
    for result in results:
        if isinstance(result, BaseException):
            raise result
    return list(results)


# ----------------------------------------------------------------------------- files


def write_suite(out_dir: str | Path, spec: SuiteSpec = SuiteSpec(), concurrency: int = 8) -> dict:
    """Write corpus.jsonl, sft.jsonl, rl.jsonl, heldout.jsonl and meta.json; returns
    meta (counts, tool settings, timings)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    docs = corpus_rows((hard.make_entities if spec.hard else make_entities)(spec))
    write_jsonl(out / "corpus.jsonl", docs)
    tasks = {s: (hard.make_tasks if spec.hard else make_tasks)(spec, s) for s in SPLITS}
    for split in ("rl", "heldout"):
        write_jsonl(out / f"{split}.jsonl", [t.row() for t in tasks[split]])
    t1 = time.perf_counter()
    tools = RealTools(docs, spec.topk, spec.snippet_chars, hide=[out], noise=spec.search_noise,
                      noise_seed=spec.seed, noise_note=spec.search_noise_note)
    # which traces answer from memory: their own generator, so the tasks do not change
    direct = np.random.default_rng([spec.seed, 9]).random(len(tasks["sft"])) < spec.direct
    noisy = spec.search_noise > 0 or spec.python_slips > 0
    demos = [Demonstrator(np.random.default_rng([spec.seed, 10, i]), spec.python_slips,
                          spec.recover) if noisy else None for i in range(len(tasks["sft"]))]
    traces = asyncio.run(build_traces(tasks["sft"], tools, concurrency, direct.tolist(), demos))
    write_jsonl(out / "sft.jsonl", traces)
    meta = {"spec": asdict(spec), "system_prompt": SYSTEM_PROMPT,
            "tools": {"search": {"topk": spec.topk, "snippet_chars": spec.snippet_chars}},
            "counts": {"corpus": len(docs), **{s: len(t) for s, t in tasks.items()},
                       "sft_direct": int(direct.sum()),
                       "sft_wrong_results": sum(t["wrong_results"] for t in traces),
                       "sft_checks": sum(t["checks"] for t in traces),
                       "sft_correct": sum(t["correct"] for t in traces)},
            "timings_s": {"tasks": round(t1 - t0, 2), "traces": round(time.perf_counter() - t1, 2)}}
    atomic_write_json(out / "meta.json", meta)
    return meta


def chat_texts(traces: list[dict]) -> list[str]:
    """Whole ChatML conversations of SFT traces: the tokenizer corpus for
    ``build_tiny_model(corpus=...)`` (SFT text only, so every token the held-out split
    uses also occurs in training)."""
    return [f"<|im_start|>system\n{t['system']}<|im_end|>\n<|im_start|>user\n{t['question']}"
            f"<|im_end|>\n<|im_start|>assistant\n{t['response']}<|im_end|>\n" for t in traces]


def parse_mix(text: str) -> dict[str, float]:
    """``"chain=2,word=1"`` -> ``{"chain": 2.0, "word": 1.0}``."""
    try:
        pairs = [item.split("=") for item in text.split(",") if item.strip()]
        return {k.strip(): float(v) for k, v in pairs}
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not kind=weight,kind=weight") from None


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="Write the synthetic tool-use task suite.")
    ap.add_argument("out_dir")
    d = SuiteSpec()
    for name in ("seed", "entities", "sft", "rl", "heldout", "topk", "snippet_chars"):
        ap.add_argument(f"--{name.replace('_', '-')}", type=int, default=getattr(d, name))
    ap.add_argument("--direct", type=float, default=d.direct,
                    help="share of SFT traces answering from memory, without a tool")
    ap.add_argument("--search-noise", type=float, default=d.search_noise,
                    help="share of query strings answered with a wrong entity")
    ap.add_argument("--search-noise-note", default=d.search_noise_note,
                    help="text before each document of a wrong reply ('': none)")
    ap.add_argument("--python-slips", type=float, default=d.python_slips,
                    help="share of SFT snippets with a slipped operand")
    ap.add_argument("--recover", type=float, default=d.recover,
                    help="share of SFT traces that check a wrong result")
    ap.add_argument("--hard", action="store_true",
                    help="the harder suite (toolenv/tasks/hard.py; needs --topk 2 with namesakes)")
    ap.add_argument("--mix", type=parse_mix, default=d.mix,
                    help="harder suite: relative share per kind, e.g. chain=3,arith=1 (a kind "
                    "not given keeps its share in toolenv.tasks.suite.HARD_MIX, 0 drops it)")
    ap.add_argument("--namesakes", type=float, default=d.namesakes,
                    help="harder suite: share of entities with a near-namesake")
    ap.add_argument("--concurrency", type=int, default=8, help="sandboxed Python runs at once")
    args = ap.parse_args(argv)
    args.mix = {**d.mix, **args.mix}
    try:
        spec = SuiteSpec(**{k: getattr(args, k) for k in asdict(d)})
    except ValueError as exc:
        ap.error(str(exc))
    meta = write_suite(args.out_dir, spec, args.concurrency)
    print(json.dumps(meta["counts"]), json.dumps(meta["timings_s"]))


if __name__ == "__main__":
    main()
