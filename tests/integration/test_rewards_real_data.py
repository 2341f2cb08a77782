"""The reward on every row of the real GSM8K and MATH-500 test sets (1,819 rows): the gold
answer scores 1, a really different answer scores 0, an equivalent form scores 1.
QA sets too: the accepted answer scores 1, another entity 0."""

from __future__ import annotations

import re
import time
from decimal import Decimal
from fractions import Fraction
from pathlib import Path

import pytest

from toolenv.tasks.data import load_examples
from toolenv.tasks.rewards import Score, score_many, score_response

pytestmark = pytest.mark.integration

DATA = Path(__file__).resolve().parents[2].parent / "shared" / "data"
if not DATA.is_dir():
    pytest.skip(f"real data folder {DATA} not present (only in the project workspace)",
                allow_module_level=True)

NUMBER = re.compile(r"-?\d+(\.\d+)?")
# Not equal to any gold of either set (checked below by the 0 scores themselves).
DISTINCT = "\\frac{7919}{104729}\\sqrt{5}"


def trajectory(boxed: str) -> str:
    return f"<think>Working it out.</think>\n<answer>The answer is \\boxed{{{boxed}}}</answer>"


def wrong_answer(gold: str) -> str:
    return str(Decimal(gold) + 1) if NUMBER.fullmatch(gold) else DISTINCT


@pytest.fixture(scope="module")
def math_examples():
    examples = (load_examples(DATA / "gsm8k_test.jsonl")
                + load_examples(DATA / "math500_test.jsonl"))
    assert len(examples) == 1819
    return examples


def test_every_math_row_gold_scores_one_and_wrong_scores_zero(math_examples):
    start = time.perf_counter()
    gold = [score_response(trajectory(e.answers[0]), e) for e in math_examples]
    wrong = [score_response(trajectory(wrong_answer(e.answers[0])), e) for e in math_examples]
    elapsed = time.perf_counter() - start
    print(f"\nscored {2 * len(math_examples)} math trajectories in {elapsed:.1f} s")
    bad_gold = [(e.id, e.answers[0], s) for e, s in zip(math_examples, gold)
                if s != Score(1.0, 1.0, True, "correct")]
    bad_wrong = [(e.id, e.answers[0], s) for e, s in zip(math_examples, wrong)
                 if s != Score(0.0, 0.0, True, "wrong answer")]
    assert not bad_gold, bad_gold[:5]
    assert not bad_wrong, bad_wrong[:5]
    assert elapsed < 60


def test_equivalent_forms_of_numeric_golds(math_examples):
    # n written as \frac{3n}{3}: only mathematical equivalence (math-verify) accepts it.
    numeric = [e for e in math_examples if NUMBER.fullmatch(e.answers[0])]
    assert len(numeric) > 1500
    texts = []
    for e in numeric:
        f = Fraction(Decimal(e.answers[0]))
        texts.append(trajectory(f"\\frac{{{3 * f.numerator}}}{{{3 * f.denominator}}}"))
    scores = score_many(texts, numeric, processes=2)
    assert [e.id for e, s in zip(numeric, scores) if s.reward != 1.0] == []


def test_process_pool_agrees_with_in_process(math_examples):
    sample = math_examples[::7]
    texts = [trajectory(wrong_answer(e.answers[0]) if i % 2 else e.answers[0])
             for i, e in enumerate(sample)]
    assert score_many(texts, sample, processes=2) == score_many(texts, sample)


@pytest.mark.parametrize("name", ["hotpotqa_test.jsonl", "bamboogle_test.jsonl"])
def test_qa_sets(name):
    examples = load_examples(DATA / name)
    gold = score_many([trajectory(e.answers[0]) for e in examples], examples)
    assert all(s.reward == 1.0 for s in gold)
    # Another row's answer is (almost always) wrong: F1 stays low on average.
    shifted = [trajectory(examples[(i + 1) % len(examples)].answers[0])
               for i in range(len(examples))]
    other = score_many(shifted, examples)
    assert sum(s.correct for s in other) / len(other) < 0.1
    assert all(s.format_ok for s in other)
