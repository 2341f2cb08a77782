"""The synthetic tool-use task suite: generated from a seed, nothing downloaded.

Invented entities (cities and writers with made-up two-word names such as "Vel Bira",
and random facts) live in a document corpus that the BM25 retriever serves. Three task
kinds need the tools:

- ``arith``: multi-digit products and sums ("What is 347 * 29?") -> ``<python>``;
- ``lookup``: one fact of one entity ("What is the population of Vel Bira?") -> ``<search>``;
- ``combo``: two facts combined ("... population of Vel Bira plus the population of
  Kos Havi?") -> two ``<search>`` calls, then ``<python>`` on the numbers found.

Splits (sft / rl / heldout) never share what matters: each entity belongs to one split,
so a held-out look-up asks about an entity training never mentioned, and an arithmetic
operand pair belongs to the split its hash picks. Every split draws from its own seeded
generator, so its items do not depend on the sizes of the other splits.

SFT traces are built with the real tools: the sandboxed ``PythonTool`` runs every snippet,
and a search result is what ``toolenv.retriever_server.BM25Index`` returns for the query,
formatted by ``toolenv.search.format_passages`` exactly as ``SearchTool`` shows the live
server's reply. A trace is stored as segments (model text / tool text) so SFT can mask
the tool segments.

CLI: ``python -m arpo_async.synthetic OUT_DIR [--seed 0 --entities 600 --sft 3000
--rl 2000 --heldout 300 --topk 1 --snippet-chars 160 --direct 0]`` writes corpus.jsonl, sft.jsonl,
rl.jsonl, heldout.jsonl and meta.json (the tool settings evaluation and RL must use).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from toolenv.tags import format_result

SYSTEM_PROMPT = (
    "Use tools: <python>code</python> runs Python, <search>query</search> searches "
    "documents; results come in <result></result>. End with <answer>\\boxed{}</answer>."
)
KINDS = ("arith", "lookup", "combo")
SPLITS = ("sft", "rl", "heldout")
ENTITY_SHARE = {"sft": 0.5, "rl": 0.25, "heldout": 0.25}  # fraction of entities per split
PAIR_BUCKETS = {"sft": range(0, 6), "rl": range(6, 7), "heldout": range(7, 8)}  # of 8

# attribute -> (entity type, question phrase, value range). The search query is the
# phrase without "the", a span the model copies from the question token for token (a
# name after a space tokenises differently from a name right after a tag).
ATTRS = {
    "population": ("city", "the population of {}", (10000, 99999)),
    "founded": ("city", "the founding year of {}", (1000, 1999)),
    "elevation": ("city", "the elevation of {}", (100, 999)),
    "born": ("person", "the birth year of {}", (1500, 1999)),
    "books": ("person", "the number of books by {}", (10, 99)),
}
# One document per fact, its number last: a look-up's answer then sits at a fixed
# distance before "</result>", which the tiny model learns to copy within the SFT budget
# (with all of an entity's facts in one document, only the last fact was copied right:
# 0% of populations, 96% of elevations after 1,000 steps). Each sentence holds its
# attribute's query words, so BM25 ranks the asked fact above the entity's others.
_FACT_SENTENCE = {
    "population": "Its population is {}.", "founded": "Its founding year is {}.",
    "elevation": "Its elevation in metres is {}.", "born": "The birth year of the writer is {}.",
    "books": "The number of books by the writer is {}.",
}
_INTRO = {"city": "{} is a city.", "person": "{} is a writer."}
# A look-up's thought restates what it searches for: one more copy of the name to
# practise, from which the query is then copied at a fixed distance.
THINK = {"arith": "Compute it with python.", "lookup": "Search for {}.",
         "combo": "Search both facts, then compute."}
THINK_DIRECT = "Answer from memory."
_ONSETS = ["b", "d", "f", "g", "k", "l", "m", "n", "p", "r", "s", "t", "v", "z", "br", "dr",
           "kr", "tr", "th", "sh", "qu", "h"]
_VOWELS = ["a", "e", "i", "o", "u"]


@dataclass(frozen=True)
class SuiteSpec:
    seed: int = 0
    entities: int = 600  # two thirds cities, one third writers
    sft: int = 3000  # SFT traces
    rl: int = 2000  # RL prompts
    heldout: int = 300  # held-out evaluation prompts
    topk: int = 1  # search results shown per query (tools.search_topk)
    snippet_chars: int = 160  # characters kept per result (tools.search_snippet_chars)
    # Share of SFT traces whose demonstrator answers from memory, without a tool (right on
    # its own entities, a guess on anyone else's): an imperfect cold start that RL has to
    # correct by learning when to look things up.
    direct: float = 0.0

    def count(self, split: str) -> int:
        return {"sft": self.sft, "rl": self.rl, "heldout": self.heldout}[split]


@dataclass
class Entity:
    name: str
    type: str  # "city" | "person"
    facts: dict[str, int]
    split: str

    def documents(self) -> list[dict]:
        """One retriever document per fact: ``{"id", "contents": "Title\ntext"}``."""
        intro, key = _INTRO[self.type].format(self.name), self.name.lower().replace(" ", "-")
        return [{"id": f"{key}-{attr}",
                 "contents": f"{self.name}\n{intro} {_FACT_SENTENCE[attr].format(value)}"}
                for attr, value in self.facts.items()]


@dataclass
class Task:
    id: str
    split: str
    kind: str  # one of KINDS
    question: str
    answer: str
    calls: list[tuple[str, str]]  # (tool, args) in the order the trace makes them
    found: list[tuple[str, int]] = field(default_factory=list)  # (entity, value) per search

    def row(self) -> dict:
        """A prompt row in the ARPO RL schema that ``toolenv.data.load_examples`` reads
        (system prompt included), plus plain question/answer/kind for people."""
        return {
            "id": self.id, "kind": self.kind, "question": self.question, "answer": self.answer,
            "ability": "math",  # numeric answers: scored by mathematical equivalence
            "prompt": [{"role": "system", "content": SYSTEM_PROMPT},
                       {"role": "user", "content": self.question}],
            "reward_model": {"ground_truth": self.answer, "style": "rule"},
            "extra_info": {"index": self.id, "question": self.question, "split": self.split},
        }


# ----------------------------------------------------------------------------- entities


def _words(rng: np.random.Generator, n: int, make, taken: set[str]) -> list[str]:
    from bm25s.stopwords import STOPWORDS_EN

    from arpo_async.tiny_model import _WORDS

    banned = taken | set(STOPWORDS_EN) | set(_WORDS)
    out: list[str] = []
    while len(out) < n:
        word = make()
        if word not in banned:
            banned.add(word)
            out.append(word.capitalize())
    return out


def _names(rng: np.random.Generator, n: int) -> list[str]:
    """n distinct two-word invented names ("Bira Tano"): unordered pairs of words from one
    small inventory (about sqrt(2n) words of two open syllables; never both "Bira Tano"
    and "Tano Bira", which BM25's bag of words could not tell apart). Each word is then one
    token that recurs in many names, and a held-out name is a new pair of known words.
    Why so few words: the tiny model copies a name into its query token by token, and it
    learns to copy a token only after seeing that token copied many times (its input
    and output embeddings are untied); 7,200 names of 180 words failed to copy at all."""
    size = math.ceil((1 + math.sqrt(1 + 8 * n)) / 2)  # size * (size - 1) / 2 >= n
    pick = lambda items: items[int(rng.integers(len(items)))]  # noqa: E731
    words = _words(rng, size, lambda: "".join(
        pick(_ONSETS) + pick(_VOWELS) for _ in range(2)), set())
    pairs = [f"{a} {b}" for i, a in enumerate(words) for b in words[i + 1:]]
    return [pairs[int(i)] for i in rng.permutation(len(pairs))[:n]]


def make_entities(spec: SuiteSpec) -> list[Entity]:
    """All entities of the suite, each assigned to one split (depends on seed and count)."""
    rng = np.random.default_rng([spec.seed, 0])
    n_city = (2 * spec.entities) // 3
    names = _names(rng, spec.entities)
    entities = []
    for i, name in enumerate(names):
        etype = "city" if i < n_city else "person"
        attrs = [a for a, v in ATTRS.items() if v[0] == etype]
        facts = {a: int(rng.integers(ATTRS[a][2][0], ATTRS[a][2][1] + 1)) for a in attrs}
        entities.append(Entity(name, etype, facts, ""))
    for etype in ("city", "person"):
        idx = [i for i, e in enumerate(entities) if e.type == etype]
        idx = [idx[j] for j in rng.permutation(len(idx))]
        cut1 = int(len(idx) * ENTITY_SHARE["sft"])
        cut2 = cut1 + int(len(idx) * ENTITY_SHARE["rl"])
        for pos, i in enumerate(idx):
            entities[i].split = "sft" if pos < cut1 else "rl" if pos < cut2 else "heldout"
    return entities


def corpus_rows(entities: list[Entity]) -> list[dict]:
    return [doc for e in entities for doc in e.documents()]


# ----------------------------------------------------------------------------- tasks


def pair_split(op: str, a: int, b: int) -> str:
    """The split an arithmetic operand pair belongs to (a fixed hash, so splits never
    share a pair whatever their sizes)."""
    bucket = (a * 7919 + b * 104729 + (1 if op == "*" else 0)) % 8
    return next(s for s, r in PAIR_BUCKETS.items() if bucket in r)


def _arith(rng: np.random.Generator, split: str, seen: set) -> tuple[str, str, str]:
    while True:
        if rng.random() < 0.5:
            op, a, b = "*", int(rng.integers(100, 1000)), int(rng.integers(11, 100))
        else:
            op, a, b = "+", int(rng.integers(1000, 10000)), int(rng.integers(1000, 10000))
        if pair_split(op, a, b) == split and (op, a, b) not in seen:
            seen.add((op, a, b))
            value = a * b if op == "*" else a + b
            return f"What is {a} {op} {b}?", f"print({a}{op}{b})", str(value)


def _query(phrase: str, name: str) -> str:
    return phrase.format(name).removeprefix("the ")


def _pick_attr(rng: np.random.Generator) -> tuple[str, tuple]:
    name = list(ATTRS)[int(rng.integers(len(ATTRS)))]
    return name, ATTRS[name]


def make_tasks(spec: SuiteSpec, split: str, n: int | None = None) -> list[Task]:
    """``n`` tasks (default: the spec's count) of one split, kinds in round-robin order so
    every prefix is balanced."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    n = spec.count(split) if n is None else n
    rng = np.random.default_rng([spec.seed, 1 + SPLITS.index(split)])
    pool: dict[str, list[Entity]] = {"city": [], "person": []}
    for e in make_entities(spec):
        if e.split == split:
            pool[e.type].append(e)
    if min(len(p) for p in pool.values()) < 2:
        raise ValueError(f"split {split}: too few entities (spec.entities={spec.entities})")
    seen: set = set()
    tasks = []
    for i in range(n):
        kind, tid = KINDS[i % len(KINDS)], f"{split}-{i:05d}"
        if kind == "arith":
            question, code, answer = _arith(rng, split, seen)
            tasks.append(Task(tid, split, kind, question, answer, [("python", code)]))
            continue
        attr, (etype, phrase, _) = _pick_attr(rng)
        ents = pool[etype]
        if kind == "lookup":
            e = ents[int(rng.integers(len(ents)))]
            tasks.append(Task(tid, split, kind, f"What is {phrase.format(e.name)}?",
                              str(e.facts[attr]), [("search", _query(phrase, e.name))],
                              [(e.name, e.facts[attr])]))
            continue
        i1, i2 = rng.choice(len(ents), size=2, replace=False)
        x, y = ents[int(i1)], ents[int(i2)]
        op, word = ("+", "plus") if rng.random() < 0.5 else ("-", "minus")
        a, b = x.facts[attr], y.facts[attr]
        question = f"What is {phrase.format(x.name)} {word} {phrase.format(y.name)}?"
        calls = [("search", _query(phrase, x.name)), ("search", _query(phrase, y.name)),
                 ("python", f"print({a}{op}{b})")]
        tasks.append(Task(tid, split, kind, question, str(a + b if op == "+" else a - b), calls,
                          [(x.name, a), (y.name, b)]))
    return tasks


def rl_prompts(seed: int, n: int) -> list:
    """The RL split as ``arpo_async.tasks.Prompt``s (task.name=synthetic_tools); the same
    items as rl.jsonl written with this seed and --rl n (and the default entity count)."""
    from arpo_async.tasks import Prompt

    tasks = make_tasks(SuiteSpec(seed=seed, rl=n), "rl")
    return [Prompt(t.id, t.question, [t.answer], "math", system_prompt=SYSTEM_PROMPT,
                   meta={"task": t.kind}) for t in tasks]


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


def _write_jsonl(path: Path, rows: list[dict]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("w", encoding="utf-8") as fh:
        for row in rows:
            fh.write(json.dumps(row, ensure_ascii=False) + "\n")
        fh.flush()
        os.fsync(fh.fileno())
    tmp.replace(path)


def write_suite(out_dir: str | Path, spec: SuiteSpec = SuiteSpec(), concurrency: int = 8) -> dict:
    """Write corpus.jsonl, sft.jsonl, rl.jsonl, heldout.jsonl and meta.json; returns
    meta (counts, tool settings, timings)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    docs = corpus_rows(make_entities(spec))
    _write_jsonl(out / "corpus.jsonl", docs)
    tasks = {s: make_tasks(spec, s) for s in SPLITS}
    for split in ("rl", "heldout"):
        _write_jsonl(out / f"{split}.jsonl", [t.row() for t in tasks[split]])
    t1 = time.perf_counter()
    tools = RealTools(docs, spec.topk, spec.snippet_chars, hide=[out])
    # which traces answer from memory: their own generator, so the tasks do not change
    direct = np.random.default_rng([spec.seed, 9]).random(len(tasks["sft"])) < spec.direct
    traces = asyncio.run(build_traces(tasks["sft"], tools, concurrency, direct.tolist()))
    _write_jsonl(out / "sft.jsonl", traces)
    meta = {"spec": asdict(spec), "system_prompt": SYSTEM_PROMPT,
            "tools": {"search_topk": spec.topk, "search_snippet_chars": spec.snippet_chars},
            "counts": {"corpus": len(docs), **{s: len(t) for s, t in tasks.items()},
                       "sft_direct": int(direct.sum())},
            "timings_s": {"tasks": round(t1 - t0, 2), "traces": round(time.perf_counter() - t1, 2)}}
    (out / "meta.json").write_text(json.dumps(meta, indent=1) + "\n")
    return meta


def chat_texts(traces: list[dict]) -> list[str]:
    """Whole ChatML conversations of SFT traces: the tokenizer corpus for
    ``build_tiny_model(corpus=...)`` (SFT text only, so every token the held-out split
    uses also occurs in training)."""
    return [f"<|im_start|>system\n{t['system']}<|im_end|>\n<|im_start|>user\n{t['question']}"
            f"<|im_end|>\n<|im_start|>assistant\n{t['response']}<|im_end|>\n" for t in traces]


def read_jsonl(path: str | Path) -> list[dict]:
    with Path(path).open(encoding="utf-8") as fh:
        return [json.loads(line) for line in fh if line.strip()]


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
