"""Hostile and malformed tool-call rounds for a syntax's ``find_calls`` (the fuzz test,
tests/unit/test_vllm_syntax.py, and bench/parsers.py).

``hostile_rounds(syntax, rng, n)`` yields rounds as a model could end them: each starts
from a well-formed call in the syntax's own format (``call_text``) and applies one or more
mutations: cut anywhere, markers doubled or nested, the name replaced (unknown, empty,
huge, code), arguments replaced by code, invalid JSON or XML, a huge value, control
tokens, random bytes; every round then ends where the engine stops a round of calls (the
end-of-call marker, or the end of the turn with ``tools.parallel_calls`` > 1).
``audit_evals()`` counts code evaluated meanwhile (``exec``/``eval`` of text raise the
``exec`` audit event; ``ast.literal_eval`` does not, it only compiles to a tree; a module
run by an import is not counted), and ``fuzz`` counts what a parser raised as a crash.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
from collections import Counter
from collections.abc import Iterator
from typing import Any

import numpy as np

CODE = ("__import__('os').system('touch /tmp/arpo_fuzz_pwned')",
        "exec(\"open('/tmp/arpo_fuzz_pwned','w')\")", "{{7*7}}", "${7*7}",
        "eval(compile('1','x','eval'))", "lambda: 0", "[i for i in ().__class__.__mro__]",
        "__builtins__", "'); DROP TABLE t;--")
JUNK = ("{", "}", "[", "]", "\"", "<", ">", "</", "/>", "<parameter=", "</parameter>",
        "<function=", "</function>", "<arg_key>", "<arg_value>", "</arg_value>", "\\", "\x00",
        "\ufffd", "\n", "{\"name\":", "\"arguments\":", "null", "NaN", "1e999")


def _mutations(rng: np.random.Generator, text: str, syntax: Any) -> str:
    """One mutation of ``text``."""
    opens = getattr(syntax, "call_open", "<tool_call>")
    close = getattr(syntax, "call_close", syntax.stop_strings[0])
    specials = list(getattr(syntax, "literals", ()))[:50] or ["<|im_end|>"]
    kind = int(rng.integers(12))
    cut = int(rng.integers(len(text) + 1))
    if kind == 0:  # truncated anywhere
        return text[:cut]
    if kind == 1:  # nested or doubled markers
        return text[:cut] + (opens if rng.random() < 0.5 else close) + text[cut:]
    if kind == 2:  # the name replaced
        name = str(rng.choice(["nope", "", "python python", "x" * 5000, CODE[0], "../etc",
                               "search\n", "<tool_call>"]))
        for real in getattr(syntax, "specs", {}):
            text = text.replace(real, name, 1)
        return text
    if kind == 3:  # code where arguments go
        return text[:cut] + str(rng.choice(CODE)) + text[cut:]
    if kind == 4:  # junk characters
        return text[:cut] + "".join(rng.choice(JUNK, size=int(rng.integers(1, 8)))) + text[cut:]
    if kind == 5:  # a long value (a round's token limit bounds it; longer: MAX_CALL_CHARS)
        return text[:cut] + "A" * int(rng.integers(2_000, 20_000)) + text[cut:]
    if kind == 6:  # control tokens inside
        return text[:cut] + str(rng.choice(specials)) + text[cut:]
    if kind == 7:  # random bytes as text
        return text[:cut] + bytes(rng.integers(0, 256, 64, dtype=np.uint8)).decode(
            "latin-1") + text[cut:]
    if kind == 8:  # two calls in one turn
        return text + "\n" + text
    if kind == 9:  # deep nesting
        return opens * int(rng.integers(2, 200)) + text
    if kind == 10:  # a fragment of the body repeated
        a, b = sorted(rng.integers(0, len(text) + 1, 2))
        return text[:b] + text[a:b] * int(rng.integers(2, 50)) + text[b:]
    return text[cut:]  # the opening cut off


def hostile_rounds(syntax: Any, rng: np.random.Generator, n: int) -> Iterator[str]:
    """``n`` malformed or hostile rounds, each ending where a round of calls stops."""
    close = syntax.stop_strings[0]
    names = list(getattr(syntax, "specs", {})) or ["python"]
    for _ in range(n):
        name = str(rng.choice(names))
        args = str(rng.choice(["print(1)", "capital of Veloria", CODE[0], "x = {'a': [1, 2]}",
                               "line one\nline two", ""]))
        spec = getattr(syntax, "specs", {}).get(name)
        if spec is not None:  # the tool's own args text (several properties: JSON)
            props = list(spec.parameters.get("properties", {})) or ["input"]
            args = spec.call_text({p: args for p in props}) if len(props) > 1 else args
        text = syntax.call_text(name, args) if spec is not None else args
        for _ in range(int(rng.integers(1, 4))):
            text = _mutations(rng, text, syntax)
        prefix = str(rng.choice(["", "Let me check.\n", "<think>\nhm\n</think>\n\n"]))
        yield prefix + (text if text.rstrip().endswith(close) else text + close)


@contextlib.contextmanager
def audit_evals() -> Iterator[Counter]:
    """Counts ``exec`` audit events (code evaluated by ``exec`` or ``eval``) while the
    block runs. An audit hook cannot be removed: it stays installed, counting only while
    a block is active."""
    counts: Counter = Counter()
    _ACTIVE.append(counts)
    try:
        yield counts
    finally:
        _ACTIVE.remove(counts)


_ACTIVE: list[Counter] = []
WARM_UP = 200  # rounds through find_calls before counting (see fuzz)


def _hook(event: str, args: tuple) -> None:
    """An ``exec`` event of code compiled from a string (its file ``<string>`` or any
    name that is no module's: an ``eval``/``exec`` of text); a module's code run by an
    import (its file a path, or ``<frozen ...>``) is not an evaluation."""
    if event != "exec" or not _ACTIVE:
        return
    filename = getattr(args[0], "co_filename", "") if args else ""
    if filename.startswith("<frozen") or os.path.isfile(filename):
        return
    for counts in _ACTIVE:
        counts["exec"] += 1


sys.addaudithook(_hook)


def reason(error: str) -> str:
    """An error's kind: its text up to the first name, number or detail it quotes."""
    text = error.removeprefix("Error: ")
    return re.split(r"[:'\"(]|\d", text, maxsplit=1)[0].strip()[:60]


def fuzz(syntax: Any, n: int, seed: int = 0) -> dict:
    """``n`` hostile rounds through ``syntax.find_calls``: crashes (an exception out of
    it), code evaluated, and the reasons calls were refused (first words; a round of
    several calls counts each). The
    syntax first parses ``WARM_UP`` other rounds uncounted: libraries that generate code
    once (jsonschema's validators through attrs) do it there, so what is counted is code
    evaluated because of a round."""
    rng = np.random.default_rng(seed)
    crashes, ran, none, reasons = 0, 0, 0, Counter()
    for text in hostile_rounds(syntax, np.random.default_rng(seed + 10**6), WARM_UP):
        with contextlib.suppress(Exception):  # lazy imports and attrs' generated methods
            syntax.find_calls(text)  # (jsonschema) run here, before anything is counted
    with audit_evals() as evals:
        for text in hostile_rounds(syntax, rng, n):
            try:
                calls = syntax.find_calls(text)
            except Exception:  # what the fuzz looks for: counted, reported
                crashes += 1
                continue
            none += not calls
            for call in calls:
                if call.error:
                    reasons[reason(call.error)] += 1
                else:
                    ran += 1
    return {"rounds": n, "crashes": crashes, "evals": evals["exec"], "valid_calls": ran,
            "no_call": none, "invalid": sum(reasons.values()),
            "reasons": dict(reasons.most_common(12))}
