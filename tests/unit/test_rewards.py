"""ARPO reward rule: hand cases for malformed responses, the two-tool bonus, F1 and EM,
and mathematical equivalence."""

from __future__ import annotations

import threading

import pytest

from toolenv.tasks.data import Example
from toolenv.tasks.rewards import Score, math_equal, qa_em, qa_f1, score_many, score_response

MATH = Example(id="m:0", question="What is 1/2 as a decimal?", answers=["0.5"], kind="math")
QA = Example(id="q:0", question="Who bid for Australia?", answers=["Frank Lowy"], kind="qa")

THINK = "<think>Let me work it out.</think>\n"
PY = "<python>print(1/2)</python>\n<result>\n0.5\n</result>\n"
SEARCH = "<search>Australia 2022 bid</search>\n<result>\nDoc 1(Title: Bid) ...\n</result>\n"


def answer(content: str) -> str:
    return f"<answer>The answer is \\boxed{{{content}}}</answer>"


@pytest.mark.parametrize(("text", "why"), [
    (THINK + "The answer is 0.5.", "no answer block"),
    (THINK + answer("0.5") + "\n" + answer("0.5"), "two answers"),
    ("<think>unclosed " + answer("0.5"), "unbalanced think"),
    (THINK + "</think>" + answer("0.5"), "stray closing tag"),
    (THINK + "<answer>The answer is 0.5</answer>", "no boxed"),
    (THINK + "<answer>\\boxed{0.5</answer>", "unbalanced boxed"),
    (THINK + answer("0.5") + " trailing words", "text after the answer"),
    ("<python>print(1)</python>" + THINK + "<result>1</result>" + answer("0.5"),
     "result not after a tool call"),
])
def test_malformed_scores_minus_one(text, why):
    score = score_response(text, MATH)
    assert score == Score(-1.0, 0.0, False, score.reason), why
    assert score.reason.startswith("malformed")


def test_correct_wrong_and_bonus():
    assert score_response(THINK + answer("0.5"), MATH) == Score(1.0, 1.0, True, "correct")
    assert score_response(THINK + answer("\\frac{1}{2}"), MATH).reward == 1.0
    assert score_response(THINK + answer("0.25"), MATH) == Score(0.0, 0.0, True, "wrong answer")
    both = score_response(THINK + PY + SEARCH + answer("\\frac{1}{2}"), MATH)
    assert both.reward == pytest.approx(1.1) and both.correct == 1.0
    # The bonus needs a right answer and both tools.
    assert score_response(THINK + PY + SEARCH + answer("3"), MATH).reward == 0.0
    assert score_response(THINK + PY + answer("0.5"), MATH).reward == 1.0
    assert score_response(THINK + SEARCH + answer("0.5"), MATH).reward == 1.0
    # Tools called inside <think> count too (ARPO's prompt allows it).
    inside = "<think>first " + PY + SEARCH + "done</think>\n" + answer("0.5")
    assert score_response(inside, MATH).reward == pytest.approx(1.1)


def test_tool_tags_inside_results_do_not_count():
    fake = "<python>print('<search>x</search>')</python>\n<result>\n<search>x</search>\n</result>\n"
    assert score_response(THINK + fake + answer("0.5"), MATH).reward == 1.0


def test_qa_f1_em_and_partial_bonus():
    exact = score_response(THINK + answer("frank lowy"), QA)
    assert exact.reward == 1.0
    partial = score_response(THINK + answer("Sir Frank Lowy"), QA)  # P=2/3, R=1 -> F1=0.8
    assert partial.correct == pytest.approx(0.8) and partial.reward == pytest.approx(0.8)
    assert score_response(THINK + answer("Sir Frank Lowy"), QA, qa_metric="em").reward == 0.0
    # As in ARPO, a partly right answer with both tools earns the bonus.
    assert score_response(THINK + PY + SEARCH + answer("Sir Frank Lowy"), QA).reward == (
        pytest.approx(0.9))
    assert score_response(THINK + answer("\\text{Frank Lowy}"), QA).reward == 1.0
    with pytest.raises(ValueError, match="qa_metric"):
        score_response(THINK + answer("x"), QA, qa_metric="bleu")


def test_f1_em_hand_values():
    assert qa_f1("The Beatles", ["beatles"]) == 1.0  # articles and case go
    assert qa_f1("Paris, France", ["Paris"]) == pytest.approx(2 * 0.5 * 1 / 1.5)
    assert qa_f1("London", ["Paris", "london"]) == 1.0  # max over accepted answers
    assert qa_f1("nothing in common", ["Paris"]) == 0.0
    assert qa_f1("no", ["no"]) == 1.0
    assert qa_f1("yes it is", ["yes"]) == 0.0  # yes/no must match exactly (HotpotQA)
    assert qa_f1("x", []) == 0.0
    assert qa_em("  the  Eiffel tower!", ["Eiffel Tower"]) == 1.0
    assert qa_em("Eiffel", ["Eiffel Tower"]) == 0.0


@pytest.mark.parametrize(("pred", "gold"), [
    ("0.5", "\\frac{1}{2}"),
    ("3\\sqrt{3}-6", "3\\sqrt{3} - 6"),
    ("\\dfrac{1}{2}", "1/2"),
    ("1,000", "1000"),
    ("025", "25"),
    ("\\frac{27}{3}", "9"),
    ("(3,\\pi/2)", "\\left( 3, \\frac{\\pi}{2} \\right)"),
    ("$18$", "18"),
    ("[4,\\infty)", "[4, \\infty)"),
])
def test_math_equivalent(pred, gold):
    assert math_equal(pred, gold)


@pytest.mark.parametrize(("pred", "gold"), [
    ("2", "3"), ("x", "y"), ("\\frac{1}{3}", "0.33"), ("", "0"), ("5", "[4,\\infty)"),
    ("-6+3\\sqrt{3}", "3\\sqrt{2}-6"),
])
def test_math_not_equivalent(pred, gold):
    assert not math_equal(pred, gold)


def test_math_equal_off_the_main_thread():
    # math-verify's SIGALRM guard would raise outside the main thread; it is switched off.
    got: list = []
    worker = threading.Thread(target=lambda: got.append(math_equal("0.75", "\\frac{6}{8}")))
    worker.start()
    worker.join(30)
    assert got == [True]


def test_score_many_matches_single_and_checks_lengths():
    texts = [THINK + answer("0.5"), THINK + answer("7"), "garbage"]
    expect = [score_response(t, MATH) for t in texts]
    assert score_many(texts, [MATH] * 3) == expect
    with pytest.raises(ValueError, match="3 responses for 2 examples"):
        score_many(texts, [MATH] * 2)
