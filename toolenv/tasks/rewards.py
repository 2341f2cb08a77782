"""Score a finished trajectory with ARPO's rule (docs/design.md "Rewards").

-1 when the trajectory is malformed (unbalanced tags, not exactly one answer, no
``\\boxed{}``; tool calls and results in either syntax, toolenv/syntax.py); otherwise
correctness in [0, 1], plus 0.1 when the answer is right and both tools (python and
search) were used. Correctness is mathematical equivalence for
math (math-verify, after a cheap string and exact-number check) and token F1 or exact
match (SQuAD normalisation, max over accepted answers) for QA.

The reference implementation scored math with F1 too, so ``0.5`` against ``\\frac{1}{2}``
counted as wrong; here it is equivalent. As in the reference, a partially right QA
answer (F1 > 0) also earns the two-tool bonus.

math-verify guards sympy with SIGALRM, which only works in the main thread of the main
interpreter. There the guard is kept; in any other thread it is switched off so that
scoring works from thread pools and executors, and very long answers skip sympy.
For untrusted output in bulk, ``score_many(..., processes=N)`` scores in worker
processes, whose main threads keep the guard.
"""

from __future__ import annotations

import multiprocessing
import re
import string
import threading
from collections import Counter
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from functools import lru_cache
from typing import TYPE_CHECKING

from toolenv.tags import Markup, extract_answer, tools_used, validate_format

if TYPE_CHECKING:
    from toolenv.tasks.data import Example

TWO_TOOL_BONUS = 0.1  # ARPO: reward for a right answer that used both tools
MALFORMED_REWARD = -1.0
MATH_VERIFY_TIMEOUT_S = 5  # per parse/verify, main thread only (see module docstring)
MAX_SYMBOLIC_CHARS = 1000  # longer answers are compared as strings only
BOTH_TOOLS = frozenset({"python", "search"})


@dataclass
class Score:
    reward: float
    correct: float
    format_ok: bool
    reason: str = ""


def score_response(response_text: str, example: Example, qa_metric: str = "f1",
                   markup: Markup | None = None) -> Score:
    """ARPO reward of one response (the model's text after the prompt, tool results
    included) against ``example.answers``. ``markup``: the tool-call syntax's blocks
    (``ToolSyntax.markup``; default ARPO's python and search tags)."""
    if qa_metric not in ("f1", "em"):
        raise ValueError(f"qa_metric must be 'f1' or 'em', got {qa_metric!r}")
    ok, reason = validate_format(response_text, markup=markup)
    if not ok:
        return Score(MALFORMED_REWARD, 0.0, False, f"malformed: {reason}")
    pred = extract_answer(response_text)
    if pred is None:
        return Score(MALFORMED_REWARD, 0.0, False, "malformed: no \\boxed{} in the answer")
    if example.kind == "math":
        correct = 1.0 if any(math_equal(pred, gold) for gold in example.answers) else 0.0
    elif example.kind == "qa":
        metric = qa_f1 if qa_metric == "f1" else qa_em
        correct = metric(pred, example.answers)
    else:
        raise ValueError(f"example {example.id}: unknown kind {example.kind!r}")
    if correct > 0 and BOTH_TOOLS <= tools_used(response_text, markup=markup):
        return Score(correct + TWO_TOOL_BONUS, correct, True, "correct, both tools used")
    return Score(correct, correct, True, "correct" if correct > 0 else "wrong answer")


def score_many(
    responses: Sequence[str],
    examples: Sequence[Example],
    qa_metric: str = "f1",
    processes: int = 0,
    markup: Markup | None = None,
) -> list[Score]:
    """Score pairs in order; with ``processes > 0`` in a pool of worker processes (chunks
    of 64), whose main threads keep math-verify's timeout."""
    if len(responses) != len(examples):
        raise ValueError(f"{len(responses)} responses for {len(examples)} examples")
    if processes <= 0:
        return [score_response(r, e, qa_metric, markup) for r, e in zip(responses, examples)]
    metrics = [qa_metric] * len(responses)
    # forkserver, not fork: forking a process that runs threads (an actor's engine) can
    # deadlock the child.
    ctx = multiprocessing.get_context("forkserver")
    with ProcessPoolExecutor(max_workers=processes, mp_context=ctx) as pool:
        return list(pool.map(score_response, responses, examples, metrics,
                             [markup] * len(responses), chunksize=64))


# ---------------------------------------------------------------- math


_SPACING = re.compile(r"\\[!,;: ]|\\left|\\right|\s+")
_PLAIN_NUMBER = re.compile(r"[-+]?(\d+(\.\d*)?|\.\d+)")
_THOUSANDS = re.compile(r"[-+]?\d{1,3}(,\d{3})+(\.\d+)?")


def _normalise_math(s: str) -> str:
    s = s.strip().strip("$").strip()
    s = _SPACING.sub("", s)
    s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    return s.rstrip(".")


def _as_number(s: str) -> Decimal | None:
    """Exact value of a plain decimal number (thousands commas allowed), else None."""
    if _THOUSANDS.fullmatch(s):
        s = s.replace(",", "")
    if not _PLAIN_NUMBER.fullmatch(s):
        return None
    try:
        return Decimal(s)
    except InvalidOperation:
        return None


@lru_cache(maxsize=65536)
def math_equal(pred: str, gold: str) -> bool:
    """True when ``pred`` and ``gold`` (LaTeX or plain text) denote the same value."""
    p, g = _normalise_math(pred), _normalise_math(gold)
    if not p or not g:
        return False
    if p == g:
        return True
    pn, gn = _as_number(p), _as_number(g)
    if pn is not None and gn is not None:
        return pn == gn  # both plain numbers: exact comparison is conclusive
    if len(p) > MAX_SYMBOLIC_CHARS or len(g) > MAX_SYMBOLIC_CHARS:
        return False
    from math_verify import verify  # lazy: pulls in sympy

    timeout = _timeout()
    gold_parsed, pred_parsed = _parse(g, timeout), _parse(p, timeout)
    if not gold_parsed or not pred_parsed:
        return False
    try:
        return bool(verify(list(gold_parsed), list(pred_parsed), timeout_seconds=timeout))
    except Exception:  # noqa: BLE001 (sympy raises anything on exotic input: no match)
        return False


def _timeout() -> int | None:
    in_main = threading.current_thread() is threading.main_thread()
    return MATH_VERIFY_TIMEOUT_S if in_main else None


@lru_cache(maxsize=8192)
def _parse(expr: str, timeout: int | None) -> tuple:
    """Parse an answer as if it were boxed, so math-verify takes the whole of it."""
    from math_verify import parse

    try:
        return tuple(parse(f"\\boxed{{{expr}}}", parsing_timeout=timeout))
    except Exception:  # noqa: BLE001 (an unparsable answer matches nothing)
        return ()


# ---------------------------------------------------------------- QA


_TEXT_WRAPPER = re.compile(r"\\(?:text|textbf|textit|mathrm|mbox)\{([^{}]*)\}")
_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCT = set(string.punctuation)
_YES_NO = ("yes", "no", "noanswer")


def normalize_answer(s: str) -> str:
    """SQuAD normalisation (lower case, no punctuation, no articles, single spaces),
    after unwrapping LaTeX text commands a boxed answer may carry."""
    s = _TEXT_WRAPPER.sub(r"\1", s).lower()
    s = "".join(ch for ch in s if ch not in _PUNCT)
    s = _ARTICLES.sub(" ", s)
    return " ".join(s.split())


def _f1(pred: str, gold: str) -> float:
    p, g = normalize_answer(pred), normalize_answer(gold)
    # HotpotQA's official rule: a yes/no answer earns credit only by matching exactly.
    if (p in _YES_NO or g in _YES_NO) and p != g:
        return 0.0
    common = Counter(p.split()) & Counter(g.split())
    same = sum(common.values())
    if same == 0:
        return 0.0
    precision, recall = same / len(p.split()), same / len(g.split())
    return 2 * precision * recall / (precision + recall)


def qa_f1(pred: str, golds: list[str]) -> float:
    """Token F1, max over accepted answers."""
    return max((_f1(pred, g) for g in golds), default=0.0)


def qa_em(pred: str, golds: list[str]) -> float:
    """1.0 when the normalised prediction equals a normalised accepted answer."""
    p = normalize_answer(pred)
    return 1.0 if any(p == normalize_answer(g) for g in golds) else 0.0
