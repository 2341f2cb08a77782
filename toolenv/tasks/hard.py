"""The harder synthetic suite (``SuiteSpec.hard``; ``pipeline.suite_hard``): the same tools
(the Python sandbox, BM25 over the suite's corpus), the same corpus format and markup as
toolenv/tasks/suite.py, with tasks a 135M model does not mostly solve after a short SFT.

On top of the default suite's entities (the same names and facts for a seed), writers get
two relations, a birthplace (a city) and a teacher (a writer), each a document like the
facts' ("The birthplace of the writer is Kos Havi."), and a share ``namesakes`` of entities
gets a near-namesake: the same name with an initial ("Vel Bira", "Vel T. Bira"), the same
type and split, other facts. BM25 drops one-letter tokens, so it scores the two alike for
every query and ranks the one first in the corpus (the pair's order is drawn) first: its
top result is the other entity for about half of their queries, and the answer needs a
look at the titles (the suite then needs ``topk >= 2``). The new kinds:

- ``chain``: "What is the population of the city where the writer Vel Bira was born?":
  search the writer's birthplace, then the city's fact (a name copied from a result);
- ``chain3``: the same through the writer's teacher (three searches);
- ``word``: a word problem of 2-3 operations on multi-digit numbers, thousands written
  with commas, one Python call;
- ``check``: "Which is larger, the population of A or the population of B? Give the
  difference.": two searches, the first about a namesake when there are any, then
  ``abs(a-b)``.

``arith``, ``lookup`` and ``combo`` are asked as in the default suite, over these entities.
Kinds follow ``SuiteSpec.mix`` (relative shares) in a smooth weighted round-robin, so
every prefix of a split is near the mix. Splits never share an entity (relations stay in
their split; a namesake is in its entity's split) nor a word problem (a hash of its
numbers picks its split, as for arithmetic pairs).
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from toolenv.tasks import suite
from toolenv.tasks.suite import ALL_KINDS, ATTRS, SPLITS, Entity, SuiteSpec, Task

# relation -> its phrase; the query is the phrase after "the" ("birthplace of Vel Bira"),
# as for the facts
RELATIONS = {"birthplace": "the birthplace of {}", "teacher": "the teacher of {}"}
_INITIALS = "BCDFGHKLMNPRSTVZ"
CITY_ATTRS = tuple(a for a, v in ATTRS.items() if v[0] == "city")
PERSON_ATTRS = tuple(a for a, v in ATTRS.items() if v[0] == "person")

# (question, snippet, operand ranges); "//" divides a multiple of b exactly
WORD = (
    ("A depot holds {a} crates of {b} bottles each and ships {c} bottles. How many bottles "
     "are left?", "{a}*{b}-{c}", {"a": (100, 999), "b": (11, 99), "c": (1000, 9999)}),
    ("A printer prints {a} pages a day for {b} days, then {c} pages more. How many pages "
     "does it print in all?", "{a}*{b}+{c}", {"a": (100, 999), "b": (11, 99), "c": (1000, 9999)}),
    ("A town has {a} houses of {b} rooms and {c} houses of {d} rooms. How many rooms are "
     "there in all?", "{a}*{b}+{c}*{d}",
     {"a": (100, 999), "b": (11, 99), "c": (100, 999), "d": (11, 99)}),
    ("A shop buys {a} boxes of {b} pens and sells {c} pens a day for {d} days. How many "
     "pens are left?", "{a}*{b}-{c}*{d}",
     {"a": (100, 999), "b": (11, 99), "c": (100, 999), "d": (11, 49)}),
    ("A farm packs {a} eggs into boxes of {b} and sells {c} boxes. How many boxes are "
     "left?", "{a}//{b}-{c}", {"a": (100, 999), "b": (11, 99), "c": (10, 99)}),
    ("A club of {a} members pays {b} dollars each and spends {c} dollars on a trip. How "
     "many dollars are left?", "{a}*{b}-{c}", {"a": (100, 999), "b": (11, 99), "c": (1000, 9999)}),
)
_PRIMES = (7919, 104729, 1299709, 15485863)


# ----------------------------------------------------------------------------- entities


def make_entities(spec: SuiteSpec) -> list[Entity]:
    """The default suite's entities for the seed, each followed or preceded by its
    namesake (a share ``spec.namesakes``), writers with a birthplace and a teacher."""
    rng = np.random.default_rng([spec.seed, 0, 1])  # the default suite's draws stay as they are
    out: list[Entity] = []
    for e in suite.make_entities(replace(spec, hard=False)):
        if rng.random() < spec.namesakes:
            twin = _namesake(e, rng)
            out.extend([e, twin] if rng.random() < 0.5 else [twin, e])
        else:
            out.append(e)
    for split in SPLITS:
        cities = [e for e in out if e.split == split and e.type == "city"]
        people = [e for e in out if e.split == split and e.type == "person"]
        for w in people:
            w.facts["birthplace"] = cities[int(rng.integers(len(cities)))].name
            others = [p for p in people if p is not w]
            w.facts["teacher"] = others[int(rng.integers(len(others)))].name
    return out


def _namesake(e: Entity, rng: np.random.Generator) -> Entity:
    """``e``'s near-namesake: its name with an initial between the words, other values of
    the same facts (so the wrong one's answer is wrong)."""
    first, second = e.name.split(" ")
    name = f"{first} {_INITIALS[int(rng.integers(len(_INITIALS)))]}. {second}"
    facts = {}
    for attr, value in e.facts.items():
        lo, hi = ATTRS[attr][2]
        other = value
        while other == value:
            other = int(rng.integers(lo, hi + 1))
        facts[attr] = other
    return Entity(name, e.type, facts, e.split)


def namesake_pairs(entities: list[Entity]) -> dict[str, str]:
    """Name -> its namesake's name, both ways."""
    by_key = {}
    for e in entities:
        by_key.setdefault((e.name.split(" ")[0], e.name.split(" ")[-1]), []).append(e.name)
    return {a: b for names in by_key.values() if len(names) == 2
            for a, b in (names, names[::-1])}


# ----------------------------------------------------------------------------- tasks


def kind_sequence(mix: dict, n: int) -> list[str]:
    """``n`` kinds in the proportions of ``mix`` (smooth weighted round-robin: every
    prefix is within one item of the mix per kind)."""
    kinds = [k for k in ALL_KINDS if mix.get(k, 0) > 0]
    weights = [float(mix[k]) for k in kinds]
    total, current, out = sum(weights), [0.0] * len(kinds), []
    for _ in range(n):
        current = [c + w for c, w in zip(current, weights)]
        j = max(range(len(kinds)), key=lambda i: current[i])
        current[j] -= total
        out.append(kinds[j])
    return out


def make_tasks(spec: SuiteSpec, split: str, n: int | None = None) -> list[Task]:
    """``n`` tasks (default: the spec's count) of one split, kinds by ``spec.mix``."""
    if not spec.hard:
        raise ValueError("hard.make_tasks: spec.hard is off (toolenv.tasks.suite.make_tasks)")
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    n = spec.count(split) if n is None else n
    rng = np.random.default_rng([spec.seed, 11 + SPLITS.index(split)])
    entities = make_entities(spec)
    pool = suite.split_pools(entities, split)
    by_name = {e.name: e for e in entities}
    twins = [e for e in pool["city"] + pool["person"] if e.name in namesake_pairs(entities)]
    seen: set = set()
    tasks = []
    for i, kind in enumerate(kind_sequence(spec.mix, n)):
        tid = f"{split}-{i:05d}"
        if kind == "arith":
            tasks.append(suite.arith_task(rng, tid, split, seen))
        elif kind == "lookup":
            tasks.append(suite.lookup_task(rng, tid, split, pool))
        elif kind == "combo":
            tasks.append(suite.combo_task(rng, tid, split, pool))
        elif kind in ("chain", "chain3"):
            hops = 2 if kind == "chain" else 3
            tasks.append(chain_task(rng, tid, split, pool, by_name, hops))
        elif kind == "word":
            tasks.append(word_task(rng, tid, split, seen))
        else:
            tasks.append(check_task(rng, tid, split, pool, twins))
    return tasks


def _pick(rng: np.random.Generator, items: list | tuple):
    return items[int(rng.integers(len(items)))]


def chain_task(rng: np.random.Generator, tid: str, split: str, pool: dict[str, list[Entity]],
               by_name: dict[str, Entity], hops: int) -> Task:
    """A city fact through the writer's birthplace (2 hops) or their teacher's (3)."""
    writer = _pick(rng, pool["person"])
    attr = _pick(rng, CITY_ATTRS)
    phrase = ATTRS[attr][1]
    steps = (["teacher"] if hops == 3 else []) + ["birthplace"]
    who = f"the writer {writer.name}"
    if hops == 3:
        who = f"the teacher of {who}"
    calls, found, rephrase, ent = [], [], [], writer
    for rel in steps:
        calls.append(("search", suite.search_query(RELATIONS[rel], ent.name)))
        found.append((ent.name, ent.facts[rel]))
        rephrase.append(suite.rephrasings(RELATIONS[rel], ent.name))
        ent = by_name[str(ent.facts[rel])]
    calls.append(("search", suite.search_query(phrase, ent.name)))
    found.append((ent.name, ent.facts[attr]))
    rephrase.append(suite.rephrasings(phrase, ent.name))
    question = f"What is {phrase.format(f'the city where {who} was born')}?"
    kind = "chain" if hops == 2 else "chain3"
    return Task(tid, split, kind, question, str(ent.facts[attr]), calls, found, rephrase)


def word_split(template: int, values: list[int]) -> str:
    """The split a word problem belongs to (a fixed hash of its template and numbers)."""
    bucket = (template + sum(v * p for v, p in zip(values, _PRIMES))) % 8
    return next(s for s, r in suite.PAIR_BUCKETS.items() if bucket in r)


def word_task(rng: np.random.Generator, tid: str, split: str, seen: set) -> Task:
    """A word problem of 2-3 operations, solved by one snippet (``word``)."""
    while True:
        t = int(rng.integers(len(WORD)))
        text, code, ranges = WORD[t]
        v = {k: int(rng.integers(lo, hi + 1)) for k, (lo, hi) in ranges.items()}
        if "//" in code:
            v["a"] *= v["b"]  # a whole number of boxes
        snippet = code.format(**v)
        value = eval(snippet, {"__builtins__": {}})  # noqa: S307 (our own arithmetic)
        key = ("word", t, *v.values())
        if value > 0 and key not in seen and word_split(t, list(v.values())) == split:
            seen.add(key)
            question = text.format(**{k: f"{x:,}" for k, x in v.items()})
            return Task(tid, split, "word", question, str(value), [("python", f"print({snippet})")])


def check_task(rng: np.random.Generator, tid: str, split: str, pool: dict[str, list[Entity]],
               twins: list[Entity]) -> Task:
    """Which of two facts is larger, and by how much (``check``); the first entity has a
    namesake when the split has any (its search is ambiguous)."""
    first = _pick(rng, twins) if twins else None
    etype = first.type if first else _pick(rng, ("city", "person"))
    attr = _pick(rng, CITY_ATTRS if etype == "city" else PERSON_ATTRS)
    phrase = ATTRS[attr][1]
    x = first or _pick(rng, pool[etype])
    y = x
    while y is x or y.facts[attr] == x.facts[attr]:
        y = _pick(rng, pool[etype])
    a, b = x.facts[attr], y.facts[attr]
    question = (f"Which is larger, {phrase.format(x.name)} or {phrase.format(y.name)}? "
                "Give the difference.")
    calls = [("search", suite.search_query(phrase, x.name)),
             ("search", suite.search_query(phrase, y.name)), ("python", f"print(abs({a}-{b}))")]
    return Task(tid, split, "check", question, str(abs(a - b)), calls, [(x.name, a), (y.name, b)],
                [suite.rephrasings(phrase, x.name), suite.rephrasings(phrase, y.name)])
