"""The synthetic tool-use tasks: entities, corpus documents and questions, generated from
a seed, nothing downloaded (the RL prompt source of ``task.name=synthetic_tools``).

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

The noisy suite (``search_noise``, ``python_slips``; ``pipeline.suite_noise`` and
``pipeline.suite_slips``) makes a tool result something to judge rather than copy: the
suite's corpus is served by an unreliable retriever (toolenv/retriever_server.py: a share
of query strings is answered with a wrong entity's documents, the same reply for the same
query, another draw for another phrasing), and a share of the SFT demonstrator's Python
snippets carry a slipped operand. After a wrong result the demonstrator checks (searches
again with another phrasing from ``Task.rephrase``, or runs the snippet again as it
should have been) in a share ``recover`` of traces and answers with the wrong value
otherwise, so the SFT model has both continuations and the better one after a tool result
is uncertain: where ARPO's branching is meant to pay. The questions are the same as the
default suite's. With ``search_noise_note`` (``pipeline.suite_noise_note``) a wrong reply
says so ("No exact match."), as search engines do: the tiny model cannot compare the
reply's entity name with the question's, so without the note it re-searches at random
(the recover suite of bench/README.md, where the post-tool choice decides the reward).

The harder suite (``SuiteSpec.hard``, ``pipeline.suite_hard``; toolenv/tasks/hard.py) adds
chains of look-ups, word problems, comparisons and near-namesakes that BM25 cannot tell
apart, in a mix of kinds and a share of namesakes that are dials (``mix``, ``namesakes``).

The files of a suite (corpus, SFT traces built with the real tools, the splits) are
written by ``python -m arpo_async.jobs.synthetic`` (arpo_async/jobs/synthetic.py).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

SYSTEM_PROMPT = (
    "Use tools: <python>code</python> runs Python, <search>query</search> searches "
    "documents; results come in <result></result>. End with <answer>\\boxed{}</answer>."
)
KINDS = ("arith", "lookup", "combo")
# the harder suite's own kinds (toolenv/tasks/hard.py): a look-up through the writer's
# birthplace (2 hops) or through their teacher's (3 hops), a word problem, a comparison
HARD_KINDS = ("chain", "chain3", "word", "check")
ALL_KINDS = KINDS + HARD_KINDS
# the harder suite's starting mix (relative shares; docs/design.md "The harder suite")
HARD_MIX = {"arith": 0.0, "lookup": 1.0, "combo": 1.0, "chain": 2.0, "chain3": 1.0,
            "word": 2.0, "check": 2.0}
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
    # the harder suite's relations: the value is another entity's name
    "birthplace": "The birthplace of the writer is {}.",
    "teacher": "The teacher of the writer is {}.",
}
_INTRO = {"city": "{} is a city.", "person": "{} is a writer."}
# A look-up's thought restates what it searches for: one more copy of the name to
# practise, from which the query is then copied at a fixed distance.
THINK = {"arith": "Compute it with python.", "lookup": "Search for {}.",
         "combo": "Search both facts, then compute.",
         "chain": "Search where the writer was born, then that city.",
         "chain3": "Search the teacher, where the teacher was born, then that city.",
         "word": "Write it as one python expression.",
         "check": "Search both facts, then compute the larger minus the smaller."}
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
    topk: int = 1  # search results shown per query (tools.search.topk)
    snippet_chars: int = 160  # characters kept per result (tools.search.snippet_chars)
    # Share of SFT traces whose demonstrator answers from memory, without a tool (right on
    # its own entities, a guess on anyone else's): an imperfect cold start that RL has to
    # correct by learning when to look things up.
    direct: float = 0.0
    # The noisy suite (module docstring): share of query strings the suite's retriever
    # answers with a wrong entity, share of SFT Python snippets with a slipped operand, and
    # share of SFT traces that check a wrong result instead of answering with it.
    search_noise: float = 0.0
    python_slips: float = 0.0
    recover: float = 0.5
    # text the retriever puts before a wrong reply's documents ('': none, the wrong reply
    # looks like a right one): a wrong result the model can see (the recover suite)
    search_noise_note: str = ""
    # The harder suite (toolenv/tasks/hard.py): off, the suite above, byte for byte.
    hard: bool = False
    # relative share of each task kind (ALL_KINDS; a kind left out or at 0 is not asked)
    mix: dict = field(default_factory=lambda: dict(HARD_MIX))
    # share of entities given a near-namesake ("Vel Bira", "Vel T. Bira"): BM25 ties the
    # two, so its top result is the other one for about half their queries (needs topk >= 2)
    namesakes: float = 0.3

    def __post_init__(self):
        if not self.hard:
            return
        unknown = sorted(set(self.mix) - set(ALL_KINDS))
        if unknown or any(w < 0 for w in self.mix.values()) or sum(self.mix.values()) <= 0:
            raise ValueError(f"mix {self.mix}: weights >= 0 of {ALL_KINDS}, not all 0"
                             + (f" (unknown: {unknown})" if unknown else ""))
        if not 0.0 <= self.namesakes <= 1.0:
            raise ValueError(f"namesakes {self.namesakes}: a share in [0, 1]")
        if self.namesakes > 0 and self.topk < 2:
            raise ValueError(f"namesakes {self.namesakes} with topk {self.topk}: BM25 ties a "
                             "name and its namesake, so the right document is only sure to be "
                             "shown with topk >= 2 (or set namesakes to 0)")

    def count(self, split: str) -> int:
        return {"sft": self.sft, "rl": self.rl, "heldout": self.heldout}[split]


@dataclass
class Entity:
    name: str
    type: str  # "city" | "person"
    facts: dict[str, int | str]  # a relation's value (the harder suite) is a name
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
    found: list[tuple[str, int | str]] = field(default_factory=list)  # (entity, value) per search
    # per search call, other phrasings of its query (tried after a wrong-entity reply)
    rephrase: list[list[str]] = field(default_factory=list)

    def row(self) -> dict:
        """A prompt row in the ARPO RL schema that ``toolenv.tasks.data.load_examples`` reads
        (system prompt included), plus plain question/answer/kind for people."""
        return {
            "id": self.id, "kind": self.kind, "question": self.question, "answer": self.answer,
            "ability": "math",  # numeric answers: scored by mathematical equivalence
            "prompt": [{"role": "system", "content": SYSTEM_PROMPT},
                       {"role": "user", "content": self.question}],
            "reward_model": {"ground_truth": self.answer, "style": "rule"},
            "extra_info": {"index": self.id, "question": self.question, "split": self.split},
        }


# Common English words: the tiny model's tokenizer is trained on them (arpo_async/jobs/
# tiny_model.py), and invented entity names never coincide with one.
_COMMON_TEXT = (
    "the a an of to and in is it that for on with as by at from this be are was we you "
    "number sum product result value answer question step first then next so therefore "
    "compute calculate find total each per more less than times plus minus divided equals "
    "let us use python search check verify think because need know year city country "
    "river capital born wrote who what when where which why how many much large small "
    "after before during between under over about into through again all any both few "
    "some most other such only own same too very can will just should now have has had "
    "do does did not no yes if or but while until since also there here their they them "
    "his her its our your he she him me my i one two three four five six seven eight nine "
    "ten hundred thousand million half twice square root prime even odd digit fraction "
    "percent average ratio area length width height distance speed time hour minute day "
    "week month price cost money dollar buy sell pay paid left remaining gave got each "
    "film book song album author director actor singer team game war king queen state "
    "university company band founded located named known called won played released "
    "population language river mountain island ocean lake north south east west world "
    "american british french german english first last new old great long high best "
    "wikipedia article page source document retrieve query information fact evidence "
    "code print import math return def function variable list loop range output error"
)
COMMON_WORDS = tuple(_COMMON_TEXT.split())


# ----------------------------------------------------------------------------- entities


def _words(rng: np.random.Generator, n: int, make, taken: set[str]) -> list[str]:
    from bm25s.stopwords import STOPWORDS_EN  # bm25s: heavy (about 1.5 s)

    banned = taken | set(STOPWORDS_EN) | set(COMMON_WORDS)
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
    _not_hard(spec, "make_entities")
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


def search_query(phrase: str, name: str) -> str:
    return phrase.format(name).removeprefix("the ")


def rephrasings(phrase: str, name: str) -> list[str]:
    """Another phrasing of a look-up query ("Vel Bira population"), its own draw of the
    noisy retriever: the demonstrator checks a wrong-entity reply with it, once."""
    core = phrase.removeprefix("the ").replace(" of {}", "").replace(" by {}", "")
    return [f"{name} {core}"]


_NUMBER = re.compile(r"\d+")


def slip(code: str, rng: np.random.Generator) -> str:
    """A typical slip in a snippet: one operand's last digit off by one (the digit count
    kept, never equal to the original)."""
    nums = list(_NUMBER.finditer(code))
    m = nums[int(rng.integers(len(nums)))]
    digits = m.group()
    last = int(digits[-1])
    new = last + 1 if last < 9 and (last == 0 or rng.random() < 0.5) else last - 1
    return code[:m.start()] + digits[:-1] + str(new) + code[m.end():]


def with_operands(code: str, values: list[int]) -> str:
    """``code`` with its numbers replaced, in order, by ``values`` (a combo's snippet on
    the numbers its searches returned)."""
    it = iter(values)
    return _NUMBER.sub(lambda _: str(next(it)), code)


def suite_noise(corpus: str | Path) -> dict:
    """The retriever noise a suite's corpus is served with (``RetrieverProcess`` keyword
    arguments), from the suite's meta.json next to it; none for any other corpus."""
    meta = Path(corpus).with_name("meta.json")
    spec = json.loads(meta.read_text()).get("spec", {}) if meta.is_file() else {}
    return {"noise": float(spec.get("search_noise", 0.0)),
            "noise_seed": int(spec.get("seed", 0)),
            "noise_note": str(spec.get("search_noise_note", ""))}


def _pick_attr(rng: np.random.Generator) -> tuple[str, tuple]:
    name = list(ATTRS)[int(rng.integers(len(ATTRS)))]
    return name, ATTRS[name]


def _not_hard(spec: SuiteSpec, name: str) -> None:
    if spec.hard:
        raise ValueError(f"{name}: the harder suite's is toolenv.tasks.hard.{name}")


def split_pools(entities: list[Entity], split: str) -> dict[str, list[Entity]]:
    """The split's entities by type; refuses a split with fewer than 2 of a type."""
    pool: dict[str, list[Entity]] = {"city": [], "person": []}
    for e in entities:
        if e.split == split:
            pool[e.type].append(e)
    if min(len(p) for p in pool.values()) < 2:
        raise ValueError(f"split {split}: too few entities (entities={len(entities)})")
    return pool


def lookup_task(rng: np.random.Generator, tid: str, split: str,
                pool: dict[str, list[Entity]]) -> Task:
    """One fact of one entity (``lookup``)."""
    attr, (etype, phrase, _) = _pick_attr(rng)
    ents = pool[etype]
    e = ents[int(rng.integers(len(ents)))]
    return Task(tid, split, "lookup", f"What is {phrase.format(e.name)}?", str(e.facts[attr]),
                [("search", search_query(phrase, e.name))], [(e.name, e.facts[attr])],
                [rephrasings(phrase, e.name)])


def combo_task(rng: np.random.Generator, tid: str, split: str,
               pool: dict[str, list[Entity]]) -> Task:
    """One fact of two entities, added or subtracted (``combo``)."""
    attr, (etype, phrase, _) = _pick_attr(rng)
    ents = pool[etype]
    i1, i2 = rng.choice(len(ents), size=2, replace=False)
    x, y = ents[int(i1)], ents[int(i2)]
    op, word = ("+", "plus") if rng.random() < 0.5 else ("-", "minus")
    a, b = x.facts[attr], y.facts[attr]
    question = f"What is {phrase.format(x.name)} {word} {phrase.format(y.name)}?"
    calls = [("search", search_query(phrase, x.name)), ("search", search_query(phrase, y.name)),
             ("python", f"print({a}{op}{b})")]
    return Task(tid, split, "combo", question, str(a + b if op == "+" else a - b), calls,
                [(x.name, a), (y.name, b)],
                [rephrasings(phrase, x.name), rephrasings(phrase, y.name)])


def arith_task(rng: np.random.Generator, tid: str, split: str, seen: set) -> Task:
    question, code, answer = _arith(rng, split, seen)
    return Task(tid, split, "arith", question, answer, [("python", code)])


def make_tasks(spec: SuiteSpec, split: str, n: int | None = None) -> list[Task]:
    """``n`` tasks (default: the spec's count) of one split, kinds in round-robin order so
    every prefix is balanced."""
    _not_hard(spec, "make_tasks")
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    n = spec.count(split) if n is None else n
    rng = np.random.default_rng([spec.seed, 1 + SPLITS.index(split)])
    pool = split_pools(make_entities(spec), split)
    seen: set = set()
    tasks = []
    for i in range(n):
        kind, tid = KINDS[i % len(KINDS)], f"{split}-{i:05d}"
        if kind == "arith":
            tasks.append(arith_task(rng, tid, split, seen))
        elif kind == "lookup":
            tasks.append(lookup_task(rng, tid, split, pool))
        else:
            tasks.append(combo_task(rng, tid, split, pool))
    return tasks


# ----------------------------------------------------------------------------- outcomes

_ASKED = re.compile(r"(?:of|by) ([A-Z][a-z]+ (?:[A-Z]\. )?[A-Z][a-z]+)")  # hard: "Vel T. Bira"
_SEARCH_RESULT = re.compile(r"</search>\s*<result>(.*?)</result>", re.S)
_TITLE = re.compile(r"\s*Doc 1\(Title: ([^)]*)\)")


def wrong_search_results(question: str, response: str, note: str = "") -> tuple[int, int]:
    """(search results, wrong ones) in one response to a suite question. With ``note``
    (the suite's ``search_noise_note``) a result is wrong when it carries the note: a wrong
    reply the model can see. Without, when its first document names none of the entities
    the question asks about (or there is none): the noisy retriever's reply to a clean
    query, or the reply to a query the model miscopied."""
    asked = set(_ASKED.findall(question))
    bodies = _SEARCH_RESULT.findall(response)
    if note:
        return len(bodies), sum(1 for b in bodies if note in b)
    titles = [m.group(1).strip() if (m := _TITLE.match(b)) else "" for b in bodies]
    return len(bodies), sum(1 for t in titles if t not in asked)


def recovery(items: list[dict], note: str = "") -> dict:
    """How an evaluation's samples fared after a wrong search result (``items.jsonl`` rows
    of arpo_async/jobs/evaluate.py; ``note``: as ``wrong_search_results``): ``rate`` the
    share of the samples that met one and still scored, of ``n`` such samples; ``share`` =
    n / all samples; ``pass_clean`` the pass rate of the samples that met none."""
    hit = clean = n = total = 0
    for item in items:
        for response, score in zip(item.get("responses", []), item.get("scores", [])):
            total += 1
            _, wrong = wrong_search_results(item["question"], response, note)
            if wrong:
                n += 1
                hit += score > 0
            else:
                clean += score > 0
    return {"rate": hit / n if n else float("nan"), "n": n,
            "share": n / total if total else float("nan"),
            "pass_clean": clean / (total - n) if total > n else float("nan")}
