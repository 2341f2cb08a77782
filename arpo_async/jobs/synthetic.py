"""Write the synthetic tool-use suite (toolenv/tasks/suite.py) to files: the corpus, the
RL and held-out splits, and SFT traces built with the real tools.

SFT traces are built with the real tools: the sandboxed ``PythonTool`` runs every snippet,
and a search result is what ``toolenv.retriever_server.BM25Index`` returns for the query,
formatted by ``toolenv.search.format_passages`` exactly as ``SearchTool`` shows the live
server's reply. A trace is stored as segments (model text / tool text) so SFT can mask
the tool segments.

CLI: ``python -m arpo_async.jobs.synthetic OUT_DIR [--seed 0 --entities 600 --sft 3000
--rl 2000 --heldout 300 --topk 1 --snippet-chars 160 --direct 0]`` writes corpus.jsonl,
sft.jsonl, rl.jsonl, heldout.jsonl and meta.json (the tool settings evaluation and RL
must use).
"""


from __future__ import annotations

import argparse
import asyncio
import json
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np

from arpo_async.core.files import atomic_write_json, write_jsonl
from toolenv.tags import format_result
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
)

# ----------------------------------------------------------------------------- traces


class RealTools:
    """The tools a trace is built with: the sandboxed Python tool and the BM25 index,
    formatted as the live ``SearchTool`` would show the retriever's reply."""

    def __init__(self, docs: list[dict], topk: int, snippet_chars: int, hide: list = ()):
        from toolenv.python_tool import PythonTool
        from toolenv.retriever_server import BM25Index

        self.index = BM25Index(docs)
        self.python = PythonTool(hide=list(hide))
        self.topk, self.snippet_chars = topk, snippet_chars

    def search(self, query: str) -> str:
        from toolenv.search import format_passages, split_contents

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


async def build_trace(task: Task, tools: RealTools, direct: bool = False) -> dict:
    """One SFT trace of ``task`` with real tool outputs; checks the outputs carry the
    facts the answer needs, so a trace never teaches a wrong answer. ``direct``: the
    demonstrator answers from memory instead (``SuiteSpec.direct``)."""
    if direct:
        segments = [{"text": f"<think>{THINK_DIRECT}</think>\n<answer>\\boxed{{{task.answer}}}"
                             "</answer>", "role": "model"}]
    else:
        segments = await _tool_segments(task, tools)
    return {"id": task.id, "kind": task.kind, "question": task.question,
            "answers": [task.answer], "system": SYSTEM_PROMPT, "segments": segments,
            "response": "".join(s["text"] for s in segments), "direct": direct}


async def _tool_segments(task: Task, tools: RealTools) -> list[dict]:
    thought = THINK[task.kind].format(task.question.removeprefix("What is ").rstrip("?"))
    segments = [{"text": f"<think>{thought}</think>\n", "role": "model"}]
    output, found = "", iter(task.found)
    for tool, args in task.calls:
        segments[-1]["text"] += f"<{tool}>{args}</{tool}>"
        output = await tools.run(tool, args)
        segments.append({"text": format_result(output), "role": "tool"})
        segments.append({"text": "", "role": "model"})
        if tool == "search":
            name, value = next(found)
            if not (output.startswith(f"Doc 1(Title: {name})") and output.endswith(f" {value}.")):
                raise RuntimeError(f"{task.id}: search {args!r} did not return its fact first")
    final = output.strip() if task.calls[-1][0] == "python" else task.answer
    if final != task.answer or (task.kind == "lookup" and task.answer not in output):
        raise RuntimeError(f"{task.id}: tools gave {output!r}, expected {task.answer!r}")
    segments[-1]["text"] = f"<answer>\\boxed{{{final}}}</answer>"
    return segments


async def build_traces(tasks: list[Task], tools: RealTools, concurrency: int = 8,
                       direct: list[bool] | None = None) -> list[dict]:
    slots = asyncio.Semaphore(concurrency)

    async def one(task: Task, from_memory: bool) -> dict:
        async with slots:
            return await build_trace(task, tools, from_memory)

    # Let every call finish before raising: cancelling sandboxed runs mid-flight is
    # avoided (it hung asyncio.run's clean-up when a trace check failed).
    direct = [False] * len(tasks) if direct is None else direct
    results = await asyncio.gather(*(one(t, d) for t, d in zip(tasks, direct, strict=True)),
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
    docs = corpus_rows(make_entities(spec))
    write_jsonl(out / "corpus.jsonl", docs)
    tasks = {s: make_tasks(spec, s) for s in SPLITS}
    for split in ("rl", "heldout"):
        write_jsonl(out / f"{split}.jsonl", [t.row() for t in tasks[split]])
    t1 = time.perf_counter()
    tools = RealTools(docs, spec.topk, spec.snippet_chars, hide=[out])
    # which traces answer from memory: their own generator, so the tasks do not change
    direct = np.random.default_rng([spec.seed, 9]).random(len(tasks["sft"])) < spec.direct
    traces = asyncio.run(build_traces(tasks["sft"], tools, concurrency, direct.tolist()))
    write_jsonl(out / "sft.jsonl", traces)
    meta = {"spec": asdict(spec), "system_prompt": SYSTEM_PROMPT,
            "tools": {"search_topk": spec.topk, "search_snippet_chars": spec.snippet_chars},
            "counts": {"corpus": len(docs), **{s: len(t) for s, t in tasks.items()},
                       "sft_direct": int(direct.sum())},
            "timings_s": {"tasks": round(t1 - t0, 2), "traces": round(time.perf_counter() - t1, 2)}}
    atomic_write_json(out / "meta.json", meta)
    return meta


def chat_texts(traces: list[dict]) -> list[str]:
    """Whole ChatML conversations of SFT traces: the tokenizer corpus for
    ``build_tiny_model(corpus=...)`` (SFT text only, so every token the held-out split
    uses also occurs in training)."""
    return [f"<|im_start|>system\n{t['system']}<|im_end|>\n<|im_start|>user\n{t['question']}"
            f"<|im_end|>\n<|im_start|>assistant\n{t['response']}<|im_end|>\n" for t in traces]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="Write the synthetic tool-use task suite.")
    ap.add_argument("out_dir")
    d = SuiteSpec()
    for name in ("seed", "entities", "sft", "rl", "heldout", "topk", "snippet_chars"):
        ap.add_argument(f"--{name.replace('_', '-')}", type=int, default=getattr(d, name))
    ap.add_argument("--direct", type=float, default=d.direct,
                    help="share of SFT traces answering from memory, without a tool")
    ap.add_argument("--concurrency", type=int, default=8, help="sandboxed Python runs at once")
    args = ap.parse_args(argv)
    spec = SuiteSpec(**{k: getattr(args, k) for k in asdict(d)})
    meta = write_suite(args.out_dir, spec, args.concurrency)
    print(json.dumps(meta["counts"]), json.dumps(meta["timings_s"]))


if __name__ == "__main__":
    main()
