"""ARPO reward rule: hand cases for malformed responses, the two-tool bonus, F1 and EM,
and mathematical equivalence. The cases with tool calls run in both tool-call syntaxes
(``tools.syntax``: arpo tags, hermes JSON calls with the template's tool message), and a
rollout with a scripted engine scores its leaves the same way in both."""

from __future__ import annotations

import threading

import pytest

from toolenv.tasks.data import Example
from toolenv.tasks.rewards import Score, math_equal, qa_em, qa_f1, score_many, score_response

MATH = Example(id="m:0", question="What is 1/2 as a decimal?", answers=["0.5"], kind="math")
QA = Example(id="q:0", question="Who bid for Australia?", answers=["Frank Lowy"], kind="qa")

THINK = "<think>Let me work it out.</think>\n"


class Fmt:
    """One syntax's way of writing the test responses' tool calls and results."""

    def __init__(self, syn):
        self.syn, self.markup = syn, syn.markup
        self.py = self.call("python", "print(1/2)", "0.5")
        self.search = self.call("search", "Australia 2022 bid", "Doc 1(Title: Bid) ...")

    def call(self, name, args, out):
        return self.syn.call_text(name, args) + self.syn.result_text(out)

    def score(self, text, example, **kw):
        return score_response(text, example, markup=self.markup, **kw)


@pytest.fixture(scope="module")
def syntaxes(tiny_model_dir):
    from transformers import AutoTokenizer

    from arpo_async.core.config import ToolsConfig
    from toolenv.syntax import build_syntax

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    return {name: build_syntax(ToolsConfig(enabled=["python", "search"], syntax=name), tok)
            for name in ("arpo", "hermes")}


@pytest.fixture(params=["arpo", "hermes"])
def fmt(request, syntaxes):
    return Fmt(syntaxes[request.param])


def test_arpo_default_is_the_tags():
    py = "<python>print(1/2)</python>\n<result>\n0.5\n</result>\n"
    search = "<search>q</search>\n<result>\nDoc\n</result>\n"
    assert score_response(THINK + py + search + answer("0.5"), MATH).reward == pytest.approx(1.1)


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
    ("CALL" + THINK + "RESULT" + answer("0.5"), "result not after a tool call"),
    ("CALL" + answer("0.5") + "RESULT", "result after the answer"),
])
def test_malformed_scores_minus_one(fmt, text, why):
    call, result = fmt.syn.call_text("python", "print(1)"), fmt.syn.result_text("1")
    text = text.replace("CALL", call).replace("RESULT", result)
    score = fmt.score(text, MATH)
    assert score == Score(-1.0, 0.0, False, score.reason), why
    assert score.reason.startswith("malformed")


def test_correct_wrong_and_bonus(fmt):
    py, search = fmt.py, fmt.search
    assert fmt.score(THINK + answer("0.5"), MATH) == Score(1.0, 1.0, True, "correct")
    assert fmt.score(THINK + answer("\\frac{1}{2}"), MATH).reward == 1.0
    assert fmt.score(THINK + answer("0.25"), MATH) == Score(0.0, 0.0, True, "wrong answer")
    both = fmt.score(THINK + py + search + answer("\\frac{1}{2}"), MATH)
    assert both.reward == pytest.approx(1.1) and both.correct == 1.0
    # The bonus needs a right answer and both tools.
    assert fmt.score(THINK + py + search + answer("3"), MATH).reward == 0.0
    assert fmt.score(THINK + py + answer("0.5"), MATH).reward == 1.0
    assert fmt.score(THINK + search + answer("0.5"), MATH).reward == 1.0
    # Tools called inside <think> count too (ARPO's prompt allows it).
    inside = "<think>first " + py + search + "done</think>\n" + answer("0.5")
    assert fmt.score(inside, MATH).reward == pytest.approx(1.1)


def test_tool_calls_inside_results_do_not_count(fmt):
    printed = fmt.syn.call_text("search", "x")  # a call the python tool printed
    fake = fmt.call("python", "print(s)", printed)
    assert fmt.score(THINK + fake + answer("0.5"), MATH).reward == 1.0


def test_qa_f1_em_and_partial_bonus(fmt):
    exact = fmt.score(THINK + answer("frank lowy"), QA)
    assert exact.reward == 1.0
    partial = fmt.score(THINK + answer("Sir Frank Lowy"), QA)  # P=2/3, R=1 -> F1=0.8
    assert partial.correct == pytest.approx(0.8) and partial.reward == pytest.approx(0.8)
    assert fmt.score(THINK + answer("Sir Frank Lowy"), QA, qa_metric="em").reward == 0.0
    # As in ARPO, a partly right answer with both tools earns the bonus.
    assert fmt.score(THINK + fmt.py + fmt.search + answer("Sir Frank Lowy"), QA).reward == (
        pytest.approx(0.9))
    assert fmt.score(THINK + answer("\\text{Frank Lowy}"), QA).reward == 1.0
    with pytest.raises(ValueError, match="qa_metric"):
        fmt.score(THINK + answer("x"), QA, qa_metric="bleu")


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


class _ScriptedEngine:
    """Calls python, then search, then answers: the reply depends on how many tool
    results the context holds (in the syntax's own result format)."""

    version = 0

    def __init__(self, syn):
        self.syn, self.tok = syn, syn.tokenizer
        self.replies = [syn.call_text("python", "print(1/2)"),
                        syn.call_text("search", "one half"), answer("0.5")]

    async def generate(self, req):
        from actors.engines.base import GenResult

        context = self.tok.decode(req.prompt_tokens, skip_special_tokens=False)
        reply = self.replies[context.count(self.syn.markup.result[0])]
        ids = self.tok.encode(reply, add_special_tokens=False)
        stop = next(s for s in self.syn.stop_strings if reply.endswith(s))
        return GenResult(ids, [0.0] * len(ids), [[0.0]] * len(ids), "stop", stop_reason=stop,
                         version=0)


class _Tools:
    async def call(self, name, args):
        from toolenv.base import ToolResult

        return ToolResult({"python": "0.5", "search": "Doc 1: one half is 0.5"}[name], ok=True)


@pytest.mark.parametrize("syntax", ["arpo", "hermes"])
async def test_rollout_leaves_score_alike_in_both_syntaxes(tiny_model_dir, syntax):
    """The real rollout (actors/rollout/) with each syntax: the calls are found,
    the results inserted in the syntax's format, and the leaves scored 1.1 (right, both
    tools) by the same reward."""
    import numpy as np
    from transformers import AutoTokenizer

    from actors.rollout import POLICIES, build_rollout
    from arpo_async.core.config import config_from_dict
    from toolenv.tasks.prompts import Prompt, PromptSource

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    cfg = config_from_dict({
        "rollout": {"mode": "grpo", "group_size": 2, "initial_samples": 2},
        "model": {"max_model_len": 1024},  # the prompt (hermes: tools block) + 400 fit
        "sampling": {"max_response_tokens": 400},
        "tools": {"enabled": ["python", "search"], "syntax": syntax}})
    source = PromptSource(cfg, tok)
    engine = _ScriptedEngine(source.syntax)
    rollout = build_rollout(cfg, engine, source, tok, _Tools(), np.random.default_rng(0),
                            POLICIES[cfg.rollout.mode])
    prompt = source.encode(Prompt("m:0", MATH.question, ["0.5"], "math", system_prompt="S"))
    group = await rollout.run(prompt, actor_id=0)
    for leaf in group.leaves:
        assert (leaf.reward, leaf.score, leaf.tool_calls) == (pytest.approx(1.1), 1.0, 2)
        results = np.flatnonzero(np.diff(np.r_[1, leaf.loss_mask, 1]))  # mask-0 runs
        first = leaf.tokens[results[0]:results[1]].tolist()
        assert first == source.syntax.result_ids("0.5")
